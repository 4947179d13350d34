"""Whether a plan can run on this machine with the local backend, checked before anything starts.

The local backend starts every engine as a subprocess of this machine. A plan that puts engines on several
nodes (the rollout GPUs after a trainer's node, or groups larger than a node), or real SGLang engines on a
machine without the GPUs they need, cannot run here: the launch would fail half-way, or SGLang would stop at
start-up. :func:`machine_fit_problems` says so in one message, with what the plan needs, what this machine
has, and what to change: the Ray backend for several nodes, settings that fit the plan on one node (only
those not already set, and only those that would fit it), and, without a GPU, the stand-in engines
(``sglang_deploy=simulated``) or SGLang on the CPU (``sglang_deploy=cpu_sglang``).

The GPUs of this machine are the ``CUDA_VISIBLE_DEVICES`` this process inherited (as the local backend reads
them), else those ``nvidia-smi`` lists, else the ``/dev/nvidiaN`` devices. The count is only checked for
SGLang's own command (``sglang_deploy.launch.command``: ``{python} -m sglang.launch_server`` or
``sglang serve``); another program may need no GPU.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from miles_sglang_plugin.backends.visible_gpus import VISIBLE_DEVICES_ENV, nvidia_smi_gpus, split_gpu_list
from miles_sglang_plugin.config.schema import BackendKind, EngineKind, SGLangDeployConf
from miles_sglang_plugin.errors import Problem
from miles_sglang_plugin.planning.plan import DeploymentPlan

#: The engine commands that are SGLang's own server (the only ones whose GPU needs are known).
SGLANG_COMMANDS = (("{python}", "-m", "sglang.launch_server"), ("sglang", "serve"))
#: Where the quickstarts are (one node, and a machine without a GPU).
QUICKSTART = "docs/quickstart.md"
_DEVICE = re.compile(r"nvidia[0-9]+")


@dataclasses.dataclass(frozen=True)
class MachineGpus:
    """The GPUs this machine gives the launch, and where that was read."""

    ids: tuple[str, ...]
    source: str

    def describe(self) -> str:
        if not self.ids:
            return f"no GPU ({self.source})"
        return f"{len(self.ids)} GPU{'s' if len(self.ids) != 1 else ''} ({self.source})"


def machine_gpus(environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> MachineGpus:
    """This machine's GPUs as the local backend sees them (see the module's docstring)."""
    env = os.environ if environ is None else environ
    raw = env.get(VISIBLE_DEVICES_ENV)
    if raw is not None:
        return MachineGpus(split_gpu_list(raw), f"{VISIBLE_DEVICES_ENV}={raw!r}")
    listed = nvidia_smi_gpus()
    if listed is not None:
        return MachineGpus(listed, "nvidia-smi lists " + (f"{len(listed)}" if listed else "none"))
    try:
        devices = sorted(p.name for p in dev.iterdir() if _DEVICE.fullmatch(p.name))
    except OSError:
        devices = []
    if devices:
        return MachineGpus(tuple(d[len("nvidia") :] for d in devices), f"/dev has {', '.join(devices)}")
    return MachineGpus((), f"no {VISIBLE_DEVICES_ENV}, no nvidia-smi, no /dev/nvidia*")


def _nodes_needed(plan: DeploymentPlan) -> int:
    """Nodes of the placement the plan's engines reach (slot 0 to the last engine's node)."""
    return max(plan.nodes, default=0) + 1


def _groups(plan: DeploymentPlan) -> str:
    return ", ".join(f"{model.name}={model.num_gpus}" for model in plan.models)


def _where(plan: DeploymentPlan) -> str:
    """Why the engines land where they do: the trainer's GPUs first (not colocated), then the groups."""
    per_node = plan.num_gpus_per_node
    groups = f"the groups hold {plan.total_gpus} GPUs ({_groups(plan)})"
    if plan.rollout_offset:
        trainer = plan.trainer
        return (
            f"the rollout GPUs start at slot {plan.rollout_offset}, after the actor's {trainer.actor_num_nodes} x "
            f"{trainer.actor_num_gpus_per_node} training GPUs (not colocated), and {groups}; "
            f"num_gpus_per_node={per_node}"
        )
    return f"{groups}; num_gpus_per_node={per_node}"


def _one_node_fixes(plan: DeploymentPlan) -> list[str]:
    """Settings that put the plan on one node, leaving out those already set and those that would not fit."""
    trainer = plan.trainer
    per_node = plan.num_gpus_per_node
    total = plan.total_gpus
    wide = [e for e in plan.engines if e.nnodes > 1]
    fixes = []
    if wide:
        fixes.append(
            f"engines of at most {per_node} GPUs (num_gpus_per_engine; {wide[0].id} has {wide[0].num_gpus})"
        )
    if total > per_node:
        fixes.append(
            f"groups of at most {per_node} GPUs in all (now {total}), e.g. a one-node preset: "
            f"sglang=pd_actor_ref_1node or sglang=actor_ref_1node ({QUICKSTART})"
        )
        return fixes
    if plan.rollout_offset == 0:
        return fixes
    if not trainer.colocate and plan.rollout_num_gpus == trainer.actor_gpus:
        fixes.append(f"colocate=true (the engines share the actor's {trainer.actor_gpus} GPUs)")
    if (
        trainer.actor_num_nodes == 1
        and total < per_node
        and trainer.actor_num_gpus_per_node > per_node - total
    ):
        fixes.append(
            f"actor_num_gpus_per_node={per_node - total} (the trainer on GPUs 0-{per_node - total - 1}, the "
            f"engines on {per_node - total}-{per_node - 1})"
        )
    if not trainer.debug_rollout_only:
        fixes.append("debug_rollout_only=true (rollout alone, no training GPUs)")
    return fixes


