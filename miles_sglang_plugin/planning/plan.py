"""The resolved deployment: a frozen plan that every later stage (render, execute, serve) only reads.

Produced by :func:`miles_sglang_plugin.planning.resolution.resolve_deployment`. Numbers in it follow Miles' rules:
``gpu_offset`` counts the GPUs of every earlier group (placeholders included) across all models; a GPU *slot* is
the global placement index ``rollout_offset + gpu_offset + ...``; a slot lives on node ``slot // num_gpus_per_node``
as local GPU ``slot % num_gpus_per_node``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_sglang_plugin.config.deployment_spec import WorkerType, thaw
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs


@dataclass(frozen=True)
class EngineProcessPlan:
    """One OS process of an engine: an engine wider than a node has one per node."""

    node: int
    node_rank: int
    gpu_slots: tuple[int, ...]
    local_gpu_ids: tuple[int, ...]
    #: Miles' worker rank: the engine's rank + node_rank (the process's ``--random-seed`` is seed + rank).
    rank: int = 0


@dataclass(frozen=True)
class EnginePlan:
    model: str
    group: str
    #: Index within the group.
    index: int
    #: Miles' rank of the engine's first process: a cursor over the deployment in order that counts one per
    #: engine process (each node of a multi-node engine) and ``num_gpus // min(gpus per engine, GPUs per
    #: node)`` for a placeholder group, as Miles' ``engine_offset`` does. Each process's seed is seed + its rank.
    rank: int
    worker_type: WorkerType
    gpu_slots: tuple[int, ...]
    processes: tuple[EngineProcessPlan, ...]

    @property
    def id(self) -> str:
        """Unique within a deployment: ``<model>.<group>.<index>``."""
        return f"{self.model}.{self.group}.{self.index}"

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_slots)

    @property
    def nnodes(self) -> int:
        return len(self.processes)

    @property
    def node(self) -> int:
        """The node of node-rank 0: the one that serves HTTP and registers with the router."""
        return self.processes[0].node

    @property
    def local_gpu_ids(self) -> tuple[int, ...]:
        return self.processes[0].local_gpu_ids

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "index": self.index,
            "rank": self.rank,
            "gpu_slots": list(self.gpu_slots),
            "node": self.node,
            "local_gpu_ids": list(self.local_gpu_ids),
            "nnodes": self.nnodes,
            "processes": [
                {
                    "node": p.node,
                    "node_rank": p.node_rank,
                    "rank": p.rank,
                    "gpu_slots": list(p.gpu_slots),
                    "local_gpu_ids": list(p.local_gpu_ids),
                }
                for p in self.processes
            ],
        }


@dataclass(frozen=True)
class GroupPlan:
    name: str
    worker_type: WorkerType
    num_gpus: int
    num_gpus_per_engine: int
    #: Parallel sizes of each engine (tp_size * pp_size == num_gpus_per_engine), from all override layers.
    tp_size: int
    pp_size: int
    dp_size: int
    gpu_offset: int
    needs_offload: bool
    #: Final per-group ServerArgs overrides (model_path and the offload decision injected, user values last).
    overrides: Mapping[str, Any]
    engines: tuple[EnginePlan, ...]
    #: Where the group was written, for messages.
    key: str = ""
    #: Its engines run DP attention (``enable_dp_attention``, or ``attn_dp_size`` > 1, from any layer), which
    #: makes the model's router dp-aware (Miles: ``--sglang-enable-dp-attention`` sets ``router_dp_aware``).
    dp_attention: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker_type": self.worker_type.value,
            "num_gpus": self.num_gpus,
            "num_gpus_per_engine": self.num_gpus_per_engine,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "dp_size": self.dp_size,
            "dp_attention": self.dp_attention,
            "gpu_offset": self.gpu_offset,
            "needs_offload": self.needs_offload,
            "overrides": thaw(self.overrides),
            "engines": [e.to_dict() for e in self.engines],
        }


@dataclass(frozen=True)
class ExternalEnginePlan:
    """An engine that runs elsewhere (not started, never stopped here), served by its model's router."""

    model: str
    #: Index among the model's external engines.
    index: int
    url: str
    worker_type: WorkerType
    bootstrap_port: int | None = None

    @property
    def id(self) -> str:
        """Unique within a deployment: ``<model>.external.<index>``."""
        return f"{self.model}.external.{self.index}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "worker_type": self.worker_type.value,
            "bootstrap_port": self.bootstrap_port,
        }


