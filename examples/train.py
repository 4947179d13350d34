"""A Hydra app shaped like an RL trainer's entry point, using the `sglang` config group.

It resolves the deployment, prints the plan, brings the engines and routers up and runs the trainer's step
loop against them: rollout (actor generation with logprobs, reference scoring, reward model) -> pause ->
offload -> training -> onload weights -> weight update to the actor only -> onload the KV cache -> continue,
printing what each engine did. With ``kill_engine_at_step`` an engine is killed before that step's rollout:
the router retries its requests, the deployment heals it, and the loop goes on.

    python examples/train.py sglang=agentic_32gpu sglang_deploy=simulated colocate=true actor_num_nodes=4 kill_engine_at_step=1
    python examples/train.py sglang=pd_actor_ref sglang_deploy=simulated colocate=true actor_num_nodes=3 rebalance_after_step=1
    python examples/train.py sglang=pd_actor_ref sglang.actor.decode.num_gpus=12 sglang_deploy=simulated sglang_deploy.launch.backend=ray
    python examples/train.py sglang=agentic_32gpu sglang_deploy.launch.backend=ray   # a GPU cluster: real SGLang
    python examples/train.py sglang=pd_actor_ref_1node colocate=true          # one node of 8 GPUs (docs/quickstart.md)
    python examples/train.py sglang=pd_actor_ref sglang.actor.decode.num_gpus=12 plan_only=true
    python examples/train.py -m sglang=pd_actor_ref sglang.actor.decode.num_gpus_per_engine=2,4,8 plan_only=true
    python examples/train.py -m sglang=pd_actor_ref sglang.actor.decode.num_gpus_per_engine=2,4,8 \
        sglang_deploy=simulated hydra/callbacks=sglang_sweep_report      # TP sweep: table + plot of the bench
    python examples/train.py sglang=multi_model --cfg job --resolve
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from miles_sglang_plugin.app.hydra_edge import (
    exit_on_config_error,
    launch_from_config,
    resolve_config_or_exit,
)
from miles_sglang_plugin.config.schema import MilesTrainerArgs
from miles_sglang_plugin.planning.views import print_plan
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.serving.results import OperationResult
from miles_sglang_plugin.sweeps.jobs import bench_from_config, bench_settings_from_config

try:  # run as a script (python examples/train.py) or as a module
    from rollout import rollout_step
except ImportError:  # pragma: no cover
    from examples.rollout import rollout_step


@dataclass
class TrainConf(MilesTrainerArgs):
    """The trainer's own arguments next to Miles' rollout arguments (which it inherits)."""

    num_rollout: int = 3
    prompts: list[str] = field(
        default_factory=lambda: [
            "Solve step by step: 12 * 7 =",
            "Write a haiku about GPUs.",
            "Explain KL divergence in one sentence.",
            "What is the capital of France?",
        ]
    )
    max_new_tokens: int = 16
    #: Where the "trainer" saves each step's weights (the engines load them from there).
    checkpoint_dir: str = "/tmp/miles-sglang-demo/checkpoints"
    #: Seconds a training step takes here (there is no training in this example).
    train_step_s: float = 0.2
    #: Kill one engine (SIGKILL) before this step's rollout, to see it healed (local backend; null: never).
    kill_engine_at_step: int | None = None
    #: After this step, move ``rebalance_gpus`` of the actor's GPUs from prefill to decode while the loop goes
    #: on (responses grew longer: more decode): the engines that stay keep running (null: never).
    rebalance_after_step: int | None = None
    rebalance_gpus: int = 4
    #: Only resolve and print the plan; start nothing.
    plan_only: bool = False
    #: Write what each engine reports about itself (its /server_info: node, CUDA_VISIBLE_DEVICES, ...) to
    #: this JSON file, next to where the plan put it.
    engines_report: str | None = None


ConfigStore.instance().store(name="train_schema", node=TrainConf)

#: The columns of the per-step table: (title, key in the step's results).
STEP_COLUMNS = (
    ("pause", "pause"),
    ("offload", "offload"),
    ("onload weights", "onload_weights"),
    ("update weights", "update"),
    ("onload kv", "onload_kv"),
    ("continue", "continue"),
)


def engine_reports(deployment, headers: dict[str, str]) -> list[dict]:
    """Each engine as the deployment placed it and as it reports itself (stand-ins report the node and the
    CUDA_VISIBLE_DEVICES they got; a real SGLang engine reports neither)."""
    out = []
    for e in deployment.engines():
        info = httpx.get(e.url + "/server_info", headers=headers, timeout=10).json()
        out.append(
            {
                "id": e.id,
                "url": e.url,
                "plan_node": e.node,
                "gpus": e.gpus,
                "reported_cuda_visible_devices": info.get("cuda_visible_devices"),
                "reported_node_id": info.get("node_id"),
                "pid": info.get("pid"),
            }
        )
    return out


def print_engines(reports: list[dict], console: Console) -> None:
    table = Table(title="engines", title_justify="left")
    for col in ("engine", "url", "plan node", "CUDA_VISIBLE_DEVICES", "reported GPUs", "reported node"):
        table.add_column(col)
    for r in reports:
        table.add_row(
            r["id"],
            r["url"],
            str(r["plan_node"]),
            r["gpus"],
            str(r["reported_cuda_visible_devices"] or "-"),
            (r["reported_node_id"] or "-")[:12],
        )
    console.print(table)


def print_results(results, console: Console) -> None:
    table = Table(title="rollout", title_justify="left")
    for col in (
        "prompt",
        "response",
        "tokens",
        "actor logprob",
        "KL(actor||ref)/tok",
        "reward",
        "served by",
        "weights",
    ):
        table.add_column(col)
    for r in results:
        table.add_row(
            r.prompt[:32],
            r.response[:40],
            str(r.response_tokens),
            f"{r.actor_logprob:.2f}",
            "-" if r.kl is None else f"{r.kl:+.3f}",
            "-"
            if r.reward_reply is None
            else (f"{r.reward:g}" if r.reward is not None else f"'{r.reward_reply[:20]}'"),
            r.served_by,
            str(r.weight_version),
        )
    console.print(table)


def _cell(result: OperationResult, engine: str) -> str:
    for reply in result.replies:
        if reply.engine == engine:
            return f"ok {reply.elapsed_s * 1000:.0f} ms" if reply.ok else f"FAILED: {reply.error}"
    return "deferred" if engine in result.deferred else "-"


def print_step(
    step: int, results: dict[str, OperationResult], versions: dict, deployment: Deployment, console: Console
) -> None:
    table = Table(
        title=f"step {step}: what each engine did ('-': not concerned, by the plan)", title_justify="left"
    )
    for title in ("engine", *(title for title, _ in STEP_COLUMNS), "weight version"):
        table.add_column(title)
    for engine in deployment.engines():
        cells = [_cell(results[key], engine.id) for _, key in STEP_COLUMNS]
        table.add_row(engine.id, *cells, str(versions.get(engine.id)))
    console.print(table)


def train_step(deployment: Deployment, step: int, cfg: DictConfig) -> dict[str, OperationResult]:
    """Between two rollouts, as Miles' train loop: the engines stop generating and give their GPU memory to
    training; then take the new weights (the actor only) and serve again."""
    control = deployment.control
    results = {"pause": control.pause_generation(), "offload": control.offload()}
    time.sleep(cfg.train_step_s)  # the training step would run here, on the GPUs the engines gave back
    results["onload_weights"] = control.onload(["weights"])
    results["update"] = control.update_weights_from_disk(
        f"{cfg.checkpoint_dir}/iter_{step + 1:07d}", weight_version=str(step + 1)
    )
    results["onload_kv"] = control.onload(["kv_cache", "cuda_graph"])
    results["continue"] = control.continue_generation()
    return results


def kill_an_engine(deployment: Deployment, console: Console) -> int:
    """SIGKILL the actor's last engine (a crash); returns the event position to wait from."""
    since = len(deployment.events())
    victim = [e for e in deployment.engines() if e.model == deployment.engines()[0].model][-1]
    (process,) = [p for p in deployment.processes() if p.name == victim.id]
    os.kill(process.pid, signal.SIGKILL)
    console.print(f"[bold]killed engine {victim.id} (pid {process.pid}) before the rollout[/]")
    return since