def _without_gpu(kind: EngineKind) -> str:
    options = ["sglang_deploy=simulated (stand-in engines: no SGLang, no GPU, any size)"]
    if kind is not EngineKind.cpu_sglang:
        options.append(
            f"sglang_deploy=cpu_sglang (SGLang's own server on the CPU, tiny models; {QUICKSTART})"
        )
    return " or ".join(options)


def _several_nodes(plan: DeploymentPlan, kind: EngineKind, gpus: MachineGpus | None) -> Problem:
    nodes = _nodes_needed(plan)
    used = ", ".join(map(str, plan.nodes))
    what = (
        f"the plan places engines on node{'s' if len(plan.nodes) != 1 else ''} {used} ({_where(plan)}): a "
        f"cluster of {nodes} nodes of {plan.num_gpus_per_node} GPUs"
    )
    wide = [e.id for e in plan.engines if e.nnodes > 1]
    if wide:
        what += f", with engine(s) {', '.join(wide[:3])}{'…' if len(wide) > 3 else ''} spanning several nodes"
    here = "this machine" if gpus is None else f"this machine, which has {gpus.describe()}"
    options = [
        f"run it on a Ray cluster of {nodes} nodes: sglang_deploy.launch.backend=ray (docs/backends.md)"
    ]
    fixes = _one_node_fixes(plan)
    if fixes:
        options.append("fit it on one node: " + "; or ".join(fixes))
    if gpus is not None and not gpus.ids:
        options.append("without a GPU: " + _without_gpu(kind))
    else:
        options.append("try it here with stand-in engines: sglang_deploy=simulated")
    return Problem(
        "sglang_deploy.launch.backend",
        f"is local (every engine a process of this machine), but {what}, and the local backend runs on {here}. "
        + "To change, one of:"
        + "".join(f"\n      ({i}) {option}" for i, option in enumerate(options, 1)),
    )


def _gpus_short(plan: DeploymentPlan, gpus: MachineGpus) -> Problem | None:
    needed = max(
        (max(p.local_gpu_ids) + 1 for e in plan.engines for p in e.processes if p.local_gpu_ids), default=0
    )
    if needed == 0 or len(gpus.ids) >= needed:
        return None
    if not gpus.ids:
        return Problem(
            "sglang_deploy.launch.engine",
            f"is sglang (SGLang's own server on GPUs), but this machine has {gpus.describe()} and the plan's "
            f"engines need GPUs 0-{needed - 1} ({plan.total_gpus} GPUs: {_groups(plan)}). Without a GPU: "
            + _without_gpu(EngineKind.sglang),
        )
    return Problem(
        "sglang_deploy.launch.engine",
        f"is sglang (SGLang's own server on GPUs), and the plan's engines need GPUs 0-{needed - 1} of a node "
        f"({plan.total_gpus} GPUs: {_groups(plan)}), but this machine has {gpus.describe()}: make the groups "
        f"smaller (sglang.<model>.<group>.num_gpus), or run with stand-in engines: sglang_deploy=simulated",
    )


def is_sglang_command(command: Sequence[str]) -> bool:
    return tuple(command[:3]) in SGLANG_COMMANDS or tuple(command[:2]) in SGLANG_COMMANDS


def machine_fit_problems(
    plan: DeploymentPlan, settings: SGLangDeployConf, gpus: MachineGpus | None = None
) -> list[Problem]:
    """What keeps ``plan`` from running on this machine with the local backend (empty: nothing, or another
    backend, or stand-in engines, which run anywhere). ``gpus``: this machine's (default: found)."""
    kind = EngineKind(settings.launch.engine)
    if BackendKind(settings.launch.backend) is not BackendKind.local or kind is EngineKind.simulated:
        return []
    spread = len(plan.nodes) > 1 or any(e.nnodes > 1 for e in plan.engines)
    real_gpus = kind is EngineKind.sglang and is_sglang_command(settings.launch.command)
    if not spread and not real_gpus:
        return []
    found = (gpus if gpus is not None else machine_gpus()) if real_gpus else None
    if spread:
        return [_several_nodes(plan, kind, found)]
    if found is None or (gpus is None and os.environ.get(VISIBLE_DEVICES_ENV, "").strip()):
        return []  # an inherited list: the local backend checks the plan against it, naming its engines
    short = _gpus_short(plan, found)
    return [short] if short is not None else []
