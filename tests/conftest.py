"""Shared test helpers."""

from __future__ import annotations

import os
from typing import Any

# The local backend honours an inherited CUDA_VISIBLE_DEVICES (a scheduler's GPUs): the tests' expected GPU
# pinning is that of a machine whose GPUs are all visible, wherever they run (a GPU node sets the variable).
# Tests of the inherited list set it themselves.
os.environ.pop("CUDA_VISIBLE_DEVICES", None)

from miles_sglang_plugin.config.deployment_spec import DeploymentSpec, GroupSpec, ModelSpec


def group(wt: str, num_gpus: Any, gpe: Any = None, name: str | None = None, **overrides: Any) -> GroupSpec:
    name = name or wt
    return GroupSpec(
        name=name, worker_type=wt, num_gpus=num_gpus, num_gpus_per_engine=gpe, overrides=overrides
    )


def model(
    name: str, *groups: GroupSpec, path: str | None = None, update: bool | None = None, gpe: Any = None
):
    keyed = tuple(
        GroupSpec(
            g.name,
            g.worker_type,
            g.num_gpus,
            g.num_gpus_per_engine,
            g.overrides,
            key=f"sglang.{name}.{g.name}",
        )
        for g in groups
    )
    return ModelSpec(
        name=name,
        groups=keyed,
        model_path=path,
        update_weights=update,
        num_gpus_per_engine=gpe,
        key=f"sglang.{name}",
    )


def spec(*models: ModelSpec) -> DeploymentSpec:
    return DeploymentSpec(models=tuple(models), source="test")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The real-engine lane's measurements (engine start times, memory), where it ran."""
    from tests.real_engine_helpers import MEASUREMENTS

    if MEASUREMENTS:
        terminalreporter.write_sep("-", "real-engine lane: measured")
        for label, value in MEASUREMENTS.items():
            terminalreporter.write_line(f"{label}: {value}")
