"""miles_sglang_plugin: the `sglang` Hydra config group, its resolver and launcher for RL trainers.

Stages (one module each): compose (:mod:`.hydra_config`, Hydra at the edge) → resolve (:mod:`.resolution`, a
pure function to the frozen :mod:`.plan`) → render → execute → serve.
"""

from miles_sglang_plugin.deployment_spec import DeploymentSpec, GroupSpec, ModelSpec, WorkerType
from miles_sglang_plugin.errors import DeploymentConfigError, Problem
from miles_sglang_plugin.plan import DeploymentPlan, EnginePlan, GroupPlan, ModelPlan
from miles_sglang_plugin.resolution import resolve_deployment
from miles_sglang_plugin.trainer_inputs import TrainerInputs

__version__ = "0.1.0"

__all__ = [
    "DeploymentConfigError",
    "DeploymentPlan",
    "DeploymentSpec",
    "EnginePlan",
    "GroupPlan",
    "GroupSpec",
    "ModelPlan",
    "ModelSpec",
    "Problem",
    "TrainerInputs",
    "WorkerType",
    "resolve_deployment",
]
