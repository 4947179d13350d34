"""A Hydra app shaped like an RL trainer's entry point, using the `sglang` config group.

python examples/train.py sglang=pd_actor_ref sglang.actor.decode.num_gpus=12
python examples/train.py -m sglang=pd_actor_ref sglang.actor.decode.num_gpus_per_engine=2,4,8
python examples/train.py sglang=multi_model --cfg job --resolve
"""

from __future__ import annotations

from dataclasses import dataclass

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from miles_sglang_plugin.hydra_config import resolve_config_or_exit
from miles_sglang_plugin.plan_view import print_plan
from miles_sglang_plugin.schema import MilesTrainerArgs


@dataclass
class TrainConf(MilesTrainerArgs):
    """The trainer's own arguments next to Miles' rollout arguments (which it inherits)."""

    num_rollout: int = 1
    rollout_batch_size: int = 4


ConfigStore.instance().store(name="train_schema", node=TrainConf)


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    plan = resolve_config_or_exit(cfg)
    print_plan(plan)


if __name__ == "__main__":
    main()