def rebalance(deployment: Deployment, num_gpus: int, console: Console) -> None:
    """Move GPUs of the actor from prefill to decode in the running deployment: the engines that stay keep
    their processes and GPUs, the removed prefill engines drain, new decode engines take their GPUs with the
    deployment's weights."""
    result = deployment.move_gpus("actor", "prefill", "decode", num_gpus)
    for line in result.lines():
        console.print(line, markup=False, highlight=False)


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 170)
    plan = resolve_config_or_exit(cfg)
    bench = bench_settings_from_config(cfg, plan)  # checked before anything starts
    print_plan(plan, console)
    if cfg.plan_only:
        return
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request is noise here
    # A plan this machine cannot run (engines on several nodes, more GPUs than it has): one message, exit 2.
    with exit_on_config_error(), launch_from_config(cfg) as deployment:
        registry = deployment.registry
        reports = engine_reports(deployment, deployment.auth_headers())
        print_engines(reports, console)
        if cfg.engines_report:
            Path(cfg.engines_report).write_text(json.dumps(reports, indent=2))
        for step in range(cfg.num_rollout):
            since = kill_an_engine(deployment, console) if step == cfg.kill_engine_at_step else None
            results = asyncio.run(
                rollout_step(
                    registry,
                    list(cfg.prompts),
                    {"max_new_tokens": cfg.max_new_tokens},
                    headers=deployment.auth_headers(),
                    actor=deployment.async_client("actor"),
                )
            )
            console.print(f"rollout {step}: {len(results)} samples")
            print_results(results, console)
            if since is not None:
                event = deployment.wait_for_event("engine_recovered", since=since, timeout_s=120)
                console.print(f"[bold]healed: {event.message}; the loop goes on[/]")
            step_results = train_step(deployment, step, cfg)
            print_step(step, step_results, deployment.control.weight_versions(), deployment, console)
            if step == cfg.rebalance_after_step:
                rebalance(deployment, cfg.rebalance_gpus, console)
        if bench is not None:  # the rollout benchmark: plan.json and metrics.json in the job's directory
            bench_from_config(cfg, deployment, console=console)
    console.print("deployment stopped: every engine and router is gone")


if __name__ == "__main__":
    main()
