"""GPU claims across concurrent launches on one machine, with the port claims' mechanism
(:mod:`~miles_sglang_plugin.rendering.claims`: the same checked lock directory, lock files opened without
following symlinks): a GPU is given to a job only while its launcher holds an ``flock`` on the GPU's lock file.
The kernel drops a lock when every process holding it is gone, so a crashed launch never leaks a GPU; the
launcher unlocks (``LOCK_UN``) when a job ends, which frees the GPU at once even though the job's process,
forked while the lock was held, had a copy of the descriptor.

GPUs are named as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs): launches keep apart when they name
a GPU alike and share the lock directory (``$MSP_GPU_LOCK_DIR``, default ``<tmp>/miles-sglang-gpus-<uid>``).
Each claim is guarded as every claim is, so removing the directory under a sweep never gives its GPUs to
another sweep; the launcher checks its claims as it polls and says when their lock files vanished.
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles_sglang_plugin.rendering.claims import LOCK_FILE_FLAGS, LockClaims, open_lock_dir

LOCK_DIR_ENV = "MSP_GPU_LOCK_DIR"


def default_gpu_lock_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"miles-sglang-gpus-{os.getuid()}"
    return Path(os.environ.get(LOCK_DIR_ENV) or default)


class GpuLockDirError(OSError):
    """The lock directory cannot be used: no GPU can be claimed."""


def _lock_name(gpu: str) -> str:
    """``gpu-<id>.lock``: indices and UUIDs as they are, any other character %-escaped (two GPU names never
    share a lock file, which would make a job needing both wait for ever)."""
    return "gpu-" + urllib.parse.quote(gpu, safe="-.") + ".lock"


@dataclass
class GpuClaims(LockClaims[str]):
    """The GPUs this process holds, each an open, flock-ed lock file (``gpu-<id>.lock``)."""

    #: GPUs whose lock file could not be opened when last tried (why), as opposed to held by another launch.
    unusable_gpus: dict[str, OSError] = field(default_factory=dict)
    #: The GPUs another launch held at the last :meth:`claim` that fell short.
    held_elsewhere: list[str] = field(default_factory=list)

    def lock_file_name(self, key: str) -> str:
        return _lock_name(key)

    def check_usable(self) -> None:
        """Raise :class:`GpuLockDirError` (naming the directory) unless it is safe (see
        :func:`~miles_sglang_plugin.rendering.claims.open_lock_dir`) and lock files can be made there."""
        try:
            dir_fd = open_lock_dir(self.lock_dir)
            try:
                os.close(os.open(".probe", LOCK_FILE_FLAGS, 0o600, dir_fd=dir_fd))
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise GpuLockDirError(f"the GPU lock directory {self.lock_dir} is not usable: {exc}") from None

    def claim(self, candidates: Sequence[str], count: int) -> list[str] | None:
        """``count`` GPUs of ``candidates``, in their order, all or none."""
        taken: list[str] = []
        held: list[str] = []
        for gpu in candidates:
            if len(taken) == count:
                break
            self.unusable = None
            if self.try_claim(gpu):
                taken.append(gpu)
            elif self.unusable is None:
                held.append(gpu)
            if self.unusable is not None:
                self.unusable_gpus[gpu] = self.unusable
            else:
                self.unusable_gpus.pop(gpu, None)
        if len(taken) == count:
            return taken
        self.held_elsewhere = held
        self.release(taken)
        return None

    def release(self, gpus: Iterable[str]) -> None:
        for gpu in list(gpus):
            self.drop(gpu, unlock=True)  # for every copy of the descriptor (forked jobs)

    def release_all(self) -> None:
        self.release(list(self.fds))

    def forget_in_child(self, keep: Iterable[str] = ()) -> None:
        """In a forked job: close the copies of the other jobs' lock descriptors (without unlocking, which
        would free them for everyone), keeping ``keep``'s, which then live as long as the job."""
        kept = set(keep)
        for gpu in [g for g in self.fds if g not in kept]:
            self.drop(gpu)
