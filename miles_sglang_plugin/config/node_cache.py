"""The built schema nodes kept on disk between processes, as Python keeps bytecode.

Building a structured config of a large schema (``OmegaConf.structured``) is most of what a first compose costs
beyond Hydra's own work: 45-65 ms for the three nodes of ``miles-sglang plan sglang=pd_actor_ref``, paid again by
every new process. Each built node is therefore also written, pickled, to
``$XDG_CACHE_HOME/miles_sglang_plugin/schema-nodes`` (default ``~/.cache/...``), and a later process that finds
it loads it (about 1 ms) instead of building it.

- **A node's file is named after what it is built from, as this process has it in memory**
  (:func:`fingerprint`): the dataclass (or instance) and every dataclass value inside it, each with its
  qualified name, its fields' names and resolved types, and their values or defaults; with OmegaConf's and
  Python's versions. A schema edited on disk but not yet imported, or imported before an edit, can therefore
  never be served the other's node, and checkouts or venvs that share the cache share the nodes they agree
  on. The newest :data:`KEEP_PER_NODE` files of each node are kept.
- **A pickle runs code when it is loaded**, so a file is read only through a folder that is this user's and
  that nobody else may write to, opened without following links, and only when it is a regular file of this
  user's that nobody else may write to and at most 1 MiB. A file that is missing, unfit, does not unpickle, or
  is not a ``DictConfig`` is built again and written anew.
- **Never an error**: a cache that cannot be found, read or written only costs the build. ``MSP_SCHEMA_CACHE=0``
  turns it off (nothing read, nothing written).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import stat
import sys
import threading
import typing
from pathlib import Path
from typing import Any

#: A cached node larger than this is not read (the largest, the trainer arguments, is about 11 KB).
MAX_NODE_BYTES = 1 << 20
#: Files kept per node (other fingerprints: other checkouts, or earlier versions of the schema).
KEEP_PER_NODE = 8
CACHE_ENV = "MSP_SCHEMA_CACHE"
FOLDER = "schema-nodes"


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/miles_sglang_plugin``, or ``~/.cache/miles_sglang_plugin``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "miles_sglang_plugin"


def _describe(made: Any, out: list[str]) -> None:
    cls = made if isinstance(made, type) else type(made)
    out.append(f"<{cls.__module__}.{cls.__qualname__}")
    if not dataclasses.is_dataclass(cls):
        out.append(repr(made))
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append(f"{f.name}:{hints.get(f.name, f.type)!r}")
        if not isinstance(made, type):
            value = getattr(made, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            out.append("=<missing>")
            continue
        if dataclasses.is_dataclass(value):
            _describe(value, out)
        else:
            out.append(f"={value!r}")
    out.append(">")


def fingerprint(made: Any) -> str:
    """A digest of what ``OmegaConf.structured(made)`` builds a node from (see the module docstring)."""
    from omegaconf import __version__ as omegaconf_version

    out = [omegaconf_version, sys.version, str(pickle.HIGHEST_PROTOCOL)]
    _describe(made, out)
    return hashlib.sha256("\0".join(out).encode()).hexdigest()[:24]


def _off() -> bool:
    return os.environ.get(CACHE_ENV, "1") == "0"


def _only_mine(info: os.stat_result, kind: int) -> bool:
    """A file of type ``kind`` (``stat.S_IFREG``, ``stat.S_IFDIR``) that is this user's and that nobody else may
    write to."""
    return (
        stat.S_IFMT(info.st_mode) == kind
        and info.st_uid == os.getuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _open_folder(create: bool) -> int | None:
    """A descriptor of the cache folder (not followed if a link), or None when it is not fit to use."""
    folder = cache_root() / FOLDER
    if create:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    if not _only_mine(os.fstat(fd), stat.S_IFDIR):
        os.close(fd)
        return None
    return fd


def _file_name(name: str, made: Any) -> str:
    return f"{name}-{fingerprint(made)}.pickle"


def load(name: str, made: Any) -> tuple[bytes, Any] | None:
    """The cached node ``name`` built from ``made`` (its pickle, and the node unpickled from it), or None when
    there is none fit to load."""
    if _off():
        return None
    try:
        file_name = _file_name(name, made)
        folder = _open_folder(create=False)
        if folder is None:
            return None
        try:
            fd = os.open(file_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        finally:
            os.close(folder)
        with os.fdopen(fd, "rb") as f:
            if not _only_mine(os.fstat(f.fileno()), stat.S_IFREG):
                return None
            data = f.read(MAX_NODE_BYTES + 1)
        if len(data) > MAX_NODE_BYTES:
            return None
        from omegaconf import DictConfig

        node = pickle.loads(data)
        if not isinstance(node, DictConfig):
            return None
        return data, node
    except Exception:  # missing, unreadable, torn or foreign: build it again
        return None


def store(name: str, made: Any, data: bytes) -> None:
    """Write ``data``, the pickled node ``name`` built from ``made``; keep the newest files of the node."""
    if _off() or len(data) > MAX_NODE_BYTES:
        return
    with contextlib.suppress(Exception):
        file_name = _file_name(name, made)
        folder = _open_folder(create=True)
        if folder is None:
            return
        try:
            tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, file_name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
            _prune(folder, name)
        finally:
            os.close(folder)


def _prune(folder: int, name: str) -> None:
    """Remove all but the newest :data:`KEEP_PER_NODE` files of node ``name``."""
    prefix = f"{name}-"
    files = []
    for entry in os.listdir(folder):
        if entry.startswith(prefix) and entry.endswith(".pickle"):
            info = os.stat(entry, dir_fd=folder, follow_symlinks=False)
            files.append((info.st_mtime_ns, entry))
    for _, entry in sorted(files, reverse=True)[KEEP_PER_NODE:]:
        with contextlib.suppress(OSError):
            os.unlink(entry, dir_fd=folder)
