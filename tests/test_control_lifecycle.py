"""The control handle across the deployment's own life (stand-in engines, real sglang-routers): an operation in
flight when the deployment stops raises at once instead of waiting for a slow engine; one called after the
stop is refused (and starts nothing); an engine killed and healed while an operation is out on it ends up in
the state the operation left the others in.

Every deployment here is checked to leave nothing behind (``leak_check``)."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.serving.errors import DeploymentStoppedError
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import REPO, LeakTracker, compose, launch_overrides
from tests.test_external_engines_live import judge
from tests.test_standin import Proc, spawn, start_standin, wait_http  # noqa: F401  (the spawn fixture)

#: Quick supervision (as in test_supervision.py).
FAST = [
    "sglang_deploy.supervision.health_interval_s=0.3",
    "sglang_deploy.supervision.health_timeout_s=0.5",
    "sglang_deploy.supervision.restart_backoff_s=0.1",
    "sglang_deploy.supervision.kill_grace_s=0.5",
]


def control_threads() -> list[str]:
    """The deployment's serving loop (where every control operation runs), while it runs."""
    return [t.name for t in threading.enumerate() if t.name == "msp-serving" and t.is_alive()]


def stats(d: Deployment, engine: str) -> dict:
    (e,) = [e for e in d.engines() if e.id == engine]
    return httpx.get(e.url + "/stand_in/stats", timeout=10).json()


def test_an_operation_in_flight_on_a_slow_engine_raises_at_once_when_the_deployment_stops(
    tmp_path: Path,
    spawn: Callable[..., Proc],
    leak_check: LeakTracker,
) -> None:
    """An external engine that takes an hour per control call: the deployment stops (from another thread)
    while a call with a 50-minute deadline is out. The caller, and a background call, raise that the deployment
    stopped, before the engine answered and long before their deadline (before: the caller hung for good, its
    loop stopped under it)."""
    outside = start_standin(spawn, env={"MSP_STANDIN_CONTROL_LATENCY_S": "3600"})
    wait_http(outside)
    raised: list[BaseException] = []
    with launch_from_config(compose(*judge(outside.url)), log_dir=tmp_path / "logs") as d:

        def caller() -> None:
            try:
                d.control.pause_generation(model="judge", timeout_s=3000)
            except BaseException as exc:
                raised.append(exc)

        blocked = threading.Thread(target=caller)
        blocked.start()
        background = d.control.background.continue_generation(model="judge", timeout_s=3000)
        wait_until(lambda: len(httpx.get(outside.url + "/stand_in/stats", timeout=10).json()["control_calls"]) == 2,
                   60, "both calls at the engine")  # fmt: skip
        assert blocked.is_alive() and not background.done()  # both wait for the slow engine
        stopper = threading.Thread(target=d.stop)
        stopper.start()
        blocked.join(timeout=120)  # an upper bound on nothing: the caller's deadline is 50 minutes away
        assert not blocked.is_alive(), "the caller still waits after the deployment stopped"
        with pytest.raises(DeploymentStoppedError, match="while continue_generation was in flight"):
            background.result(timeout=120)
        stopper.join(timeout=120)
        # Raised before the engine answered: it still holds both calls (and has not paused).
        engine = httpx.get(outside.url + "/stand_in/stats", timeout=10).json()
        assert engine["paused"] is None and len(engine["control_calls"]) == 2
    (error,) = raised
    assert isinstance(error, DeploymentStoppedError)
    assert str(error) == (
        "the deployment was stopped while pause_generation was in flight: its engines are no longer driven"
    )
    assert control_threads() == []
    assert outside.popen.poll() is None  # the external engine is left running


