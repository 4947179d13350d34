"""Claims across the concurrent launches of one machine (ports here, GPUs in the packed launcher): a key (a port,
a GPU) is this launch's only while it holds an exclusive ``flock`` on the key's lock file in a shared lock
directory. The kernel drops a lock when every process holding it is gone, so a crashed launch never leaks a
claim; launches keep apart when they share the directory.

The lock directory is created 0700; one that is a symlink, is reached through another user's symlink, is owned
by another user, or that others may write in (a shared one such as ``/tmp``) is refused
(:class:`UnsafeLockDirError`): another user could otherwise redirect the lock files or hold the claims. An
existing directory is never changed (making a shared one private would lock its other users out). Lock files
are opened inside the checked directory without following symlinks.

A lock file can vanish under its holder: the directory removed (``rm -rf``, a ``/tmp`` cleaner) or replaced.
A launch coming after that would make a new file and lock it, and get a key another launch still holds. So
each claim also holds a *guard* that no file operation can remove: an abstract Unix socket bound to a name
made of the user, the directory's path and the key (Linux; the kernel frees it when its holder closes it or
dies). A key is claimed only when its guard binds and its lock file locks, in that order, so two launches that
share the directory's path never hold one key, whatever happened to the directory. The guard is this
process's own: forked children close their copies at once (a lingering child never keeps a key), and release
frees both. Guards are per network namespace: launches in different ones (sharing the directory through the
file system) keep apart through the lock files alone, as before. Abstract names have no permissions: another
local user who binds a guard's name first makes that key look taken (a denial of service, never a key held
twice). Each claim takes two file descriptors (its lock file and its guard).

The holder notices a removed or replaced directory (:meth:`LockClaims.directory` compares the open directory
with the path before each use, and opens the new one) and :meth:`LockClaims.verify` makes the held keys' lock
files again, or reports the keys whose new lock file another process took (lost: that process does not
share the guards).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
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


#: The abstract socket names of the guards start with this (a NUL byte: Linux's abstract namespace).
GUARD_PREFIX = b"\0miles-sglang-claim/"
#: Every guard this process holds: a forked child closes its copies (see :func:`_close_guards_in_child`).
_GUARDS: set[socket.socket] = set()


def _close_guards_in_child() -> None:
    """In a forked child: close the copies of the parent's guards (the parent's claims stay the parent's; a
    child that lived on after the parent released a key would otherwise keep it claimed)."""
    for guard in list(_GUARDS):
        with contextlib.suppress(OSError):
            guard.close()
    _GUARDS.clear()


os.register_at_fork(after_in_child=_close_guards_in_child)


def guard_address(lock_dir: str, lock_file_name: str) -> bytes:
    """The abstract socket name guarding ``lock_file_name`` of the directory at path ``lock_dir``."""
    text = f"{os.getuid()}\0{lock_dir}\0{lock_file_name}"
    return GUARD_PREFIX + hashlib.sha256(text.encode(errors="surrogateescape")).hexdigest()[:48].encode()


def bind_guard(address: bytes) -> socket.socket | None:
    """A socket bound to ``address``; None when another socket holds the name (another launch holds the key).
    Raises ``OSError`` when no socket can be made (too many open files)."""
    guard = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # close-on-exec, as Python makes every socket
    try:
        guard.bind(address)
    except OSError as exc:
        guard.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    _GUARDS.add(guard)
    return guard


def _close_guard(guard: socket.socket | None) -> None:
    if guard is None:
        return
    try:
        _GUARDS.discard(guard)
        guard.close()
    except (
        Exception
    ):  # at interpreter exit (a claim's __del__) module globals may be gone; the kernel frees it
        pass


def _same_file(info: os.stat_result, other: os.stat_result) -> bool:
    return (info.st_dev, info.st_ino) == (other.st_dev, other.st_ino)


def _lock(fd: int) -> bool:
    """An exclusive flock on ``fd`` unless another open file holds one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class ClaimCheck(Generic[Key]):
    """What :meth:`LockClaims.verify` found: held keys whose lock file had vanished (their directory or the file
    removed or replaced) and was made and locked again (the guard kept them claimed meanwhile), and keys whose
    new lock file another process holds (lost: it may use the key too)."""

    remade: tuple[Key, ...] = ()
    lost: tuple[Key, ...] = ()
    #: Why the lock directory cannot be opened now (removed and replaced by something refused), if so.
    unreachable: OSError | None = None


