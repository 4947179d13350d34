"""What the trainer tells the resolver: Miles' own argument names, one to one.

A Miles (or slime) ``argparse.Namespace`` maps onto :class:`TrainerInputs` field by field
(:meth:`TrainerInputs.from_namespace`); a Hydra app keeps the same names at the root of its config
(:func:`miles_sglang_plugin.config.reading.trainer_from_config`). A trainer whose arguments are named differently maps them in one place:
interpolations at the root of its primary config, e.g. ``hf_checkpoint: ${model.path}`` (see the docs' Compose page).

Miles' own post-processing of these arguments (colocate defaults, the PPO critic's size, ...) and its placement
rules are planning's (:mod:`miles_sglang_plugin.planning.miles_rules`); resolution applies them to the inputs of
both paths before anything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from miles_sglang_plugin.config.shared_fields import ReadOnlyFields, TrainerFields
from miles_sglang_plugin.errors import Problem

#: Miles' ``--eval-sglang-*`` flags arrive in a namespace as ``eval_sglang_<ServerArgs field>``.
EVAL_SGLANG_PREFIX = "eval_sglang_"


@dataclass(unsafe_hash=True)
class TrainerInputs(ReadOnlyFields, TrainerFields):
    """Trainer-side inputs of resolution, named exactly as Miles' command-line arguments; read-only.

    The fields are declared once, in :class:`~miles_sglang_plugin.config.shared_fields.TrainerFields`, which the
    Hydra root schema :class:`~miles_sglang_plugin.config.schema.MilesTrainerArgs` derives from as well, so each
    is a typed config key too."""

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
    def miles_rollout_num_gpus(self) -> int | None:
        """``rollout_num_gpus`` as Miles' post-processing leaves it: 0 under ``debug_train_only``; colocated, the
        actor's GPUs (under ``debug_rollout_only`` only when none is given); else as given. The composed config
        reads it (``${msp.rollout_num_gpus:...}``) before anything is planned; planning derives the same value
        step by step, with its notes (:func:`miles_sglang_plugin.planning.miles_rules.apply_miles_rules`), and
        tests/test_miles_parity.py holds the two to each other."""
        if self.debug_train_only:
            return 0
        if self.colocate and not (self.debug_rollout_only and self.rollout_num_gpus):
            return self.actor_gpus
        return self.rollout_num_gpus

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
