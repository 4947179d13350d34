"""The reconciler itself (not only its pure policy) against a fake backend, a fake HTTP pool and a virtual clock,
as Ray Serve tests its deployment state with mock replicas (issue 36): a real :class:`Reconciler` runs its loop
and its work actions (probes, spawns, cleanups, replays, registrations, drains, router restarts) on the fakes of
:mod:`tests.reconciler_fakes`, in virtual time, so that seconds of backoff and timeouts pass at once and every
run is the same whatever the machine's load.

The settings are the stand-in deployment's (``tests.launch_helpers.compose``): ``launch.poll_interval_s`` 0.2,
``supervision``: health every 1 s with a 2 s timeout, ``failure_threshold`` 2, ``max_restarts`` 3,
``restart_backoff_s`` 1, ``kill_grace_s`` 1; a fake engine answers ``/health_generate`` 0.5 s after its start.
Every expected value below is worked out from those by hand."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from miles_sglang_plugin.app.hydra_edge import resolve_config
from miles_sglang_plugin.config.reading import deploy_settings_from_config
from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.rendering.ports import PortAssignment
from miles_sglang_plugin.rendering.prepared import PreparedDeployment, prepare_deployment
from miles_sglang_plugin.serving import elastic
from miles_sglang_plugin.serving.changes import Converging
from miles_sglang_plugin.serving.fleet import EngineState, RouterState, engine_rows
from miles_sglang_plugin.serving.ledger import Weights
from miles_sglang_plugin.serving.operations import disk_weights_body, disk_weights_effect
from miles_sglang_plugin.serving.policy import RESTART_POLL_S
from tests.launch_helpers import compose
from tests.reconciler_fakes import Entry, Harness

S, R = EngineState, RouterState
PORT_BASE = 21000  # nothing listens: no port is probed, no socket is opened
REGULAR = ("sglang.actor.num_gpus_per_engine=1", "sglang.actor.regular.num_gpus=2")
PD = ("sglang=pd", "sglang.actor.num_gpus_per_engine=1")
#: PD with GPU 1 given to decode instead of prefill: prefill.1 goes, decode.1 comes on its GPU.
PD_BEFORE = (*PD, "sglang.actor.prefill.num_gpus=2", "sglang.actor.decode.num_gpus=1")
PD_AFTER = (*PD, "sglang.actor.prefill.num_gpus=1", "sglang.actor.decode.num_gpus=2")
E0, E1 = "actor.regular.0", "actor.regular.1"
#: A weight update the engines accepted, and the replay a fresh process gets for it (its body with
#: ``abort_all_requests`` false: a replay never aborts what the engine serves).
STEP7 = disk_weights_body("/ckpt/step7", weight_version="7")
STEP7_REPLAY = {
    "model_path": "/ckpt/step7",
    "flush_cache": True,
    "weight_version": "7",
    "abort_all_requests": False,
}


@functools.cache
def _resolved(overrides: tuple[str, ...]) -> tuple[Any, SGLangDeployConf]:
    cfg = compose(*overrides, port_base=PORT_BASE)
    return resolve_config(cfg), deploy_settings_from_config(cfg)


def prepared_of(*overrides: str) -> PreparedDeployment:
    plan, settings = _resolved(tuple(overrides))
    return prepare_deployment(plan, settings)


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    """``make(*overrides, **supervision)``: a harness of that deployment, with these supervision settings."""
    made: list[Harness] = []

    def build(*overrides: str, **supervision: Any) -> Harness:
        prepared = prepared_of(*(overrides or REGULAR))
        settings = dataclasses.replace(
            prepared.settings, supervision=dataclasses.replace(prepared.settings.supervision, **supervision)
        )
        harness = Harness(prepared, settings, tmp_path)
        harness.patch_router_processes(monkeypatch)
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.close()
    for harness in made:
        harness.check_no_surprises()


def start_up(h: Harness) -> float:
    h.start()
    ready_at = h.run_until(h.reconciler.startup.done, within=10)
    assert h.reconciler.startup.result() is None
    return ready_at


def record_step7(h: Harness) -> None:
    """What the control handle records once every engine accepted ``update_weights_from_disk(step7)``."""
    engines = [row.id for row in h.fleet.engines()]
    h.ledger.record(
        disk_weights_effect(dict(STEP7)),
        sent=dict.fromkeys(engines, 0),
        accepted=engines,
        deferred=[],
        generations=dict.fromkeys(engines, 0),
    )


def steps(entries: Sequence[Entry]) -> list[tuple[str, Any]]:
    """(what, status) of each entry, the serving engine's own /health polls left out."""
    return [(e.what, e.status) for e in entries if e.what != "GET /health"]


