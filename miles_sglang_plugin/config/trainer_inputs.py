"""What the trainer tells the resolver: Miles' own argument names, one to one.

A Miles (or slime) ``argparse.Namespace`` maps onto :class:`TrainerInputs` field by field
(:meth:`TrainerInputs.from_namespace`); a Hydra app keeps the same names at the root of its config
(:func:`miles_sglang_plugin.config.reading.trainer_from_config`). A trainer whose arguments are named differently maps them in one place:
interpolations at the root of its primary config, e.g. ``hf_checkpoint: ${model.path}`` (see the docs' Compose page).

:func:`apply_miles_rules` is Miles' own post-processing of these arguments (colocate defaults, the PPO critic's
size, ...), which resolution applies to the inputs of both paths before anything else.
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

    The Hydra root schema :class:`~miles_sglang_plugin.config.schema.MilesTrainerArgs` declares the same
    fields (``dict`` for ``Mapping``), so each is a typed config key as well; tests/test_schema.py holds the
    two to each other (a field added here without it there fails)."""

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
    """Rollout shares the training GPUs (from slot 0; Miles sizes rollout to the actor's GPUs and offloads)."""
    offload_rollout: bool | None = None
    """Engines on training GPUs release their memory during training; null: on with colocate, else off."""
    eval_num_gpus: int = 0
    """GPUs of the separate eval fleet (a model named eval); 0: none."""
    eval_num_gpus_per_engine: int = 1
    """GPUs per engine of the eval fleet (Miles' default 1, whatever rollout_num_gpus_per_engine is)."""
    prefill_num_servers: int | None = None
    """Miles' legacy PD split without a deployment: prefill engines of the one model; null: none."""
    debug_rollout_only: bool = False
    """Rollout without training (no Megatron GPUs; rollout starts at slot 0)."""
    debug_train_only: bool = False
    """Training without rollout: no rollout engines (Miles sets rollout_num_gpus to 0); an eval fleet
    (eval_num_gpus > 0) still starts, alone, after the actor's GPUs."""
    use_critic: bool = False
    """A critic trains next to the actor (Miles gives it the actor's size, on the actor's GPUs)."""
    critic_train_only: bool = False
    """Only the critic trains (its GPUs come before rollout's)."""
    critic_num_nodes: int | None = None
    """Nodes the critic trains on; null: actor_num_nodes; 0: no critic (with use_critic: the actor's)."""
    critic_num_gpus_per_node: int | None = None
    """GPUs per node the critic trains on; null: actor_num_gpus_per_node; 0: no critic."""
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
        """The critic's GPUs (``critic_num_nodes`` x ``critic_num_gpus_per_node``; None: the actor's)."""
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
    def starts_inference_engines(self) -> bool:
        """Whether any engine starts (Miles' ``starts_inference_engines``): always but under
        ``debug_train_only``, where only an eval fleet (``eval_num_gpus`` > 0) does."""
        return not self.debug_train_only or self.eval_num_gpus > 0

    @property
    def rollout_offset(self) -> int:
        """First placement slot of rollout GPUs (Miles ``_compute_rollout_offset``): 0 when colocated, when only
        rollout runs or when no engine starts; the critic's GPUs for critic-only training; else the actor's (so
        the eval fleet of ``debug_train_only`` comes after the actor). A PPO critic (``use_critic``) shares the
        actor's GPUs, so it adds nothing."""
        if self.debug_rollout_only or self.colocate or not self.starts_inference_engines:
            return 0
        if self.critic_train_only:
            return self.critic_gpus
        return self.actor_gpus

    @property
    def megatron_num_gpus(self) -> int:
        """Placement slots that Megatron trains on (Miles ``_compute_megatron_num_gpus``): the actor's, which a
        PPO critic shares; the critic's for critic-only training."""
        if self.debug_rollout_only:
            return 0
        if self.critic_train_only:
            return self.critic_gpus
        return self.actor_gpus

    def problems(self) -> list[Problem]:
        """Type and range checks of the inputs themselves."""
        out = self._integer_problems() + self._flag_problems()
        if self.debug_rollout_only and self.debug_train_only:
            out.append(
                Problem("debug_train_only", "debug_rollout_only and debug_train_only exclude each other")
            )
        if not out and self.eval_sglang_overrides and self.eval_num_gpus == 0:  # Miles: at argument time
            out.append(
                Problem(
                    "eval_sglang_overrides",
                    f"eval overrides {sorted(self.eval_sglang_overrides)} are set but eval_num_gpus is 0",
                )
            )
        if not out and self.critic_train_only and not self.use_critic and self.critic_gpus == 0:
            out.append(
                Problem(
                    "critic_train_only",
                    f"trains only the critic, but it has no GPUs (critic_num_nodes={self.critic_num_nodes} x "
                    f"critic_num_gpus_per_node={self.critic_num_gpus_per_node}); give the critic GPUs",
                )
            )
        return out

    def _integer_problems(self) -> list[Problem]:
        out: list[Problem] = []
        positive = (
            "rollout_num_gpus_per_engine",
            "num_gpus_per_node",
            "actor_num_nodes",
            "actor_num_gpus_per_node",
            "eval_num_gpus_per_engine",
        )
        optional_positive = ("num_nodes",)
        non_negative = ("eval_num_gpus",)
        #: 0 critic nodes or GPUs per node: no critic (Miles' own fixtures use 0 so).
        optional_non_negative = (
            "rollout_num_gpus",
            "prefill_num_servers",
            "critic_num_nodes",
            "critic_num_gpus_per_node",
        )
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
        return out

    def _flag_problems(self) -> list[Problem]:
        out: list[Problem] = []
        for name in (
            "colocate",
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
        if self.offload_rollout is not None and not isinstance(self.offload_rollout, bool):
            out.append(
                Problem("offload_rollout", f"must be true, false or null, got {self.offload_rollout!r}")
            )
        return out


# ==================================================================================== Miles' post-processing
#: Deployment-wide ServerArgs values (Miles' ``--sglang-*``) that Miles sets under ``--colocate`` unless they
#: are given: prefill CUDA graphs off, "to avoid NVLS OOM".
COLOCATE_SERVER_DEFAULTS: Mapping[str, Any] = MappingProxyType({"cuda_graph_backend_prefill": "disabled"})


@dataclass(frozen=True)
class MilesDerivation:
    """The trainer's arguments after Miles' own post-processing of them (``miles_validate_args``), and what it
    derived: the trainer arguments it set, the deployment-wide ServerArgs values it adds, and one note each."""

    trainer: TrainerInputs
    #: Trainer argument -> the value the rules gave it (only those that changed).
    derived: Mapping[str, Any]
    #: ServerArgs field -> value, below ``sglang_deploy.server_defaults`` (which the rules never override).
    server_defaults: Mapping[str, Any]
    notes: tuple[str, ...]


class _Rules:
    """Miles' rules applied in Miles' order, each change recorded."""

    def __init__(self, trainer: TrainerInputs, server_defaults: Mapping[str, Any]) -> None:
        self.values = {name: getattr(trainer, name) for name in TrainerInputs.field_names()}
        self.changed: dict[str, Any] = {}
        self.derived: dict[str, Any] = {}
        self.server_defaults: dict[str, Any] = {}
        self.user_defaults = {str(key).replace("-", "_"): value for key, value in server_defaults.items()}
        self.notes: list[str] = []

    @property
    def actor_gpus(self) -> int:
        nodes: int = self.values["actor_num_nodes"]
        per_node: int = self.values["actor_num_gpus_per_node"]
        return nodes * per_node

    def set(self, name: str, value: Any, why: str, *, derived: bool = True) -> None:
        """Set ``name``; noted unless it only fills a value that was not given (None). ``derived=False``: a
        plain default, applied but not reported."""
        before = self.values[name]
        if before is value or (type(before) is type(value) and before == value):
            return
        self.values[name] = value
        self.changed[name] = value
        if derived:
            self.derived[name] = value
        if derived and before is not None:
            self.notes.append(f"{name}={_shown(value)} (given {_shown(before)}): {why}")

    def critic(self) -> None:
        """Shared actor/critic PPO: the critic takes the actor's size (Miles ``arguments.py``)."""
        if not self.values["use_critic"]:
            return
        why = "use_critic: the critic shares the actor's GPUs, so Miles gives it the actor's size"
        self.set("critic_num_nodes", self.values["actor_num_nodes"], why)
        self.set("critic_num_gpus_per_node", self.values["actor_num_gpus_per_node"], why)

    def debug_rollout_only(self) -> None:
        if not self.values["debug_rollout_only"]:
            return
        if self.values["colocate"] and not self.values["rollout_num_gpus"]:
            self.fill(
                "rollout_num_gpus", self.actor_gpus, "debug_rollout_only with colocate: the actor's GPUs"
            )
        why = "debug_rollout_only trains nothing, so Miles turns colocate and offload_rollout off"
        self.set("colocate", False, why)
        self.set("offload_rollout", False, why)

    def colocate(self) -> None:
        if not self.values["colocate"]:
            return
        if self.values["offload_rollout"] is None:
            self.fill("offload_rollout", True, "colocate turns it on unless given (Miles)")
        if self.values["rollout_num_gpus"] != self.actor_gpus and not self.values["debug_train_only"]:
            why = (
                f"colocate: the actor's GPUs (actor_num_nodes={self.values['actor_num_nodes']} x "
                f"actor_num_gpus_per_node={self.values['actor_num_gpus_per_node']}), as Miles sets it"
            )
            self.fill("rollout_num_gpus", self.actor_gpus, why)
        for name, value in COLOCATE_SERVER_DEFAULTS.items():
            if name not in self.user_defaults:
                self.server_defaults[name] = value
                self.notes.append(
                    f"{name}={value} on every engine: Miles' default with colocate (against NVLS out-of-memory); "
                    f"set sglang_deploy.server_defaults.{name} (Miles: --sglang-{name.replace('_', '-')}) to choose"
                )
            elif self.user_defaults[name] != value:
                self.notes.append(
                    f"colocate with {name}={self.user_defaults[name]!r} may run out of memory (NVLS); Miles warns "
                    f"the same and defaults it to {value!r}"
                )

    def debug_train_only(self) -> None:
        """No rollout engines (Miles zeroes ``rollout_num_gpus`` after the colocate rule, which therefore does
        not size it here); an eval fleet still starts."""
        if self.values["debug_train_only"]:
            why = "debug_train_only starts no rollout engines, so Miles sets it to 0 (an eval fleet still starts)"
            self.set("rollout_num_gpus", 0, why)

    def fill(self, name: str, value: Any, why: str) -> None:
        """Set ``name`` and always note it (a value the plan now depends on)."""
        before = self.values[name]
        self.set(name, value, why)
        if before is None:
            self.notes.append(f"{name}={_shown(value)}: {why}")


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def apply_miles_rules(
    trainer: TrainerInputs, server_defaults: Mapping[str, Any] | None = None
) -> MilesDerivation:
    """Miles' post-processing of its arguments (``miles_validate_args``, radixark/miles ``arguments.py``), in
    Miles' order: ``use_critic`` gives the critic the actor's size; ``debug_rollout_only`` turns ``colocate``
    and ``offload_rollout`` off (and, colocated without ``rollout_num_gpus``, sizes rollout as the actor);
    ``colocate`` turns ``offload_rollout`` on unless given, sets ``rollout_num_gpus`` to the actor's GPUs and
    ``cuda_graph_backend_prefill=disabled`` unless ``server_defaults`` (Miles' ``--sglang-*``) sets it;
    ``debug_train_only`` sets ``rollout_num_gpus`` to 0 (only an eval fleet starts); an ``offload_rollout`` still
    unset is off. Applied to its own result's ``trainer`` it derives no further
    trainer argument."""
    rules = _Rules(trainer, server_defaults or {})
    rules.critic()
    rules.debug_rollout_only()
    rules.colocate()
    rules.debug_train_only()
    if rules.values["offload_rollout"] is None:
        rules.set("offload_rollout", False, "", derived=False)
    return MilesDerivation(
        trainer=dataclasses.replace(trainer, **rules.changed),
        derived=MappingProxyType(dict(rules.derived)),
        server_defaults=MappingProxyType(dict(rules.server_defaults)),
        notes=tuple(rules.notes),
    )
