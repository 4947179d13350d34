"""The control operations as a table: for each, the SGLang route, which engines it concerns by the plan, and
whether the ledger records it; plus the request bodies (the installed SGLang's request classes, checked by
the tests and by the stand-in) and each operation's effect on an engine's state (:mod:`.ledger`).

The handles (:mod:`.control`) turn a call into (spec, body, effect) and run it; nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from miles_sglang_plugin.serving.fleet import EngineRow
from miles_sglang_plugin.serving.ledger import MEMORY_TAGS, ControlState, Effect, Weights

__all__ = [
    "DEFAULT_GROUP_NAME",
    "MEMORY_TAGS",
    "OPERATIONS",
    "PAUSE_MODES",
    "OperationSpec",
    "check_timeout",
    "memory_tags",
]

#: SGLang's default name of a weights update group (``InitWeightsUpdateGroupReqInput.group_name``).
DEFAULT_GROUP_NAME = "weight_update_group"
PAUSE_MODES = ("abort", "retract", "in_place")


def _every(_row: EngineRow) -> bool:
    return True


def _offloaded(row: EngineRow) -> bool:
    return row.needs_offload


def _receives_weights(row: EngineRow) -> bool:
    return row.update_weights


def _serves_lora(row: EngineRow) -> bool:
    return row.serves_lora


@dataclass(frozen=True)
class OperationSpec:
    """One control operation: its route, the engines it concerns by the plan, whether the ledger records it."""

    name: str
    route: str
    concerns: Callable[[EngineRow], bool]
    records: bool
    method: str = "POST"
    doc: str = ""
    #: An engine that answers this status is busy, not refusing: it is asked again until the deadline
    #: (SGLang's ``/flush_cache`` answers 400 while any request runs or waits, and for a moment after the
    #: last answer went out, until its scheduler's next pass; Miles polls it until 200).
    busy_status: int | None = None


_SPECS = (
    OperationSpec("offload", "/release_memory_occupation", _offloaded, True, doc="groups with needs_offload"),
    OperationSpec("onload", "/resume_memory_occupation", _offloaded, True, doc="groups with needs_offload"),
    OperationSpec("update_weights_from_disk", "/update_weights_from_disk", _receives_weights, True),
    OperationSpec("init_weights_update_group", "/init_weights_update_group", _receives_weights, False),
    OperationSpec(
        "update_weights_from_distributed", "/update_weights_from_distributed", _receives_weights, True
    ),
    OperationSpec("destroy_weights_update_group", "/destroy_weights_update_group", _receives_weights, False),
    OperationSpec("update_weight_version", "/update_weight_version", _receives_weights, True),
    OperationSpec("pause_generation", "/pause_generation", _every, True),
    OperationSpec("continue_generation", "/continue_generation", _every, True),
    OperationSpec("flush_cache", "/flush_cache", _every, False, busy_status=400),
    OperationSpec("abort_all", "/abort_request", _every, False),
    OperationSpec("load_lora_adapter", "/load_lora_adapter", _serves_lora, True),
    OperationSpec("unload_lora_adapter", "/unload_lora_adapter", _serves_lora, True),
    OperationSpec("query", "", _every, False, method="GET"),
)
#: Every operation by name.
OPERATIONS: dict[str, OperationSpec] = {spec.name: spec for spec in _SPECS}


# ------------------------------------------------------------------------------------------- validation
def check_timeout(timeout_s: float | None) -> float | None:
    """A control deadline must be a finite number of seconds > 0 (None: the configured default)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 (a deadline the engines can meet), got {timeout_s!r}")
    return float(timeout_s)


def memory_tags(tags: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``tags`` as SGLang's memory tags: None (all memory), one tag (``"weights"``), or several; unknown tags
    are refused."""
    if tags is None:
        return None
    listed = (tags,) if isinstance(tags, str) else tuple(tags)
    unknown = [tag for tag in listed if tag not in MEMORY_TAGS]
    if unknown or not listed:
        raise ValueError(
            f"memory tags must be some of {', '.join(MEMORY_TAGS)} (or None: all), got {list(listed)!r}"
        )
    return tuple(dict.fromkeys(listed))


def check_version(version: object, what: str = "new_version") -> str:
    if version is None or isinstance(version, bool) or not isinstance(version, str | int):
        raise ValueError(f"{what} must be a string (or an integer), got {version!r}")
    return str(version)


# ---------------------------------------------------------------------------------------- bodies, effects
def memory_body(tags: Sequence[str] | None) -> dict[str, Any]:
    """``/release_memory_occupation`` and ``/resume_memory_occupation`` (``tags`` None: all memory)."""
    return {} if tags is None else {"tags": list(tags)}


def memory_effect(tags: Sequence[str] | None, *, released: bool) -> Effect:
    changed = frozenset(tags if tags is not None else MEMORY_TAGS)

    def effect(state: ControlState) -> ControlState:
        now = state.released | changed if released else state.released - changed
        return replace(state, released=frozenset(now))

    return effect


def disk_weights_body(
    model_path: str,
    *,
    weight_version: str | None = None,
    load_format: str | None = None,
    abort_all_requests: bool = False,
    flush_cache: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model_path": model_path,
        "abort_all_requests": abort_all_requests,
        "flush_cache": flush_cache,
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    if load_format is not None:
        body["load_format"] = load_format
    return body


def disk_weights_effect(body: dict[str, Any]) -> Effect:
    weights = Weights.from_disk({k: v for k, v in body.items() if k != "abort_all_requests"})
    version = body.get("weight_version")

    def effect(state: ControlState) -> ControlState:
        return replace(
            state, weights=weights, weight_version=version if version is not None else state.weight_version
        )

    return effect


def _dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` -> ``"bfloat16"`` (Miles sends dtypes without ``torch.``)."""
    return str(dtype).removeprefix("torch.")


def distributed_weights_body(
    names: Sequence[str],
    dtypes: Sequence[Any],
    shapes: Sequence[Sequence[int]],
    *,
    group_name: str = DEFAULT_GROUP_NAME,
    weight_version: str | None = None,
    flush_cache: bool = False,
    abort_all_requests: bool = False,
    load_format: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "names": list(names),
        "dtypes": [_dtype_name(dtype) for dtype in dtypes],
        "shapes": [[int(n) for n in shape] for shape in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    if load_format is not None:
        body["load_format"] = load_format
    return body


def init_group_body(
    *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, Any]:
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def weight_version_body(new_version: str, *, abort_all_requests: bool = False) -> dict[str, Any]:
    return {"new_version": str(new_version), "abort_all_requests": abort_all_requests}


def weight_version_effect(version: str) -> Effect:
    return lambda state: replace(state, weight_version=version)


def pause_body(mode: str) -> dict[str, Any]:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
    return {"mode": mode}


def pause_effect(mode: str | None) -> Effect:
    return lambda state: replace(state, paused=mode)


def lora_load_body(name: str, path: str, *, pinned: bool = False) -> dict[str, Any]:
    return {"lora_name": name, "lora_path": path, "pinned": pinned}


def lora_load_effect(name: str, path: str, pinned: bool) -> Effect:
    return lambda state: state.with_lora(name, path, pinned)


def lora_unload_body(name: str) -> dict[str, Any]:
    return {"lora_name": name}


def lora_unload_effect(name: str) -> Effect:
    return lambda state: state.without_lora(name)