def url(h: Harness, engine: str) -> str:
    return h.fleet.engine(engine).url


# ------------------------------------------------------------------------------------------------- start-up
def test_start_up_polls_each_engine_until_it_answers_then_registers_it_and_the_router_becomes_ready(
    make: Callable[..., Harness],
) -> None:
    h = make()
    ready_at = start_up(h)
    assert h.reconciler.phase == "serving"
    assert [(row.id, row.state, row.registered) for row in h.fleet.engines()] == [
        (E0, S.SERVING, True),
        (E1, S.SERVING, True),
    ]
    router = h.fleet.router("actor")
    assert router is not None and router.state is R.READY
    for engine in (E0, E1):
        # spawned at 0; polled every 0.2 s from 0 on: 0, 0.2 and 0.4 are before its warm-up ends (0.5), 0.6 is
        # after; then registered with the router (which lists it healthy at once)
        trace = h.trace.of(engine)
        assert steps(trace) == [
            ("start", None),
            ("GET /health_generate", 503),
            ("GET /health_generate", 503),
            ("GET /health_generate", 503),
            ("GET /health_generate", 200),
            ("registered", None),
        ]
        assert [e.t for e in trace[:5]] == pytest.approx([0.0, 0.0, 0.2, 0.4, 0.6], abs=0.02)
        assert trace[5].t == trace[4].t  # registered as soon as it answered: nothing to replay
        assert h.fleet.engine(engine).healthy_at == trace[4].t
    assert ready_at == pytest.approx(0.6, abs=0.1)
    # the router: started with no worker, alive at its first poll, ready once it lists both engines
    router_trace = h.trace.of("router.actor")
    assert [(e.what, e.status) for e in router_trace[:2]] == [("start", None), ("GET /liveness", 200)]
    assert router_trace[0].body == []
    registered = max(h.trace.first(e, "registered").seq for e in (E0, E1))
    assert any(e.what == "GET /workers" and e.seq > registered for e in router_trace)
    assert h.router().listed() == sorted([url(h, E0), url(h, E1)])
    assert h.events.kinds() == []  # a plain start-up tells no event
    assert h.backend.stops == []


