"""A composed config resolves in another process as in the driver (issue 20, item 1): a trainer hands its config
to a Ray worker (verl's ``TaskRunner.run``, SkyRL's tracker), which resolves it without having imported this
package. The group's typed nodes import the schema when they are unpickled, and importing the schema registers
the ``msp.*`` resolvers. (The same in a real Ray task: ``tests/test_trainers.py``.)"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

from omegaconf import open_dict

from miles_sglang_plugin.config.compose import compose_config

APP = Path(__file__).resolve().parent / "trainer_app"

#: A fresh interpreter: unpickle, check the resolvers were not there before, resolve, print the group's node.
_CHILD = """
import json, pickle, sys
from omegaconf import OmegaConf
before = OmegaConf.has_resolver("msp.trainer")
cfg = pickle.loads(sys.stdin.buffer.read())
after = OmegaConf.has_resolver("msp.trainer")
OmegaConf.resolve(cfg)
print(json.dumps({"before": before, "after": after,
                  "engines": OmegaConf.to_container(cfg.actor_rollout_ref.rollout.engines)}))
"""


def test_a_composed_config_resolves_in_a_process_that_only_unpickles_it():
    cfg = compose_config(["sglang@actor_rollout_ref.rollout.engines=default"], "ppo_trainer", config_dir=APP / "config", return_hydra_config=True)  # fmt: skip
    with open_dict(cfg):
        del cfg["hydra"]  # as Hydra hands it to the task function
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], input=pickle.dumps(cfg), capture_output=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    result = json.loads(proc.stdout)
    assert (result["before"], result["after"]) == (False, True)
    actor = result["engines"]["actor"]
    # the default preset, colocated on the app's 4 x 8 GPUs (Miles: rollout_num_gpus = the actor's GPUs), TP 2
    assert (actor["model_path"], actor["num_gpus_per_engine"]) == ("/models/Qwen3-8B", 2)
    assert (actor["regular"]["num_gpus"], actor["regular"]["num_gpus_per_engine"]) == (32, 2)
