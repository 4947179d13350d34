"""A Hydra app shaped like an RL trainer's entry point, using the `sglang` config group.

It resolves the deployment, prints the plan, brings the engines and routers up, runs one rollout step
(actor generation with logprobs, reference scoring, reward model), prints the result and tears down.

    python examples/train.py sglang=agentic_32gpu sglang_deploy=simulated    # CPU machine: stand-in engines
    python examples/train.py sglang=pd_actor_ref sglang.actor.decode.num_gpus=12 sglang_deploy.launch.backend=ray
    python examples/train.py sglang=agentic_32gpu                             # GPU node: real SGLang
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
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from miles_sglang_plugin.app.hydra_edge import launch_from_config, resolve_config_or_exit
from miles_sglang_plugin.config.schema import MilesTrainerArgs
from miles_sglang_plugin.planning.views import print_plan
from miles_sglang_plugin.sweeps.jobs import bench_from_config, bench_settings_from_config

try:  # run as a script (python examples/train.py) or as a module
    from rollout import rollout_step
except ImportError:  # pragma: no cover
    from examples.rollout import rollout_step


@dataclass
class TrainConf(MilesTrainerArgs):
    """The trainer's own arguments next to Miles' rollout arguments (which it inherits)."""

    num_rollout: int = 1
    prompts: list[str] = field(
        default_factory=lambda: [
            "Solve step by step: 12 * 7 =",
            "Write a haiku about GPUs.",
            "Explain KL divergence in one sentence.",
            "What is the capital of France?",
        ]
    )
    max_new_tokens: int = 16
    #: Only resolve and print the plan; start nothing.
    plan_only: bool = False
    #: Write what each engine reports about itself (its /server_info: node, CUDA_VISIBLE_DEVICES, ...) to
    #: this JSON file, next to where the plan put it.
    engines_report: str | None = None


ConfigStore.instance().store(name="train_schema", node=TrainConf)


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
    table = Table(title="rollout step", title_justify="left")
    for col in ("prompt", "response", "tokens", "actor logprob", "KL(actor||ref)/tok", "reward", "served by"):
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
        )
    console.print(table)


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    plan = resolve_config_or_exit(cfg)
    bench = bench_settings_from_config(cfg, plan)  # checked before anything starts
    print_plan(plan, console)
    if cfg.plan_only:
        return
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request is noise here
    with launch_from_config(cfg) as deployment:
        registry = deployment.registry
        reports = engine_reports(deployment, deployment.auth_headers())
        print_engines(reports, console)
        if cfg.engines_report:
            Path(cfg.engines_report).write_text(json.dumps(reports, indent=2))
        for step in range(cfg.num_rollout):
            results = asyncio.run(
                rollout_step(
                    registry,
                    list(cfg.prompts),
                    {"max_new_tokens": cfg.max_new_tokens},
                    headers=deployment.auth_headers(),
                )
            )
            console.print(f"rollout {step}: {len(results)} samples")
            print_results(results, console)
        if bench is not None:  # the rollout benchmark: plan.json and metrics.json in the job's directory
            bench_from_config(cfg, deployment, console=console)
    console.print("deployment stopped: every engine and router is gone")


if __name__ == "__main__":
    main()
