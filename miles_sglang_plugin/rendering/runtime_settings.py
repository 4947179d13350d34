"""Checks of the settings the running deployment reads (``sglang_deploy.supervision``, ``sglang_deploy.control``,
the stand-in's control latency): each value of its type and in its range, every problem with its key."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.errors import Problem

#: What supervision may poll.
HEALTH_ENDPOINTS = ("/health", "/health_generate")

#: key -> (minimum, whether the minimum itself is allowed, integer only)
_BOUNDS: dict[str, tuple[float, bool, bool]] = {
    "supervision.health_interval_s": (0.0, False, False),
    "supervision.health_timeout_s": (0.0, False, False),
    "supervision.failure_threshold": (1, True, True),
    "supervision.max_restarts": (0, True, True),
    "supervision.restart_backoff_s": (0.0, True, False),
    "supervision.restart_backoff_max_s": (0.0, True, False),
    "supervision.restart_budget_reset_s": (0.0, False, False),
    "supervision.kill_grace_s": (0.0, True, False),
    "supervision.router_max_restarts": (0, True, True),
    "control.timeout_s": (0.0, False, False),
    "control.max_concurrency": (1, True, True),
    "standin.control_latency_s": (0.0, True, False),
}


def _value(settings: SGLangDeployConf, dotted: str) -> Any:
    node: Any = settings
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _problem(key: str, value: Any, minimum: float, inclusive: bool, integer: bool) -> str | None:
    kind = "an integer" if integer else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
    ):
        return f"must be {kind}, got {value!r}"
    if not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if value < minimum or (value == minimum and not inclusive):
        return f"must be {'>=' if inclusive else '>'} {minimum:g}, got {value!r}"
    return None


def runtime_settings_problems(settings: SGLangDeployConf) -> Iterator[Problem]:
    for key, (minimum, inclusive, integer) in _BOUNDS.items():
        message = _problem(key, _value(settings, key), minimum, inclusive, integer)
        if message is not None:
            yield Problem(f"sglang_deploy.{key}", message)
    supervision = settings.supervision
    if supervision.health_endpoint not in HEALTH_ENDPOINTS:
        yield Problem(
            "sglang_deploy.supervision.health_endpoint",
            f"{supervision.health_endpoint!r} is not one of {', '.join(HEALTH_ENDPOINTS)}",
        )
    if not isinstance(supervision.enabled, bool):
        yield Problem(
            "sglang_deploy.supervision.enabled", f"must be true or false, got {supervision.enabled!r}"
        )
    backoff, cap = supervision.restart_backoff_s, supervision.restart_backoff_max_s
    if isinstance(backoff, int | float) and isinstance(cap, int | float) and cap < backoff:
        yield Problem(
            "sglang_deploy.supervision.restart_backoff_max_s",
            f"{cap!r} is below restart_backoff_s={backoff!r}; the cap must be at least the first wait",
        )
