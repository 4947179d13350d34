"""Rolling weight updates: which engines the next wave takes (pure; the control handle runs the waves).

A rolling update takes the engines that receive weights out of their router a few at a time, per group (a
model's ``regular``, ``prefill``, ``decode`` ... group), so that at least ``min_serving_fraction`` of each
group serves throughout. With ``n`` engines in a group, ``ceil(f * n)`` of them must keep serving, so a wave
takes at most ``serving_now - ceil(f * n)`` of the group's engines that still wait for the update. Where that
is less than one (a group of one engine, ``f = 1``, or engines lost meanwhile) the wave takes one: the update
always goes on, and the group serves below ``f`` for that wave. The waves of every group run side by side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["GroupProgress", "check_fraction", "next_wave", "wave_size"]


def check_fraction(value: object, key: str = "min_serving_fraction") -> float:
    """``value`` as a fraction in [0, 1], or a ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} must be a number >= 0 and <= 1, got {value!r}")
    if not 0 <= value <= 1:
        raise ValueError(f"{key} must be a number >= 0 and <= 1, got {value!r}")
    return float(value)


def wave_size(engines: int, serving: int, fraction: float) -> int:
    """How many engines of a group of ``engines`` (``serving`` of them serving now) one wave may take so that
    ``ceil(fraction * engines)`` keep serving; at least one."""
    keep = math.ceil(round(fraction * engines, 9))  # 0.7 * 10 is 7.000000000000001 in floats: 7, not 8
    return max(1, serving - keep)


@dataclass(frozen=True)
class GroupProgress:
    """One group of a rolling update as it stands before a wave."""

    #: Every engine of the group the update concerns, in deployment order.
    engines: Sequence[str]
    #: Those serving now (in their router).
    serving: frozenset[str]
    #: Those not updated yet, in deployment order.
    waiting: Sequence[str]


def next_wave(groups: Mapping[str, GroupProgress], fraction: float) -> tuple[str, ...]:
    """The engines of the next wave: per group, its waiting engines that serve, as many as
    :func:`wave_size` allows, in deployment order; a group whose waiting engines all do not serve (lost,
    waiting for weights) sends them in one wave (they take no requests, so taking them keeps nothing from
    serving). Empty once no engine waits."""
    wave: list[str] = []
    for group in groups.values():
        serving = [e for e in group.waiting if e in group.serving]
        if not serving:
            wave += list(group.waiting)
            continue
        size = wave_size(len(group.engines), len(group.serving), fraction)
        wave += serving[:size]
    return tuple(wave)