def test_an_engine_that_exits_while_serving_is_cleaned_up_restarted_replayed_and_back(
    make: Callable[..., Harness],
) -> None:
    h = make(restart_backoff_s=5.0)
    start_up(h)
    record_step7(h)
    # -- first loss: restart 1 of 3 waits for nothing (backoff(1) = 0)
    mark = h.trace.mark
    killed = h.backend.kill(E0)
    killed_at = h.clock()
    h.run_until(lambda: "engine_recovered" in h.events.kinds(E0), within=10)
    assert h.events.kinds(E0) == ["engine_lost", "engine_restarting", "engine_recovered"]
    _t, lost, details = h.events.one("engine_lost", E0)
    reason = f"process {E0} exited with code -9 (fake {E0} #1)"
    assert lost == f"engine {E0} ({url(h, E0)}) lost: {reason}" and details == {"reason": reason}
    assert h.events.one("engine_restarting", E0)[2] == {"attempt": 1, "delay_s": 0.0}
    # cleanup: its one process stopped with the kill grace (1 s); it left its router before the new one starts
    assert h.backend.stops == [(killed_at, ((E0, 1),), 1.0)]
    trace = h.trace.of(E0, since=mark)
    whats = [what for what, _status in steps(trace)]
    start = whats.index("start")
    assert sorted(whats[:start]) == ["deregistered", "killed", "stop"]
    assert trace[0].what == "killed" and h.trace.first(E0, "start", since=mark).t == killed_at
    polls = [status for what, status in steps(trace)[start + 1 :] if what == "GET /health_generate"]
    assert polls[-1] == 200 and set(polls[:-1]) == {503}
    replay = h.trace.first(E0, "POST /update_weights_from_disk", since=mark)
    assert replay.body == STEP7_REPLAY
    assert whats[-3:] == ["GET /health_generate", "POST /update_weights_from_disk", "registered"]
    # polled every 50 ms while it starts: 0.5 s of warm-up
    answered = next(e for e in trace if e.what == "GET /health_generate" and e.status == 200)
    assert answered.t - killed_at == pytest.approx(0.5, abs=RESTART_POLL_S + 0.01)
    assert answered.t - killed_at >= 0.5
    assert h.ledger.has(E0).weights == Weights.from_disk(
        {k: v for k, v in STEP7.items() if k != "abort_all_requests"}
    )
    assert h.ledger.has(E0).weight_version == "7"
    row = h.fleet.engine(E0)
    assert (row.state, row.restarts, row.registered, row.processes) == (
        S.SERVING,
        1,
        True,
        (h.backend.process(E0),),
    )
    assert killed.serial == 1 and h.backend.process(E0).serial == 2
    assert h.events.one("engine_recovered", E0)[2]["restarts"] == 1
    assert h.router().listed() == sorted([url(h, E0), url(h, E1)])
    # -- second loss: restart 2 of 3 waits backoff(2) = restart_backoff_s = 5 s, not a moment less
    mark = h.trace.mark
    h.backend.kill(E0)
    killed_at = h.clock()
    h.run_until(lambda: h.events.kinds(E0).count("engine_recovered") == 2, within=20)
    restarting = [(t, m, d) for t, k, _s, m, d in h.events.timeline if k == "engine_restarting"][-1]
    assert restarting[2] == {"attempt": 2, "delay_s": 5.0}
    assert restarting[1].startswith(f"restarting engine {E0} in 5 s (restart 2 of 3)")
    restarted_at = h.trace.first(E0, "start", since=mark).t
    assert restarted_at - killed_at >= 5.0
    assert restarted_at - killed_at == pytest.approx(5.0, abs=0.01)
    assert h.trace.first(E0, "POST /update_weights_from_disk", since=mark).body == STEP7_REPLAY
    assert (h.fleet.engine(E0).restarts, h.fleet.engine(E0).state) == (2, S.SERVING)
    # the other engine was never touched: only polled
    assert {e.what for e in h.trace.of(E1) if e.seq > h.trace.first(E1, "registered").seq} == {"GET /health"}
    assert h.failures == [] and h.reconciler.phase == "serving"


def test_restarts_used_up_fail_the_deployment_naming_the_engine(make: Callable[..., Harness]) -> None:
    h = make(max_restarts=1)
    start_up(h)
    h.backend.kill(E0)
    h.run_until(lambda: "engine_recovered" in h.events.kinds(E0), within=10)
    mark = h.trace.mark
    h.backend.kill(E0)
    h.run_until(lambda: h.reconciler.failure is not None, within=10)
    assert h.failed.wait(30)  # on_fail runs on a thread of its own
    expected = (
        f"engine {E0} ({url(h, E0)}) lost: process {E0} exited with code -9 (fake {E0} #2); "
        "its 1 restarts (supervision.max_restarts) are used up"
    )
    assert h.failures == [expected]
    assert h.reconciler.failure == expected and h.reconciler.phase == "stopping"
    assert h.events.kinds() == [
        "engine_lost",
        "engine_restarting",
        "engine_recovered",
        "engine_lost",
        "deployment_failed",
    ]
    assert h.events.one("deployment_failed")[2] == {"reason": expected}
    h.run_until(lambda: h.task is not None and h.task.done(), within=5)  # the loop ended
    assert "start" not in h.trace.whats(E0, since=mark)  # no third process
    assert h.reconciler.startup.result() is None  # start-up itself had succeeded


