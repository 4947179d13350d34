"""Miles' own rules for the trainer's arguments, which planning applies before it places anything: its
post-processing of them (``miles_validate_args``: colocate defaults, the PPO critic's size, ...; with a note for
each value it derives) and where rollout and Megatron sit on the trainer's GPU slots (``_compute_rollout_offset``,
``_compute_megatron_num_gpus``).

The inputs are the frozen :class:`~miles_sglang_plugin.config.trainer_inputs.TrainerInputs` of both paths (a
composed config, a Miles namespace); nothing here reads a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from miles_sglang_plugin.config.trainer_inputs import TrainerInputs


# ==================================================================================== Miles' placement
def rollout_offset(trainer: TrainerInputs) -> int:
    """First placement slot of rollout GPUs (Miles ``_compute_rollout_offset``): 0 when colocated, when only
    rollout runs or when no engine starts; the critic's GPUs for critic-only training; else the actor's (so
    the eval fleet of ``debug_train_only`` comes after the actor). A PPO critic (``use_critic``) shares the
    actor's GPUs, so it adds nothing."""
    if trainer.debug_rollout_only or trainer.colocate or not trainer.starts_inference_engines:
        return 0
    if trainer.critic_train_only:
        return trainer.critic_gpus
    return trainer.actor_gpus


def megatron_num_gpus(trainer: TrainerInputs) -> int:
    """Placement slots that Megatron trains on (Miles ``_compute_megatron_num_gpus``): the actor's, which a
    PPO critic shares; the critic's for critic-only training."""
    if trainer.debug_rollout_only:
        return 0
    if trainer.critic_train_only:
        return trainer.critic_gpus
    return trainer.actor_gpus


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