@dataclass(frozen=True)
class ModelPlan:
    name: str
    model_path: str
    update_weights: bool
    groups: tuple[GroupPlan, ...]
    is_eval: bool = False
    #: Engines already running elsewhere that its router serves too (no GPUs of this deployment).
    external: tuple[ExternalEnginePlan, ...] = ()

    @property
    def is_pd(self) -> bool:
        """Prefill/decode disaggregated: its router runs in PD mode."""
        return any(g.worker_type.is_pd for g in self.groups) or any(
            e.worker_type.is_pd for e in self.external
        )

    @property
    def dp_attention(self) -> bool:
        """Whether any of its groups runs DP attention: its router is then dp-aware (Miles' rule)."""
        return any(g.dp_attention for g in self.groups)

    @property
    def has_router(self) -> bool:
        """It serves something: engines of its own, or external ones."""
        return bool(self.engines or self.external)

    @property
    def engines(self) -> tuple[EnginePlan, ...]:
        return tuple(e for g in self.groups for e in g.engines)

    @property
    def num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.groups)

    def group(self, name: str) -> GroupPlan:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(
            f"model {self.name!r} has no group {name!r}; groups: {[group.name for group in self.groups]}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "update_weights": self.update_weights,
            "pd_disaggregation": self.is_pd,
            "is_eval": self.is_eval,
            "num_gpus": self.num_gpus,
            "groups": {g.name: g.to_dict() for g in self.groups},
            "external": [e.to_dict() for e in self.external],
        }


@dataclass(frozen=True)
class DeploymentPlan:
    models: tuple[ModelPlan, ...]
    trainer: TrainerInputs
    #: GPUs of all groups of all models, placeholders and eval included.
    total_gpus: int
    rollout_num_gpus: int
    rollout_offset: int
    megatron_num_gpus: int
    source: str = ""
    notes: tuple[str, ...] = field(default=())
    #: Trainer arguments that Miles' post-processing set (``apply_miles_rules``): name -> value; ``trainer``
    #: already holds them.
    derived: Mapping[str, Any] = field(default_factory=dict)
    #: Deployment-wide ServerArgs values it adds below ``sglang_deploy.server_defaults`` (the colocate default
    #: ``cuda_graph_backend_prefill=disabled``); every engine gets them unless a higher layer sets the field.
    derived_server_defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_gpus_per_node(self) -> int:
        return self.trainer.num_gpus_per_node

    @property
    def engines(self) -> tuple[EnginePlan, ...]:
        return tuple(e for m in self.models for e in m.engines)

    @property
    def nodes(self) -> tuple[int, ...]:
        """Nodes that run at least one engine process."""
        return tuple(sorted({p.node for e in self.engines for p in e.processes}))

    def model(self, name: str) -> ModelPlan:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no model {name!r} in the plan; models: {[model.name for model in self.models]}")

    def groups(self) -> Iterator[tuple[ModelPlan, GroupPlan]]:
        for model in self.models:
            for group in model.groups:
                yield model, group

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "num_gpus_per_node": self.num_gpus_per_node,
            "rollout_offset": self.rollout_offset,
            "megatron_num_gpus": self.megatron_num_gpus,
            "rollout_num_gpus": self.rollout_num_gpus,
            "eval_num_gpus": self.trainer.eval_num_gpus,
            "total_gpus": self.total_gpus,
            "offload_rollout": self.trainer.offload_rollout,
            "nodes": list(self.nodes),
            "models": {m.name: m.to_dict() for m in self.models},
            "derived": {"trainer": dict(self.derived), "server_defaults": dict(self.derived_server_defaults)},
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)
