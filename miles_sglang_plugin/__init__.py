"""miles_sglang_plugin: the SGLang engines an RL trainer uses for rollout, as a Hydra config group ``sglang``.

Data flows one way through one package per stage (each imports only earlier ones, checked by import-linter):

    config     what the user and trainer describe (the group's schema, compose, trainer inputs)
    planning   pure resolution to a frozen plan (Miles' rules)
    rendering  argv + env of every engine process and router, ports, SGLang's parser
    backends   where engine processes run (``local``), started and stopped
    serving    the running deployment: routers, readiness, registration, registry

``app`` wires them for a Hydra app (``resolve_config``, ``launch_from_config``, callbacks), ``miles`` reads and
writes Miles/slime formats, ``sweeps`` measures jobs, reports sweeps and packs sweep jobs on GPUs, ``standin`` is
the engine stand-in for machines without GPUs.

The public API is importable from here; names load on first use, so that the Hydra plugin scan, which imports
this package in every Hydra app, stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # config: what is described
    "CompositionError": "miles_sglang_plugin.config.compose",
    "compose_config": "miles_sglang_plugin.config.compose",
    "register_configs": "miles_sglang_plugin.config.store",
    "DeploymentSpec": "miles_sglang_plugin.config.deployment_spec",
    "GroupSpec": "miles_sglang_plugin.config.deployment_spec",
    "ModelSpec": "miles_sglang_plugin.config.deployment_spec",
    "WorkerType": "miles_sglang_plugin.config.deployment_spec",
    "TrainerInputs": "miles_sglang_plugin.config.trainer_inputs",
    "MilesTrainerArgs": "miles_sglang_plugin.config.schema",
    "ModelConf": "miles_sglang_plugin.config.schema",
    "SGLangDeployConf": "miles_sglang_plugin.config.schema",
    "trainer_mapping": "miles_sglang_plugin.config.trainer_mappings",
    "TrainerMapping": "miles_sglang_plugin.config.trainer_mappings",
    # errors
    "DeploymentConfigError": "miles_sglang_plugin.errors",
    "Problem": "miles_sglang_plugin.errors",
    # planning
    "resolve_deployment": "miles_sglang_plugin.planning.resolution",
    "apply_miles_rules": "miles_sglang_plugin.planning.miles_rules",
    "DeploymentPlan": "miles_sglang_plugin.planning.plan",
    "ModelPlan": "miles_sglang_plugin.planning.plan",
    "GroupPlan": "miles_sglang_plugin.planning.plan",
    "EnginePlan": "miles_sglang_plugin.planning.plan",
    "print_plan": "miles_sglang_plugin.planning.views",
    # rendering
    "prepare_deployment": "miles_sglang_plugin.rendering.prepared",
    "PreparedDeployment": "miles_sglang_plugin.rendering.prepared",
    "LaunchSpecs": "miles_sglang_plugin.rendering.launch_specs",
    "EngineProcessLaunch": "miles_sglang_plugin.rendering.launch_specs",
    # backends
    "Backend": "miles_sglang_plugin.backends.base",
    "EngineProcess": "miles_sglang_plugin.backends.base",
    "LaunchError": "miles_sglang_plugin.backends.base",
    "UnsupportedPlanError": "miles_sglang_plugin.backends.base",
    "get_backend": "miles_sglang_plugin.backends",
    "LocalBackend": "miles_sglang_plugin.backends.local",
    "RayBackend": "miles_sglang_plugin.backends.ray_backend",
    # serving
    "Deployment": "miles_sglang_plugin.serving.deployment",
    "ApplyResult": "miles_sglang_plugin.serving.elastic",
    "PlanDiff": "miles_sglang_plugin.planning.stable",
    "stabilize": "miles_sglang_plugin.planning.stable",
    "EngineInfo": "miles_sglang_plugin.serving.fleet",
    "EngineState": "miles_sglang_plugin.serving.fleet",
    "RouterState": "miles_sglang_plugin.serving.fleet",
    "DeploymentControl": "miles_sglang_plugin.serving.control",
    "AsyncDeploymentControl": "miles_sglang_plugin.serving.control",
    "BackgroundControl": "miles_sglang_plugin.serving.control",
    "OperationResult": "miles_sglang_plugin.serving.results",
    "EngineReply": "miles_sglang_plugin.serving.results",
    "WeightUpdateGroup": "miles_sglang_plugin.serving.results",
    "WeightUpdateRank": "miles_sglang_plugin.serving.results",
    "ApplyTimeoutError": "miles_sglang_plugin.serving.errors",
    "ControlError": "miles_sglang_plugin.serving.errors",
    "DeploymentFailedError": "miles_sglang_plugin.serving.errors",
    "DeploymentStoppedError": "miles_sglang_plugin.serving.errors",
    "StartupInterrupted": "miles_sglang_plugin.serving.errors",
    "DeploymentEvent": "miles_sglang_plugin.serving.events",
    "DeploymentState": "miles_sglang_plugin.serving.fleet",
    "RouterInfo": "miles_sglang_plugin.serving.fleet",
    "RouterRegistry": "miles_sglang_plugin.serving.registry",
    "ModelRoute": "miles_sglang_plugin.serving.registry",
    "UnknownModelError": "miles_sglang_plugin.serving.registry",
    "get_model_url": "miles_sglang_plugin.serving.registry",
    "AsyncRolloutClient": "miles_sglang_plugin.serving.rollout",
    "RolloutClient": "miles_sglang_plugin.serving.rollout",
    "RolloutResult": "miles_sglang_plugin.serving.rollout",
    "RolloutError": "miles_sglang_plugin.serving.rollout",
    "VersionUnavailable": "miles_sglang_plugin.serving.rollout",
    "Segment": "miles_sglang_plugin.serving.rollout",
    "HttpWorkers": "miles_sglang_plugin.serving.rollout",
    # app: what a Hydra app calls
    "resolve_config": "miles_sglang_plugin.app.hydra_edge",
    "resolve_config_or_exit": "miles_sglang_plugin.app.hydra_edge",
    "prepare_from_config": "miles_sglang_plugin.app.hydra_edge",
    "launch_from_config": "miles_sglang_plugin.app.hydra_edge",
    "SGLangCleanupCallback": "miles_sglang_plugin.app.callbacks",
    "SGLangPlanCallback": "miles_sglang_plugin.app.callbacks",
    "fill_skyrl_engine_urls": "miles_sglang_plugin.app.trainers",
    "skyrl_engine_urls": "miles_sglang_plugin.app.trainers",
    # Miles / slime formats
    "load_miles_config": "miles_sglang_plugin.miles.sglang_config",
    "resolve_namespace": "miles_sglang_plugin.miles.argparse_bridge",
    "lora_from_namespace": "miles_sglang_plugin.miles.argparse_bridge",
    # sweeps: per-job rollout metrics, the sweep report, GPU packing
    "BenchSettings": "miles_sglang_plugin.sweeps.bench",
    "run_rollout_bench": "miles_sglang_plugin.sweeps.bench",
    "arun_rollout_bench": "miles_sglang_plugin.sweeps.bench",
    "bench_from_config": "miles_sglang_plugin.sweeps.jobs",
    "bench_settings_from_config": "miles_sglang_plugin.sweeps.jobs",
    "build_report": "miles_sglang_plugin.sweeps.report",
    "SweepReportCallback": "miles_sglang_plugin.sweeps.report_callback",
    "gpu_need": "miles_sglang_plugin.sweeps.packing",
}

__all__ = [
    "ApplyResult",
    "ApplyTimeoutError",
    "AsyncDeploymentControl",
    "AsyncRolloutClient",
    "Backend",
    "BackgroundControl",
    "BenchSettings",
    "CompositionError",
    "ControlError",
    "Deployment",
    "DeploymentConfigError",
    "DeploymentControl",
    "DeploymentEvent",
    "DeploymentFailedError",
    "DeploymentPlan",
    "DeploymentSpec",
    "DeploymentState",
    "DeploymentStoppedError",
    "EngineInfo",
    "EnginePlan",
    "EngineProcess",
    "EngineProcessLaunch",
    "EngineReply",
    "EngineState",
    "GroupPlan",
    "GroupSpec",
    "HttpWorkers",
    "LaunchError",
    "LaunchSpecs",
    "LocalBackend",
    "MilesTrainerArgs",
    "ModelConf",
    "ModelPlan",
    "ModelRoute",
    "ModelSpec",
    "OperationResult",
    "PlanDiff",
    "PreparedDeployment",
    "Problem",
    "RayBackend",
    "RolloutClient",
    "RolloutError",
    "RolloutResult",
    "RouterInfo",
    "RouterRegistry",
    "RouterState",
    "SGLangCleanupCallback",
    "SGLangDeployConf",
    "SGLangPlanCallback",
    "Segment",
    "StartupInterrupted",
    "SweepReportCallback",
    "TrainerInputs",
    "TrainerMapping",
    "UnknownModelError",
    "UnsupportedPlanError",
    "VersionUnavailable",
    "WeightUpdateGroup",
    "WeightUpdateRank",
    "WorkerType",
    "apply_miles_rules",
    "arun_rollout_bench",
    "bench_from_config",
    "bench_settings_from_config",
    "build_report",
    "compose_config",
    "fill_skyrl_engine_urls",
    "get_backend",
    "get_model_url",
    "gpu_need",
    "launch_from_config",
    "load_miles_config",
    "lora_from_namespace",
    "prepare_deployment",
    "prepare_from_config",
    "print_plan",
    "register_configs",
    "resolve_config",
    "resolve_config_or_exit",
    "resolve_deployment",
    "resolve_namespace",
    "run_rollout_bench",
    "skyrl_engine_urls",
    "stabilize",
    "trainer_mapping",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'miles_sglang_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # what static tools see; at run time the names load lazily through __getattr__
    from miles_sglang_plugin.app.callbacks import SGLangCleanupCallback, SGLangPlanCallback
    from miles_sglang_plugin.app.hydra_edge import (
        launch_from_config,
        prepare_from_config,
        resolve_config,
        resolve_config_or_exit,
    )
    from miles_sglang_plugin.app.trainers import fill_skyrl_engine_urls, skyrl_engine_urls
    from miles_sglang_plugin.backends import get_backend
    from miles_sglang_plugin.backends.base import Backend, EngineProcess, LaunchError, UnsupportedPlanError
    from miles_sglang_plugin.backends.local import LocalBackend
    from miles_sglang_plugin.backends.ray_backend import RayBackend
    from miles_sglang_plugin.config.compose import CompositionError, compose_config
    from miles_sglang_plugin.config.deployment_spec import DeploymentSpec, GroupSpec, ModelSpec, WorkerType
    from miles_sglang_plugin.config.schema import MilesTrainerArgs, ModelConf, SGLangDeployConf
    from miles_sglang_plugin.config.store import register_configs
    from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
    from miles_sglang_plugin.config.trainer_mappings import TrainerMapping, trainer_mapping
    from miles_sglang_plugin.errors import DeploymentConfigError, Problem
    from miles_sglang_plugin.miles.argparse_bridge import lora_from_namespace, resolve_namespace
    from miles_sglang_plugin.miles.sglang_config import load_miles_config
    from miles_sglang_plugin.planning.miles_rules import apply_miles_rules
    from miles_sglang_plugin.planning.plan import DeploymentPlan, EnginePlan, GroupPlan, ModelPlan
    from miles_sglang_plugin.planning.resolution import resolve_deployment
    from miles_sglang_plugin.planning.stable import PlanDiff, stabilize
    from miles_sglang_plugin.planning.views import print_plan
    from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch, LaunchSpecs
    from miles_sglang_plugin.rendering.prepared import PreparedDeployment, prepare_deployment
    from miles_sglang_plugin.serving.control import (
        AsyncDeploymentControl,
        BackgroundControl,
        DeploymentControl,
    )
    from miles_sglang_plugin.serving.deployment import Deployment
    from miles_sglang_plugin.serving.elastic import ApplyResult
    from miles_sglang_plugin.serving.errors import (
        ApplyTimeoutError,
        ControlError,
        DeploymentFailedError,
        DeploymentStoppedError,
        StartupInterrupted,
    )
    from miles_sglang_plugin.serving.events import DeploymentEvent
    from miles_sglang_plugin.serving.fleet import (
        DeploymentState,
        EngineInfo,
        EngineState,
        RouterInfo,
        RouterState,
    )
    from miles_sglang_plugin.serving.registry import (
        ModelRoute,
        RouterRegistry,
        UnknownModelError,
        get_model_url,
    )
    from miles_sglang_plugin.serving.results import (
        EngineReply,
        OperationResult,
        WeightUpdateGroup,
        WeightUpdateRank,
    )
    from miles_sglang_plugin.serving.rollout import (
        AsyncRolloutClient,
        HttpWorkers,
        RolloutClient,
        RolloutError,
        RolloutResult,
        Segment,
        VersionUnavailable,
    )
    from miles_sglang_plugin.sweeps.bench import BenchSettings, arun_rollout_bench, run_rollout_bench
    from miles_sglang_plugin.sweeps.jobs import bench_from_config, bench_settings_from_config
    from miles_sglang_plugin.sweeps.packing import gpu_need
    from miles_sglang_plugin.sweeps.report import build_report
    from miles_sglang_plugin.sweeps.report_callback import SweepReportCallback
