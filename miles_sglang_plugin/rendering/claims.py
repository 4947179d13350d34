"""Claims across the concurrent launches of one machine (ports here, GPUs in the packed launcher): a key (a port,
a GPU) is this launch's only while it holds an exclusive ``flock`` on the key's lock file in a shared lock
directory. The kernel drops a lock when every process holding it is gone, so a crashed launch never leaks a
claim; launches keep apart when they share the directory.

The lock directory is created 0700; one that is a symlink, is reached through another user's symlink, is owned
by another user, or that others may write in (a shared one such as ``/tmp``) is refused
(:class:`UnsafeLockDirError`): another user could otherwise redirect the lock files or hold the claims. An
existing directory is never changed (making a shared one private would lock its other users out). Lock files
are opened inside the checked directory without following symlinks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

Key = TypeVar("Key")

#: How a lock file is opened: created 0600 where missing, never through a symlink, not inherited by programs run.
LOCK_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeLockDirError(PermissionError):
    """The lock directory could be controlled by someone else: refused (``str()`` says why)."""


def _check_parents(path: Path) -> None:
    """No directory above ``path`` is a symlink that another user (not root, not this user) could redirect."""
    for parent in path.parents:
        try:
            info = os.lstat(parent)
        except FileNotFoundError:
            continue  # made below, by this user
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (0, os.getuid()):
            raise UnsafeLockDirError(f"it is reached through {parent}, a symlink owned by uid {info.st_uid}")


def open_lock_dir(path: Path) -> int:
    """The lock directory, opened (a file descriptor): created 0700 if missing; refused when it is a symlink,
    reached through another user's symlink, owned by another user, or writable by group or others (another
    user could create lock files in it and hold claims). An existing directory's mode is left as it is."""
    path = Path(os.path.abspath(path))
    _check_parents(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file is in the way somewhere above
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path.parent)) from None
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise UnsafeLockDirError("it is a symlink; use a real directory") from None
        raise
    info = os.fstat(fd)
    if info.st_uid != os.getuid():
        os.close(fd)
        raise UnsafeLockDirError(f"it is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise UnsafeLockDirError(
            f"others may write in it (mode {mode:o}); give a directory of this user's own, not a shared one"
        )
    return fd


@dataclass
class LockClaims(Generic[Key]):
    """The keys this process holds, each an open, flock-ed lock file in the checked ``lock_dir``
    (:func:`open_lock_dir`, opened on first use). Subclasses name the lock files (:meth:`lock_file_name`)."""

    lock_dir: Path
    fds: dict[Key, int] = field(default_factory=dict)
    #: The last reason a lock file could not be opened at all (not: another launch holds it).
    unusable: OSError | None = None
    _dir_fd: int | None = field(default=None, repr=False)

    def lock_file_name(self, key: Key) -> str:
        return f"{key}.lock"

    def directory(self) -> int:
        """The lock directory's descriptor (checked and opened once); raises what :func:`open_lock_dir` raises."""
        if self._dir_fd is None:
            self._dir_fd = open_lock_dir(self.lock_dir)
        return self._dir_fd

    def try_claim(self, key: Key) -> bool:
        """Claim ``key`` unless another launch (or this one) holds it; a lock file that cannot be opened
        counts as taken (the reason: :attr:`unusable`)."""
        if key in self.fds:
            return False
        try:
            fd = os.open(self.lock_file_name(key), LOCK_FILE_FLAGS, 0o600, dir_fd=self.directory())
        except OSError as exc:
            self.unusable = exc
            return False  # cannot take part in claims here: treat the key as taken
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.fds[key] = fd
        return True

    def drop(self, key: Key, *, unlock: bool = False) -> None:
        """Close ``key``'s lock file (held by nobody else, that frees it). ``unlock`` first frees it for every
        process, also where a forked child holds a copy of the descriptor; without it, a forked child closes
        only its copy."""
        fd = self.fds.pop(key, None)
        if fd is None:
            return
        if unlock:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(fd)

    def close(self) -> None:
        """Close every lock file (without unlocking) and the directory."""
        for key in list(self.fds):
            self.drop(key)
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)
            self._dir_fd = None


__all__ = ["LOCK_FILE_FLAGS", "LockClaims", "UnsafeLockDirError", "open_lock_dir"]