def test_an_engine_whose_health_polls_time_out_threshold_times_is_lost_and_restarted(
    make: Callable[..., Harness],
) -> None:
    h = make()
    start_up(h)
    mark = h.trace.mark
    h.backend.process(E1).hung = True
    h.run_until(lambda: "engine_lost" in h.events.kinds(E1), within=10)
    lost_at, message, details = h.events.one("engine_lost", E1)
    # polled every 1 s; each hung poll takes its whole 2 s timeout, and the next one goes out at once (1 s
    # have passed): the second timeout in a row (failure_threshold 2) is the loss, 4 s after the first poll
    polls = [e for e in h.trace.of(E1, since=mark) if e.what == "GET /health"]
    assert [e.status for e in polls] == ["timeout", "timeout"]
    assert polls[1].t - polls[0].t == pytest.approx(2.0, abs=1e-9)
    assert lost_at - polls[0].t == pytest.approx(4.0, abs=1e-9)
    reason = "no answer to /health within 2 s (2 polls in a row)"
    assert message == f"engine {E1} ({url(h, E1)}) lost: {reason}" and details == {"reason": reason}
    # the hung process is stopped, a fresh one answers
    h.run_until(lambda: "engine_recovered" in h.events.kinds(E1), within=10)
    assert h.events.kinds(E1) == ["engine_lost", "engine_restarting", "engine_recovered"]
    assert h.backend.stops == [(lost_at, ((E1, 1),), 1.0)]
    assert (h.fleet.engine(E1).state, h.fleet.engine(E1).restarts) == (S.SERVING, 1)
    assert h.events.kinds(E0) == []


def test_a_router_killed_while_a_poll_of_it_is_out_is_restarted_polled_and_ready_again(
    make: Callable[..., Harness],
) -> None:
    """The wedge of issue 36: the /liveness poll out when the router died comes back only after the restart (it
    is stale then); the new process must be polled, list its workers and be ready all the same."""
    h = make()
    start_up(h)
    gate = h.router().hold_next("/liveness", h.loop)
    h.run_until(lambda: bool(h.router().held), within=5)
    router = h.fleet.router("actor")
    assert router is not None and "probe" in router.pending
    mark = h.trace.mark
    h.kill_router()
    h.run_until(lambda: "router_recovered" in h.events.kinds("router.actor"), within=10)
    assert not gate.done()  # the old poll is still out
    assert h.events.kinds() == ["router_lost", "router_recovered"]
    whats = h.trace.whats("router.actor", since=mark)
    assert whats[:3] == ["killed", "stop", "start"]
    # restarted with the engines that served, polled, its list read: ready
    assert h.router().started_with[-1] == [url(h, E0), url(h, E1)]
    assert "GET /liveness" in whats[3:] and "GET /workers" in whats[whats.index("GET /liveness") :]
    router = h.fleet.router("actor")
    assert router is not None and (router.state, router.restarts) == (R.READY, 1)
    assert [row.registered for row in h.fleet.engines()] == [True, True]
    # the stale answer comes back (a failure): dropped; the router goes on being polled and stays ready
    released = h.trace.mark
    gate.set_result(None)
    h.advance(3.0)
    after = [e for e in h.trace.of("router.actor", since=released) if e.what == "GET /liveness"]
    assert len(after) >= 2 and {e.status for e in after} == {200}
    router = h.fleet.router("actor")
    assert router is not None and (router.state, router.health_failures, router.restarts) == (R.READY, 0, 1)
    assert h.events.kinds() == ["router_lost", "router_recovered"]
    assert [e for e in h.trace.entries if e.what in ("start", "stop") and e.subject.startswith("actor.")] == [
        e for e in h.trace.entries[:mark] if e.what in ("start", "stop") and e.subject.startswith("actor.")
    ]  # no engine was stopped or started for it


