"""Which ServerArgs fields exist: from the installed SGLang, or (where SGLang cannot be imported, as on a
machine that only runs the stand-in) from the field list of SGLang 0.5.23 shipped with this package. The
fallback is announced once per process, never taken silently.

The installed SGLang's list is kept between processes (importing SGLang takes seconds) in
``$XDG_CACHE_HOME/miles_sglang_plugin``, read and written through the guard of every file the package keeps
(:mod:`miles_sglang_plugin.kept_files`): a list planted by another user, behind a link, in a FIFO, too large or
altered is ignored (with a note) and made again from SGLang."""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from importlib import metadata, resources

from miles_sglang_plugin import kept_files

log = logging.getLogger("miles_sglang_plugin")

SHIPPED_SGLANG_VERSION = "0.5.23"
#: A kept field list larger than this is not read (SGLang 0.5.23's is about 12 KB).
MAX_FIELDS_BYTES = 1 << 18
#: The kept files' format, part of their names: files of an earlier format are never looked at.
FORMAT = "kept-1"


@dataclass(frozen=True)
class KnownFields:
    fields: frozenset[str]
    #: e.g. "SGLang 0.5.23 (installed)" or "SGLang 0.5.23 (field list shipped with miles_sglang_plugin)"
    source: str
    installed: bool


@functools.cache
def shipped_server_arg_fields() -> frozenset[str]:
    text = resources.files("miles_sglang_plugin.data").joinpath("sglang_server_args_fields.txt").read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


def cache_file_name(version: str, location: str) -> str:
    """The kept file of the field list of SGLang ``version`` installed at ``location``."""
    digest = hashlib.sha256(f"{version}\0{location}\0{FORMAT}".encode()).hexdigest()[:16]
    return f"sglang-{version}-{digest}-server-args-fields.txt"


def _parsed(payload: bytes) -> frozenset[str] | None:
    """The field names of a kept list, or None when it is not one (empty, or a line that is no name)."""
    try:
        names = payload.decode("ascii").split()
    except UnicodeDecodeError:
        return None
    return frozenset(names) if names and all(name.isidentifier() for name in names) else None


def _cached_fields(version: str, location: str) -> frozenset[str] | None:
    """The kept field list of this SGLang, or None (none, or refused: noted)."""
    name = cache_file_name(version, location)
    folder = kept_files.cache_folder()
    payload = kept_files.load(folder, name, MAX_FIELDS_BYTES, "the ServerArgs field list")
    fields = _parsed(payload) if payload is not None else None
    if payload is not None and fields is None:
        kept_files.note(f"{folder.path / name if folder else name} is no field list: ignored; made again")
    return fields


@functools.cache
def installed_sglang() -> tuple[str, str] | None:
    """(version, install location) of the installed SGLang distribution, without importing it; looked up once
    per process (a search of ``sys.path``)."""
    try:
        dist = metadata.distribution("sglang")
    except metadata.PackageNotFoundError:
        return None
    return dist.version, str(dist.locate_file(""))


@functools.cache
def known_server_arg_fields() -> KnownFields:
    """The installed SGLang's ServerArgs fields. Importing SGLang takes seconds (it imports torch), so the list
    is cached per SGLang version and install location under ``~/.cache/miles_sglang_plugin``."""
    from miles_sglang_plugin.rendering import sglang_server_args

    installed = installed_sglang()
    if installed is not None:
        version, location = installed
        source = f"SGLang {version} (installed)"
        cached = _cached_fields(version, location)
        if cached is not None:
            return KnownFields(cached, source, True)
        try:
            fields = sglang_server_args.server_args_fields()
        except sglang_server_args.SGLangUnavailableError as exc:
            log.warning("SGLang %s is installed but does not import here: %s", version, exc)
            fields = None
        if fields is not None:
            payload = ("\n".join(sorted(fields)) + "\n").encode()
            kept_files.store(kept_files.cache_folder(), cache_file_name(version, location), payload)
            return KnownFields(frozenset(fields), source, True)
    source = f"SGLang {SHIPPED_SGLANG_VERSION} (field list shipped with miles_sglang_plugin)"
    log.warning(
        "SGLang is not importable here: ServerArgs names are checked against %s, not against the SGLang "
        "that will run the engines",
        source,
    )
    return KnownFields(shipped_server_arg_fields(), source, False)
