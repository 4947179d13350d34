"""Sweeps: the packed launcher against Hydra's sequential one, and what the report and the launcher cost per job.

(1) packed vs sequential: a 4-job sweep of ``examples/train.py`` whose jobs each need 4 of 8 GPUs (actor 4 GPUs,
    TP 2, rollout only), with stand-in engines that wait T seconds before they listen
    (``sglang_deploy.standin.start_delay_s``) and then serve a fixed load (the example's rollout step and its
    ``sglang_bench``, paced by the stand-in's speed model). Wall time of the whole multirun (a subprocess)
    with ``hydra/launcher=sglang_packed hydra.launcher.gpus=8`` against ``hydra/launcher=basic``; goal: packed
    / sequential <= 0.55 (two jobs at a time: 0.5 plus the launcher's overhead).
(2) report overhead: ``build_report`` of a sweep directory of 100 jobs (each job's metrics.json and plan.json,
    two models each, the sizes a real job writes), with and without the plot.
(3) launcher overhead per job: a sweep of N jobs that only resolve their plan (``plan_only=true``), packed one
    at a time (``hydra.launcher.max_parallel=1``: every job sized before dispatch, then forked, its result sent
    back) against Hydra's sequential launcher.

    python benchmarks/bench_sweep.py [--delay 10] [--jobs 100] [--json]
    python benchmarks/bench_sweep.py --smoke     # T = 1 s, 10 jobs for (2) and (3) (run by the tests)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
#: A job of 4 GPUs at local GPUs 0..3 (rollout only), 2 stand-in engines of TP 2.
JOB_OF_4 = [
    "sglang_deploy=simulated",
    "debug_rollout_only=true",
    "sglang.actor.regular.num_gpus=4",
    "rollout_num_gpus_per_engine=2",
    "sglang_deploy.launch.live=never",
]


def _multirun(sweep_dir: Path, overrides: list[str], lock_dir: Path) -> float:
    env = {**os.environ, "MSP_GPU_LOCK_DIR": str(lock_dir)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(TRAIN), "-m", f"hydra.sweep.dir={sweep_dir}", *overrides],
        cwd=TRAIN.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        stdin=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(
            f"the sweep failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return wall


def packed_vs_sequential(work: Path, delay_s: float, prompts: int) -> dict[str, float]:
    sweep = [
        *JOB_OF_4,
        f"sglang_deploy.standin.start_delay_s={delay_s}",
        f"sglang_bench.num_prompts={prompts}",
    ]
    sweep.append("seed=1,2,3,4")  # 4 jobs
    sequential = _multirun(work / "sequential", [*sweep, "hydra/launcher=basic"], work / "locks")
    packed = _multirun(
        work / "packed", [*sweep, "hydra/launcher=sglang_packed", "hydra.launcher.gpus=8"], work / "locks"
    )
    return {"sequential_s": sequential, "packed_s": packed, "ratio": packed / sequential}


def _synthetic_sweep(sweep: Path, jobs: int, template: Path) -> None:
    """``jobs`` job directories whose metrics (a real job's, varied) sweep TP over 1..8."""
    metrics = json.loads((template / "metrics.json").read_text())
    plan = (template / "plan.json").read_text()
    for num in range(jobs):
        job = sweep / str(num)
        (job / ".hydra").mkdir(parents=True)
        tp = 2 ** (num % 4)
        (job / ".hydra" / "overrides.yaml").write_text(
            f"- sglang.actor.num_gpus_per_engine={tp}\n- seed={num}\n"
        )
        for model in metrics["models"].values():
            model["output_tokens_per_s"] *= 1.01
        (job / "metrics.json").write_text(json.dumps(metrics))
        (job / "plan.json").write_text(plan)
        (job / "job_status.json").write_text('{"status": "COMPLETED", "error": null}')


def report_overhead(work: Path, jobs: int) -> dict[str, float]:
    from miles_sglang_plugin.sweeps.report import build_report

    template = next((work / "packed").glob("*/metrics.json")).parent
    sweep = work / "report"
    _synthetic_sweep(sweep, jobs, template)
    start = time.perf_counter()
    build_report(sweep, plot=False)
    table = time.perf_counter() - start
    start = time.perf_counter()
    build_report(sweep, plot=True)
    full = time.perf_counter() - start
    return {"jobs": jobs, "table_s": table, "with_plot_s": full}


def launcher_overhead(work: Path, jobs: int) -> dict[str, float]:
    sweep = [*JOB_OF_4, "plan_only=true", f"seed=range(0,{jobs})"]
    basic = _multirun(work / "plan-basic", [*sweep, "hydra/launcher=basic"], work / "locks")
    packed = _multirun(
        work / "plan-packed",
        [*sweep, "hydra/launcher=sglang_packed", "hydra.launcher.gpus=8"],
        work / "locks",
    )
    return {
        "jobs": jobs,
        "basic_s": basic,
        "packed_s": packed,
        "extra_per_job_ms": (packed - basic) / jobs * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--delay", type=float, default=10.0, help="stand-in start delay T (seconds)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts of each job's rollout benchmark")
    parser.add_argument("--jobs", type=int, default=100, help="jobs of (2) and (3)")
    parser.add_argument("--smoke", action="store_true", help="T = 1 s, 8 prompts, 10 jobs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.delay, args.prompts, args.jobs = 1.0, 8, 10
    work = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    try:
        results: dict[str, Any] = {
            "packed_vs_sequential": packed_vs_sequential(work, args.delay, args.prompts)
        }
        results["report"] = report_overhead(work, args.jobs)
        results["launcher"] = launcher_overhead(work, args.jobs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    p, r, la = results["packed_vs_sequential"], results["report"], results["launcher"]
    print(
        f"(1) 4 jobs x 4 of 8 GPUs, T = {args.delay:g} s: sequential {p['sequential_s']:.1f} s, packed {p['packed_s']:.1f} s"
    )
    print(f"(1) packed/sequential: {p['ratio']:.3f} (goal <= 0.55)")
    print(
        f"(2) report of {r['jobs']} jobs: table {r['table_s']:.2f} s, table + plot {r['with_plot_s']:.2f} s"
    )
    print(
        f"(3) {la['jobs']} plan-only jobs one at a time: basic {la['basic_s']:.1f} s, packed {la['packed_s']:.1f} s "
        f"({la['extra_per_job_ms']:+.0f} ms per job)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
