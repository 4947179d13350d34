"""The settings the running deployment reads (supervision, control, the router's retries) are checked with the
rest, every problem with its key, before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from miles_sglang_plugin.app.hydra_edge import prepare_from_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.errors import DeploymentConfigError


def test_every_bad_runtime_setting_is_named() -> None:
    cfg = compose_config(
        [
            "hf_checkpoint=/c",
            "sglang_deploy.supervision.health_interval_s=0",
            "sglang_deploy.supervision.failure_threshold=0",
            "sglang_deploy.supervision.max_restarts=-1",
            "sglang_deploy.supervision.restart_backoff_s=5",
            "sglang_deploy.supervision.restart_backoff_max_s=2",
            "sglang_deploy.control.timeout_s=0",
            "sglang_deploy.control.max_concurrency=0",
            "sglang_deploy.standin.control_latency_s=-1",
            "sglang_deploy.router.retry_backoff_multiplier=0.5",
            "sglang_deploy.router.retry_jitter_factor=2",
            "sglang_deploy.router.retry_initial_backoff_ms=0",
        ]
    )
    with pytest.raises(DeploymentConfigError) as exc:
        prepare_from_config(cfg)
    got = {p.key: p.message for p in exc.value.problems}
    assert got == {
        "sglang_deploy.supervision.health_interval_s": "must be > 0, got 0.0",
        "sglang_deploy.supervision.failure_threshold": "must be >= 1, got 0",
        "sglang_deploy.supervision.max_restarts": "must be >= 0, got -1",
        "sglang_deploy.supervision.restart_backoff_max_s": (
            "2.0 is below restart_backoff_s=5.0; the cap must be at least the first wait"
        ),
        "sglang_deploy.control.timeout_s": "must be > 0, got 0.0",
        "sglang_deploy.control.max_concurrency": "must be >= 1, got 0",
        "sglang_deploy.standin.control_latency_s": "must be >= 0, got -1.0",
        "sglang_deploy.router": got["sglang_deploy.router"],
    }
    router = [p.message for p in exc.value.problems if p.key == "sglang_deploy.router"]
    assert router == [
        "retry_initial_backoff_ms: must be >= 1, got 0",
        "retry_backoff_multiplier: must be a number in 1..100, got 0.5",
        "retry_jitter_factor: must be a number in 0..1, got 2.0",
    ]


def test_plan_exits_2_on_a_bad_supervision_setting() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_sglang_plugin",
            "plan",
            "hf_checkpoint=/c",
            "sglang_deploy.supervision.max_restarts=-2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "sglang_deploy.supervision.max_restarts: must be >= 0, got -2" in " ".join(proc.stderr.split())
