"""The GPUs a scheduler gave the launcher: an inherited ``CUDA_VISIBLE_DEVICES`` (Slurm, submitit, a Ray actor,
a sweep job's slice) is the machine's GPUs as far as the deployment goes.

The plan numbers each node's GPUs 0, 1, ... (``local_gpu_ids``); with an inherited list those are positions in
it: ``CUDA_VISIBLE_DEVICES=4,5,6,7`` and engines on local GPUs ``0,1`` and ``2,3`` see ``4,5`` and ``6,7``. A plan
that needs more GPUs than the list holds is refused before anything starts. Without the variable the local
ids are the machine's own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

from miles_sglang_plugin.errors import DeploymentConfigError, Problem
from miles_sglang_plugin.rendering.prepared import PreparedDeployment

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


def inherited_visible_devices(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The inherited list (``""``: no GPU at all), or None when the variable is not set."""
    raw = (os.environ if environ is None else environ).get(VISIBLE_DEVICES_ENV)
    if raw is None:
        return None
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def restrict_to_visible(prepared: PreparedDeployment, visible: Sequence[str]) -> PreparedDeployment:
    """``prepared`` with every engine process's ``CUDA_VISIBLE_DEVICES`` taken from ``visible`` (its local ids
    as positions); :class:`DeploymentConfigError` when the plan needs more GPUs than ``visible`` holds."""
    local_ids = {
        (engine.id, process.node_rank): process.local_gpu_ids
        for engine in prepared.plan.engines
        for process in engine.processes
    }
    needed = max((max(ids) + 1 for ids in local_ids.values() if ids), default=0)
    if needed > len(visible):
        beyond = sorted({key[0] for key, ids in local_ids.items() if ids and max(ids) >= len(visible)})
        shown = ",".join(visible) if visible else "none"
        raise DeploymentConfigError(
            [
                Problem(
                    VISIBLE_DEVICES_ENV,
                    f"this launcher may use {len(visible)} GPU(s) ({shown}) but the plan needs local GPUs "
                    f"0..{needed - 1} on a node (engines {', '.join(beyond[:4])}{'…' if len(beyond) > 4 else ''} "
                    "lie beyond); give the job more GPUs or make the deployment smaller",
                )
            ],
            source="the GPUs this process was given",
        )
    engines = tuple(
        dataclasses.replace(
            launch,
            env={
                **launch.env,
                VISIBLE_DEVICES_ENV: ",".join(
                    visible[i] for i in local_ids[(launch.engine_id, launch.node_rank)]
                ),
            },
        )
        for launch in prepared.launch.engines
    )
    return dataclasses.replace(prepared, launch=dataclasses.replace(prepared.launch, engines=engines))
