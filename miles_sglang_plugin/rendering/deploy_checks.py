"""Checks of the deployment-wide settings (``sglang_deploy``: launch, LoRA's switches and paths, env, stand-in,
API key, supervision, control): every value, before anything is rendered or started.

They run in :func:`~miles_sglang_plugin.rendering.launch_specs.check_deploy_settings`, hence on every path
that renders a deployment (``plan``, ``export``, ``resolve_config``'s callers, ``launch``). The settings may come
from a composed Hydra config (typed by the schema: a wrong type fails there already) or from code (anything):
both are checked the same way. A secret (the API key) is never shown in a message.

A numeric setting is checked by its :class:`Bounds` (one message shape for every one: ``must be an integer >= 1,
got 0``); the router's numbers (:mod:`~miles_sglang_plugin.rendering.router_specs`), LoRA's
(:mod:`~miles_sglang_plugin.rendering.lora`) and the ray backend's use the same.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from miles_sglang_plugin.config.schema import (
    BackendKind,
    EngineKind,
    LaunchConf,
    LoraConf,
    SGLangDeployConf,
    StandInFaultsConf,
    SupervisionConf,
)
from miles_sglang_plugin.errors import Problem
from miles_sglang_plugin.masking import secret_value_problem

LIVE_MODES = ("auto", "always", "never")
#: What supervision may poll.
HEALTH_ENDPOINTS = ("/health", "/health_generate")
#: A host name of RFC 1123 labels (letters, digits, ``-``; dot separated), at most 253 characters.
_HOST_NAME_RE = re.compile(
    r"^(?=.{1,253}\.?$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
#: The longest ``poll_interval_s``: start-up notices an engine that exits at the next poll.
MAX_POLL_INTERVAL_S = 60.0


def _number(value: float) -> str:
    """A bound as a reader writes it: ``2592000``, ``0.5``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Bounds:
    """What a numeric setting may hold: a finite number (an integer where ``integer``) at or above ``minimum``
    (above it where not ``inclusive``) and, where ``maximum`` is given, at most ``maximum``; ``why`` (optional)
    says what the bounds protect."""

    minimum: float
    inclusive: bool = True
    integer: bool = False
    maximum: float | None = None
    why: str = ""

    def _range(self) -> str:
        low = _number(self.minimum)
        if self.maximum is None:
            return f"{'>=' if self.inclusive else '>'} {low}"
        if self.inclusive:
            return f"in {low}..{_number(self.maximum)}"
        return f"> {low} and <= {_number(self.maximum)}"

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (``must be a number > 0, got -1.0``), or None when it is fine."""
        kinds = (int,) if self.integer else (int, float)
        ok = not isinstance(value, bool) and isinstance(value, kinds)
        finite = not ok or math.isfinite(value)
        if ok and finite:
            low_ok = value > self.minimum or (self.inclusive and value == self.minimum)
            if low_ok and (self.maximum is None or value <= self.maximum):
                return None
        what = "an integer" if self.integer else "a number" if finite else "a finite number"
        why = f" ({self.why})" if self.why else ""
        return f"must be {what} {self._range()}{why}, got {value!r}"


def bounds_problems(key: str, value: Any, bounds: Bounds) -> list[Problem]:
    """``value`` of the setting ``key`` against its ``bounds``: no problem, or one with the key."""
    message = bounds.problem(value)
    return [] if message is None else [Problem(key, message)]


def flag_problem(value: Any) -> str | None:
    """A switch is ``true`` or ``false`` (not 1, not ``"yes"``)."""
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def choice_problem(value: Any, valid: Collection[str]) -> str | None:
    """``value`` is one of the strings ``valid`` (a member of a string enum counts as its value)."""
    if isinstance(value, str) and str(value) in valid:
        return None
    return f"{value!r} is not one of {', '.join(valid)}"


def _problems(key: str, message: str | None) -> list[Problem]:
    return [] if message is None else [Problem(key, message)]


#: The longest duration a setting may hold: 30 days (a longer wait is a mistake, and past about 1e11 s the
#: waits themselves fail: OverflowError in the timers).
MAX_DURATION_S = 30 * 24 * 3600
#: The largest count (restarts, thresholds, concurrency) a setting may hold.
MAX_COUNT = 1_000_000
#: Ports this package hands out stay below the ephemeral range (Linux' default starts at 32768).
EPHEMERAL_PORTS_START = 32768


def duration_bounds(*, positive: bool = False) -> Bounds:
    """A duration in seconds: >= 0 (> 0 where ``positive``), at most :data:`MAX_DURATION_S`."""
    return Bounds(0, inclusive=not positive, maximum=MAX_DURATION_S, why="at most 30 days")


def _count(minimum: int) -> Bounds:
    return Bounds(minimum, integer=True, maximum=MAX_COUNT)


#: The numeric settings under ``sglang_deploy`` (dotted, below it) and their bounds.
SETTING_BOUNDS: Mapping[str, Bounds] = {
    "launch.startup_timeout_s": duration_bounds(positive=True),
    "launch.poll_interval_s": Bounds(
        0,
        inclusive=False,
        maximum=MAX_POLL_INTERVAL_S,
        why="an engine that exits is noticed at the next poll",
    ),
    "launch.shutdown_grace_s": duration_bounds(),
    "launch.drain_timeout_s": duration_bounds(),
    "launch.port_base": Bounds(
        1024,
        integer=True,
        maximum=EPHEMERAL_PORTS_START - 2,
        why=f"ports are handed out below the ephemeral range, {EPHEMERAL_PORTS_START}",
    ),
    "launch.port_max": Bounds(1024, integer=True, maximum=65535, why="above 32767 it means 32767"),
    "standin.start_delay_s": duration_bounds(),
    "standin.control_latency_s": duration_bounds(),
    "supervision.health_interval_s": duration_bounds(positive=True),
    "supervision.health_timeout_s": duration_bounds(positive=True),
    "supervision.failure_threshold": _count(1),
    "supervision.max_restarts": _count(0),
    "supervision.restart_backoff_s": duration_bounds(),
    "supervision.restart_backoff_max_s": duration_bounds(),
    "supervision.restart_budget_reset_s": duration_bounds(positive=True),
    "supervision.kill_grace_s": duration_bounds(),
    "supervision.router_max_restarts": _count(0),
    "control.timeout_s": duration_bounds(positive=True),
    "control.max_concurrency": _count(1),
}


def _setting(settings: SGLangDeployConf, dotted: str) -> Any:
    node: Any = settings
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _in_bounds(settings: SGLangDeployConf, dotted: str) -> bool:
    return SETTING_BOUNDS[dotted].problem(_setting(settings, dotted)) is None


def _bounded_setting_problems(settings: SGLangDeployConf) -> list[Problem]:
    """Every numeric setting of :data:`SETTING_BOUNDS`, the stand-in's per-engine death times and its speed
    model (durations of at most 30 days, rates > 0 and at most 1e9)."""
    out: list[Problem] = []
    for dotted, bounds in SETTING_BOUNDS.items():
        out += bounds_problems(f"sglang_deploy.{dotted}", _setting(settings, dotted), bounds)
    die_after = settings.standin.die_after_s
    for pattern, seconds in die_after.items() if isinstance(die_after, Mapping) else ():
        out += bounds_problems(f"sglang_deploy.standin.die_after_s.{pattern}", seconds, duration_bounds())
    for speed in dataclasses.fields(settings.standin.speed):
        if speed.name != "enabled":
            rate = speed.name.endswith("_per_s")
            bounds = Bounds(0, inclusive=False, maximum=1e9) if rate else duration_bounds()
            value = getattr(settings.standin.speed, speed.name)
            out += bounds_problems(f"sglang_deploy.standin.speed.{speed.name}", value, bounds)
    return out


def host_problem(path: str, host: Any) -> list[Problem]:
    """``host`` is an IP address (IPv6 with or without brackets) or a host name."""
    if isinstance(host, str) and host:
        with_brackets = host.startswith("[") and host.endswith("]")
        try:
            ipaddress.ip_address(host[1:-1] if with_brackets else host)
            return []
        except ValueError:
            if not with_brackets and _HOST_NAME_RE.match(host):
                return []
    return [Problem(path, f"{host!r} is neither an IP address nor a host name (e.g. 127.0.0.1, ::1, node-0)")]


def _command_problems(key: str, command: Any) -> list[Problem]:
    if (
        isinstance(command, list | tuple)
        and command
        and all(isinstance(part, str) and part and "\0" not in part for part in command)
    ):
        return []
    return [
        Problem(
            key, "must be a non-empty list of non-empty strings, e.g. [{python}, -m, sglang.launch_server]"
        )
    ]


def _launch_problems(settings: SGLangDeployConf) -> list[Problem]:
    """What is not a number in ``sglang_deploy.launch``, and the port range as a whole."""
    key = "sglang_deploy.launch"
    launch: LaunchConf = settings.launch
    out: list[Problem] = []
    for name, kind in (("engine", EngineKind), ("backend", BackendKind)):
        out += _problems(f"{key}.{name}", choice_problem(getattr(launch, name), [m.value for m in kind]))
    out += _command_problems(f"{key}.command", launch.command)
    out += host_problem(f"{key}.host", launch.host)
    ports_ok = _in_bounds(settings, "launch.port_base") and _in_bounds(settings, "launch.port_max")
    if ports_ok and launch.port_base >= launch.port_max:
        out.append(
            Problem(f"{key}.port_base", f"{launch.port_base} must be below port_max={launch.port_max}")
        )
    log_dir = launch.log_dir
    if log_dir is not None and (not isinstance(log_dir, str) or not log_dir or "\0" in log_dir):
        out.append(Problem(f"{key}.log_dir", f"must be a directory path or null, got {log_dir!r}"))
    return out + _problems(f"{key}.live", choice_problem(launch.live, LIVE_MODES))


def _lora_problems(lora: LoraConf) -> list[Problem]:
    """The switches, adapter paths and module names (the numbers: :func:`~miles_sglang_plugin.rendering.lora.
    lora_problems`, with Miles' multi-LoRA rules)."""
    key = "sglang_deploy.lora"
    out: list[Problem] = []
    for name in ("enabled", "base_cpu_backup"):
        out += _problems(f"{key}.{name}", flag_problem(getattr(lora, name)))
    paths = lora.paths if isinstance(lora.paths, Mapping) else None
    if paths is None:
        out.append(Problem(f"{key}.paths", f"must map adapter names to paths, got {lora.paths!r}"))
    for name, path in (paths or {}).items():
        if not isinstance(name, str) or not _ADAPTER_NAME_RE.match(name):
            out.append(
                Problem(f"{key}.paths.{name}", "an adapter name holds letters, digits, '_', '-' or '.'")
            )
        elif not isinstance(path, str) or not path:
            out.append(Problem(f"{key}.paths.{name}", f"must be a non-empty path, got {path!r}"))
    modules = lora.target_modules
    if not isinstance(modules, list | tuple) or not all(isinstance(m, str) and m for m in modules):
        out.append(Problem(f"{key}.target_modules", f"must be a list of module names, got {modules!r}"))
    return out


def _env_problems(env: Any) -> list[Problem]:
    """Names that are variable names; values strings without NUL (values are not shown: they may be secrets)."""
    if not isinstance(env, Mapping):
        return [
            Problem("sglang_deploy.env", f"must map variable names to strings, got a {type(env).__name__}")
        ]
    out = []
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME_RE.match(name):
            out.append(
                Problem(
                    f"sglang_deploy.env.{name}",
                    "is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
                )
            )
        elif not isinstance(value, str) or "\0" in value:
            out.append(
                Problem(
                    f"sglang_deploy.env.{name}",
                    f"must be a string without NUL bytes, got a {type(value).__name__}",
                )
            )
    return out


def _standin_problems(faults: StandInFaultsConf) -> list[Problem]:
    """The engine id patterns (the delays and the speed model: :data:`SETTING_BOUNDS`)."""
    key = "sglang_deploy.standin"
    out = []
    for name in ("fail_at_start", "never_healthy"):
        patterns = getattr(faults, name)
        if not isinstance(patterns, list | tuple) or not all(isinstance(p, str) for p in patterns):
            out.append(Problem(f"{key}.{name}", f"must be a list of engine id patterns, got {patterns!r}"))
    if not isinstance(faults.die_after_s, Mapping):
        out.append(
            Problem(
                f"{key}.die_after_s", f"must map engine id patterns to seconds, got {faults.die_after_s!r}"
            )
        )
    return out


def _supervision_problems(settings: SGLangDeployConf) -> list[Problem]:
    """The switch, the endpoint, and the backoff cap against the first wait."""
    key = "sglang_deploy.supervision"
    supervision: SupervisionConf = settings.supervision
    out = _problems(f"{key}.health_endpoint", choice_problem(supervision.health_endpoint, HEALTH_ENDPOINTS))
    out += _problems(f"{key}.enabled", flag_problem(supervision.enabled))
    backoff, cap = supervision.restart_backoff_s, supervision.restart_backoff_max_s
    in_bounds = _in_bounds(settings, "supervision.restart_backoff_s") and _in_bounds(
        settings, "supervision.restart_backoff_max_s"
    )
    if in_bounds and cap < backoff:
        out.append(
            Problem(
                f"{key}.restart_backoff_max_s",
                f"{cap!r} is below restart_backoff_s={backoff!r}; the cap must be at least the first wait",
            )
        )
    return out


def _api_key_problems(api_key: Any) -> list[Problem]:
    problem = secret_value_problem(api_key)
    return [] if problem is None else [Problem("sglang_deploy.api_key", problem)]


def deploy_setting_problems(settings: SGLangDeployConf) -> list[Problem]:
    """Every problem with the launch, LoRA (but its numbers), environment, stand-in, API key, supervision and
    control settings (empty: fine)."""
    return [
        *_bounded_setting_problems(settings),
        *_launch_problems(settings),
        *_lora_problems(settings.lora),
        *_env_problems(settings.env),
        *_standin_problems(settings.standin),
        *_api_key_problems(settings.api_key),
        *_supervision_problems(settings),
    ]


__all__ = [
    "EPHEMERAL_PORTS_START",
    "HEALTH_ENDPOINTS",
    "LIVE_MODES",
    "MAX_COUNT",
    "MAX_DURATION_S",
    "MAX_POLL_INTERVAL_S",
    "SETTING_BOUNDS",
    "Bounds",
    "bounds_problems",
    "choice_problem",
    "deploy_setting_problems",
    "duration_bounds",
    "flag_problem",
    "host_problem",
]
