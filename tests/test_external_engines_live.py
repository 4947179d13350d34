"""External engines in a running deployment: stand-ins started by the test (as if someone else ran them) are
served by their model's router next to local engines, reached by the control handle, taken out of the router
while they do not answer and put back when they do, and left running when the deployment stops."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.backends.base import LaunchError
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import LeakTracker, compose, generate_body
from tests.router_helpers import router_workers
from tests.test_standin import Proc, spawn, start_standin, wait_http  # noqa: F401  (the spawn fixture)


def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def judge(*urls: str) -> list[str]:
    listed = ",".join(f'"{url}"' for url in urls)
    return [
        "sglang.actor.regular.num_gpus=1",
        "+sglang_model@sglang.judge=base",
        "sglang.judge.model_path=/judge",
        f"sglang.judge.external=[{listed}]",
        "sglang_deploy.router.policy=round_robin",
        "sglang_deploy.supervision.health_interval_s=0.3",
        "sglang_deploy.supervision.health_timeout_s=0.5",
    ]


def test_external_engines_are_served_controlled_and_left_running(
    tmp_path: Path,
    spawn: Callable[..., Proc],
    leak_check: LeakTracker,
) -> None:
    outside = [start_standin(spawn, "--tp-size", "2"), start_standin(spawn, "--tp-size", "2")]
    for engine in outside:
        wait_http(engine)
    with launch_from_config(compose(*judge(*(e.url for e in outside))), log_dir=tmp_path / "logs") as d:
        infos = {e.id: e for e in d.engines()}
        assert [(i, infos[i].external, infos[i].num_gpus, infos[i].node) for i in infos] == [
            ("actor.regular.0", False, 1, 0),
            ("judge.external.0", True, 2, None),
            ("judge.external.1", True, 2, None),
        ]
        served = {
            httpx.post(d.registry.get_model_url("judge"), json=generate_body(), timeout=10).json()[
                "meta_info"
            ]["stand_in"]["port"]
            for _ in range(4)
        }
        assert served == {e.port for e in outside}
        result = d.control.pause_generation(model="judge")
        assert result.engines == ("judge.external.0", "judge.external.1")
        assert httpx.get(outside[0].url + "/stand_in/stats").json()["paused"] == "retract"
        assert d.control.offload().engines == ()  # external engines hold no GPU of the deployment
        d.control.continue_generation()
        # Lost: out of the router; back: in again (never restarted from here).
        since = len(d.events())
        os.kill(outside[1].popen.pid, signal.SIGSTOP)
        d.wait_for_event("external_engine_lost", subject="judge.external.1", since=since, timeout_s=60)
        assert until(
            lambda: [w["url"] for w in router_workers(d.registry["judge"].base_url)] == [outside[0].url]
        )
        os.kill(outside[1].popen.pid, signal.SIGCONT)
        d.wait_for_event("external_engine_back", subject="judge.external.1", since=since, timeout_s=60)
        assert len(router_workers(d.registry["judge"].base_url)) == 2
        assert [e.kind for e in d.events()[since:]] == ["external_engine_lost", "external_engine_back"]
    time.sleep(0.5)
    for engine in outside:  # teardown left them alone
        assert engine.popen.poll() is None
        assert httpx.get(engine.url + "/health", timeout=5).status_code == 200


def test_an_external_engine_that_never_answers_fails_the_start_naming_it(
    tmp_path: Path,
    leak_check: LeakTracker,
) -> None:
    cfg = compose(*judge("http://127.0.0.1:9"), startup_timeout_s=4)
    with pytest.raises(LaunchError) as exc, launch_from_config(cfg, log_dir=tmp_path / "logs"):
        pytest.fail("the launch should have failed")
    assert "external engine judge.external.0 never answered /health_generate at http://127.0.0.1:9" in str(
        exc.value
    )
    assert "actor.regular.0 never answered" not in str(exc.value)


def test_the_slime_flags_serve_external_engines(
    tmp_path: Path,
    spawn: Callable[..., Proc],
) -> None:
    """``--rollout-external-engine-addrs`` through ``miles-sglang``'s Python path: resolve_namespace, then the
    same deployment (a router for model ``default`` over the two engines)."""
    from miles_sglang_plugin.backends.local import LocalBackend
    from miles_sglang_plugin.config.reading import deploy_settings_from_config
    from miles_sglang_plugin.miles.argparse_bridge import resolve_namespace
    from miles_sglang_plugin.serving.deployment import Deployment
    from tests.test_argparse_bridge import miles_namespace

    outside = [start_standin(spawn), start_standin(spawn)]
    for engine in outside:
        wait_http(engine)
    plan = resolve_namespace(
        miles_namespace(
            rollout_external=True,
            rollout_external_engine_addrs=[f"127.0.0.1:{e.port}" for e in outside],
            hf_checkpoint="/ckpt",
        )
    )
    settings = deploy_settings_from_config(compose())
    backend = LocalBackend()
    with Deployment(backend.prepare(plan, settings), backend, log_dir=tmp_path / "logs") as d:
        assert [e.id for e in d.engines()] == ["default.external.0", "default.external.1"]
        assert d.control.update_weights_from_disk("/ckpt/2", weight_version="2").engines == (
            "default.external.0",
            "default.external.1",
        )
        assert (
            httpx.post(d.registry.get_model_url("default"), json=generate_body(), timeout=10).status_code
            == 200
        )
    assert all(e.popen.poll() is None for e in outside)
