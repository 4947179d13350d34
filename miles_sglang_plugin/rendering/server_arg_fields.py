"""Which ServerArgs fields exist: from the installed SGLang, or (where SGLang cannot be imported, as on a
machine that only runs the stand-in) from the field list of SGLang 0.5.23 shipped with this package. The
fallback is announced once per process, never taken silently."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

log = logging.getLogger("miles_sglang_plugin")

SHIPPED_SGLANG_VERSION = "0.5.23"


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


def _cache_file(version: str, location: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "miles_sglang_plugin"
    digest = hashlib.sha256(f"{version}\0{location}".encode()).hexdigest()[:16]
    return base / f"sglang-{version}-{digest}-server-args-fields.txt"


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
        cache = _cache_file(version, location)
        source = f"SGLang {version} (installed)"
        with contextlib.suppress(OSError):
            cached = frozenset(cache.read_text().split())
            if cached:
                return KnownFields(cached, source, True)
        try:
            fields = sglang_server_args.server_args_fields()
        except sglang_server_args.SGLangUnavailableError as exc:
            log.warning("SGLang %s is installed but does not import here: %s", version, exc)
            fields = None
        if fields is not None:
            with contextlib.suppress(OSError):
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text("\n".join(sorted(fields)) + "\n")
                tmp.replace(cache)
            return KnownFields(fields, source, True)
    source = f"SGLang {SHIPPED_SGLANG_VERSION} (field list shipped with miles_sglang_plugin)"
    log.warning(
        "SGLang is not importable here: ServerArgs names are checked against %s, not against the SGLang "
        "that will run the engines",
        source,
    )
    return KnownFields(shipped_server_arg_fields(), source, False)