# ------------------------------------------------------------------------------------------------- changes
def _ports_from(first: int) -> Callable[[Mapping[int, Sequence[Sequence[int]]]], dict[int, list[list[int]]]]:
    """Engine ports of a change's new processes, consecutive from ``first`` (as a backend that looks them up on
    the nodes would hand them out)."""

    def find(requests: Mapping[int, Sequence[Sequence[int]]]) -> dict[int, list[list[int]]]:
        port = first
        found: dict[int, list[list[int]]] = {}
        for node, runs_of in requests.items():
            found[node] = []
            for runs in runs_of:
                starts = []
                for count in runs:
                    starts.append(port)
                    port += count
                found[node].append(starts)
        return found

    return find


def begin_change(h: Harness, *overrides: str) -> tuple[Converging, list[Converging]]:
    """What ``Deployment.apply`` and ``_begin_change`` do with the config of ``overrides``: the change planned and
    rendered, handed to the reconcile loop. Also the changes ``on_change_done`` was called with."""
    plan, settings = _resolved(tuple(overrides))

    def render(new_plan: Any, ports: PortAssignment) -> PreparedDeployment:
        return prepare_deployment(
            new_plan, settings, fixed_ports=ports, find_node_ports=_ports_from(PORT_BASE + 1000)
        )

    change = elastic.plan_change(h.prepared, plan, render, settings=settings)
    converging = Converging(
        change=change,
        before=h.prepared,
        fleet=h.fleet,
        ledger=h.ledger,
        new_rows={row.id: row for row in engine_rows(change.prepared)},
        started_at=h.reconciler.clock(),
        admit=h.reconciler.admit,
    )
    finished: list[Converging] = []

    async def change_done(done: Converging) -> None:
        finished.append(done)

    h.reconciler.on_change_done = change_done
    h.reconciler.begin_change(converging)
    return converging, finished


