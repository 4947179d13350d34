"""The files the package keeps between processes (its caches; state files), read and written through one guard
(a shared leaf: it imports nothing of the package).

A kept file may sit where other users can reach (``$XDG_CACHE_HOME`` on a shared directory), and what is read
from it decides what a plan holds (a pickle even runs code when it is loaded). So:

- **Where**: a :class:`KeptFolder` is a base directory (``$XDG_CACHE_HOME``, taken only when it is an absolute
  path, as the XDG spec says, else ``~/.cache``) and the folders below it (``miles_sglang_plugin``, ...). Each of
  those is opened without following a link, made ``0700`` where it is missing, and used only when it is a
  folder of this user's that nobody else may write to.
- **Reading** (:meth:`KeptFolder.read`): a file is opened without following a link and without waiting (a FIFO
  never blocks), and used only when it is a regular file of this user's, with no other hard link, that nobody
  else may write to, no larger than the caller's bound, whose first line holds the SHA-256 digest of the rest
  (a truncated or altered file is refused).
- **Writing** (:meth:`KeptFolder.write`): into a temporary file of an unpredictable name, created exclusively
  and not through a link (``O_EXCL | O_NOFOLLOW``, mode ``0600``), then renamed over the name: two writers at
  once leave one whole file, a reader never sees half of one, a failed write (a full or read-only file system)
  leaves no temporary file and the old file as it was.

:func:`load` and :func:`store` are what a cache calls: a file refused is ignored with a note (once per process
and reason, on the ``miles_sglang_plugin`` logger), and nothing here raises or blocks.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("miles_sglang_plugin")

#: The folder of the package under a base directory (``~/.cache/miles_sglang_plugin``).
APP_FOLDER = "miles_sglang_plugin"
#: The first line of a kept file: this, the hex SHA-256 digest of the rest of the file, a newline.
MAGIC = b"miles_sglang_plugin kept file, sha256 "
HEADER_BYTES = len(MAGIC) + 64 + 1
#: Tries at a fresh temporary name when one is taken (a name of 64 random bits is taken only if planted).
TEMPORARY_NAME_TRIES = 4

_noted: set[str] = set()


class UnfitError(Exception):
    """A kept file or folder that is not used; the message says which and why."""


def cache_base() -> Path:
    """``$XDG_CACHE_HOME`` when it is an absolute path (a relative one is ignored, as the XDG spec says), else
    ``~/.cache``. Raises ``RuntimeError`` where there is no home directory."""
    value = os.environ.get("XDG_CACHE_HOME", "")
    if value and os.path.isabs(value):
        return Path(value)
    return Path.home() / ".cache"


def _unfit(info: os.stat_result, kind: int, what: str) -> str | None:
    """Why a file (``kind``: ``stat.S_IFREG``) or folder (``stat.S_IFDIR``) with ``info`` is not used, or None."""
    if stat.S_IFMT(info.st_mode) != kind:
        return f"{what} is not a {'folder' if kind == stat.S_IFDIR else 'regular file'}"
    if info.st_uid != os.getuid():
        return f"{what} belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} may be written by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    if kind == stat.S_IFREG and info.st_nlink > 1:  # 0: replaced since it was opened, whole all the same
        return f"{what} has {info.st_nlink - 1} other hard link(s)"
    return None


def framed(payload: bytes) -> bytes:
    """What a kept file holds for ``payload``: the digest line, then the payload."""
    return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def unframed(data: bytes, what: str) -> bytes:
    """The payload of a kept file's content ``data``; :class:`UnfitError` when its digest does not match."""
    head, payload = data[:HEADER_BYTES], data[HEADER_BYTES:]
    if not head.startswith(MAGIC) or head[-1:] != b"\n":
        raise UnfitError(f"{what} has no digest line (not written by this version, or altered)")
    if hashlib.sha256(payload).hexdigest().encode() != head[len(MAGIC) : -1]:
        raise UnfitError(f"{what} does not match its digest (truncated or altered)")
    return payload


