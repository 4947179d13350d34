"""What the trainer tells the resolver: Miles' own argument names, one to one.

A Miles (or slime) ``argparse.Namespace`` maps onto :class:`TrainerInputs` field by field
(:meth:`TrainerInputs.from_namespace`); a Hydra app keeps the same names at the root of its config
(:func:`miles_sglang_plugin.config.reading.trainer_from_config`). A trainer whose arguments are named differently maps them in one place:
interpolations at the root of its primary config, e.g. ``hf_checkpoint: ${model.path}`` (see the README).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from miles_sglang_plugin.errors import Problem

#: Miles' ``--eval-sglang-*`` flags arrive in a namespace as ``eval_sglang_<ServerArgs field>``.
EVAL_SGLANG_PREFIX = "eval_sglang_"


@dataclass(frozen=True)
class TrainerInputs:
    """Trainer-side inputs of resolution, named exactly as Miles' command-line arguments.

    The one definition of these fields: the Hydra root schema ``MilesTrainerArgs`` copies them, so a field
    added here is a typed config key as well."""

    hf_checkpoint: str | None = None
    """The trained model's checkpoint (Miles' --hf-checkpoint); the default model path of every model."""
    rollout_num_gpus: int | None = None
    """GPUs for rollout, eval excluded; null: whatever the server groups hold (set: must match them)."""
    rollout_num_gpus_per_engine: int = 1
    """GPUs per engine (TP x PP) of groups that pin none, in GPUs."""
    num_gpus_per_node: int = 8
    """GPUs of each node of the cluster."""
    actor_num_nodes: int = 1
    """Nodes the actor trains on (placement: rollout GPUs come after the actor's unless colocated)."""
    actor_num_gpus_per_node: int = 8
    """GPUs per node the actor trains on."""
    colocate: bool = False
    """Rollout shares the training GPUs (rollout starts at GPU slot 0)."""
    offload_rollout: bool = False
    """Engines on training GPUs release their memory during training (memory saver on those groups)."""
    eval_num_gpus: int = 0
    """GPUs of the separate eval fleet (a model named eval); 0: none."""
    eval_num_gpus_per_engine: int | None = None
    """GPUs per engine of the eval fleet; null: rollout_num_gpus_per_engine."""
    prefill_num_servers: int | None = None
    """Miles' legacy PD split without a deployment: prefill engines of the one model; null: none."""
    debug_rollout_only: bool = False
    """Rollout without training (no Megatron GPUs; rollout starts at slot 0)."""
    debug_train_only: bool = False
    """Training without rollout (no engines are started)."""
    use_critic: bool = False
    """A critic trains next to the actor (its GPUs come before rollout's)."""
    critic_train_only: bool = False
    """Only the critic trains (its GPUs come before rollout's)."""
    critic_num_nodes: int | None = None
    """Nodes the critic trains on; null: actor_num_nodes."""
    critic_num_gpus_per_node: int | None = None
    """GPUs per node the critic trains on; null: actor_num_gpus_per_node."""
    seed: int = 1234
    """Base of each engine's --random-seed (Miles: seed + the engine's rank)."""
    use_rollout_routing_replay: bool = False
    """Engines record MoE routing for replay in training (Miles' --use-rollout-routing-replay)."""
    use_rollout_indexer_replay: bool = False
    """Engines record the indexer's choices for replay in training (Miles' --use-rollout-indexer-replay)."""
    fp16: bool = False
    """Train in fp16 (engines then serve in float16)."""
    eval_sglang_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Miles' --eval-sglang-* values for the eval fleet (ServerArgs field -> value)."""
    num_nodes: int | None = None
    """Nodes of the cluster, for the capacity check (not a Miles argument); null: unknown, not checked."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "eval_sglang_overrides", MappingProxyType(dict(self.eval_sglang_overrides)))

    # ----------------------------------------------------------------------------------------------- builders
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> TrainerInputs:
        """Build from a mapping holding (some of) the field names; absent or None values take the defaults
        where the field has a non-None default (Miles namespaces carry None for unset optional flags)."""
        kwargs: dict[str, Any] = {}
        for dataclass_field in dataclasses.fields(cls):
            if dataclass_field.name not in values:
                continue
            value = values[dataclass_field.name]
            has_default = (
                dataclass_field.default is not dataclasses.MISSING
                or dataclass_field.default_factory is not dataclasses.MISSING
            )
            if value is None and has_default and dataclass_field.default is not None:
                continue  # unset: the field's own default (Miles namespaces carry None for unset flags)
            kwargs[dataclass_field.name] = value
        return cls(**kwargs)

    @classmethod
    def from_namespace(cls, ns: Any) -> TrainerInputs:
        """Build from a Miles/slime ``argparse.Namespace`` (or any object with those attributes)."""
        values = {name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)}
        eval_overrides = {
            key[len(EVAL_SGLANG_PREFIX) :]: value
            for key, value in vars(ns).items()
            if key.startswith(EVAL_SGLANG_PREFIX) and key != "eval_sglang_overrides" and value is not None
        }
        if eval_overrides:
            values["eval_sglang_overrides"] = {
                **eval_overrides,
                **dict(values.get("eval_sglang_overrides") or {}),
            }
        return cls.from_mapping(values)

    # ------------------------------------------------------------------------------------------------- derived
    @property
    def critic_gpus(self) -> int:
        nodes = self.critic_num_nodes if self.critic_num_nodes is not None else self.actor_num_nodes
        per_node = (
            self.critic_num_gpus_per_node
            if self.critic_num_gpus_per_node is not None
            else self.actor_num_gpus_per_node
        )
        return nodes * per_node

    @property
    def actor_gpus(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def rollout_offset(self) -> int:
        """First placement slot of rollout GPUs (Miles ``_compute_rollout_offset``)."""
        if self.debug_train_only or self.debug_rollout_only or self.colocate:
            return 0
        if self.critic_train_only:
            return self.critic_gpus
        return self.actor_gpus + (self.critic_gpus if self.use_critic else 0)

    @property
    def megatron_num_gpus(self) -> int:
        """Placement slots that Megatron trains on (Miles ``_compute_megatron_num_gpus``)."""
        if self.debug_rollout_only:
            return 0
        if self.critic_train_only:
            return self.critic_gpus
        return self.actor_gpus + (self.critic_gpus if self.use_critic else 0)

    @property
    def effective_eval_num_gpus_per_engine(self) -> int:
        if self.eval_num_gpus_per_engine is not None:
            return self.eval_num_gpus_per_engine
        return self.rollout_num_gpus_per_engine

    def problems(self) -> list[Problem]:
        """Type and range checks of the inputs themselves."""
        out: list[Problem] = []
        positive = (
            "rollout_num_gpus_per_engine",
            "num_gpus_per_node",
            "actor_num_nodes",
            "actor_num_gpus_per_node",
        )
        optional_positive = (
            "eval_num_gpus_per_engine",
            "critic_num_nodes",
            "critic_num_gpus_per_node",
            "num_nodes",
        )
        non_negative = ("eval_num_gpus",)
        optional_non_negative = ("rollout_num_gpus", "prefill_num_servers")
        for name in positive + optional_positive + non_negative + optional_non_negative:
            value = getattr(self, name)
            if value is None and name in optional_positive + optional_non_negative:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                out.append(Problem(name, f"must be an integer, got {value!r}"))
            elif name in positive + optional_positive and value < 1:
                out.append(Problem(name, f"must be >= 1, got {value}"))
            elif value < 0:
                out.append(Problem(name, f"must be >= 0, got {value}"))
        for name in (
            "colocate",
            "offload_rollout",
            "debug_rollout_only",
            "debug_train_only",
            "use_critic",
            "critic_train_only",
            "use_rollout_routing_replay",
            "use_rollout_indexer_replay",
            "fp16",
        ):
            if not isinstance(getattr(self, name), bool):
                out.append(Problem(name, f"must be true or false, got {getattr(self, name)!r}"))
        if self.debug_rollout_only and self.debug_train_only:
            out.append(
                Problem("debug_train_only", "debug_rollout_only and debug_train_only exclude each other")
            )
        return out
