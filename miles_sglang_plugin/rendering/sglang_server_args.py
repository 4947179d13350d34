"""Access to the installed SGLang's ``launch_server`` argument parser and ``ServerArgs`` field names.

SGLang is an optional dependency of this package: everything here answers ``None`` (or raises
:class:`SGLangUnavailableError`) when it is not installed, and nothing is imported before it is needed, so
importing this module is cheap, prints nothing and never initialises CUDA.

**CPU-only machines without triton.** ``sglang.srt.utils.common`` does a hard ``import triton``, so importing
``sglang.srt.server_args`` fails where triton is missing (a CPU-only test machine, where the 1 GB triton wheel
is not wanted). SGLang ships a stub for macOS, ``sglang/_platform_stubs.py``, which this module borrows: it
loads that file by path (without running ``sglang/__init__``) and calls its ``install_platform_stubs()`` while
``sys.platform``, ``platform.machine`` and ``torch.backends.mps.is_available`` pretend to be darwin / arm64 /
available. That installs a fake ``triton`` package (a meta-path finder plus ``triton.*`` modules); it also adds
MPS shims to ``torch.mps`` and wraps ``torch.Tensor.to`` / ``torch.Tensor.copy_``, which this module undoes
straight away. The fake ``triton`` is only visible while SGLang is being imported or a command line is being
parsed; outside those windows ``import triton`` fails again as it should, so nothing else in the process (torch's
Inductor, other libraries probing for triton) mistakes the stub for a real triton. Nothing is stubbed where
triton is installed.

Other process-wide side effects of SGLang that are undone: ``prepare_server_args`` calls
``logging.basicConfig(force=True)`` (which would remove and close the host's root log handlers), and importing
``sglang`` sets cache-directory environment variables (``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``,
``CUDA_CACHE_PATH``, ...) that would otherwise leak into every subprocess launched afterwards. Both are
restored. The loading and parsing are serialised by a lock; while they run, other threads can briefly see the
faked platform, the stub ``triton`` or a redirected ``sys.stderr``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import importlib.machinery
import importlib.util
import io
import logging
import os
import platform
import re
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SGLangArgvError",
    "SGLangUnavailableError",
    "load_sglang_server_args_module",
    "parse_launch_argv",
    "server_args_fields",
    "server_args_help",
    "sglang_version",
    "suggest_field_names",
]

_LOGGER = logging.getLogger(__name__)

_SERVER_ARGS_MODULE = "sglang.srt.server_args"
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: Private ``sys.modules`` name under which SGLang's ``_platform_stubs.py`` is registered.
_STUBS_MODULE_NAME = "_miles_sglang_plugin_sglang_platform_stubs"
_INSTALL_HINT = (
    "install it into this environment (on a CPU-only machine: `bash scripts/install-sglang-cpu.sh` "
    "with the virtual environment active)"
)

# Serialises loading and parsing: both fake process-global state for a moment.
_LOCK = threading.RLock()


class SGLangUnavailableError(RuntimeError):
    """SGLang (or a dependency its argument parser needs) is not installed or cannot be imported."""


class SGLangArgvError(ValueError):
    """SGLang's own argument parser rejected a ``sglang.launch_server`` command line.

    ``str(error)`` names the offending flag as argparse reported it (plus close ``ServerArgs`` field names for
    an unknown flag). ``argv`` is the rejected command line, ``exit_code`` the code argparse exited with
    (2 for an error, 0 for ``--help`` / ``--version``) and ``parser_output`` everything the parser printed.
    """

    def __init__(
        self, message: str, *, argv: Sequence[str], exit_code: int | None, parser_output: str
    ) -> None:
        super().__init__(message)
        self.argv: tuple[str, ...] = tuple(argv)
        self.exit_code = exit_code
        self.parser_output = parser_output


# --------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------


@functools.cache
def load_sglang_server_args_module() -> types.ModuleType | None:
    """Import and return ``sglang.srt.server_args``, or ``None`` when SGLang is not installed.

    Where triton is not installed, SGLang's own triton stub is put in place for the import (see the module
    docstring). The result is cached: SGLang is imported once per process (about 2 s on a small CPU).

    Raises:
        SGLangUnavailableError: SGLang is installed but cannot be imported (typically a missing dependency such
            as torch or msgspec); the underlying ``ImportError`` is chained. Not cached, so a later call retries.
    """
    with _LOCK:
        already_imported = sys.modules.get(_SERVER_ARGS_MODULE)
        if already_imported is not None:  # by the host, e.g. where triton is real
            return already_imported
        if _find_spec("sglang") is None:
            return None
        stub = _triton_stub() if _find_spec("triton") is None else None
        try:
            with (
                _preserved_environ(),
                contextlib.redirect_stdout(sys.stderr),
                _stub_visible(stub),
            ):
                return importlib.import_module(_SERVER_ARGS_MODULE)
        except ImportError as exc:
            raise SGLangUnavailableError(
                f"SGLang is installed but `import {_SERVER_ARGS_MODULE}` failed: {exc}; {_INSTALL_HINT}"
            ) from exc


@functools.cache
def server_args_fields() -> frozenset[str] | None:
    """The field names of the installed SGLang's ``ServerArgs``, or ``None`` if it cannot be imported."""
    try:
        module = load_sglang_server_args_module()
    except SGLangUnavailableError as exc:
        _LOGGER.debug("SGLang's ServerArgs are not available: %s", exc)
        return None
    if module is None:
        return None
    return frozenset(_ordered_field_names(module.ServerArgs))