def test_a_change_drains_and_stops_the_removed_engine_before_the_added_one_starts_on_its_gpu(
    make: Callable[..., Harness],
) -> None:
    h = make(*PD_BEFORE)
    start_up(h)
    record_step7(h)
    assert [row.id for row in h.fleet.engines()] == ["actor.prefill.0", "actor.prefill.1", "actor.decode.0"]
    h.backend.running_requests["actor.prefill.1"] = [2, 0]  # two requests left at the first look, then none
    removed_process = h.backend.process("actor.prefill.1")
    mark = h.trace.mark
    converging, finished = begin_change(h, *PD_AFTER)
    assert converging.change.changes == {
        "actor.prefill.0": "kept",
        "actor.decode.0": "kept",
        "actor.decode.1": "started",
        "actor.prefill.1": "stopped",
    }
    assert h.fleet.engine("actor.decode.1").gpus == "1"  # the GPU prefill.1 gives up
    h.run_until(converging.finished.done, within=30)
    outcome = converging.finished.result()
    # prefill.1: out of its router, drained (2 requests left, then none 0.1 s later), stopped, dropped
    removed = h.trace.of("actor.prefill.1", since=mark)
    assert steps(removed) == [
        ("deregistered", None),
        ("GET /metrics", 200),
        ("GET /metrics", 200),
        ("stop", None),
    ]
    assert removed[2].t - removed[1].t == pytest.approx(2 * RESTART_POLL_S, abs=0.01)
    stopped = h.trace.first("actor.prefill.1", "stop", since=mark)
    # decode.1: started only once prefill.1 stopped, given the deployment's weights, registered
    added = h.trace.of("actor.decode.1")
    assert added[0].what == "start" and added[0].seq > stopped.seq and added[0].t == stopped.t
    whats = [what for what, _status in steps(added)]
    assert set(whats[1:-2]) == {"GET /health_generate"}
    assert whats[-2:] == ["POST /update_weights_from_disk", "registered"]
    assert h.trace.first("actor.decode.1", "POST /update_weights_from_disk").body == STEP7_REPLAY
    # the change: both done, at the stop and once decode.1 served (its warm-up 0.5 s later at least)
    assert set(outcome.done_at) == {"actor.prefill.1", "actor.decode.1"}
    assert outcome.done_at["actor.prefill.1"] == stopped.t
    assert outcome.done_at["actor.decode.1"] - stopped.t >= 0.5
    assert outcome.given_up == () and outcome.removed_processes == (removed_process,)
    assert finished == [converging]
    assert [row.id for row in h.fleet.engines()] == ["actor.prefill.0", "actor.decode.0", "actor.decode.1"]
    assert h.fleet.engine("actor.decode.1").state is S.SERVING
    assert h.events.kinds() == ["engine_removed", "engine_added"]
    assert h.router().listed() == sorted(
        url(h, e) for e in ("actor.prefill.0", "actor.decode.0", "actor.decode.1")
    )
    for kept in ("actor.prefill.0", "actor.decode.0"):  # left alone: only polled
        assert {e.what for e in h.trace.of(kept, since=mark)} <= {"GET /health"}
    assert h.backend.stops == [(stopped.t, (("actor.prefill.1", 1),), 1.0)]


def test_an_added_engine_that_cannot_start_is_given_up_and_the_deployment_serves_on(
    make: Callable[..., Harness],
) -> None:
    h = make(*PD_BEFORE, max_restarts=1)
    start_up(h)
    h.backend.failing.add("actor.decode.1")
    converging, _finished = begin_change(h, *PD_AFTER)
    h.run_until(converging.finished.done, within=30)
    outcome = converging.finished.result()
    assert outcome.given_up == ("actor.decode.1",)
    assert set(outcome.done_at) == {"actor.prefill.1", "actor.decode.1"}
    # its first start fails; restart 1 of 1 (no backoff) fails too: given up, alone
    assert h.trace.whats("actor.decode.1") == ["start", "start"]
    problem = "it could not be started: fake: actor.decode.1 cannot be started"
    assert [(k, m) for _t, k, s, m, _d in h.events.timeline if s == "actor.decode.1"] == [
        ("engine_restart_failed", f"the start of added engine actor.decode.1 failed: {problem}"),
        ("engine_restarting", h.events.one("engine_restarting", "actor.decode.1")[1]),
        ("engine_restart_failed", f"restart 1 of engine actor.decode.1 failed: {problem}"),
        ("engine_given_up", h.events.one("engine_given_up", "actor.decode.1")[1]),
    ]
    assert h.events.one("engine_given_up", "actor.decode.1")[2] == {"reason": problem}
    assert h.events.one("engine_restarting", "actor.decode.1")[2] == {"attempt": 1, "delay_s": 0.0}
    assert h.fleet.engine("actor.decode.1").state is S.FAILED
    assert h.failures == [] and h.reconciler.failure is None and h.reconciler.phase == "serving"
    assert [(row.id, row.state) for row in h.fleet.engines()] == [
        ("actor.prefill.0", S.SERVING),
        ("actor.decode.0", S.SERVING),
        ("actor.decode.1", S.FAILED),
    ]
    assert "deployment_failed" not in h.events.kinds()
    assert h.router().listed() == sorted(url(h, e) for e in ("actor.prefill.0", "actor.decode.0"))
