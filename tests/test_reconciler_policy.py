"""The reconciler's decisions as a pure function, with a fake clock and fake observations (the way Ray Serve
tests its deployment state with fake replicas): backoff, restart budget and its reset, the failure threshold,
the router restart limit, external engines, the catch-up gate, start-up; and the fleet's state machine.

Every number below is worked out by hand from the settings each test gives."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.backends.processes import ManagedProcess
from miles_sglang_plugin.rendering.launch_specs import RouterLaunch
from miles_sglang_plugin.rendering.router_specs import RouterLaunchSpec, WorkerRegistration
from miles_sglang_plugin.serving.errors import IllegalTransitionError
from miles_sglang_plugin.serving.fleet import (
    ENGINE_TRANSITIONS,
    EngineRow,
    EngineState,
    Fleet,
    RouterRow,
    RouterState,
)
from miles_sglang_plugin.serving.ledger import Ledger, initial_state
from miles_sglang_plugin.serving.operations import pause_effect
from miles_sglang_plugin.serving.policy import (
    Action,
    Observation,
    Policy,
    done,
    exited,
    next_wake,
    plan_actions,
    router_done,
)

S = EngineState


def engine(
    engine_id: str, *, state: EngineState = S.SERVING, external: bool = False, model: str = "actor", **kw: Any
) -> EngineRow:
    port = 20000 + sum(map(ord, engine_id)) % 5000
    url = f"http://127.0.0.1:{port}"
    row = EngineRow(
        id=engine_id,
        model=model,
        group="external" if external else "regular",
        worker_type="regular",
        url=url,
        node=None if external else 0,
        gpus="" if external else "0",
        nnodes=1,
        num_gpus=1,
        needs_offload=False,
        update_weights=True,
        serves_lora=False,
        registration=WorkerRegistration(url=url),
        external=external,
        state=state,
        registered=state is S.SERVING,
        catch_up="" if state is S.SERVING else "start",
    )
    for name, value in kw.items():
        setattr(row, name, value)
    return row


def router(model: str = "actor", state: RouterState = RouterState.READY, **kw: Any) -> RouterRow:
    spec = RouterLaunchSpec(
        model=model, host="127.0.0.1", port=30000, prometheus_port=30001, pd_disaggregation=False
    )
    process = ManagedProcess(name=f"router.{model}", argv=["router"], env={}, log_path=Path("/dev/null"))
    row = RouterRow(model=model, launch=_launch(model, spec), process=process, state=state)
    for name, value in kw.items():
        setattr(row, name, value)
    return row


def _launch(model: str, spec: RouterLaunchSpec) -> RouterLaunch:
    return RouterLaunch(model=model, spec=spec, workers=())


def world(*rows: EngineRow, routers: Sequence[RouterRow] | None = None) -> tuple[Fleet, Ledger]:
    fleet = Fleet(list(rows), list(routers) if routers is not None else [router()])
    ledger = Ledger({row.id: initial_state() for row in rows})
    return fleet, ledger


def decide(
    fleet: Fleet,
    ledger: Ledger,
    observations: Iterable[Observation] = (),
    *,
    now: float,
    policy: Policy | None = None,
    phase: str = "serving",
    deadline: float | None = None,
) -> list[Action]:
    actions = plan_actions(
        fleet, list(observations), ledger, policy or Policy(), now, phase=phase, startup_deadline=deadline
    )
    apply(fleet, actions)
    return actions


def apply(fleet: Fleet, actions: Iterable[Action]) -> None:
    """What the reconciler does with the state actions (the work actions are only looked at)."""
    for a in actions:
        if a.kind == "transition":
            fleet.transition(a.engine, a.state, **a.changes)
        elif a.kind == "update":
            fleet.update(a.engine, **a.changes)
        elif a.kind == "router_transition":
            fleet.transition_router(a.router, a.state, **a.changes)
        elif a.kind == "router_update":
            fleet.update_router(a.router, **a.changes)


def work(actions: Iterable[Action], engine_id: str | None = None) -> list[str]:
    """The work the actions start (for one engine), in order."""
    state_kinds = ("transition", "update", "emit", "router_transition", "router_update")
    return [
        a.kind for a in actions if a.kind not in state_kinds and (engine_id is None or a.engine == engine_id)
    ]


def events(actions: Iterable[Action]) -> list[tuple[str, str]]:
    return [(a.event or "", a.message) for a in actions if a.kind == "emit"]


def ends(actions: Iterable[Action]) -> list[tuple[str, str]]:
    return [(a.kind, a.message) for a in actions if a.kind in ("fail", "startup_failed", "ready")]


def lose(fleet: Fleet, ledger: Ledger, engine_id: str, *, now: float, policy: Policy) -> list[Action]:
    """The engine's process exits at ``now``."""
    row = fleet.engine(engine_id)
    return decide(
        fleet, ledger, [exited(engine_id, row.restarts, "process gone", -9)], now=now, policy=policy
    )