@dataclass(frozen=True)
class KeptFolder:
    """A folder of kept files: ``base`` (the user's, used as it is) and the folders ``parts`` below it, each
    checked."""

    base: Path
    parts: tuple[str, ...]

    @property
    def path(self) -> Path:
        return self.base.joinpath(*self.parts)

    @contextlib.contextmanager
    def _opened(self, create: bool) -> Iterator[int]:
        """A descriptor of the folder, each part opened without following a link and checked."""
        if create:
            self.base.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY)
        try:
            where = self.base
            for part in self.parts:
                where = where / part
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o700, dir_fd=fd)
                below = _open_below(fd, part, where)
                os.close(fd)
                fd = below
            yield fd
        finally:
            os.close(fd)

    def read(self, name: str, max_bytes: int) -> bytes | None:
        """The payload of the kept file ``name`` (None: there is none, or no folder); :class:`UnfitError` when
        the file or a folder is refused (see the module docstring)."""
        what = str(self.path / name)
        try:
            with self._opened(create=False) as folder:
                fd = _open_file(folder, name, what)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            problem = _unfit(info, stat.S_IFREG, what)
            if problem is None and info.st_size > HEADER_BYTES + max_bytes:
                problem = f"{what} is {info.st_size} bytes, more than a kept file of its kind may be"
            if problem is not None:
                raise UnfitError(problem)
            data = f.read(HEADER_BYTES + max_bytes + 1)
        if len(data) > HEADER_BYTES + max_bytes:
            raise UnfitError(f"{what} grew past the size a kept file of its kind may be")
        return unframed(data, what)

    def write(self, name: str, payload: bytes) -> None:
        """Write ``payload`` as the kept file ``name``, whole or not at all (``OSError``, :class:`UnfitError`)."""
        with self._opened(create=True) as folder:
            tmp, fd = _new_temporary(folder, name)
            try:
                with os.fdopen(fd, "wb") as f:
                    _write_all(f.fileno(), framed(payload))
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise

    def prune(self, prefix: str, suffix: str, keep: int) -> None:
        """Remove all but the newest ``keep`` files whose names start with ``prefix`` and end with ``suffix``."""
        with self._opened(create=False) as folder:
            found = []
            for entry in os.listdir(folder):
                if entry.startswith(prefix) and entry.endswith(suffix):
                    info = os.stat(entry, dir_fd=folder, follow_symlinks=False)
                    found.append((info.st_mtime_ns, entry))
            for _, entry in sorted(found, reverse=True)[keep:]:
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=folder)


def _open_below(fd: int, part: str, where: Path) -> int:
    """The folder ``part`` below the open folder ``fd``, opened and checked; raises
    :class:`UnfitError` (a link, not a folder, another user's, writable by others) or ``FileNotFoundError``."""
    try:
        below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnfitError(f"{where} is a symbolic link or not a folder") from exc
        raise
    problem = _unfit(os.fstat(below), stat.S_IFDIR, f"folder {where}")
    if problem is not None:
        os.close(below)
        raise UnfitError(problem)
    return below


def _open_file(folder: int, name: str, what: str) -> int:
    """``name`` in ``folder`` opened to read, not through a link and not waiting for a FIFO's writer."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        return os.open(name, flags, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnfitError(f"{what} is a symbolic link") from exc
        raise


def _new_temporary(folder: int, name: str) -> tuple[str, int]:
    """A new temporary file next to ``name``: its name (unpredictable) and a descriptor to write it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY
    for attempt in range(TEMPORARY_NAME_TRIES):
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            return tmp, os.open(tmp, flags, 0o600, dir_fd=folder)
        except FileExistsError:
            if attempt == TEMPORARY_NAME_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def note(message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` once per process."""
    if message not in _noted:
        _noted.add(message)
        log.log(level, "%s", message)


def cache_folder(*parts: str) -> KeptFolder | None:
    """The package's cache folder ``parts`` (``$XDG_CACHE_HOME/miles_sglang_plugin/...``), or None (with a
    note) where there is no home directory to put it in."""
    try:
        return KeptFolder(cache_base(), (APP_FOLDER, *parts))
    except RuntimeError as exc:
        note(f"no cache folder ({exc}): nothing is cached", logging.DEBUG)
        return None


def load(folder: KeptFolder | None, name: str, max_bytes: int, what: str) -> bytes | None:
    """The payload of the kept file ``name``, or None: none there, or refused (noted, saying that ``what`` is
    made again). Never raises."""
    if folder is None:
        return None
    try:
        return folder.read(name, max_bytes)
    except UnfitError as exc:
        note(f"{exc}: ignored; {what} is made again")
    except OSError as exc:
        note(f"{folder.path / name} cannot be read ({exc.strerror or exc}): {what} is made again")
    return None


def store(folder: KeptFolder | None, name: str, payload: bytes) -> bool:
    """Write the kept file ``name`` (whether it was written); a refusal is noted, a file system that cannot take
    it (full, read-only) is noted at debug level only. Never raises."""
    if folder is None:
        return False
    try:
        folder.write(name, payload)
        return True
    except UnfitError as exc:
        note(f"{exc}: nothing is kept there")
    except OSError as exc:
        note(f"{folder.path / name} cannot be written ({exc.strerror or exc})", logging.DEBUG)
    return False


__all__ = [
    "KeptFolder",
    "UnfitError",
    "cache_base",
    "cache_folder",
    "framed",
    "load",
    "note",
    "store",
    "unframed",
]