def test_operations_after_the_stop_are_refused_and_start_nothing(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    with launch_from_config(compose("sglang.actor.regular.num_gpus=2"), log_dir=tmp_path / "logs") as d:
        d.control.flush_cache()
        assert len(control_threads()) == 1
    assert d.state().status == "stopped" and control_threads() == []
    for operation, args in (
        ("pause_generation", ()),
        ("update_weights_from_disk", ("/ckpt/step2",)),
        ("offload", ()),
        ("query", ("/model_info",)),
    ):
        with pytest.raises(DeploymentStoppedError, match="the deployment was stopped"):
            getattr(d.control, operation)(*args)
    with pytest.raises(DeploymentStoppedError, match=r"stopped before flush_cache was sent"):
        d.control.background.flush_cache()
    with pytest.raises(DeploymentStoppedError, match="control operations no longer reach its engines"):
        d.control.weight_update_group("127.0.0.1", 29500)
    with pytest.raises(DeploymentStoppedError):  # the coroutines too, on any loop
        asyncio.run(d.async_control.pause_generation())
    assert control_threads() == []  # no loop was started again


def test_an_async_operation_in_flight_when_the_deployment_stops_raises_and_records_nothing(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    # The coroutine runs on the caller's own loop, which stop() leaves alone: when its calls come back (the
    # engines are gone by then) it says the deployment stopped, and the state it would have recorded is not.
    cfg = compose("sglang.actor.regular.num_gpus=2", "sglang_deploy.standin.control_latency_s=3")
    out: dict[str, BaseException] = {}
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:

        def caller() -> None:
            try:
                asyncio.run(d.async_control.pause_generation("in_place", timeout_s=10))
            except BaseException as exc:  # what the trainer would see
                out["exc"] = exc

        thread = threading.Thread(target=caller)
        thread.start()
        time.sleep(0.5)  # the calls are out (each engine answers after 3 s)
        d.stop()
        thread.join(15)
        assert not thread.is_alive()
    assert isinstance(out.get("exc"), DeploymentStoppedError), out
    assert [d.ledger.desired(e.id).paused for e in d.engines()] == [None, None]


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def engine_pid(d: Deployment, engine: str) -> int:
    return d.fleet.engine(engine).processes[0].pid  # type: ignore[attr-defined]


def test_an_engine_replaced_while_an_operation_is_out_on_it_is_caught_up_not_failed(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """Each control call takes 4 s; engine 0 is killed 0.5 s into a pause and is back (restarted, its replay
    read before the pause was recorded) before the other engine answers. Its failed reply came from the
    process that is gone: the operation is sent to its replacement, and it ends up paused like the other one
    (before: ControlError naming it, and the replacement left generating)."""
    cfg = compose("sglang.actor.regular.num_gpus=2", *FAST, "sglang_deploy.standin.control_latency_s=4")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        since = len(d.events())
        killer = threading.Timer(0.5, os.kill, (engine_pid(d, "actor.regular.0"), signal.SIGKILL))
        killer.start()
        result = d.control.pause_generation("in_place")  # raises ControlError if an engine failed
        killer.join()
        assert result.ok and sorted([*result.engines, *result.deferred]) == [
            "actor.regular.0",
            "actor.regular.1",
        ]
        d.wait_for_event("engine_recovered", subject="actor.regular.0", since=since, timeout_s=60)
        assert [e.restarts for e in d.engines()] == [1, 0]
        assert [stats(d, e)["paused"] for e in ("actor.regular.0", "actor.regular.1")] == ["in_place"] * 2


def replayed(d: Deployment, engine: str) -> bool:
    """Has the (restarted) engine received the replayed pause (recorded as it arrives, before it answers)?"""
    try:
        calls = stats(d, engine)["control_calls"]
    except httpx.HTTPError:
        return False
    return any(path == "/pause_generation" for path, _body in calls)


def test_a_slow_replay_blocks_neither_other_operations_nor_loss_detection(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """The restarted actor engine gets the pause replayed (4 s per control call). Meanwhile an operation on
    the other model ends on its own 1 s deadline before the replay is done, and the other model's engine,
    killed, is noticed lost while the replay is still out (before: both waited for the replay, which held
    the control state's lock: the 1 s deadline returned after 7.2 s)."""
    cfg = compose(
        "sglang.actor.regular.num_gpus=1",
        "+sglang_model@sglang.ref=base",
        "sglang.ref.regular.num_gpus=1",
        "sglang.ref.model_path=/ref",
        *FAST,
        "sglang_deploy.standin.control_latency_s=4",
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        d.control.pause_generation(model="actor", timeout_s=30)  # accepted: in the ledger, replayed later
        since = len(d.events())
        os.kill(engine_pid(d, "actor.regular.0"), signal.SIGKILL)
        d.wait_for_event("engine_lost", subject="actor.regular.0", since=since, timeout_s=60)
        wait_until(lambda: replayed(d, "actor.regular.0"), 60, "the restarted engine's replay")
        result = d.control.continue_generation(model="ref", timeout_s=1, check=False)
        assert [r.error for r in result.failed] == ["no answer within 1 s"]
        assert d.engines()[0].state == "catching_up"  # the replay is still out: the deadline did not wait
        os.kill(engine_pid(d, "ref.regular.0"), signal.SIGKILL)
        lost = d.wait_for_event("engine_lost", subject="ref.regular.0", since=since, timeout_s=60)
        recovered = d.wait_for_event("engine_recovered", subject="actor.regular.0", since=since, timeout_s=60)
        assert lost.monotonic < recovered.monotonic  # noticed while the replay was out
        assert stats(d, "actor.regular.0")["paused"] == "retract"


#: A launch whose engine 0 is killed after a pause was remembered; argv[1]: JSON overrides, argv[2]: log dir.
#: Prints JSON lines: ``up`` (processes, ports, engine URLs), then waits for a signal.
REPLAY_SCRIPT = r"""
import json, os, signal, sys, time
from pathlib import Path
from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.config.compose import compose_config

with launch_from_config(compose_config(json.loads(sys.argv[1])), log_dir=Path(sys.argv[2])) as d:
    d.control.pause_generation(timeout_s=120)  # accepted (each control call takes 20 s): it is replayed
    launch = d.prepared.launch
    print(json.dumps({
        "processes": [{"pid": p.pid, "name": p.name, "marker": p.argv[2]} for p in d.processes()],
        "ports": [e.port for e in launch.engines] + [p for r in launch.routers for p in (r.spec.port, r.spec.prometheus_port)],
        "urls": [e.url for e in d.engines()],
    }), flush=True)
    os.kill(d.fleet.engines()[0].processes[0].pid, signal.SIGKILL)
    while True:
        time.sleep(0.1)
"""


def test_sigterm_during_a_slow_replay_stops_everything_without_waiting_for_it(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """The restarted engine's replay (a pause, 20 s per control call here) is in flight when the launcher
    gets SIGTERM: it ends without waiting for it (the engine is stopped with the pause unanswered), nothing
    left (before: 30 s more, the teardown waiting for the recovery thread before it stopped the engine that
    thread waited for)."""
    script = tmp_path / "replay.py"
    script.write_text(REPLAY_SCRIPT)
    overrides = launch_overrides(
        "sglang.actor.regular.num_gpus=2", *FAST, "sglang_deploy.standin.control_latency_s=20"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with (tmp_path / "out").open("wb") as out, (tmp_path / "err").open("wb") as err:
        child = subprocess.Popen(
            [sys.executable, str(script), json.dumps(overrides), str(tmp_path / "logs")],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        wait_until(lambda: (tmp_path / "out").read_text().strip() != "" or child.poll() is not None, 60, "up")
        up = json.loads((tmp_path / "out").read_text().splitlines()[0])
        for process in up["processes"]:
            leak_check.add_process(process["pid"], process["name"], process["marker"])
        leak_check.add_ports(up["ports"])
        url = up["urls"][0]

        def replay_in_flight() -> bool:
            try:
                answer = httpx.get(url + "/stand_in/stats", timeout=2).json()
            except httpx.HTTPError:
                return False
            return any(path == "/pause_generation" for path, _body in answer["control_calls"])

        wait_until(replay_in_flight, 60, "the restarted engine's replay")
        pid = httpx.get(url + "/server_info", timeout=5).json()["pid"]
        leak_check.add_process(pid, "actor.regular.0 (restarted)", "miles_sglang_plugin.standin")
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
    assert code == -signal.SIGTERM, (tmp_path / "err").read_text()[-3000:]
    # The restarted engine was stopped with the replayed pause still out (20 s from its answer): the
    # teardown did not wait for the replay.
    log = (tmp_path / "logs" / "actor.regular.0.log").read_text()
    assert "stopping: signal received; control calls unanswered: /pause_generation" in log, log[-3000:]
    leak_check.assert_nothing_left(wait_s=10.0)


def test_a_close_from_the_serving_loop_itself_still_ends_every_other_operation() -> None:
    """Closing the loop from one of its own coroutines: the others must still end (cancelled, their callers
    told), not stay pending once the loop stops; then nothing more runs there."""
    from miles_sglang_plugin.serving.reconciler import ServingLoop

    closed_client: list[bool] = []
    serving = ServingLoop()
    serving.start()

    async def slow() -> None:
        await asyncio.sleep(30)

    async def before() -> None:
        closed_client.append(True)

    async def closer() -> None:
        serving.close(before)

    waiting = serving.submit(slow())
    serving.submit(closer())
    with pytest.raises(concurrent.futures.CancelledError):
        waiting.result(timeout=5)
    wait_until(lambda: not control_threads(), 60, "the serving loop's thread ends")
    assert closed_client == [True]
    coro = slow()
    with pytest.raises(RuntimeError, match="the serving loop is closed"):
        serving.submit(coro)


def _served_and_received(url: str, route: str) -> tuple[int, int]:
    stats = httpx.get(url + "/stand_in/stats", timeout=10).json()
    return stats["requests_served"].get(route, 0), stats["requests_received"].get(route, 0)


def _generate_in_background(url: str, tokens: int) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    out: dict[str, httpx.Response] = {}
    body = {"text": "a long answer", "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    thread = threading.Thread(
        target=lambda: out.update(answer=httpx.post(url + "/generate", json=body, timeout=120)), daemon=True
    )
    thread.start()
    return thread, out


def _running_line(url: str) -> str:
    text = httpx.get(url + "/metrics", timeout=10).text
    return next((line for line in text.splitlines() if line.startswith("sglang:num_running_reqs{")), "")


def test_a_flush_is_asked_again_while_a_request_runs_and_gives_up_at_its_deadline(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """SGLang refuses ``/flush_cache`` (400) until its scheduler is idle, also for a moment after the last answer
    went out; Miles polls it until 200. The control handle asks again while the deadline allows, and past it
    says the engine stayed busy. (The stand-in paced at 0.05 s a decode step: 60 tokens run about 3 s.)"""
    cfg = compose(
        "sglang.actor.regular.num_gpus=1",
        "sglang_deploy.standin.speed.enabled=true",
        "sglang_deploy.standin.speed.decode_step_s=0.05",
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as deployment:
        (url,) = [e.url for e in deployment.engines()]
        _flush_while_running(deployment, url)


def _flush_while_running(deployment: Deployment, url: str) -> None:
    served, received = _served_and_received(url, "/flush_cache")
    thread, out = _generate_in_background(url, 60)
    wait_until(lambda: _running_line(url).endswith(" 1"), 60, "the request runs on the engine")
    refused = httpx.post(url + "/flush_cache", timeout=10)
    assert (refused.status_code, refused.text) == (400, "Flush cache failed.\n")
    flushed = deployment.control.flush_cache()
    assert [(r.engine, r.status) for r in flushed.replies] == [("actor.regular.0", 200)]
    thread.join(timeout=120)
    assert out["answer"].status_code == 200 and len(out["answer"].json()["output_ids"]) == 60
    now_served, now_received = _served_and_received(url, "/flush_cache")
    assert now_served == served + 1  # one success, after the refusals
    assert now_received >= received + 3  # the refusal above, at least one the handle met, the success

    # still running when a 0.5 s deadline passes
    thread, out = _generate_in_background(url, 60)
    wait_until(lambda: _running_line(url).endswith(" 1"), 60, "the request runs on the engine")
    gave_up = deployment.control.flush_cache(timeout_s=0.5, check=False)
    (reply,) = gave_up.replies
    assert not gave_up.ok and (reply.engine, reply.status) == ("actor.regular.0", 400)
    assert reply.error is not None and reply.error.startswith("still busy after ")
    assert reply.error.endswith(" tries in 0.5 s: HTTP 400: Flush cache failed.\n")
    thread.join(timeout=120)
    assert out["answer"].status_code == 200
    assert deployment.control.flush_cache().ok