# ----------------------------------------------------------------------------------------------- backoff
def test_backoff_none_before_the_first_restart_then_doubling_from_the_second_capped() -> None:
    policy = Policy(restart_backoff_s=1.0, restart_backoff_max_s=30.0)
    assert [policy.backoff(n) for n in range(1, 9)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert Policy(restart_backoff_s=0.5, restart_backoff_max_s=3.0).backoff(5) == 3.0  # 0.5 * 8 = 4 -> 3


def test_a_lost_engine_is_cleaned_up_then_restarted_after_its_backoff() -> None:
    policy = Policy(max_restarts=3, restart_backoff_s=2.0, restart_budget_reset_s=600)
    # Its second restart within the budget: backoff 2 s (the first restart waited for nothing).
    fleet, ledger = world(engine("e", restarts=1, restarts_in_budget=1, recovered_at=90.0))
    actions = lose(fleet, ledger, "e", now=100.0, policy=policy)
    row = fleet.engine("e")
    assert (row.state is S.LOST and not row.registered) or row.state is S.LOST
    assert work(actions, "e") == ["cleanup", "deregister"]
    assert events(actions)[1] == (
        "engine_restarting",
        "restarting engine e in 2 s (restart 2 of 3) with its same command line, environment and GPUs (0)",
    )
    assert row.restart_at == 102.0
    # Cleaned up at once, but the backoff holds the restart until 102.
    actions = decide(
        fleet, ledger, [done("cleanup", "e", 1), done("deregister", "e", 1)], now=100.5, policy=policy
    )
    assert work(actions, "e") == []
    assert next_wake(fleet, policy, 100.5, phase="serving") == pytest.approx(1.0)  # at most 1 s between looks
    assert work(decide(fleet, ledger, now=101.9, policy=policy), "e") == []
    actions = decide(fleet, ledger, now=102.0, policy=policy)
    assert work(actions, "e") == ["spawn"]
    assert (fleet.engine("e").state, fleet.engine("e").restarts, fleet.engine("e").restarts_in_budget) == (
        S.RESTARTING,
        2,
        2,
    )


def test_the_first_restart_waits_for_nothing() -> None:
    fleet, ledger = world(engine("e"))
    lose(fleet, ledger, "e", now=10.0, policy=Policy(restart_backoff_s=5.0))
    actions = decide(fleet, ledger, [done("cleanup", "e", 0), done("deregister", "e", 0)], now=10.0)
    assert work(actions, "e") == ["spawn"]


def test_no_restart_while_its_router_still_has_it() -> None:
    """The new process must not get requests before it has its state: the restart waits for the router to
    let go of the old registration."""
    fleet, ledger = world(engine("e"))
    lose(fleet, ledger, "e", now=10.0, policy=Policy())
    assert work(decide(fleet, ledger, [done("cleanup", "e", 0)], now=10.1), "e") == []  # still registered
    assert work(decide(fleet, ledger, [done("deregister", "e", 0)], now=10.2), "e") == ["spawn"]


# ------------------------------------------------------------------------------------------------- budget
def test_restarts_used_up_fail_the_deployment() -> None:
    policy = Policy(max_restarts=2, restart_budget_reset_s=600)
    fleet, ledger = world(engine("e", restarts=2, restarts_in_budget=2, recovered_at=500.0))
    actions = lose(fleet, ledger, "e", now=1000.0, policy=policy)  # 500 s of service: not yet 600
    assert ends(actions) == [
        (
            "fail",
            "engine e (http://127.0.0.1:20101) lost: process gone; its 2 restarts (supervision.max_restarts) "
            "are used up",
        )
    ]


def test_the_budget_is_given_back_after_a_long_stretch_of_service() -> None:
    policy = Policy(max_restarts=2, restart_budget_reset_s=600, restart_backoff_s=1.0)
    fleet, ledger = world(engine("e", restarts=2, restarts_in_budget=2, recovered_at=400.0))
    actions = lose(fleet, ledger, "e", now=1000.0, policy=policy)  # 600 s of service: budget back
    assert ends(actions) == []
    assert events(actions)[1][1].startswith("restarting engine e (restart 1 of 2)")  # no backoff: restart 1
    row = fleet.engine("e")
    assert (row.restarts_in_budget, row.recovered_at, row.restart_at) == (0, None, 1000.0)


def test_a_failed_restart_does_not_reset_the_budget_again() -> None:
    """The budget is given back once per stretch of service, not at every failed attempt that follows it."""
    policy = Policy(max_restarts=1, restart_budget_reset_s=600)
    fleet, ledger = world(engine("e", restarts=4, restarts_in_budget=1, recovered_at=0.0))
    lose(fleet, ledger, "e", now=1000.0, policy=policy)  # reset: attempt 1 of 1
    decide(fleet, ledger, [done("cleanup", "e", 4), done("deregister", "e", 4)], now=1000.0, policy=policy)
    assert fleet.engine("e").state is S.RESTARTING
    actions = decide(
        fleet, ledger, [done("spawn", "e", 5, "it could not be started: boom")], now=1001.0, policy=policy
    )
    assert ends(actions) == [
        (
            "fail",
            "engine e could not be brought back after 1 restart(s) (supervision.max_restarts=1); last "
            "problem: it could not be started: boom",
        )
    ]


def test_with_max_restarts_zero_the_first_loss_fails_fast() -> None:
    fleet, ledger = world(engine("e"))
    actions = lose(fleet, ledger, "e", now=5.0, policy=Policy(max_restarts=0))
    assert ends(actions) == [
        (
            "fail",
            "engine e (http://127.0.0.1:20101) lost: process gone; supervision.max_restarts=0 (fail fast)",
        )
    ]


def test_a_restart_that_cannot_happen_where_the_plan_put_it_fails_at_once() -> None:
    fleet, ledger = world(engine("e", state=S.RESTARTING, restarts=1, lost_reason="its node left"))
    actions = decide(fleet, ledger, [done("spawn", "e", 1, "node 2 is gone", fatal=True)], now=3.0)
    assert ends(actions) == [("fail", "engine e lost (its node left) and node 2 is gone")]


def test_a_restarted_engine_that_never_answers_is_a_failed_restart() -> None:
    policy = Policy(startup_timeout_s=60, restart_backoff_s=1.0)
    fleet, ledger = world(engine("e", state=S.STARTING, restarts=1, restarts_in_budget=1, started_at=100.0))
    assert work(decide(fleet, ledger, now=160.0, policy=policy), "e") == ["probe"]  # 60 s: not over yet
    actions = decide(fleet, ledger, now=160.1, policy=policy)
    assert events(actions)[0] == (
        "engine_restart_failed",
        "restart 1 of engine e failed: it did not answer /health_generate within 60 s",
    )
    assert fleet.engine("e").state is S.LOST and fleet.engine("e").restart_at == pytest.approx(161.1)


# ---------------------------------------------------------------------------------------- health threshold
def test_failed_polls_in_a_row_make_a_loss_and_an_answer_resets_the_count() -> None:
    policy = Policy(failure_threshold=3)
    fleet, ledger = world(engine("e"))
    bad = done("probe", "e", 0, "no answer to /health within 2 s")
    for now in (1.0, 2.0):
        decide(fleet, ledger, [bad], now=now, policy=policy)
    assert fleet.engine("e").health_failures == 2 and fleet.engine("e").state is S.SERVING
    decide(fleet, ledger, [done("probe", "e", 0)], now=3.0, policy=policy)
    assert fleet.engine("e").health_failures == 0
    for now in (4.0, 5.0):
        decide(fleet, ledger, [bad], now=now, policy=policy)
    actions = decide(fleet, ledger, [bad], now=6.0, policy=policy)
    assert events(actions)[0] == (
        "engine_lost",
        "engine e (http://127.0.0.1:20101) lost: no answer to /health within 2 s (3 polls in a row)",
    )


def test_a_poll_of_an_older_process_is_stale() -> None:
    fleet, ledger = world(engine("e", restarts=2))
    decide(fleet, ledger, [exited("e", 1, "old process gone", -9)], now=1.0)
    assert fleet.engine("e").state is S.SERVING


def test_serving_engines_are_polled_every_interval_on_their_endpoint() -> None:
    policy = Policy(health_interval_s=1.0, health_timeout_s=0.5, health_endpoint="/health_generate")
    fleet, ledger = world(engine("e", probed_at=10.0), engine("f", probed_at=10.5))
    ledger.accepted("f", pause_effect("in_place"))  # f cannot generate now: polled on /health
    ledger.record(
        pause_effect("in_place"), sent={"f": 0}, accepted=["f"], deferred=[], generations={"e": 0, "f": 0}
    )
    probes = [
        (a.engine, a.path, a.timeout_s)
        for a in decide(fleet, ledger, now=11.0, policy=policy)
        if a.kind == "probe"
    ]
    assert probes == [("e", "/health_generate", 0.5)]
    assert next_wake(fleet, policy, 11.0, phase="serving") == pytest.approx(0.5)  # f is due at 11.5
    probes = [(a.engine, a.path) for a in decide(fleet, ledger, now=11.5, policy=policy) if a.kind == "probe"]
    assert probes == [("f", "/health")]


# --------------------------------------------------------------------------------------------- routers
def test_a_lost_router_is_restarted_with_its_serving_engines_until_its_restarts_are_used_up() -> None:
    policy = Policy(router_max_restarts=1)
    fleet, ledger = world(engine("e"), engine("f", state=S.LOST, registered=False))
    actions = decide(
        fleet,
        ledger,
        [router_done("router_exited", "actor", "its process exited with code 1")],
        now=1.0,
        policy=policy,
    )
    (restart,) = [a for a in actions if a.kind == "router_restart"]
    assert restart.details == {"workers": ("e",)}
    assert fleet.router("actor").state is RouterState.RESTARTING and fleet.router("actor").restarts == 1
    decide(
        fleet,
        ledger,
        [router_done("router_restart", "actor", generation=1, details={"workers": ("e",)})],
        now=1.5,
        policy=policy,
    )
    assert fleet.router("actor").state is RouterState.STARTING and fleet.router("actor").started_with == (
        "e",
    )
    actions = decide(
        fleet, ledger, [router_done("router_probe", "actor", generation=1)], now=1.6, policy=policy
    )
    assert fleet.router("actor").state is RouterState.LIVE
    (listing,) = [a for a in actions if a.kind == "router_list"]  # it lists its workers at once
    assert listing.details == {"workers": ("e",)}
    actions = decide(
        fleet, ledger, [router_done("router_list", "actor", generation=1)], now=1.8, policy=policy
    )
    assert fleet.router("actor").state is RouterState.READY
    assert events(actions) == [("router_recovered", "router of model actor serves again after 0.8 s")]
    actions = decide(
        fleet,
        ledger,
        [router_done("router_exited", "actor", "its process exited with code 1", generation=1)],
        now=9.0,
        policy=policy,
    )
    assert ends(actions) == [
        (
            "fail",
            "router of model actor lost: its process exited with code 1; its 1 restarts "
            "(supervision.router_max_restarts) are used up",
        )
    ]


def test_the_exit_of_a_replaced_router_process_is_stale() -> None:
    fleet, ledger = world(engine("e"), routers=[router(restarts=1)])
    decide(fleet, ledger, [router_done("router_exited", "actor", "gone", generation=0)], now=1.0)
    assert fleet.router("actor").state is RouterState.READY


def test_engines_wait_for_a_restarting_router_before_they_register() -> None:
    fleet, ledger = world(
        engine("e", state=S.CATCHING_UP, catch_up="restart", registered=False),
        routers=[router(state=RouterState.RESTARTING, restarts=1)],
    )
    assert work(decide(fleet, ledger, now=1.0), "e") == []
    fleet.transition_router("actor", RouterState.STARTING)
    fleet.transition_router("actor", RouterState.LIVE)
    assert work(decide(fleet, ledger, now=1.1), "e") == ["register"]


# -------------------------------------------------------------------------------------------- externals
def test_an_external_engine_is_never_restarted_and_catches_up_on_what_it_missed_when_back() -> None:
    policy = Policy(failure_threshold=1, health_interval_s=1.0)
    fleet, ledger = world(engine("x", external=True, learned=True), engine("e"))
    actions = decide(
        fleet, ledger, [done("probe", "x", 0, "/health failed (ConnectError)")], now=1.0, policy=policy
    )
    assert [kind for kind, _ in events(actions)] == ["external_engine_lost"]
    assert work(actions, "x") == ["deregister"]  # no cleanup, no restart: it runs elsewhere
    decide(fleet, ledger, [done("deregister", "x", 0)], now=1.1, policy=policy)
    # While it is away the trainer pauses; the local engine takes it, so the external one should have it too.
    record = ledger.record(
        pause_effect("retract"), sent={"e": 0}, accepted=["e"], deferred=["x"], generations={"e": 0, "x": 0}
    )
    assert (record.recorded, record.deferred) == (True, ("x",))
    assert work(decide(fleet, ledger, now=1.5, policy=policy), "x") == []  # the next poll is due at 2.0
    assert work(decide(fleet, ledger, now=2.0, policy=policy), "x") == ["probe"]
    actions = decide(fleet, ledger, [done("probe", "x", 0)], now=2.1, policy=policy)
    assert fleet.engine("x").state is S.CATCHING_UP
    (replay,) = [a for a in actions if a.kind == "replay"]  # what it missed, at once
    assert [(c.route, dict(c.body)) for c in replay.calls] == [("/pause_generation", {"mode": "retract"})]
    for call in replay.calls:
        ledger.accepted("x", call.effect)
    assert work(decide(fleet, ledger, [done("replay", "x", 0)], now=2.3, policy=policy), "x") == ["register"]
    actions = decide(fleet, ledger, [done("register", "x", 0)], now=2.4, policy=policy)
    assert fleet.engine("x").state is S.SERVING
    assert [kind for kind, _ in events(actions)] == ["external_engine_back"]


# ------------------------------------------------------------------------------------------ catching up
def test_no_catch_up_step_while_an_operation_concerning_the_engine_is_out() -> None:
    fleet, ledger = world(engine("e", state=S.CATCHING_UP, catch_up="restart", ops_in_flight=1))
    ledger.record(pause_effect("in_place"), sent={}, accepted=[], deferred=["e"], generations={"e": 0})
    assert work(decide(fleet, ledger, now=1.0), "e") == []
    fleet.update("e", ops_in_flight=0)
    assert work(decide(fleet, ledger, now=1.1), "e") == [
        "register"
    ]  # nothing was accepted: nothing to replay


def test_a_restarted_engine_is_replayed_registered_and_reported_back() -> None:
    fleet, ledger = world(
        engine("e", state=S.CATCHING_UP, catch_up="restart", lost_at=10.0, started_at=10.2, healthy_at=10.9),
        engine("f"),
    )
    ledger.record(
        pause_effect("in_place"), sent={"f": 0}, accepted=["f"], deferred=["e"], generations={"e": 1, "f": 0}
    )
    (replay,) = [a for a in decide(fleet, ledger, now=11.0) if a.kind == "replay"]
    assert [c.route for c in replay.calls] == ["/pause_generation"]
    ledger.accepted("e", replay.calls[0].effect)
    assert work(decide(fleet, ledger, [done("replay", "e", 0)], now=11.05), "e") == ["register"]
    actions = decide(fleet, ledger, [done("register", "e", 0)], now=11.2)
    assert events(actions) == [
        ("engine_recovered", "engine e serves again after 1.2 s (0.7 s of it its own start)")
    ]
    assert fleet.engine("e").recovered_at == 11.2


def test_an_engine_that_disagrees_with_the_ledger_is_reported_once_and_replayed() -> None:
    fleet, ledger = world(engine("e"), engine("f"))
    record = ledger.record(
        pause_effect("abort"),
        sent={"e": 0, "f": 0},
        accepted=["f"],
        deferred=[],
        generations={"e": 0, "f": 0},
    )
    assert record.diverged == ("e",)
    actions = decide(fleet, ledger, now=1.0)
    assert [kind for kind, _ in events(actions)] == ["engine_diverged"]
    assert fleet.engine("e").state is S.CATCHING_UP and fleet.engine("e").registered  # it keeps serving
    assert work(actions, "e") == ["replay"]


# -------------------------------------------------------------------------------------------- start-up
def test_start_up_is_ready_once_every_engine_serves_and_every_router_is_ready() -> None:
    fleet, ledger = world(
        engine("e", state=S.STARTING, catch_up="start", registered=False),
        routers=[router(state=RouterState.LIVE)],
    )
    actions = decide(fleet, ledger, [done("probe", "e", 0)], now=1.0, phase="starting")
    assert fleet.engine("e").state is S.CATCHING_UP
    assert work(actions, "e") == ["register"]  # nothing to replay at start-up
    actions = decide(fleet, ledger, [done("register", "e", 0)], now=1.2, phase="starting")
    assert work(actions) == ["router_list"] and ends(actions) == []
    actions = decide(fleet, ledger, [router_done("router_list", "actor")], now=1.3, phase="starting")
    assert ends(actions) == [("ready", "")]


def test_start_up_fails_at_the_first_exit_and_at_its_deadline() -> None:
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False), routers=[router(state=RouterState.STARTING)]
    )
    actions = decide(
        fleet, ledger, [exited("e", 0, "process e exited with code 1", 1)], now=1.0, phase="starting"
    )
    assert [(a.kind, a.details.get("cause")) for a in actions if a.kind == "startup_failed"] == [
        ("startup_failed", "exited")
    ]
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False), routers=[router(state=RouterState.STARTING)]
    )
    assert ends(decide(fleet, ledger, now=59.9, phase="starting", deadline=60.0)) == []
    actions = decide(fleet, ledger, now=60.1, phase="starting", deadline=60.0)
    assert [(a.kind, a.details.get("cause")) for a in actions if a.kind == "startup_failed"] == [
        ("startup_failed", "timeout")
    ]


