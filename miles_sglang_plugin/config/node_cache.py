"""The built schema nodes kept on disk between processes, as Python keeps bytecode.

Building a structured config of a large schema (``OmegaConf.structured``) is most of what a first compose costs
beyond Hydra's own work: 45-65 ms for the three nodes of ``miles-sglang plan sglang=pd_actor_ref``, paid again by
every new process. Each built node is therefore also written, pickled, to
``$XDG_CACHE_HOME/miles_sglang_plugin`` (default ``~/.cache/miles_sglang_plugin``), and a later process that
finds it loads it (about 1 ms) instead of building it.

- **What a node is made from decides its folder**: ``schema-nodes-<install>-<sources>``, ``<install>`` a digest
  of where the package is, ``<sources>`` a digest of the name, size and modification time of every one of its
  ``.py`` files, of OmegaConf's version and of Python's. A changed source gives a new folder; writing into a
  new folder removes the other folders of the same install (one live folder per install, as one ``.pyc`` per
  module).
- **A pickle runs code when it is loaded**, so a file is loaded only when it and its folder belong to this
  user and nobody else may write to them, and it is at most 1 MiB. A file that is missing, unreadable, too
  large, does not unpickle, or is not a ``DictConfig`` is built again and written over.
- **Never an error**: a cache that cannot be read or written only costs the build. ``MSP_SCHEMA_CACHE=0`` turns
  it off (nothing read, nothing written).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

#: A cached node larger than this is not read (the largest, the trainer arguments, is about 11 KB).
MAX_NODE_BYTES = 1 << 20
CACHE_ENV = "MSP_SCHEMA_CACHE"
_PREFIX = "schema-nodes-"


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/miles_sglang_plugin``, or ``~/.cache/miles_sglang_plugin``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "miles_sglang_plugin"


def _package_dir() -> Path:
    return Path(__file__).resolve().parent.parent


def _sources_digest(package: Path) -> str:
    """A digest of every ``.py`` file of the package (relative name, size, modification time), OmegaConf's
    version and Python's."""
    from omegaconf import __version__ as omegaconf_version

    digest = hashlib.sha256(f"{omegaconf_version}\0{sys.version}\0{pickle.HIGHEST_PROTOCOL}".encode())
    for folder, subfolders, files in os.walk(package):
        subfolders[:] = sorted(name for name in subfolders if name != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                info = os.stat(path)
                digest.update(
                    f"\0{os.path.relpath(path, package)}\0{info.st_size}\0{info.st_mtime_ns}".encode()
                )
    return digest.hexdigest()[:16]


@functools.cache
def _cache_dir() -> Path | None:
    """This install's folder for the current sources; None when the cache is off or the sources unreadable."""
    if os.environ.get(CACHE_ENV, "1") == "0":
        return None
    package = _package_dir()
    try:
        sources = _sources_digest(package)
    except OSError:
        return None
    install = hashlib.sha256(str(package).encode()).hexdigest()[:12]
    return cache_root() / f"{_PREFIX}{install}-{sources}"


def _only_mine(path: Path) -> bool:
    """Whether ``path`` (a file or folder, not followed if a link) is this user's and nobody else may write it."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return False
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _file(folder: Path, name: str) -> Path:
    return folder / f"{name}.pickle"


def load(name: str) -> tuple[bytes, Any] | None:
    """The cached node ``name`` (its pickle and the node unpickled from it), or None when there is none fit to
    load."""
    folder = _cache_dir()
    if folder is None:
        return None
    path = _file(folder, name)
    try:
        if not (_only_mine(folder) and _only_mine(path)):
            return None
        with path.open("rb") as f:
            data = f.read(MAX_NODE_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_NODE_BYTES:
        return None
    from omegaconf import DictConfig

    try:
        node = pickle.loads(data)
    except Exception:  # a torn or foreign file: build it again
        return None
    if not isinstance(node, DictConfig):
        return None
    return data, node


def store(name: str, data: bytes) -> None:
    """Write the pickled node ``name``; a new folder first removes this install's other folders."""
    folder = _cache_dir()
    if folder is None or len(data) > MAX_NODE_BYTES:
        return
    with contextlib.suppress(OSError):
        if not folder.is_dir():
            _remove_stale(folder)
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _only_mine(folder):
            return
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        tmp.replace(_file(folder, name))


def _remove_stale(folder: Path) -> None:
    """Remove the folders of the same install made from other sources (``folder``: the new one)."""
    install_prefix = folder.name.rsplit("-", 1)[0] + "-"
    with contextlib.suppress(OSError):
        for other in folder.parent.iterdir():
            if other.name.startswith(install_prefix) and other != folder and _only_mine(other):
                shutil.rmtree(other, ignore_errors=True)
