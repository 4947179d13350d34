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
- **A pickle runs code when it is loaded**, so a file is read only through the guard of every file the package
  keeps (:mod:`miles_sglang_plugin.kept_files`): a folder that is this user's and that nobody else may write
  to, a regular file of this user's that nobody else may write to, not a link, at most 1 MiB, whose digest
  (stored in the file) matches its content. A file that is missing, unfit, altered (one byte is enough), does
  not unpickle, or is not a ``DictConfig`` is built again and written anew; one refused is noted once.
- **Never an error**: a cache that cannot be found, read or written only costs the build. ``MSP_SCHEMA_CACHE=0``
  turns it off (nothing read, nothing written).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import sys
import typing
from typing import Any

from miles_sglang_plugin import kept_files

#: A cached node larger than this is not read (the largest, the trainer arguments, is about 11 KB).
MAX_NODE_BYTES = 1 << 20
#: Files kept per node (other fingerprints: other checkouts, or earlier versions of the schema).
KEEP_PER_NODE = 8
CACHE_ENV = "MSP_SCHEMA_CACHE"
FOLDER = "schema-nodes"
#: The files' format, part of every fingerprint: files of an earlier format are never looked at (nor noted).
FORMAT = "kept-1"


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

    out = [FORMAT, omegaconf_version, sys.version, str(pickle.HIGHEST_PROTOCOL)]
    _describe(made, out)
    return hashlib.sha256("\0".join(out).encode()).hexdigest()[:24]


def _off() -> bool:
    return os.environ.get(CACHE_ENV, "1") == "0"


def _file_name(name: str, made: Any) -> str:
    return f"{name}-{fingerprint(made)}.pickle"


def load(name: str, made: Any) -> tuple[bytes, Any] | None:
    """The cached node ``name`` built from ``made`` (its pickle, and the node unpickled from it), or None when
    there is none fit to load."""
    if _off():
        return None
    try:
        file_name = _file_name(name, made)
        data = kept_files.load(kept_files.cache_folder(FOLDER), file_name, MAX_NODE_BYTES, f"node {name}")
        if data is None:
            return None
        from omegaconf import DictConfig

        node = pickle.loads(data)
        if not isinstance(node, DictConfig):
            return None
        return data, node
    except Exception:  # foreign content under a valid digest (this user's own file): build it again
        return None


def store(name: str, made: Any, data: bytes) -> None:
    """Write ``data``, the pickled node ``name`` built from ``made``; keep the newest files of the node."""
    if _off() or len(data) > MAX_NODE_BYTES:
        return
    with contextlib.suppress(Exception):
        folder = kept_files.cache_folder(FOLDER)
        if kept_files.store(folder, _file_name(name, made), data) and folder is not None:
            folder.prune(f"{name}-", ".pickle", KEEP_PER_NODE)