@dataclass
class LockClaims(Generic[Key]):
    """The keys this process holds, each an open, flock-ed lock file in the checked ``lock_dir``
    (:func:`open_lock_dir`, opened on first use) and a guard (see the module's docstring). Subclasses name the
    lock files (:meth:`lock_file_name`)."""

    lock_dir: Path
    fds: dict[Key, int] = field(default_factory=dict)
    #: The last reason a lock file could not be opened at all (not: another launch holds it).
    unusable: OSError | None = None
    #: How often the lock directory was found removed or replaced (and the new one opened).
    replaced: int = 0
    guards: dict[Key, socket.socket | None] = field(default_factory=dict, repr=False)
    #: Keys whose lock file vanished and another process now holds (reported once by :meth:`verify`).
    lost: set[Key] = field(default_factory=set, repr=False)
    _dir_fd: int | None = field(default=None, repr=False)
    #: The directory's absolute path, fixed at first use (a later change of the working directory does not move
    #: the claims), and its real path, which names the guards.
    _dir_abs: str = field(default="", repr=False)
    _dir_path: str = field(default="", repr=False)

    def lock_file_name(self, key: Key) -> str:
        return f"{key}.lock"

    def directory(self) -> int:
        """The lock directory's descriptor, checked and opened once, and again when the directory at the path is
        not the one open (removed, replaced); raises what :func:`open_lock_dir` raises."""
        if self._dir_fd is not None and not self._still_there():
            os.close(self._dir_fd)
            self._dir_fd = None
            self.replaced += 1
        if self._dir_fd is None:
            self._dir_abs = self._dir_abs or os.path.abspath(self.lock_dir)
            self._dir_fd = open_lock_dir(Path(self._dir_abs))
            self._dir_path = os.path.realpath(self._dir_abs)
        return self._dir_fd

    def _still_there(self) -> bool:
        assert self._dir_fd is not None
        try:
            return _same_file(os.stat(self._dir_abs, follow_symlinks=False), os.fstat(self._dir_fd))
        except OSError:
            return False

    def _guard(self, key: Key) -> socket.socket | None:
        return bind_guard(guard_address(self._dir_path, self.lock_file_name(key)))

    def try_claim(self, key: Key) -> bool:
        """Claim ``key`` unless another launch (or this one) holds it; a lock file that cannot be opened
        counts as taken (the reason: :attr:`unusable`)."""
        if key in self.fds:
            return False
        guard = None
        try:
            dir_fd = self.directory()
            guard = self._guard(key)
            if guard is None:
                return False  # another launch holds the key (its lock file may be gone)
            fd = os.open(self.lock_file_name(key), LOCK_FILE_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            _close_guard(guard)
            self.unusable = exc
            return False  # cannot take part in claims here: treat the key as taken
        if not _lock(fd):
            os.close(fd)
            _close_guard(guard)
            return False
        self.fds[key], self.guards[key] = fd, guard
        return True

    def verify(self) -> ClaimCheck[Key]:
        """Check that each held key's lock file is still the one at its path (its directory and the file not
        removed or replaced); make and lock a vanished one again. Keys whose new lock file another process
        holds are reported once, as lost (and made again once it is free)."""
        if not self.fds:
            return ClaimCheck()
        try:
            dir_fd = self.directory()
        except OSError as exc:
            self.unusable = exc
            return ClaimCheck(unreachable=exc)  # nowhere to make them again: the guards keep the keys
        remade, lost = [], []
        for key in [k for k in self.fds if not self._linked(k, dir_fd)]:
            outcome = self._remake(key, dir_fd)
            if outcome is True:
                remade.append(key)
                self.lost.discard(key)
            elif outcome is False and key not in self.lost:
                self.lost.add(key)
                lost.append(key)
        return ClaimCheck(tuple(remade), tuple(lost))

    def _linked(self, key: Key, dir_fd: int) -> bool:
        try:
            at_path = os.stat(self.lock_file_name(key), dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        return _same_file(at_path, os.fstat(self.fds[key]))

    def _remake(self, key: Key, dir_fd: int) -> bool | None:
        """True: the key's lock file made and locked again; False: another process holds it; None: it cannot
        be opened now (tried again at the next check)."""
        try:
            fd = os.open(self.lock_file_name(key), LOCK_FILE_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            self.unusable = exc
            return None
        if not _lock(fd):
            os.close(fd)
            return False
        old, self.fds[key] = self.fds[key], fd
        with contextlib.suppress(OSError):
            os.close(old)  # the vanished file's lock: only forked children's copies are left of it
        return True

    def drop(self, key: Key, *, unlock: bool = False) -> None:
        """Close ``key``'s lock file and guard (held by nobody else, that frees it). ``unlock`` first frees the
        lock for every process, also where a forked child holds a copy of the descriptor; without it, a forked
        child closes only its copy (a child's copies of the guards are closed when it is forked)."""
        self.lost.discard(key)
        _close_guard(self.guards.pop(key, None))
        fd = self.fds.pop(key, None)
        if fd is None:
            return
        if unlock:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(fd)

    def close(self) -> None:
        """Close every lock file (without unlocking), every guard and the directory."""
        for key in list(self.fds):
            self.drop(key)
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)
            self._dir_fd = None


__all__ = [
    "LOCK_FILE_FLAGS",
    "ClaimCheck",
    "LockClaims",
    "UnsafeLockDirError",
    "bind_guard",
    "guard_address",
    "open_lock_dir",
]
