"""``hydra/launcher=sglang_packed`` with the ray backend, on the tests' 4-node cluster of 8 fake GPUs each: the
launcher counts the cluster's GPUs (asked of the cluster from a short-lived process), runs jobs side by side
while they fit, and the engines of concurrent jobs hold disjoint GPUs of the cluster, as Ray assigned them."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest

from tests.conftest_ray import clean_cluster, ray_cluster  # noqa: F401 - fixtures
from tests.ray_helpers import FakeCluster
from tests.test_ray_backend import ray_overrides, subprocess_env

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = Path(__file__).resolve().parent / "sweep_app" / "app.py"


def _run(
    tmp_path: Path, cluster: FakeCluster, *args: str
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    sweep = tmp_path / "sweep"
    argv = [
        sys.executable,
        str(APP),
        "-m",
        "hydra/launcher=sglang_packed",
        f"hydra.sweep.dir={sweep}",
        *ray_overrides("sglang.actor.regular.num_gpus=8", *args),
    ]
    env = subprocess_env(cluster, MSP_GPU_LOCK_DIR=str(tmp_path / "locks"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = subprocess.run(argv, cwd=APP.parent, env=env, capture_output=True, text=True, timeout=300)
    records = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/job_record.json"))]
    return result, records


def _cluster_gpus(record: dict) -> set[tuple[str, str]]:
    return {(e["node_id"], gpu) for e in record["engines"] for gpu in e["reported"].split(",")}


def _overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_jobs_share_the_cluster_side_by_side_on_disjoint_gpus(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    result, jobs = _run(tmp_path, clean_cluster, "hold_s=3,3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "packed on 32 GPUs" in result.stderr + result.stdout  # the cluster's 4 x 8, asked of it
    assert len(jobs) == 2 and _overlap(jobs[0], jobs[1])
    for job in jobs:
        assert len(_cluster_gpus(job)) == 8 and job["packed_gpus"].count(",") == 7
    assert not _cluster_gpus(jobs[0]) & _cluster_gpus(jobs[1])


def test_jobs_that_do_not_fit_together_run_one_after_the_other(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    result, jobs = _run(tmp_path, clean_cluster, "hydra.launcher.gpus=8", "hold_s=0.5,0.5")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(jobs) == 2 and not any(_overlap(a, b) for a, b in combinations(jobs, 2))
