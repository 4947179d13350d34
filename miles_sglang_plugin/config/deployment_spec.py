"""The unresolved description of a deployment: models and their server groups, as the user wrote them.

Every input format converges here: a composed Hydra ``sglang`` node (:mod:`miles_sglang_plugin.config.reading`),
a Miles/slime ``--sglang-config`` YAML file (:mod:`miles_sglang_plugin.miles.sglang_config`), or nothing at all (the
trainer's legacy flags, handled by the resolver). ``None`` in an optional field means "not given: inherit".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, TypeGuard


class WorkerType(StrEnum):
    """What a server group runs (Miles' ``worker_type``)."""

    regular = "regular"
    prefill = "prefill"
    decode = "decode"
    placeholder = "placeholder"

    def __str__(self) -> str:
        return self.value

    @property
    def is_pd(self) -> bool:
        return self in (WorkerType.prefill, WorkerType.decode)


WORKER_TYPES: tuple[str, ...] = tuple(t.value for t in WorkerType)

#: Model and group names: usable as Hydra keys (``sglang.<model>.<group>``) and in engine ids.
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def is_int(value: object) -> TypeGuard[int]:
    """An integer that is not a bool (YAML's ``true`` must not count as 1 GPU)."""
    return isinstance(value, int) and not isinstance(value, bool)


def freeze(value: Any) -> Any:
    """A read-only deep copy: mappings become ``MappingProxyType``, lists become tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The inverse of :func:`freeze`, for JSON and YAML output."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class GroupSpec:
    """One server group as written. ``key`` is where it was written, for error messages."""

    name: str
    worker_type: WorkerType | str
    num_gpus: Any
    num_gpus_per_engine: Any = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    key: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", freeze(dict(self.overrides)))


@dataclass(frozen=True)
class ExternalEngineSpec:
    """An engine that already runs elsewhere, as written: its URL, what it serves (``regular``, ``prefill``,
    ``decode``) and, for a prefill engine, its bootstrap port. Checked at resolution."""

    url: Any
    worker_type: Any = "regular"
    bootstrap_port: Any = None
    key: str = ""


@dataclass(frozen=True)
class ModelSpec:
    """One model (one router) as written."""

    name: str
    groups: tuple[GroupSpec, ...]
    model_path: str | None = None
    update_weights: bool | None = None
    num_gpus_per_engine: Any = None
    key: str = ""
    #: Engines already running elsewhere that the model's router serves besides (or instead of) its groups.
    external: tuple[ExternalEngineSpec, ...] = ()


@dataclass(frozen=True)
class DeploymentSpec:
    """All models in deployment order (the order of GPU offsets)."""

    models: tuple[ModelSpec, ...]
    source: str = ""
    #: True for a Miles/slime ``--sglang-config`` file: like Miles, resolution drops (and notes) group override
    #: keys that the installed SGLang lacks, where a Hydra config of the user's own has them refused.
    drops_unknown_override_keys: bool = False

    def model(self, name: str) -> ModelSpec:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no model {name!r}; models: {[model.name for model in self.models]}")
