"""Checks of Hydra override strings, made before Hydra composes: the cases where Hydra itself fails with a
traceback instead of a message.

- ``sglang=null`` or ``sglang_deploy=null`` (a group choice that is not a name): Hydra raises ``ValueError:
  Config group override must be a string or a list``.
- A key or option name longer than a file name may be (``+sglang.<300 characters>.regular.num_gpus=1``): Hydra
  looks every override key up as a config group on disk and raises ``OSError: File name too long``.
- ``+sglang_model=base`` / ``+sglang_group=decode`` without the ``@`` package they exist for: Hydra adds a
  stray root node.

Both ``miles-sglang`` (:func:`miles_sglang_plugin.config.compose.compose_config`) and every Hydra app (the
plugin's search-path hook, :func:`check_app_overrides`) run these checks, so that the user gets one clean
error and exit status 2, and nothing starts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Any

from miles_sglang_plugin.errors import Problem

#: The config groups of this package whose option names the checks know.
CHOICE_GROUPS = ("sglang", "sglang_deploy")
#: Helper groups, meaningful only at their package (a model, an extra group of a model) -> how to use them.
HELPER_GROUPS = {
    "sglang_model": "add a model with +sglang_model@{key}.<name>=base",
    "sglang_group": "add a group with +sglang_group@{key}.<model>.extra_groups.<name>=decode",
}
#: Longest key part or option name, in bytes: Hydra looks each up as ``<name>.yaml``, and file systems allow
#: names of 255 bytes.
MAX_LOOKUP_NAME_BYTES = 200
#: Exit status of a user error.
EXIT_USER_ERROR = 2


def preset_names() -> list[str]:
    """The ``sglang`` presets this package ships (the app may add its own)."""
    from pathlib import Path

    from miles_sglang_plugin.config.store import config_search_path

    location = config_search_path()
    if location.startswith("pkg://"):
        from importlib import resources

        files: Iterable[Any] = resources.files(location[len("pkg://") :]).joinpath("sglang").iterdir()
    else:
        files = (Path(location[len("file://") :]) / "sglang").iterdir()
    return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))


def _shown(text: str) -> str:
    return text if len(text) <= 60 else f"{text[:40]}… ({len(text)} characters)"


def _long_names(override: Any, text: str) -> list[Problem]:
    parts = str(override.key_or_group).split("/")
    value = override.value() if not override.is_sweep_override() else None
    if override.key_or_group in CHOICE_GROUPS + tuple(HELPER_GROUPS) and isinstance(value, str):
        parts.append(value)
    too_long = [part for part in parts if len(part.encode()) > MAX_LOOKUP_NAME_BYTES]
    if not too_long:
        return []
    return [
        Problem(
            _shown(text),
            f"a key or name of {len(too_long[0].encode())} bytes; at most {MAX_LOOKUP_NAME_BYTES} (Hydra looks "
            "keys and option names up as file names)",
        )
    ]


def _choice_values(override: Any) -> list[Any]:
    from hydra.core.override_parser.types import ChoiceSweep, Glob

    value = override.value()
    if isinstance(value, ChoiceSweep):
        return list(value.list)
    if isinstance(value, Glob):
        return []
    if override.is_sweep_override():  # a range or interval sweep: numbers
        return [value]
    return value if isinstance(value, list) else [value]


def _bad_choice(override: Any, text: str) -> list[Problem]:
    group = override.key_or_group
    if group not in CHOICE_GROUPS or override.is_delete():
        return []
    bad = [v for v in _choice_values(override) if not isinstance(v, str) or not v]
    if not bad:
        return []
    if group == "sglang":
        valid = f"a preset name (this package's: {', '.join(preset_names())}; or one of the app's)"
    else:
        valid = "default, simulated or cpu_sglang"
    shown = "null" if bad[0] is None else repr(bad[0])
    return [
        Problem(
            _shown(text),
            f"{group} is a config group: its value must be {valid}, not {shown}; ~{group} removes it",
        )
    ]


def _helper_without_package(override: Any, text: str) -> list[Problem]:
    group = override.key_or_group
    if group not in HELPER_GROUPS or override.is_delete() or override.package:
        return []
    hint = HELPER_GROUPS[group].format(key="sglang")
    return [Problem(_shown(text), f"{group} is a helper group, used only at a package: {hint}")]


def _may_have_problems(text: str) -> bool:
    """Whether ``text`` can have a problem the checks find: one longer than a name may be, or one of this
    package's groups (by its key as written, before any ``@package`` or ``=value``); the others need no parse
    (Hydra's override parser takes about 1.5 ms an override)."""
    if len(text.encode()) > MAX_LOOKUP_NAME_BYTES:
        return True
    group = text.strip().lstrip("+~").split("=", 1)[0].split("@", 1)[0].strip()
    return group in CHOICE_GROUPS or group in HELPER_GROUPS


def override_problems(overrides: Sequence[str]) -> list[Problem]:
    """What is wrong with ``overrides`` before composition (empty when nothing is). An override that does not
    parse is left to Hydra, whose message for it is clean."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    problems: list[Problem] = []
    for text in overrides:
        if not _may_have_problems(text):
            continue
        try:
            (override,) = parser.parse_overrides([text])
        except (HydraException, ValueError):
            continue
        for check in (_long_names, _bad_choice, _helper_without_package):
            problems.extend(check(override, text))
    return problems


def render(problems: Sequence[Problem]) -> str:
    head = f"{len(problems)} bad override{'s' if len(problems) != 1 else ''}:"
    return "\n".join([head, *(f"  - {problem}" for problem in problems)])


def _running_app_arguments() -> Any:
    """The parsed command line of the ``@hydra.main`` app being started (Hydra's ``_run_hydra`` holds it),
    or None outside one (the compose API, this package's own command)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == "_run_hydra"
            and frame.f_globals.get("__name__") == "hydra._internal.utils"
        ):
            return frame.f_locals.get("args")
        frame = frame.f_back
    return None


def check_app_overrides() -> None:
    """In a Hydra app being started: print what is wrong with its overrides and exit with status 2 (before
    Hydra composes, so before anything starts); nothing otherwise. Called by the plugin's search-path hook,
    which Hydra runs before it composes (outside its own error reporting, so the exit is not caught)."""
    args = _running_app_arguments()
    if args is None or getattr(args, "shell_completion", False):
        return
    problems = override_problems(list(getattr(args, "overrides", None) or []))
    if problems:
        print(f"error: {render(problems)}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)
