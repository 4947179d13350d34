"""Supervision of a running deployment (stand-in engines, real sglang-routers): an engine that exits, one that
hangs (SIGSTOP) and a router that dies are each reported and healed, with the control state the trainer left
the engines in; requests in flight are retried by the router; with no restarts left the deployment fails
whole and leaves nothing.

Every deployment here is checked to leave nothing behind (``leak_check``)."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.serving.errors import DeploymentFailedError
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import (
    LeakTracker,
    children_of,
    compose,
    generate_body,
    launch_overrides,
    process_alive,
)
from tests.router_helpers import router_workers

#: Quick supervision: polls every 0.3 s answering within 0.5 s, 2 failed polls make a loss.
FAST = [
    "sglang_deploy.supervision.health_interval_s=0.3",
    "sglang_deploy.supervision.health_timeout_s=0.5",
    "sglang_deploy.supervision.restart_backoff_s=0.1",
    "sglang_deploy.supervision.kill_grace_s=0.5",
    "sglang_deploy.router.policy=round_robin",
]
TWO = ["sglang.actor.regular.num_gpus=2", *FAST]
#: Colocated with a 2-GPU actor (Miles' colocate: offload on, rollout_num_gpus = the actor's 2 GPUs): both
#: engines of TWO start below Megatron's 2 GPUs, so their group needs offload.
COLOCATED = ["debug_rollout_only=false", "colocate=true", "actor_num_gpus_per_node=2"]


def engine_pid(d: Deployment, engine: str) -> int:
    return d.fleet.engine(engine).processes[0].pid  # type: ignore[attr-defined]


def info(d: Deployment, engine: str) -> dict:
    (e,) = [e for e in d.engines() if e.id == engine]
    return httpx.get(e.url + "/server_info", timeout=10).json()


def stats(d: Deployment, engine: str) -> dict:
    (e,) = [e for e in d.engines() if e.id == engine]
    return httpx.get(e.url + "/stand_in/stats", timeout=10).json()


def router_urls(d: Deployment, model: str = "actor") -> list[str]:
    return sorted(w["url"] for w in router_workers(d.registry[model].base_url) if w.get("is_healthy"))


def test_an_engine_that_exits_is_restarted_with_its_command_gpus_and_control_state(
    tmp_path: Path,
    leak_check: LeakTracker,
) -> None:
    cfg = compose(*TWO, *COLOCATED, "sglang_deploy.lora.enabled=true")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        before = info(d, "actor.regular.1")
        d.control.update_weights_from_disk("/ckpt/step5", weight_version="5")
        d.control.load_lora_adapter("math", "/lora/math")
        d.control.pause_generation("in_place")
        d.control.offload(["kv_cache"])
        since = len(d.events())
        os.kill(engine_pid(d, "actor.regular.1"), signal.SIGKILL)
        lost = d.wait_for_event("engine_lost", subject="actor.regular.1", since=since, timeout_s=60)
        assert "exited with code -9" in lost.message  # told by the exit watcher, not by a failed health poll
        recovered = d.wait_for_event("engine_recovered", subject="actor.regular.1", since=since, timeout_s=60)
        assert recovered.details["restarts"] == 1 and lost.monotonic < recovered.monotonic
        after = info(d, "actor.regular.1")
        assert after["pid"] != before["pid"]
        assert (after["argv"], after["cuda_visible_devices"], after["port"]) == (
            before["argv"],
            "1",
            before["port"],
        )
        # The trainer's state was replayed before it served again.
        state = stats(d, "actor.regular.1")
        assert (state["weight_version"], state["loaded_model_path"]) == ("5", "/ckpt/step5")
        assert (state["lora_adapters"], state["paused"], state["released_memory_tags"]) == (
            {"math": "/lora/math"},
            "in_place",
            ["kv_cache"],
        )
        assert [e.restarts for e in d.engines()] == [0, 1]
        assert d.state().status == "serving" and len(router_urls(d)) == 2
        kinds = [e.kind for e in d.events()[since:]]
        assert kinds == ["engine_lost", "engine_restarting", "engine_recovered"]
        d.control.onload(["kv_cache"])  # what was released (resuming anything else ends a real engine)
        d.control.continue_generation()


def test_a_hung_engine_is_noticed_killed_and_replaced_and_its_requests_are_retried(
    tmp_path: Path,
    leak_check: LeakTracker,
) -> None:
    with launch_from_config(compose(*TWO), log_dir=tmp_path / "logs") as d:
        pid = engine_pid(d, "actor.regular.0")
        since = len(d.events())
        os.kill(pid, signal.SIGSTOP)
        (other,) = [e for e in d.engines() if e.id == "actor.regular.1"]

        async def requests() -> list[tuple[int, int]]:
            # No timeout of the client's: a request the router held past the loss would hang (the router's
            # own request timeout is 4 hours) and fail the test by its timeout.
            async with httpx.AsyncClient(timeout=None) as client:

                async def one() -> tuple[int, int]:
                    response = await client.post(d.registry.get_model_url("actor"), json=generate_body())
                    return response.status_code, response.json()["meta_info"]["stand_in"]["port"]

                return list(await asyncio.gather(*(one() for _ in range(6))))

        answers = asyncio.run(requests())
        lost = d.wait_for_event("engine_lost", subject="actor.regular.0", since=since, timeout_s=60)
        assert "no answer to /health within 0.5 s (2 polls in a row)" in lost.message
        # Round robin sent half of them to the stopped engine: they hung until it was killed, then the router
        # retried them on the other engine, which answered all six. None failed, none hung past the loss.
        assert answers == [(200, int(other.url.rsplit(":", 1)[1]))] * 6
        assert not process_alive(pid)
        d.wait_for_event("engine_recovered", subject="actor.regular.0", since=since, timeout_s=60)
        assert len(router_urls(d)) == 2


def test_a_dead_router_is_restarted_and_repopulated(tmp_path: Path, leak_check: LeakTracker) -> None:
    with launch_from_config(compose(*TWO), log_dir=tmp_path / "logs") as d:
        workers = router_urls(d)
        router = d.fleet.routers()[0]
        since = len(d.events())
        os.kill(router.process.pid, signal.SIGKILL)
        d.wait_for_event("router_lost", subject="router.actor", since=since, timeout_s=60)
        d.wait_for_event("router_recovered", subject="router.actor", since=since, timeout_s=60)
        assert router_urls(d) == workers and router.restarts == 1
        response = httpx.post(d.registry.get_model_url("actor"), json=generate_body(), timeout=10)
        assert response.status_code == 200
        assert d.state().status == "serving"


def test_with_no_restarts_the_deployment_fails_whole_and_leaves_nothing(
    tmp_path: Path,
    leak_check: LeakTracker,
) -> None:
    with (
        pytest.raises(DeploymentFailedError) as exc,
        launch_from_config(
            compose(*TWO, "sglang_deploy.supervision.max_restarts=0"), log_dir=tmp_path / "logs"
        ) as d,
    ):
        os.kill(engine_pid(d, "actor.regular.0"), signal.SIGKILL)
        failed = d.wait_for_event("deployment_failed", timeout_s=60)
        assert "supervision.max_restarts=0 (fail fast)" in failed.message
        assert d.wait_stopped(timeout_s=120)  # a failure stops the deployment by itself
        assert all(p.exit_code() is not None for p in d.processes())  # everything is stopped already
        assert d.state().status == "failed"
        with pytest.raises(DeploymentFailedError, match="exited with code -9"):
            d.control.pause_generation()
    assert "the deployment failed and was stopped: engine actor.regular.0" in str(exc.value)


def test_restarts_used_up_fail_the_deployment(tmp_path: Path, leak_check: LeakTracker) -> None:
    cfg = compose(
        *TWO,
        "sglang_deploy.supervision.max_restarts=1",
        "+sglang_deploy.standin.die_after_s={actor.regular.1:1.5}",
    )
    with pytest.raises(DeploymentFailedError), launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        failed = d.wait_for_event("deployment_failed", timeout_s=60)
        kinds = [e.kind for e in d.events() if e.subject == "actor.regular.1"]
        assert kinds == ["engine_lost", "engine_restarting", "engine_recovered", "engine_lost"]
        assert "its 1 restarts (supervision.max_restarts) are used up" in failed.message


def test_an_engine_restarted_after_a_broadcast_waits_for_weights(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """Weights that came through a weights update group cannot be replayed: the restarted engine stays out
    of its router until the trainer re-formed the group with it and sent it weights (Miles NEW's
    PendingWeights; HEAD re-connects when num_new_engines > 0)."""
    with launch_from_config(compose(*TWO), log_dir=tmp_path / "logs") as d:
        d.control.background.init_weights_update_group("127.0.0.1", 29500).result(timeout=30)
        d.control.update_weights_from_distributed(["w"], ["bfloat16"], [[2]], weight_version="7")
        since = len(d.events())
        os.kill(engine_pid(d, "actor.regular.0"), signal.SIGKILL)
        pending = d.wait_for_event(
            "engine_pending_weights", subject="actor.regular.0", since=since, timeout_s=30
        )
        assert (
            "its weights are not the deployment's (they came through a weights update group)"
            in pending.message
        )
        assert [e.state for e in d.engines()] == ["pending_weights", "serving"]
        assert len(router_urls(d)) == 1
        assert d.control.engines_outside_weight_group() == ("actor.regular.0",)
        # The restarted engine never joined the group: SGLang answers it 400 "The group to be destroyed does
        # not exist." (tests/test_engine_contract.py), as the stand-in now does. The engine of the group took it.
        destroyed = d.control.destroy_weights_update_group(check=False)
        assert [r.engine for r in destroyed.replies if r.ok] == ["actor.regular.1"]
        group = d.control.background.init_weights_update_group("127.0.0.1", 29501).result(timeout=30).group
        assert [(r.engine, r.rank_offset) for r in group.ranks] == [
            ("actor.regular.0", 1),
            ("actor.regular.1", 2),
        ]
        d.control.update_weights_from_distributed(["w"], ["bfloat16"], [[2]], weight_version="8")
        d.wait_for_event("engine_admitted", subject="actor.regular.0", since=since, timeout_s=60)
        assert len(router_urls(d)) == 2
        assert d.control.weight_versions() == {"actor.regular.0": "8", "actor.regular.1": "8"}


def test_miles_sglang_launch_heals_instead_of_stopping(tmp_path: Path, leak_check: LeakTracker) -> None:
    command = [
        str(Path(sys.executable).parent / "miles-sglang"),
        "launch",
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("wb") as fo, err.open("wb") as fe:
        cli = subprocess.Popen(
            [*command, *launch_overrides(*TWO)], stdout=fo, stderr=fe, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while "serving; logs in" not in err.read_text() and time.monotonic() < deadline:
            assert cli.poll() is None, err.read_text()
            time.sleep(0.1)
        engines = sorted(children_of(cli.pid, ["miles_sglang_plugin.standin"]))
        for pid in engines:
            leak_check.add_process(pid, "engine", "miles_sglang_plugin.standin")
        assert len(engines) == 2
        os.kill(engines[0], signal.SIGKILL)
        while "engine_recovered" not in err.read_text() and time.monotonic() < deadline:
            assert cli.poll() is None, err.read_text()
            time.sleep(0.1)
        assert "engine_lost: engine actor.regular." in err.read_text()
        assert cli.poll() is None  # still serving
        replacement = children_of(cli.pid, ["miles_sglang_plugin.standin"]) - set(engines)
        for pid in replacement:
            leak_check.add_process(pid, "engine", "miles_sglang_plugin.standin")
        assert len(replacement) == 1
        os.killpg(cli.pid, signal.SIGINT)
        assert cli.wait(timeout=30) == 130
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait(timeout=10)


def test_no_request_hangs_past_the_routers_request_timeout(
    tmp_path: Path, leak_check: LeakTracker, test_gateway: str
) -> None:
    """Without supervision nothing takes a hung engine out: the router's request_timeout_secs still bounds
    every request (an error after it, not a hang of Miles' 4 hours)."""
    cfg = compose(
        "sglang.actor.regular.num_gpus=1",
        "sglang_deploy.supervision.enabled=false",
        "sglang_deploy.router.request_timeout_secs=2",
        "sglang_deploy.router.retry_max_retries=1",
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        pid = engine_pid(d, "actor.regular.0")
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            response = httpx.post(d.registry.get_model_url("actor"), json=generate_body(), timeout=60)
            elapsed = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        # sglang-router 0.3.2: 500 call_upstream_request_error; SMG 1.13.0: 504 call_upstream_timeout
        status, code = {
            "sglang_router": (500, "call_upstream_request_error"),
            "smg": (504, "call_upstream_timeout"),
        }[test_gateway]
        assert response.status_code == status and f'"code":"{code}"' in response.text, response.text
        assert elapsed > 1.9  # the router's 2 s, which ended it (the code above): no hang, whatever the load
        assert d.events() == ()  # nothing watched


def test_generation_health_checks_spare_engines_that_cannot_generate(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """With health_endpoint=/health_generate (Miles' monitor), an offloaded or paused engine is polled on
    /health instead (its /health_generate fails: it cannot generate), so it is not taken for lost; a hang is
    still noticed."""
    cfg = compose(*TWO, *COLOCATED, "sglang_deploy.supervision.health_endpoint=/health_generate")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        d.control.offload(model="actor", group="regular")
        d.control.pause_generation("in_place")
        assert httpx.get(d.engines()[0].url + "/health_generate", timeout=5).status_code == 503
        time.sleep(2.0)  # several polls
        assert d.events() == () and d.state().status == "serving"
        d.control.onload()
        d.control.continue_generation()
        since = len(d.events())
        os.kill(engine_pid(d, "actor.regular.1"), signal.SIGSTOP)
        lost = d.wait_for_event("engine_lost", subject="actor.regular.1", since=since, timeout_s=60)
        assert "no answer to /health_generate within 0.5 s" in lost.message
        d.wait_for_event("engine_recovered", subject="actor.regular.1", since=since, timeout_s=60)


def test_a_restart_that_fails_half_way_stops_the_processes_it_had_started(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """A two-node engine (16 GPUs as two nodes of 8, side by side here): the first restart starts node 0, then
    node 1 fails to start. The node-0 process it had started is stopped with the failed attempt (before: it
    was never tracked and ran on, next to the replacement, until the launcher ended); the next restart
    serves."""
    cfg = compose("sglang.actor.regular.num_gpus=16", "sglang.actor.num_gpus_per_engine=16", *FAST)
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        real_start = d.backend.start
        started: list = []
        refused: list[str] = []

        def start(launch, *, log_path):  # type: ignore[no-untyped-def]
            if launch.node_rank == 1 and not refused:
                refused.append(launch.name)
                raise OSError("node 1 cannot start it (the test)")
            process = real_start(launch, log_path=log_path)
            started.append(process)
            leak_check.add_process(process.pid, process.name, "miles_sglang_plugin.standin")
            return process

        d.backend.start = start  # type: ignore[method-assign]
        since = len(d.events())
        os.kill(engine_pid(d, "actor.regular.0"), signal.SIGKILL)
        failed = d.wait_for_event(
            "engine_restart_failed", subject="actor.regular.0", since=since, timeout_s=30
        )
        assert "node 1 cannot start it (the test)" in failed.message
        d.wait_for_event("engine_recovered", subject="actor.regular.0", since=since, timeout_s=60)
        assert refused == ["actor.regular.0.node1"]
        assert [p.name for p in started] == ["actor.regular.0.node0"] * 2 + ["actor.regular.0.node1"]
        assert not process_alive(started[0].pid)
        assert [p.pid for p in d.fleet.engines()[0].processes] == [p.pid for p in started[1:]]
        assert d.state().status == "serving"


def test_an_admission_under_way_when_the_deployment_stops_ends_with_it_and_reports_nothing(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """An engine waiting for weights gets them from disk; its admission then registers it with a router that
    does not answer (SIGSTOPped) when the deployment stops. The admission is the reconciler's work: stopping
    cancels it, nothing is reported after the stop, and no thread of the deployment is left (before: an
    untracked thread that, once the router was stopped, reported the engine lost after the deployment had
    stopped)."""
    with launch_from_config(compose(*TWO), log_dir=tmp_path / "logs") as d:
        d.control.background.init_weights_update_group("127.0.0.1", 29500).result(timeout=30)
        d.control.update_weights_from_distributed(["w"], ["bfloat16"], [[2]], weight_version="7")
        since = len(d.events())
        os.kill(engine_pid(d, "actor.regular.0"), signal.SIGKILL)
        d.wait_for_event("engine_pending_weights", subject="actor.regular.0", since=since, timeout_s=60)
        router_pid = d.fleet.routers()[0].process.pid
        os.kill(router_pid, signal.SIGSTOP)  # the admission's registration waits for an answer
        try:
            d.control.update_weights_from_disk("/ckpt/step9", weight_version="9", model="actor")
            deadline = time.monotonic() + 10
            while "register" not in d.fleet.engine("actor.regular.0").pending:
                assert time.monotonic() < deadline, "the admission never began to register the engine"
                time.sleep(0.01)
            stopped_at = len(d.events())
            d.stop()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(router_pid, signal.SIGCONT)
        time.sleep(0.5)
        assert [e.kind for e in d.events()[stopped_at:]] == []
        assert serving_threads() == []


def serving_threads() -> list[str]:
    """Threads of a deployment still running (its serving loop, spawner, exit watcher, workers, events)."""
    names = ("msp-serving", "msp-spawn", "msp-exits", "msp-io", "msp-events")
    return [t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith(names)]


def test_miles_sglang_launch_shows_the_supervisors_log_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """What ``miles-sglang launch`` sets up before it starts anything: every supervision event once, with its
    kind, and the supervisor's other warnings too (before: a NullHandler swallowed the latter)."""
    import logging

    from miles_sglang_plugin.cli import log_to_stderr
    from miles_sglang_plugin.serving.events import EventLog

    package_logger = logging.getLogger("miles_sglang_plugin")
    before = (package_logger.level, package_logger.propagate, list(package_logger.handlers))
    with log_to_stderr():
        EventLog().emit("engine_lost", "actor.regular.1", "engine actor.regular.1 (http://h:1) lost: gone")
        logging.getLogger("miles_sglang_plugin.supervision").warning(
            "could not take %s out of router %s: %s", "actor.regular.1", "actor", "refused"
        )
        logging.getLogger("miles_sglang_plugin.supervision").debug("not shown")
    assert (package_logger.level, package_logger.propagate, package_logger.handlers) == before  # as it was
    assert capsys.readouterr().err.splitlines() == [
        "engine_lost: engine actor.regular.1 (http://h:1) lost: gone",
        "warning: could not take actor.regular.1 out of router actor: refused",
    ]


def test_a_wait_for_an_event_that_never_comes_names_the_ones_that_did() -> None:
    """What the deployment did instead is in the error (a test that times out says why, not only that)."""
    from miles_sglang_plugin.serving.events import EventLog

    log = EventLog()
    log.emit("engine_lost", "actor.regular.0", "lost")  # before ``since``: not named
    since = 1
    with pytest.raises(TimeoutError) as nothing:
        log.wait_for("router_recovered", subject="router.actor", since=since, timeout_s=0.01)
    assert str(nothing.value) == "no router_recovered event of router.actor in 0.01 s; no event came"
    log.emit("router_lost", "router.actor", "lost")
    log.emit("router_recovered", "router.ref", "back")  # another subject
    with pytest.raises(TimeoutError) as two:
        log.wait_for("router_recovered", subject="router.actor", since=since, timeout_s=0.01)
    assert str(two.value) == (
        "no router_recovered event of router.actor in 0.01 s; 2 came: router_lost (router.actor), "
        "router_recovered (router.ref)"
    )
    for i in range(13):
        log.emit("engine_restarting", f"actor.regular.{i}", "again")
    with pytest.raises(TimeoutError) as many:
        log.wait_for("router_recovered", subject="router.actor", since=since, timeout_s=0.01)
    message = str(many.value)
    assert message.startswith("no router_recovered event of router.actor in 0.01 s; 15 came (the last 12: ")
    assert message.endswith("engine_restarting (actor.regular.12))")
    assert "actor.regular.0)" not in message and "router_lost" not in message  # the first 3 left out