# ------------------------------------------------------------------------------------------ state machine
def test_a_transition_the_state_machine_does_not_allow_raises() -> None:
    fleet, _ = world(engine("e"))
    with pytest.raises(IllegalTransitionError, match="engine e: serving -> restarting"):
        fleet.transition("e", S.RESTARTING)
    fleet.transition("e", S.STOPPED)
    with pytest.raises(IllegalTransitionError, match="engine e: stopped -> serving"):
        fleet.transition("e", S.SERVING)
    assert {s for s, to in ENGINE_TRANSITIONS.items() if S.SERVING in to} == {S.CATCHING_UP}
    assert all(S.STOPPED in ENGINE_TRANSITIONS[s] for s in S if s is not S.STOPPED)


_KINDS = ["exited", "probe", "spawn", "cleanup", "replay", "register", "deregister", "learn"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["e", "f", "x"]),
            st.sampled_from(_KINDS),
            st.booleans(),
            st.booleans(),
            st.floats(min_value=0.0, max_value=5.0),
        ),
        max_size=40,
    )
)
def test_decisions_never_break_the_state_machine(steps: list[tuple[str, str, bool, bool, float]]) -> None:
    """Whatever is observed, in any order, the decisions only make allowed transitions (apply() would raise)
    and never start a second piece of work of a kind that is still pending."""
    fleet, ledger = world(
        engine("e"), engine("f", state=S.STARTING, registered=False), engine("x", external=True)
    )
    now = 0.0
    for engine_id, kind, ok, current, dt in steps:
        now += dt
        generation = fleet.engine(engine_id).restarts if current else fleet.engine(engine_id).restarts - 1
        observation = (
            exited(engine_id, generation, "gone", -9)
            if kind == "exited"
            else done(kind, engine_id, generation, None if ok else "failed")
        )
        pending = {row.id: set(row.pending) for row in fleet.engines()}
        actions = decide(fleet, ledger, [observation], now=now)
        pending[engine_id].discard(kind)
        started = [(a.engine, a.kind) for a in actions if a.kind in _KINDS]
        assert all(what not in pending[who] for who, what in started if who is not None), started
