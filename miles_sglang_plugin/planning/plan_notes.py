"""Notes a plan carries about settings that resolve but do nothing, or hold a value the user must replace.

- A model whose path is a placeholder of a preset (``/path/to/...``, as ``multi_model``'s reward model): the
  plan resolves, but the engines would stop at start-up on a path that is not there. The note names the key to
  set.
- ``offload_rollout`` on while no group of engines sits on the trainer's GPUs (Miles offloads a group only when
  it starts below the Megatron GPUs, ``needs_offload``): nothing is offloaded. (Not under ``debug_train_only``,
  where only an eval fleet starts.)
"""

from __future__ import annotations

from collections.abc import Sequence

from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.planning.miles_rules import megatron_num_gpus
from miles_sglang_plugin.planning.plan import ModelPlan

#: How a preset writes a path the user must fill in.
PLACEHOLDER_PATH_PREFIX = "/path/to/"


def _model_key(model: ModelPlan) -> str:
    for group in model.groups:
        if group.key:
            return group.key.rsplit(".", 1)[0]
    return f"sglang.{model.name}"


def placeholder_path_notes(models: Sequence[ModelPlan]) -> list[str]:
    return [
        f"{_model_key(model)}.model_path={model.model_path} is a placeholder, not a checkpoint: set "
        f"{_model_key(model)}.model_path=<your {model.name} checkpoint> before a launch (its engines would stop "
        "at start-up)"
        for model in models
        if model.model_path.startswith(PLACEHOLDER_PATH_PREFIX)
    ]


def offload_notes(models: Sequence[ModelPlan], trainer: TrainerInputs, rollout_offset: int) -> list[str]:
    groups = [group for model in models for group in model.groups if group.engines]
    if trainer.debug_train_only or not trainer.offload_rollout or not groups:
        return []  # under debug_train_only only an eval fleet starts: no rollout engines to offload
    if any(group.needs_offload for group in groups):
        return []
    megatron = megatron_num_gpus(trainer)
    trains = f"the trainer trains on slots 0-{megatron - 1}" if megatron else "the trainer holds no GPU"
    return [
        f"offload_rollout=true, but no engine group sits on the trainer's GPUs (rollout starts at slot "
        f"{rollout_offset}, {trains}): nothing is offloaded "
        "(Miles offloads only groups that start below the trainer's GPUs; colocate=true puts them there)"
    ]


def advisory_notes(
    models: Sequence[ModelPlan], trainer: TrainerInputs, rollout_offset: int
) -> tuple[str, ...]:
    """Every note of this module about a resolved plan."""
    return (*placeholder_path_notes(models), *offload_notes(models, trainer, rollout_offset))
