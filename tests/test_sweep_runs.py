"""Sweeps end to end, as a user runs them: the example trainer's TP sweep with the report callback (the issue's
command), and a sweep with a failing job, whose report still shows it."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KEY = "sglang.actor.decode.num_gpus_per_engine"


def run_app(app: Path, args: list[str], timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [sys.executable, str(app), *args],
        cwd=app.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_the_example_tp_sweep_leaves_a_table_and_a_plot_of_its_jobs_metrics(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_app(
        REPO / "examples" / "train.py",
        [
            "-m",
            "sglang=pd_actor_ref",
            f"{KEY}=2,4,8",
            "sglang_deploy=simulated",
            "hydra/callbacks=sglang_sweep_report",
            f"hydra.sweep.dir={sweep}",
            "sglang_bench.num_prompts=16",  # the example's load, halved: a quicker test
        ],
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with (sweep / "sweep_report.csv").open() as f:
        rows = list(csv.DictReader(f))
    # 3 jobs x 2 models (actor, ref), in job order
    assert [(r["job"], r[KEY], r["model"]) for r in rows] == [
        (str(job), tp, model) for job, tp in enumerate(["2", "4", "8"]) for model in ("actor", "ref")
    ]
    for row in rows:
        metrics = json.loads((sweep / row["job"] / "metrics.json").read_text())
        model = metrics["models"][row["model"]]
        assert float(row["output_tokens_per_s"]) == pytest.approx(model["output_tokens_per_s"])
        assert float(row["latency_p99_s"]) == pytest.approx(model["latency_s"]["p99"])
        assert (row["requests"], row["succeeded"], row["status"]) == ("16", "16", "ok")
        assert row["simulated"] == "True" and model["latency_source"] == "engine"
        assert (sweep / row["job"] / "plan.json").exists()
    # decode engines: 8 GPUs / TP -> 4, 2, 1 (prefill: 8 GPUs of the trainer's TP 2 -> 4; the preset leaves
    # TP to the trainer, examples/conf's rollout_num_gpus_per_engine=2)
    actor_groups = [r["groups"] for r in rows if r["model"] == "actor"]
    assert actor_groups == [f"prefill 4x TP2, decode {8 // tp}x TP{tp}" for tp in (2, 4, 8)]
    md = (sweep / "sweep_report.md").read_text()
    assert "**Simulated numbers**" in md and md.count("| ok |") == 6
    import matplotlib.image

    image = matplotlib.image.imread(sweep / "sweep_report.png")
    assert image.shape[:2] == (420, 1100) and image.std() > 0.05  # drawn, not blank
    assert "sweep_report.md" in result.stdout and "simulated" in result.stdout


def test_a_failed_job_is_a_row_with_its_error_and_the_sweep_still_reports(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_app(
        REPO / "tests" / "sweep_app" / "app.py",
        [
            "-m",
            "sglang.actor.regular.num_gpus=4,3",  # 3 GPUs do not split into engines of TP 2
            "hold_s=0",
            "+sglang_bench=smoke",
            "hydra/callbacks=sglang_sweep_report",
            f"hydra.sweep.dir={sweep}",
        ],
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    with (sweep / "sweep_report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["model"], r["status"]) for r in rows] == [("0", "actor", "ok"), ("1", "", "failed")]
    assert rows[0]["requests"] == "8" and float(rows[0]["requests_per_s"]) > 0
    assert rows[1]["error"].startswith("DeploymentConfigError: 1 problem with the SGLang deployment")
    assert "sglang.actor.regular" in rows[1]["error"]
    assert "the sweep ended with failed jobs" in result.stdout


def test_a_sweep_with_an_api_key_and_a_token_shows_neither_in_its_results_or_logs(tmp_path: Path) -> None:
    # Given on the command line (the docs prefer SGLANG_API_KEY): Hydra keeps its own copy of the overrides
    # in each job's .hydra/ and in multirun.yaml, as with any Hydra app; everything this project writes or logs
    # masks them.
    key, token = "sk-SWEEP-k3y-91", "hf_SWEEPt0ken42"
    sweep = tmp_path / "sweep"
    result = run_app(
        REPO / "tests" / "sweep_app" / "app.py",
        [
            "-m",
            "sglang.actor.regular.num_gpus=2,4,3",  # the last does not split into engines of TP 2: it fails
            "hold_s=0",
            "+sglang_bench=smoke",
            "hydra/callbacks=sglang_sweep_report",
            "hydra/launcher=sglang_packed",
            "hydra.launcher.gpus=8",
            f"hydra.sweep.dir={sweep}",
            f"sglang_deploy.api_key={key}",
            f"+sglang_deploy.env.HF_TOKEN={token}",
        ],
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert key not in output and token not in output
    assert "sglang_deploy.api_key=***" in output  # the packed launcher's job list
    assert "Error executing job with overrides:" in output  # Hydra's, of the masked overrides
    assert (
        "Traceback" not in output and "3 GPUs do not split into engines" in output
    )  # bad input: its message
    # The engines' own log files hold what they wrote (SGLang logs its server_args, key included): not ours.
    engine_logs = {p for p in sweep.rglob("sglang_logs/*.log") if not p.name.startswith("router.")}
    assert engine_logs and all(key in p.read_text() for p in engine_logs)
    written = [
        p
        for p in sweep.rglob("*")
        if p.is_file() and ".hydra" not in p.parts and p.name != "multirun.yaml" and p not in engine_logs
    ]
    assert {"metrics.json", "plan.json", "sweep_report.md", "sweep_report.csv"} <= {p.name for p in written}
    for path in written:
        if path.suffix != ".png":
            text = path.read_text(errors="replace")
            assert key not in text and token not in text, path
    metrics = json.loads((sweep / "0" / "metrics.json").read_text())
    assert "sglang_deploy.api_key=***" in metrics["overrides"]
    assert "+sglang_deploy.env.HF_TOKEN=***" in metrics["overrides"]
    assert metrics["models"]["actor"]["succeeded"] == 8  # the key reached the engines and the client


def test_the_apps_dry_run_of_a_sweep_shows_no_secret(tmp_path: Path) -> None:
    result = run_app(
        REPO / "examples" / "train.py",
        [
            "-m",
            "hydra/callbacks=sglang_plan",
            "sglang_deploy.api_key=sk-DRY-k3y",
            "+sglang_deploy.env.HF_TOKEN=hf_DRYt0ken",
            "seed=1,2",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "sk-DRY-k3y" not in output and "hf_DRYt0ken" not in output
    assert "#1 : sglang_deploy.api_key=*** +sglang_deploy.env.HF_TOKEN=*** seed=2" in output
