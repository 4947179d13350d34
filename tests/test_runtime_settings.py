"""The settings the running deployment reads (supervision, control, the router's retries) are checked with the
rest, every problem with its key, before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from miles_sglang_plugin.app.hydra_edge import prepare_from_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.errors import DeploymentConfigError

#: Why every duration is capped (30 days = 2,592,000 s).
DAYS = "(at most 30 days)"


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
        "sglang_deploy.supervision.health_interval_s": f"must be a number > 0 and <= 2592000 {DAYS}, got 0.0",
        "sglang_deploy.supervision.failure_threshold": "must be an integer in 1..1000000, got 0",
        "sglang_deploy.supervision.max_restarts": "must be an integer in 0..1000000, got -1",
        "sglang_deploy.supervision.restart_backoff_max_s": (
            "2.0 is below restart_backoff_s=5.0; the cap must be at least the first wait"
        ),
        "sglang_deploy.control.timeout_s": f"must be a number > 0 and <= 2592000 {DAYS}, got 0.0",
        "sglang_deploy.control.max_concurrency": "must be an integer in 1..1000000, got 0",
        "sglang_deploy.standin.control_latency_s": f"must be a number in 0..2592000 {DAYS}, got -1.0",
        "sglang_deploy.router": got["sglang_deploy.router"],
    }
    router = [p.message for p in exc.value.problems if p.key == "sglang_deploy.router"]
    assert router == [
        "retry_initial_backoff_ms: must be an integer in 1..86400000 (at most a day), got 0",
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
    assert "sglang_deploy.supervision.max_restarts: must be an integer in 0..1000000, got -2" in " ".join(
        proc.stderr.split()
    )


def test_every_number_of_sglang_deploy_gets_one_message_shape() -> None:
    """Launch, stand-in speed, supervision and router numbers alike: the type, the range, the value given."""
    from miles_sglang_plugin.config.schema import SGLangDeployConf
    from miles_sglang_plugin.rendering.launch_specs import check_deploy_settings

    settings = SGLangDeployConf()
    settings.standin.speed.prefill_tokens_per_s = 0.0
    settings.standin.speed.decode_step_s = "fast"  # type: ignore[assignment]
    settings.standin.die_after_s = {"actor.*": -2}
    settings.supervision.health_timeout_s = float("inf")
    settings.supervision.max_restarts = 2.5  # type: ignore[assignment]
    settings.router.retry_max_retries = True  # type: ignore[assignment]
    settings.launch.port_max = 99
    got = [str(p) for p in check_deploy_settings(settings, None)]
    assert got == [
        "sglang_deploy.router: retry_max_retries: must be an integer in 1..1000000, got True",
        "sglang_deploy.launch.port_max: must be an integer in 1024..65535 (above 32767 it means 32767), got 99",
        "sglang_deploy.supervision.health_timeout_s: must be a finite number > 0 and <= 2592000 (at most 30 days), got inf",
        "sglang_deploy.supervision.max_restarts: must be an integer in 0..1000000, got 2.5",
        "sglang_deploy.standin.die_after_s.actor.*: must be a number in 0..2592000 (at most 30 days), got -2",
        "sglang_deploy.standin.speed.prefill_tokens_per_s: must be a number > 0 and <= 1000000000, got 0.0",
        "sglang_deploy.standin.speed.decode_step_s: must be a number in 0..2592000 (at most 30 days), got 'fast'",
    ]


@pytest.mark.parametrize(
    ("bounds", "value", "message"),
    [
        ({"minimum": 0, "inclusive": False, "maximum": 1}, 1, None),
        ({"minimum": 0, "inclusive": False, "maximum": 1}, 0, "must be a number > 0 and <= 1, got 0"),
        ({"minimum": 0, "inclusive": False, "maximum": 1}, 1.5, "must be a number > 0 and <= 1, got 1.5"),
        ({"minimum": 1, "maximum": 100}, 100, None),
        ({"minimum": 1, "maximum": 100}, 0.5, "must be a number in 1..100, got 0.5"),
        ({"minimum": 0}, 0, None),
        ({"minimum": 0}, float("nan"), "must be a finite number >= 0, got nan"),
        ({"minimum": 1, "integer": True}, 1.0, "must be an integer >= 1, got 1.0"),
        ({"minimum": 0, "why": "seconds"}, -1, "must be a number >= 0 (seconds), got -1"),
    ],
)
def test_bounds_say_the_type_and_the_range(bounds: dict, value: object, message: str | None) -> None:
    from miles_sglang_plugin.rendering.deploy_checks import Bounds

    assert Bounds(**bounds).problem(value) == message