@functools.cache
def server_args_help() -> dict[str, str] | None:
    """Each ``ServerArgs`` field's help text from the installed SGLang's own argument parser (field -> text;
    fields without a flag or text are left out), or ``None`` where SGLang cannot be imported. Nothing is parsed
    or started."""
    import argparse

    try:
        module = load_sglang_server_args_module()
    except SGLangUnavailableError:
        return None
    if module is None:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    with (
        _LOCK,
        _preserved_environ(),
        _stub_visible(_ACTIVE_STUB),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        try:
            module.ServerArgs.add_cli_args(parser)
        except Exception as exc:  # a parser SGLang cannot build here is no help text, not an error
            _LOGGER.debug("SGLang's argument parser could not be built: %s", exc)
            return None
    texts: dict[str, str] = {}
    for action in parser._actions:
        text = action.help if isinstance(action.help, str) else ""
        if action.dest and text and text != argparse.SUPPRESS and action.dest not in texts:
            texts[action.dest] = " ".join(text.replace("%%", "%").split())
    return texts


def sglang_version() -> str | None:
    """The installed SGLang's version (from its package metadata), or ``None`` if it is not installed."""
    import importlib.metadata  # not at the top: it costs ~40 ms, and importing this module is meant to be cheap

    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pass
    # An SGLang on sys.path without package metadata (a source checkout): ask the package itself.
    try:
        if load_sglang_server_args_module() is None:
            return None
    except SGLangUnavailableError:
        return None
    version = getattr(sys.modules.get("sglang"), "__version__", None)
    return str(version) if version is not None else None


def parse_launch_argv(argv: Sequence[str]) -> dict[str, Any]:
    """Parse a ``python -m sglang.launch_server`` command line with the installed SGLang's own parser.

    ``argv`` is what follows ``python -m sglang.launch_server``. It goes through SGLang's
    ``prepare_server_args``, which parses and builds the ``ServerArgs`` without resolving them: the model path
    is not read and no GPU is touched. Returns every ``ServerArgs`` field (in declaration order) mapped to its
    value; fields not on the command line carry SGLang's defaults. Takes a few tens of ms after the first call.
    What SGLang prints while parsing an accepted command line (deprecation notices) is logged as a warning.

    Raises:
        SGLangArgvError: SGLang's parser rejected ``argv`` (unknown flag, invalid value, missing required
            flag) or exited early (``--help``). The message is argparse's, naming the flag.
        SGLangUnavailableError: SGLang is not installed or cannot be imported.
        TypeError: ``argv`` is a single string or holds non-strings.
    """
    args = _checked_argv(argv)
    module = load_sglang_server_args_module()
    if module is None:
        raise SGLangUnavailableError(f"SGLang is not installed; {_INSTALL_HINT}")

    output = io.StringIO()
    with (
        _LOCK,
        _preserved_environ(),
        _preserved_root_logging(),
        _stub_visible(_ACTIVE_STUB),
        contextlib.redirect_stdout(output),
        contextlib.redirect_stderr(output),
    ):
        try:
            server_args = module.prepare_server_args(args)
        except SystemExit as exc:
            raise _argv_error(args, exc, output.getvalue()) from None
        except ImportError as exc:  # e.g. `--config FILE` without pyyaml
            raise SGLangUnavailableError(
                f"SGLang's parser needs a module that is not installed: {exc}; {_INSTALL_HINT}"
            ) from exc

    printed = _ANSI_ESCAPE.sub("", output.getvalue()).strip()
    if printed:  # e.g. "'--enable-dp-attention' is deprecated ... Use '--attn-dp-size <dp-size>' instead."
        _LOGGER.warning("SGLang's parser, on %s:\n%s", " ".join(args), printed)
    return {name: getattr(server_args, name) for name in _ordered_field_names(type(server_args))}


def suggest_field_names(name: str, fields: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` names from ``fields`` close to ``name``, best first (``difflib``).

    ``name`` may be spelled as a flag: leading dashes are dropped and ``-`` counts as ``_``, so
    ``--mem-fraction-statc`` and ``mem_fraction_statc`` both suggest ``mem_fraction_static``. The names
    returned are spelled as in ``fields``. ``n`` must be positive.
    """
    by_normalised: dict[str, str] = {}
    for field in sorted(fields):
        by_normalised.setdefault(_normalise_name(field), field)
    matches = difflib.get_close_matches(_normalise_name(name), list(by_normalised), n=n)
    return [by_normalised[match] for match in matches]


# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------


def _normalise_name(name: str) -> str:
    return name.strip().lstrip("-").replace("-", "_").lower()


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """``importlib.util.find_spec`` that treats an already imported module without a spec as present."""
    try:
        return importlib.util.find_spec(name)
    except ValueError:  # in sys.modules with __spec__ None (e.g. set by hand)
        return importlib.machinery.ModuleSpec(name, None)


def _ordered_field_names(server_args_cls: type) -> tuple[str, ...]:
    """Field names of ``ServerArgs``: a msgspec Struct since 0.5.2x, a dataclass in older SGLang."""
    struct_fields = getattr(server_args_cls, "__struct_fields__", None)
    if struct_fields is not None:
        return tuple(struct_fields)
    if dataclasses.is_dataclass(server_args_cls):
        return tuple(field.name for field in dataclasses.fields(server_args_cls))
    raise SGLangUnavailableError(
        f"cannot list the fields of {server_args_cls!r}: neither a msgspec Struct nor a dataclass"
    )


def _checked_argv(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, str | bytes):
        raise TypeError(f"argv must be a sequence of strings, not a single {type(argv).__name__}: {argv!r}")
    args = list(argv)
    not_str = [arg for arg in args if not isinstance(arg, str)]
    if not_str:
        raise TypeError(f"argv must hold only strings; got {not_str!r}")
    return args


def _argv_error(args: list[str], exc: SystemExit, output: str) -> SGLangArgvError:
    code = exc.code if isinstance(exc.code, int) or exc.code is None else None
    command = " ".join(["sglang.launch_server", *args])
    if code == 0:
        message = f"SGLang's parser exited without parsing (help or version requested) for: {command}"
    else:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        # argparse's error is the last line: "sglang serve: error: unrecognized arguments: --foo 1".
        detail = lines[-1] if lines else (str(exc.code) if exc.code not in (None, 2) else "rejected")
        _, sep, after = detail.partition(": error: ")
        if sep:
            detail = after
        message = f"SGLang rejected the launch_server arguments: {detail}"
        hints = _unknown_flag_hints(detail)
        if hints:
            message += f" ({hints})"
    return SGLangArgvError(message, argv=args, exit_code=code, parser_output=output)


def _unknown_flag_hints(detail: str) -> str:
    prefix = "unrecognized arguments:"
    if not detail.startswith(prefix):
        return ""
    fields = server_args_fields() or frozenset()
    hints = []
    for token in detail[len(prefix) :].split():
        if token.startswith("--"):
            close = suggest_field_names(token.partition("=")[0], fields)
            if close:
                hints.append(f"{token.partition('=')[0]}: did you mean {' / '.join(close)}?")
    return "; ".join(hints)


@contextlib.contextmanager
def _preserved_environ() -> Iterator[None]:
    """Undo environment changes made inside the block (SGLang's import sets cache-directory variables)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in [key for key in os.environ if key not in before]:
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def _preserved_root_logging() -> Iterator[None]:
    """Keep the root logger's handlers and level, which ``prepare_server_args`` resets with ``force=True``.

    The host's handlers are taken off the root logger for the block, so that ``basicConfig(force=True)`` has
    nothing to close; whatever handlers were added in the block are closed and the old ones put back.
    """
    root = logging.getLogger()
    handlers = list(root.handlers)
    level = root.level
    for handler in handlers:
        root.removeHandler(handler)
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            if handler not in handlers:
                handler.close()
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


# --------------------------------------------------------------------------------------------------------------
# The triton stub
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _TritonStub:
    """SGLang's fake ``triton``, kept out of ``sys.modules`` / ``sys.meta_path`` except inside :meth:`visible`."""

    finders: list[Any]
    mock_type: type
    modules: dict[str, types.ModuleType] = dataclasses.field(default_factory=dict)

    def show(self) -> None:
        if "triton" in sys.modules and not isinstance(sys.modules["triton"], self.mock_type):
            return  # something else provides triton now; leave it alone
        for finder in reversed(self.finders):
            if not any(finder is present for present in sys.meta_path):
                sys.meta_path.insert(0, finder)
        for name, module in self.modules.items():
            sys.modules.setdefault(name, module)

    def hide(self) -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if not any(f is finder for finder in self.finders)]
        for name, module in list(sys.modules.items()):
            if isinstance(module, self.mock_type):
                self.modules[name] = module
                del sys.modules[name]


# The stub in use by the loaded SGLang (None where triton is installed); set by _triton_stub().
_ACTIVE_STUB: _TritonStub | None = None


@contextlib.contextmanager
def _stub_visible(stub: _TritonStub | None) -> Iterator[None]:
    if stub is None:
        yield
        return
    stub.show()
    try:
        yield
    finally:
        stub.hide()


@functools.cache
def _triton_stub() -> _TritonStub:
    """Install SGLang's macOS triton stub on this (non-macOS) machine, then hide it again; see module doc."""
    global _ACTIVE_STUB
    try:
        import torch
        import torch.backends.mps
    except ImportError as exc:
        # Import torch before sys.platform is faked below: torch's own import must see the real platform.
        raise SGLangUnavailableError(f"SGLang's argument parser needs torch: {exc}; {_INSTALL_HINT}") from exc

    stubs = _load_platform_stubs_module()

    meta_path_before = list(sys.meta_path)
    mps_names_before = set(vars(torch.mps))
    tensor_to, tensor_copy = torch.Tensor.to, torch.Tensor.copy_
    real_platform, real_machine = sys.platform, platform.machine
    real_mps_is_available = torch.backends.mps.is_available
    try:
        sys.platform = "darwin"
        platform.machine = lambda: "arm64"
        torch.backends.mps.is_available = lambda: True
        stubs.install_platform_stubs()
    finally:
        sys.platform = real_platform
        platform.machine = real_machine
        torch.backends.mps.is_available = real_mps_is_available
        # Keep only the triton part: drop the MPS shims added to torch.mps and the Tensor.to / copy_ wrappers.
        for name in set(vars(torch.mps)) - mps_names_before:
            delattr(torch.mps, name)
        torch.Tensor.to, torch.Tensor.copy_ = tensor_to, tensor_copy

    mock_type = getattr(stubs, "_MockModule", None)
    if not isinstance(mock_type, type) or not isinstance(sys.modules.get("triton"), mock_type):
        raise SGLangUnavailableError(
            "triton is not installed and SGLang's platform stub did not provide one; install triton, "
            "or an SGLang whose sglang/_platform_stubs.py has install_platform_stubs()"
        )
    finders = [f for f in sys.meta_path if not any(f is before for before in meta_path_before)]
    stub = _TritonStub(finders=finders, mock_type=mock_type)
    stub.hide()
    _ACTIVE_STUB = stub
    return stub


def _load_platform_stubs_module() -> types.ModuleType:
    """Load ``sglang/_platform_stubs.py`` by file path, without running ``sglang/__init__``."""
    if _STUBS_MODULE_NAME in sys.modules:
        return sys.modules[_STUBS_MODULE_NAME]
    spec = _find_spec("sglang")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    candidates = [Path(location) / "_platform_stubs.py" for location in locations]
    path = next((candidate for candidate in candidates if candidate.is_file()), None)
    if path is None:
        raise SGLangUnavailableError(
            "triton is not installed and this SGLang has no sglang/_platform_stubs.py to stand in for it "
            f"(looked in {locations}); install triton"
        )
    file_spec = importlib.util.spec_from_file_location(_STUBS_MODULE_NAME, path)
    if file_spec is None or file_spec.loader is None:
        raise SGLangUnavailableError(f"cannot load {path}")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[_STUBS_MODULE_NAME] = module
    try:
        file_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_STUBS_MODULE_NAME]
        raise
    if not callable(getattr(module, "install_platform_stubs", None)):
        del sys.modules[_STUBS_MODULE_NAME]
        raise SGLangUnavailableError(f"{path} has no install_platform_stubs(); install triton")
    return module
