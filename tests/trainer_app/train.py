"""A verl-style trainer's entry point using the `sglang` config group (the docs' guide "Use it in your
trainer", docs/trainers/hydra-app.md).

Its config uses its own key names (actor_rollout_ref.model.path, trainer.nnodes, ...), maps them to Miles'
names in one place (the root of config/ppo_trainer.yaml), nests the engines under its rollout config
(`sglang@actor_rollout_ref.rollout.engines`) and has presets of its own (config/sglang/).

    python train.py hydra/callbacks=sglang_plan                  # the dry run: the plan of this config
    python train.py trainer.rollout_steps=1 sglang_deploy=simulated \
        sglang@actor_rollout_ref.rollout.engines=small           # start stand-in engines, generate once
"""

from __future__ import annotations

import json
import logging

import hydra
from omegaconf import DictConfig

from miles_sglang_plugin import launch_from_config, resolve_config_or_exit

log = logging.getLogger("trainer")


def _summary(plan) -> dict:
    groups = {
        f"{m.name}.{g.name}": [g.num_gpus, g.num_gpus_per_engine, g.gpu_offset] for m, g in plan.groups()
    }
    return {"total_gpus": plan.total_gpus, "rollout_offset": plan.rollout_offset, "groups": groups}


def _generate_once(cfg: DictConfig) -> None:
    import httpx

    with launch_from_config(cfg) as deployment:
        url = deployment.registry.get_model_url("actor", "/generate")
        body = {"text": "1 + 1 =", "sampling_params": {"max_new_tokens": 4}}
        reply = httpx.post(url, json=body, headers=deployment.auth_headers(), timeout=30).json()
        log.info("generated %r", reply.get("text"))
        print("GENERATED " + json.dumps({"text": reply.get("text")}), flush=True)


@hydra.main(version_base=None, config_path="config", config_name="ppo_trainer")
def main(cfg: DictConfig) -> None:
    plan = resolve_config_or_exit(cfg)  # the group found where the defaults list placed it
    print("PLAN " + json.dumps(_summary(plan)), flush=True)
    log.info("planned %d GPUs", plan.total_gpus)
    if cfg.trainer.rollout_steps:
        _generate_once(cfg)


if __name__ == "__main__":
    main()
