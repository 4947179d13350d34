"""GPU claims across concurrent launches on one machine, as the port claims (``rendering/ports.py``): a GPU is
given to a job only while its launcher holds an ``flock`` on the GPU's lock file in a shared directory. The
kernel drops a lock when every process holding it is gone, so a crashed launch never leaks a GPU; the
launcher unlocks (``LOCK_UN``) when a job ends, which frees the GPU at once even though the job's process,
forked while the lock was held, had a copy of the descriptor.

GPUs are named as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs): launches keep apart when they name
a GPU alike and share the lock directory (``$MSP_GPU_LOCK_DIR``, default ``<tmp>/miles-sglang-gpus-<uid>``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOCK_DIR_ENV = "MSP_GPU_LOCK_DIR"


def default_gpu_lock_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"miles-sglang-gpus-{os.getuid()}"
    return Path(os.environ.get(LOCK_DIR_ENV) or default)


class GpuLockDirError(OSError):
    """The lock directory cannot be used: no GPU can be claimed."""


def _lock_name(gpu: str) -> str:
    return "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", gpu) + ".lock"


@dataclass
class GpuClaims:
    """The GPUs this process holds, each an open, flock-ed lock file."""

    lock_dir: Path
    fds: dict[str, int] = field(default_factory=dict)

    def check_usable(self) -> None:
        """Raise :class:`GpuLockDirError` (naming the directory) unless lock files can be made there."""
        try:
            self.lock_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_dir / ".probe", os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
        except OSError as exc:
            raise GpuLockDirError(f"the GPU lock directory {self.lock_dir} is not usable: {exc}") from None

    def try_claim(self, gpu: str) -> bool:
        """Claim ``gpu`` unless another launch (or this one) holds it."""
        if gpu in self.fds:
            return False
        try:
            fd = os.open(self.lock_dir / _lock_name(gpu), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return False  # cannot take part in claims: treat it as taken
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.fds[gpu] = fd
        return True

    def claim(self, candidates: Sequence[str], count: int) -> list[str] | None:
        """``count`` GPUs of ``candidates``, in their order, all or none."""
        taken: list[str] = []
        for gpu in candidates:
            if len(taken) == count:
                break
            if self.try_claim(gpu):
                taken.append(gpu)
        if len(taken) == count:
            return taken
        self.release(taken)
        return None

    def release(self, gpus: Iterable[str]) -> None:
        for gpu in list(gpus):
            fd = self.fds.pop(gpu, None)
            if fd is None:
                continue
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)  # for every copy of the descriptor (forked jobs)
            with contextlib.suppress(OSError):
                os.close(fd)

    def release_all(self) -> None:
        self.release(list(self.fds))

    def forget_in_child(self, keep: Iterable[str] = ()) -> None:
        """In a forked job: close the copies of the other jobs' lock descriptors (without unlocking, which
        would free them for everyone), keeping ``keep``'s, which then live as long as the job."""
        kept = set(keep)
        for gpu in [g for g in self.fds if g not in kept]:
            with contextlib.suppress(OSError):
                os.close(self.fds.pop(gpu))
