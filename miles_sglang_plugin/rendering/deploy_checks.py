"""Checks of the deployment-wide launch settings (``sglang_deploy.launch``, ``.lora``, ``.env``, ``.standin``,
``.api_key``): every value, before anything is rendered or started.

They run in :func:`~miles_sglang_plugin.rendering.launch_specs.check_deploy_settings`, hence on every path
that renders a deployment (``plan``, ``export``, ``resolve_config``'s callers, ``launch``). The settings may come
from a composed Hydra config (typed by the schema: a wrong type fails there already) or from code (anything):
both are checked the same way. A secret (the API key) is never shown in a message.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from typing import Any

from miles_sglang_plugin.config.schema import (
    BackendKind,
    EngineKind,
    LaunchConf,
    LoraConf,
    SGLangDeployConf,
    StandInFaultsConf,
)
from miles_sglang_plugin.errors import Problem

LIVE_MODES = ("auto", "always", "never")
#: A host name of RFC 1123 labels (letters, digits, ``-``; dot separated), at most 253 characters.
_HOST_NAME_RE = re.compile(
    r"^(?=.{1,253}\.?$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
#: The longest ``poll_interval_s``: start-up notices an engine that exits at the next poll.
MAX_POLL_INTERVAL_S = 60.0


def _number(
    path: str, value: Any, *, minimum: float, inclusive: bool, integer: bool = False
) -> list[Problem]:
    """``value`` is a finite number (an integer where ``integer``) at or above (or above) ``minimum``."""
    kinds = (int,) if integer else (int, float)
    what = "an integer" if integer else "a number"
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"
    if isinstance(value, bool) or not isinstance(value, kinds):
        return [Problem(path, f"must be {what} {bound}, got {value!r}")]
    if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
        return [Problem(path, f"must be {what} {bound}, got {value!r}")]
    return []


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


def _timing_problems(key: str, launch: LaunchConf) -> list[Problem]:
    out = _number(f"{key}.startup_timeout_s", launch.startup_timeout_s, minimum=0, inclusive=False)
    poll = _number(f"{key}.poll_interval_s", launch.poll_interval_s, minimum=0, inclusive=False)
    if not poll and launch.poll_interval_s > MAX_POLL_INTERVAL_S:
        poll.append(
            Problem(
                f"{key}.poll_interval_s",
                f"must be at most {MAX_POLL_INTERVAL_S:g} s (an engine that exits is noticed at the next poll), "
                f"got {launch.poll_interval_s!r}",
            )
        )
    return out + poll + _number(f"{key}.shutdown_grace_s", launch.shutdown_grace_s, minimum=0, inclusive=True)


def _port_problems(key: str, launch: LaunchConf) -> list[Problem]:
    out = _number(f"{key}.port_base", launch.port_base, minimum=1024, inclusive=True, integer=True)
    out += _number(f"{key}.port_max", launch.port_max, minimum=1024, inclusive=True, integer=True)
    if not out and launch.port_base >= launch.port_max:
        out.append(
            Problem(f"{key}.port_base", f"{launch.port_base} must be below port_max={launch.port_max}")
        )
    return out


def _launch_problems(launch: LaunchConf) -> list[Problem]:
    key = "sglang_deploy.launch"
    out: list[Problem] = []
    for name, kind in (("engine", EngineKind), ("backend", BackendKind)):
        value = getattr(launch, name)
        valid = [member.value for member in kind]
        if str(value) not in valid:
            out.append(Problem(f"{key}.{name}", f"{value!r} is not one of {', '.join(valid)}"))
    out += _command_problems(f"{key}.command", launch.command)
    out += host_problem(f"{key}.host", launch.host)
    out += _timing_problems(key, launch)
    out += _port_problems(key, launch)
    log_dir = launch.log_dir
    if log_dir is not None and (not isinstance(log_dir, str) or not log_dir or "\0" in log_dir):
        out.append(Problem(f"{key}.log_dir", f"must be a directory path or null, got {log_dir!r}"))
    if launch.live not in LIVE_MODES:
        out.append(Problem(f"{key}.live", f"{launch.live!r} is not one of {', '.join(LIVE_MODES)}"))
    return out


def _lora_problems(lora: LoraConf) -> list[Problem]:
    """The switches, adapter paths and module names (the numbers: :func:`~miles_sglang_plugin.rendering.lora.
    lora_problems`, with Miles' multi-LoRA rules)."""
    key = "sglang_deploy.lora"
    out: list[Problem] = []
    for name in ("enabled", "base_cpu_backup"):
        if not isinstance(getattr(lora, name), bool):
            out.append(Problem(f"{key}.{name}", f"must be true or false, got {getattr(lora, name)!r}"))
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
    key = "sglang_deploy.standin"
    out = _number(f"{key}.start_delay_s", faults.start_delay_s, minimum=0, inclusive=True)
    for name in ("fail_at_start", "never_healthy"):
        patterns = getattr(faults, name)
        if not isinstance(patterns, list | tuple) or not all(isinstance(p, str) for p in patterns):
            out.append(Problem(f"{key}.{name}", f"must be a list of engine id patterns, got {patterns!r}"))
    die_after = faults.die_after_s if isinstance(faults.die_after_s, Mapping) else {}
    if not isinstance(faults.die_after_s, Mapping):
        out.append(
            Problem(
                f"{key}.die_after_s", f"must map engine id patterns to seconds, got {faults.die_after_s!r}"
            )
        )
    for pattern, seconds in die_after.items():
        out += _number(f"{key}.die_after_s.{pattern}", seconds, minimum=0, inclusive=True)
    return out


def _api_key_problems(api_key: Any) -> list[Problem]:
    if api_key is None or (isinstance(api_key, str) and "\0" not in api_key and api_key.strip() == api_key):
        return []
    what = (
        f"a {type(api_key).__name__}"
        if not isinstance(api_key, str)
        else "a string with a NUL byte or surrounding blanks"
    )
    return [
        Problem(
            "sglang_deploy.api_key",
            f"must be a string without NUL bytes or surrounding blanks (its value is not shown), got {what}",
        )
    ]


def launch_setting_problems(settings: SGLangDeployConf) -> list[Problem]:
    """Every problem with the launch, LoRA, environment, stand-in and API key settings (empty: fine)."""
    return [
        *_launch_problems(settings.launch),
        *_lora_problems(settings.lora),
        *_env_problems(settings.env),
        *_standin_problems(settings.standin),
        *_api_key_problems(settings.api_key),
    ]


__all__ = ["LIVE_MODES", "MAX_POLL_INTERVAL_S", "host_problem", "launch_setting_problems"]
