"""The reconciler's decisions, action by action: for each rule the whole list of actions it makes (state
changes and their fields, events with their subjects, messages and details, the work it starts with its
endpoint and deadline, the end of start-up or of the deployment), and the due times of ``next_wake``, with a
fake clock.

Every expected value is worked out by hand from the rules (policy.py's docstrings, the Supervision and
Changing a running deployment sections of docs/serve.md) and the settings each test gives. Times are binary fractions
(10.25, 11.5, ...) so that the differences the events carry are exact."""

from __future__ import annotations

from typing import Any

import pytest

from miles_sglang_plugin.config.schema import LaunchConf, SGLangDeployConf, SupervisionConf
from miles_sglang_plugin.serving.fleet import EngineState, Fleet, RouterState
from miles_sglang_plugin.serving.ledger import ReplayCall
from miles_sglang_plugin.serving.operations import memory_effect, pause_effect
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
from tests.test_reconciler_policy import decide, engine, router, world

S = EngineState
R = RouterState


def url(engine_id: str) -> str:
    """The URL test_reconciler_policy.engine() gives an engine."""
    return f"http://127.0.0.1:{20000 + sum(map(ord, engine_id)) % 5000}"


# The actions, as the rules describe them.
def T(engine_id: str, state: EngineState, **changes: Any) -> Action:
    return Action("transition", engine=engine_id, state=state, changes=changes)


def U(engine_id: str, **changes: Any) -> Action:
    return Action("update", engine=engine_id, changes=changes)


def E(kind: str, subject: str, message: str, **details: Any) -> Action:
    return Action("emit", event=kind, message=message, details={"subject": subject, **details})


def W(kind: str, engine_id: str, **kw: Any) -> Action:
    return Action(kind, engine=engine_id, **kw)


def RT(state: RouterState, model: str = "actor", **changes: Any) -> Action:
    return Action("router_transition", router=model, state=state, changes=changes)


def RU(model: str = "actor", **changes: Any) -> Action:
    return Action("router_update", router=model, changes=changes)


def RW(kind: str, model: str = "actor", **kw: Any) -> Action:
    return Action(f"router_{kind}", router=model, **kw)


def END(kind: str, message: str = "", **details: Any) -> Action:
    return Action(kind, message=message, details=details)


def pending(*kinds: str) -> frozenset[str]:
    return frozenset(kinds)


NONE: frozenset[str] = frozenset()


def call(route: str, body: dict[str, Any]) -> ReplayCall:
    """A replay call as the actions compare it (by route and body)."""
    return ReplayCall(route, body, lambda state: state)


def busy_router(**kw: Any) -> Any:
    """A ready router with a probe out: it asks for nothing itself, so a test sees the engines' actions."""
    return router(pending=pending("probe"), **kw)


RESTARTING_TEXT = "with its same command line, environment and GPUs"


# ------------------------------------------------------------------------------------ observations
def test_the_observation_constructors() -> None:
    assert exited("e", 2, "process e exited with code 1", 1) == Observation(
        "exited",
        engine="e",
        router=None,
        generation=2,
        ok=False,
        problem="process e exited with code 1",
        code=1,
    )
    assert done("probe", "e", 3) == Observation("probe", engine="e", generation=3, ok=True, problem=None)
    assert done("spawn", "e", 1, "node 2 is gone", fatal=True) == Observation(
        "spawn", engine="e", generation=1, ok=False, problem="node 2 is gone", fatal=True
    )
    assert router_done("router_probe", "actor") == Observation("router_probe", router="actor", ok=True)
    assert router_done("router_restart", "actor", "port in use", generation=2) == Observation(
        "router_restart", router="actor", engine=None, generation=2, ok=False, problem="port in use"
    )
    listed = router_done("router_list", "actor", details={"workers": ("e",)})
    assert (listed.ok, dict(listed.details)) == (True, {"workers": ("e",)})


def test_the_policy_from_the_settings() -> None:
    settings = SGLangDeployConf(
        supervision=SupervisionConf(
            enabled=False,
            health_endpoint="/health_generate",
            health_interval_s=1.5,
            health_timeout_s=2.5,
            failure_threshold=4,
            max_restarts=5,
            restart_backoff_s=0.5,
            restart_backoff_max_s=8.0,
            restart_budget_reset_s=90.0,
            router_max_restarts=6,
        ),
        launch=LaunchConf(startup_timeout_s=120.0, drain_timeout_s=7.0, poll_interval_s=0.125),
    )
    assert Policy.from_settings(settings) == Policy(
        supervise=False,
        health_endpoint="/health_generate",
        health_interval_s=1.5,
        health_timeout_s=2.5,
        failure_threshold=4,
        max_restarts=5,
        restart_backoff_s=0.5,
        restart_backoff_max_s=8.0,
        restart_budget_reset_s=90.0,
        drain_timeout_s=7.0,
        router_max_restarts=6,
        startup_timeout_s=120.0,
        poll_interval_s=0.125,
    )


# -------------------------------------------------------------------------------- a loss, healed
def test_an_exit_is_healed_step_by_step() -> None:
    """Lost (out of its router, processes stopped), restarted at once (its first restart), polled on
    /health_generate while it starts, caught up (nothing to replay), registered, serving: engine_recovered
    with its downtime (exit at 10, serving at 11.5) and its own start (started 10.5, healthy 11)."""
    fleet, ledger = world(engine("e"), routers=[busy_router()])
    assert decide(fleet, ledger, [exited("e", 0, "process gone", -9)], now=10.0) == [
        T(
            "e",
            S.LOST,
            lost_at=10.0,
            lost_reason="process gone",
            cleaned_up=False,
            health_failures=0,
            probed_at=10.0,
        ),
        E("engine_lost", "e", f"engine e ({url('e')}) lost: process gone", reason="process gone"),
        U("e", pending=pending("cleanup")),
        W("cleanup", "e"),
        U("e", restarts_in_budget=0, restart_at=10.0, recovered_at=None),
        E(
            "engine_restarting",
            "e",
            f"restarting engine e (restart 1 of 3) {RESTARTING_TEXT} (0)",
            attempt=1,
            delay_s=0.0,
        ),
        U("e", pending=pending("cleanup", "deregister")),
        W("deregister", "e"),
    ]
    assert decide(fleet, ledger, [done("cleanup", "e", 0), done("deregister", "e", 0)], now=10.25) == [
        U("e", pending=pending("deregister")),
        U("e", cleaned_up=True),
        U("e", pending=NONE),
        U("e", registered=False),
        T(
            "e",
            S.RESTARTING,
            restarts=1,
            restarts_in_budget=1,
            restart_at=None,
            catch_up="restart",
            registered=False,
            pending=pending("spawn"),
        ),
        W("spawn", "e"),
    ]
    assert decide(fleet, ledger, [done("spawn", "e", 1)], now=10.5) == [
        U("e", pending=NONE),
        T("e", S.STARTING, started_at=10.5, probed_at=None, health_failures=0, cleaned_up=False),
        U("e", probed_at=10.5),
        U("e", pending=pending("probe")),
        W("probe", "e", path="/health_generate", timeout_s=2.0),
    ]
    assert decide(fleet, ledger, now=10.75) == []  # its probe is out
    assert decide(fleet, ledger, [done("probe", "e", 1)], now=11.0) == [
        U("e", pending=NONE),
        T("e", S.CATCHING_UP, healthy_at=11.0, health_failures=0),
        U("e", pending=pending("register")),
        W("register", "e"),
    ]
    assert decide(fleet, ledger, [done("register", "e", 1)], now=11.5) == [
        U("e", pending=NONE),
        U("e", registered=True),
        T("e", S.SERVING, catch_up="", health_failures=0, probed_at=11.5, divergence=""),
        U("e", recovered_at=11.5, lost_at=None),
        E(
            "engine_recovered",
            "e",
            "engine e serves again after 1.5 s (0.5 s of it its own start)",
            downtime_s=1.5,
            start_s=0.5,
            restarts=1,
        ),
    ]
    # Serving: polled on the configured /health every health_interval_s (1 s) from its last poll.
    assert decide(fleet, ledger, now=12.25) == []
    assert decide(fleet, ledger, now=12.5) == [
        U("e", probed_at=12.5),
        U("e", pending=pending("probe")),
        W("probe", "e", path="/health", timeout_s=2.0),
    ]


def test_plan_actions_decides_for_the_serving_phase_by_default() -> None:
    fleet, ledger = world(engine("e"), routers=[busy_router()])
    assert plan_actions(fleet, [], ledger, Policy(health_timeout_s=0.5), 3.0) == [
        U("e", probed_at=3.0),
        U("e", pending=pending("probe")),
        W("probe", "e", path="/health", timeout_s=0.5),
    ]


def test_nothing_is_decided_while_stopping() -> None:
    fleet, ledger = world(engine("e"))
    assert plan_actions(fleet, [exited("e", 0, "gone", -9)], ledger, Policy(), 1.0, phase="stopping") == []


def test_observations_of_engines_and_routers_no_longer_in_the_fleet_are_dropped() -> None:
    fleet, ledger = world(engine("e", probed_at=1.0), routers=[busy_router()])
    observations = [
        exited("gone", 0, "process gone", -9),
        done("probe", "gone", 0),
        router_done("router_exited", "critic", "its process exited"),
    ]
    assert decide(fleet, ledger, observations, now=1.5) == []


def test_a_second_restart_waits_its_backoff_and_an_engine_without_gpus_says_so() -> None:
    policy = Policy(restart_backoff_s=2.0)
    fleet, ledger = world(engine("e", gpus="", restarts=1, restarts_in_budget=1), routers=[busy_router()])
    actions = decide(fleet, ledger, [exited("e", 1, "process gone", -9)], now=20.0, policy=policy)
    assert actions[4:6] == [
        U("e", restarts_in_budget=1, restart_at=22.0, recovered_at=None),
        E(
            "engine_restarting",
            "e",
            f"restarting engine e in 2 s (restart 2 of 3) {RESTARTING_TEXT} (-)",
            attempt=2,
            delay_s=2.0,
        ),
    ]
    decide(fleet, ledger, [done("cleanup", "e", 1), done("deregister", "e", 1)], now=20.5, policy=policy)
    assert decide(fleet, ledger, now=21.75, policy=policy) == []
    assert [a.kind for a in decide(fleet, ledger, now=22.0, policy=policy)] == ["transition", "spawn"]


def test_an_exit_without_a_problem_is_its_process_exiting() -> None:
    fleet, ledger = world(engine("e"), routers=[busy_router()])
    actions = decide(fleet, ledger, [Observation("exited", engine="e", ok=False)], now=1.0)
    assert actions[:2] == [
        T(
            "e",
            S.LOST,
            lost_at=1.0,
            lost_reason="its process exited",
            cleaned_up=False,
            health_failures=0,
            probed_at=1.0,
        ),
        E("engine_lost", "e", f"engine e ({url('e')}) lost: its process exited", reason="its process exited"),
    ]


def test_used_up_restarts_fail_the_deployment_and_nothing_else_is_decided() -> None:
    policy = Policy(max_restarts=2)
    fleet, ledger = world(engine("e", restarts=2, restarts_in_budget=2), engine("f"), routers=[router()])
    assert decide(fleet, ledger, [exited("e", 2, "process gone", -9)], now=5.0, policy=policy) == [
        T(
            "e",
            S.LOST,
            lost_at=5.0,
            lost_reason="process gone",
            cleaned_up=False,
            health_failures=0,
            probed_at=5.0,
        ),
        E("engine_lost", "e", f"engine e ({url('e')}) lost: process gone", reason="process gone"),
        U("e", pending=pending("cleanup")),
        W("cleanup", "e"),
        END(
            "fail",
            f"engine e ({url('e')}) lost: process gone; its 2 restarts (supervision.max_restarts) are used up",
        ),
    ]  # no deregistration, no poll of f or of the router: the deployment stops


def test_the_budget_is_given_back_only_after_a_full_stretch_of_service() -> None:
    policy = Policy(max_restarts=1, restart_budget_reset_s=100.0)
    fleet, ledger = world(
        engine("e", restarts=1, restarts_in_budget=1, recovered_at=10.0), routers=[busy_router()]
    )
    actions = decide(fleet, ledger, [exited("e", 1, "gone", -9)], now=109.75, policy=policy)  # 99.75 s
    assert actions[-1] == END(
        "fail", f"engine e ({url('e')}) lost: gone; its 1 restarts (supervision.max_restarts) are used up"
    )
    fleet, ledger = world(
        engine("e", restarts=1, restarts_in_budget=1, recovered_at=10.0), routers=[busy_router()]
    )
    actions = decide(fleet, ledger, [exited("e", 1, "gone", -9)], now=110.0, policy=policy)  # 100 s
    assert actions[4:6] == [
        U("e", restarts_in_budget=0, restart_at=110.0, recovered_at=None),
        E(
            "engine_restarting",
            "e",
            f"restarting engine e (restart 1 of 1) {RESTARTING_TEXT} (0)",
            attempt=1,
            delay_s=0.0,
        ),
    ]


# --------------------------------------------------------------------------------- failed restarts
def restarting(**kw: Any) -> tuple[Fleet, Any]:
    """Engine e being started again (its first restart), out of its router."""
    row = engine(
        "e",
        state=S.RESTARTING,
        restarts=1,
        restarts_in_budget=1,
        registered=False,
        catch_up="restart",
        lost_reason="process gone",
        pending=pending("spawn"),
        **kw,
    )
    return world(row, routers=[busy_router()])


def test_a_spawn_that_fails_is_a_failed_restart_tried_again_after_the_backoff() -> None:
    fleet, ledger = restarting()
    assert decide(fleet, ledger, [Observation("spawn", engine="e", generation=1, ok=False)], now=30.0) == [
        U("e", pending=NONE),
        E("engine_restart_failed", "e", "restart 1 of engine e failed: it could not be started"),
        T("e", S.LOST, lost_reason="it could not be started", cleaned_up=False, health_failures=0),
        U("e", pending=pending("cleanup")),
        W("cleanup", "e"),
        U("e", restarts_in_budget=1, restart_at=31.0, recovered_at=None),
        E(
            "engine_restarting",
            "e",
            f"restarting engine e in 1 s (restart 2 of 3) {RESTARTING_TEXT} (0)",
            attempt=2,
            delay_s=1.0,
        ),
    ]
    assert fleet.engine("e").lost_reason == "it could not be started"


def test_a_restart_that_cannot_happen_where_the_plan_put_it_fails_and_nothing_else_is_decided() -> None:
    fleet, ledger = restarting()
    actions = decide(fleet, ledger, [done("spawn", "e", 1, "node 2 is gone", fatal=True)], now=3.0)
    assert actions == [U("e", pending=NONE), END("fail", "engine e lost (process gone) and node 2 is gone")]


def test_the_outcome_of_a_spawn_is_only_looked_at_while_the_engine_is_being_started() -> None:
    fleet, ledger = world(engine("e", probed_at=1.0), routers=[busy_router()])
    assert decide(fleet, ledger, [done("spawn", "e", 0, "it could not be started: boom")], now=1.5) == [
        U("e", pending=NONE)
    ]
    assert fleet.engine("e").state is S.SERVING


def test_a_restart_that_never_answers_in_time_is_a_failed_restart() -> None:
    policy = Policy(startup_timeout_s=60.0)
    fleet, ledger = world(
        engine(
            "e",
            state=S.STARTING,
            restarts=1,
            restarts_in_budget=1,
            registered=False,
            started_at=100.0,
            probed_at=160.0,
        ),
        routers=[busy_router()],
    )
    assert decide(fleet, ledger, now=160.0, policy=policy) == []  # 60 s: not over yet (and just polled)
    actions = decide(fleet, ledger, now=160.5, policy=policy)
    assert actions[:3] == [
        E(
            "engine_restart_failed",
            "e",
            "restart 1 of engine e failed: it did not answer /health_generate within 60 s",
        ),
        T(
            "e",
            S.LOST,
            lost_reason="it did not answer /health_generate within 60 s",
            cleaned_up=False,
            health_failures=0,
        ),
        U("e", pending=pending("cleanup")),
    ]


def test_at_start_up_an_engine_is_polled_at_the_poll_interval_and_never_timed_out_by_its_row() -> None:
    policy = Policy(startup_timeout_s=60.0, poll_interval_s=0.25)
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False, started_at=0.0, probed_at=100.0), routers=[]
    )
    assert decide(fleet, ledger, now=100.125, policy=policy, phase="starting") == []
    assert decide(fleet, ledger, now=100.25, policy=policy, phase="starting") == [
        U("e", probed_at=100.25),
        U("e", pending=pending("probe")),
        W("probe", "e", path="/health_generate", timeout_s=2.0),
    ]


def test_a_restarted_engine_is_polled_every_50_ms_at_most() -> None:
    policy = Policy(poll_interval_s=0.25)
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False, probed_at=1.0), routers=[busy_router()]
    )
    assert decide(fleet, ledger, now=1.03125, policy=policy) == []
    assert [a.kind for a in decide(fleet, ledger, now=1.0625, policy=policy)] == ["update", "update", "probe"]
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False, probed_at=1.0), routers=[busy_router()]
    )
    slow = Policy(poll_interval_s=0.03125)  # a poll interval below 50 ms is kept
    assert [a.kind for a in decide(fleet, ledger, now=1.03125, policy=slow)] == ["update", "update", "probe"]


# ----------------------------------------------------------------------------------------- exits
def test_at_start_up_an_exit_fails_the_launch_naming_the_engine() -> None:
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False, probed_at=1.0), routers=[router(state=R.STARTING)]
    )
    actions = decide(
        fleet, ledger, [exited("e", 0, "process e exited with code 1", 1)], now=1.0, phase="starting"
    )
    assert actions == [END("startup_failed", "process e exited with code 1", cause="exited", engine="e")]
    fleet, ledger = world(engine("e", state=S.STARTING, registered=False), routers=[router(state=R.STARTING)])
    actions = decide(
        fleet,
        ledger,
        [Observation("exited", engine="e", ok=False)],
        now=1.0,
        phase="starting",
        policy=Policy(supervise=False),
    )
    assert actions == [
        END("startup_failed", "", cause="exited", engine="e")
    ]  # watched at start-up regardless


def test_without_supervision_a_serving_engine_that_exits_is_left_alone() -> None:
    fleet, ledger = world(engine("e"), routers=[router()])
    assert decide(fleet, ledger, [exited("e", 0, "gone", -9)], now=1.0, policy=Policy(supervise=False)) == []
    assert fleet.engine("e").state is S.SERVING


def test_the_exit_of_an_engine_that_is_not_running_is_ignored() -> None:
    for state in (S.LOST, S.RESTARTING, S.FAILED, S.STOPPED):
        fleet, ledger = world(engine("e", state=state, registered=False), routers=[busy_router()])
        assert decide(fleet, ledger, [exited("e", 0, "gone", -9)], now=1.0) == [], state


# ----------------------------------------------------------------------------------------- probes
def test_a_failed_probe_counts_and_an_answer_resets_the_count_only_when_there_is_one() -> None:
    fleet, ledger = world(engine("e", probed_at=1.0), routers=[busy_router()])
    assert decide(fleet, ledger, [done("probe", "e", 0)], now=1.5) == [U("e", pending=NONE)]
    assert decide(fleet, ledger, [done("probe", "e", 0, "no answer to /health within 2 s")], now=1.5) == [
        U("e", pending=NONE),
        U("e", health_failures=1),
    ]
    assert decide(fleet, ledger, [done("probe", "e", 0)], now=1.5) == [
        U("e", pending=NONE),
        U("e", health_failures=0),
    ]
    decide(fleet, ledger, [done("probe", "e", 0, "no answer to /health within 2 s")], now=1.5)
    actions = decide(fleet, ledger, [done("probe", "e", 0, "no answer to /health within 2 s")], now=1.75)
    reason = "no answer to /health within 2 s (2 polls in a row)"
    assert actions[:3] == [
        U("e", pending=NONE),
        U("e", health_failures=2),
        T("e", S.LOST, lost_at=1.75, lost_reason=reason, cleaned_up=False, health_failures=0, probed_at=1.75),
    ]
    assert actions[3] == E("engine_lost", "e", f"engine e ({url('e')}) lost: {reason}", reason=reason)


def test_failed_probes_at_start_up_do_not_lose_a_serving_engine() -> None:
    fleet, ledger = world(engine("e", probed_at=1.0), routers=[])
    bad = done("probe", "e", 0, "/health answered 503")
    actions = decide(fleet, ledger, [bad], now=1.5, phase="starting", policy=Policy(failure_threshold=1))
    assert actions == [U("e", pending=NONE), U("e", health_failures=1), END("ready")]


def test_a_starting_engine_that_does_not_answer_yet_stays_starting() -> None:
    fleet, ledger = world(engine("e", state=S.STARTING, registered=False, probed_at=1.0), routers=[])
    assert decide(fleet, ledger, [done("probe", "e", 0, "refused")], now=1.0, phase="starting") == [
        U("e", pending=NONE)
    ]
    assert fleet.engine("e").state is S.STARTING


def test_the_probe_of_an_engine_being_caught_up_or_restarted_is_ignored() -> None:
    for state in (S.CATCHING_UP, S.RESTARTING, S.LOST):
        row = engine("e", state=state, registered=False, ops_in_flight=1, catch_up="restart")
        fleet, ledger = world(row, routers=[busy_router()])
        assert decide(fleet, ledger, [done("probe", "e", 0, "refused")], now=1.0) == [U("e", pending=NONE)], (
            state
        )
        assert fleet.engine("e").health_failures == 0


def test_probes_of_the_current_process_only_and_work_of_a_kind_out_once() -> None:
    fleet, ledger = world(
        engine("e", restarts=2, probed_at=1.0, pending=pending("probe")), routers=[busy_router()]
    )
    assert (
        decide(fleet, ledger, [done("probe", "e", 1, "refused")], now=3.0) == []
    )  # stale: the probe stays out
    assert fleet.engine("e").pending == pending("probe")


# ------------------------------------------------------------------------------------- external engines
def test_an_external_engine_that_is_away_is_polled_on_health_and_comes_back_through_catching_up() -> None:
    policy = Policy(health_interval_s=1.0, health_timeout_s=0.5, health_endpoint="/health_generate")
    row = engine(
        "x", state=S.LOST, external=True, learned=True, registered=False, cleaned_up=True, probed_at=5.0
    )
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, now=5.75, policy=policy) == []
    assert decide(fleet, ledger, now=6.0, policy=policy) == [
        U("x", probed_at=6.0),
        U("x", pending=pending("probe")),
        W("probe", "x", path="/health", timeout_s=0.5),
    ]
    assert decide(fleet, ledger, [done("probe", "x", 0, "refused")], now=6.25, policy=policy) == [
        U("x", pending=NONE)
    ]
    assert fleet.engine("x").state is S.LOST
    fleet.update("x", pending=pending("probe"))
    assert decide(fleet, ledger, [done("probe", "x", 0)], now=6.5, policy=policy) == [
        U("x", pending=NONE),
        T("x", S.CATCHING_UP, catch_up="external_back", health_failures=0),
        U("x", pending=pending("register")),
        W("register", "x"),
    ]
    assert decide(fleet, ledger, [done("register", "x", 0)], now=6.75, policy=policy) == [
        U("x", pending=NONE),
        U("x", registered=True),
        T("x", S.SERVING, catch_up="", health_failures=0, probed_at=6.75, divergence=""),
        U("x", lost_at=None),
        E("external_engine_back", "x", f"external engine x ({url('x')}) answers again"),
    ]


def test_an_external_engine_away_is_not_polled_without_supervision_nor_at_start_up() -> None:
    row = engine("x", state=S.LOST, external=True, registered=False, cleaned_up=True, probed_at=None)
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, now=9.0, policy=Policy(supervise=False)) == []
    assert decide(fleet, ledger, now=9.0, phase="starting") == []
    fleet.update("x", pending=pending("probe"))
    assert decide(fleet, ledger, [done("probe", "x", 0)], now=9.0, phase="starting") == [U("x", pending=NONE)]
    assert fleet.engine("x").state is S.LOST  # answers at start-up: not taken back here


def test_an_external_engine_is_learnt_before_anything_else_and_its_loss_is_no_restart() -> None:
    row = engine("x", state=S.CATCHING_UP, external=True, registered=False, catch_up="start")
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, now=1.0) == [U("x", pending=pending("learn")), W("learn", "x")]
    assert decide(fleet, ledger, [done("learn", "x", 0)], now=1.25) == [
        U("x", pending=NONE),
        U("x", learned=True),
        U("x", pending=pending("register")),
        W("register", "x"),
    ]
    row = engine("x", state=S.CATCHING_UP, external=True, registered=False, pending=pending("learn"))
    fleet, ledger = world(row, routers=[busy_router()])
    reason = "its /server_info could not be read"
    assert decide(fleet, ledger, [Observation("learn", engine="x", ok=False)], now=2.0) == [
        U("x", pending=NONE),
        T("x", S.LOST, lost_at=2.0, lost_reason=reason, cleaned_up=True, health_failures=0, probed_at=2.0),
        E("external_engine_lost", "x", f"engine x ({url('x')}) lost: {reason}", reason=reason),
    ]


def test_a_failed_learn_fails_the_start_and_is_ignored_once_the_engine_is_away() -> None:
    row = engine("x", state=S.CATCHING_UP, external=True, registered=False, pending=pending("learn"))
    fleet, ledger = world(row, routers=[router(state=R.LIVE)])
    actions = decide(
        fleet, ledger, [done("learn", "x", 0, "/server_info answered 404")], now=1.0, phase="starting"
    )
    assert actions == [
        U("x", pending=NONE),
        END(
            "startup_failed",
            f"external engine x ({url('x')}): /server_info answered 404",
            cause="learn",
            engine="x",
        ),
    ]
    row = engine(
        "x",
        state=S.LOST,
        external=True,
        registered=False,
        cleaned_up=True,
        probed_at=1.0,
        pending=pending("learn"),
    )
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, [done("learn", "x", 0, "refused")], now=1.0) == [U("x", pending=NONE)]


# ------------------------------------------------------------------------------------ replay, register
def caught_up(kind: str, catch_up: str, **kw: Any) -> tuple[Fleet, Any]:
    """Engine e being caught up (why: ``catch_up``) with work ``kind`` out."""
    row = engine("e", state=S.CATCHING_UP, catch_up=catch_up, pending=pending(kind), **kw)
    return world(row, routers=[busy_router()])


def test_a_refused_replay_fails_the_start_is_a_failed_restart_or_a_loss() -> None:
    problem = "/pause_generation: answered 500"
    why = f"it did not take the control state back: {problem}"
    fleet, ledger = caught_up("replay", "start", registered=False)
    assert decide(fleet, ledger, [done("replay", "e", 0, problem)], now=1.0, phase="starting") == [
        U("e", pending=NONE),
        END("startup_failed", f"engine e: {why}", cause="replay", engine="e"),
    ]
    fleet, ledger = caught_up("replay", "restart", registered=False, restarts=1, restarts_in_budget=1)
    assert decide(fleet, ledger, [done("replay", "e", 1, problem)], now=40.0) == [
        U("e", pending=NONE),
        E("engine_restart_failed", "e", f"restart 1 of engine e failed: {why}"),
        T("e", S.LOST, lost_reason=why, cleaned_up=False, health_failures=0),
        U("e", pending=pending("cleanup")),
        W("cleanup", "e"),
        U("e", restarts_in_budget=1, restart_at=41.0, recovered_at=None),
        E(
            "engine_restarting",
            "e",
            f"restarting engine e in 1 s (restart 2 of 3) {RESTARTING_TEXT} (0)",
            attempt=2,
            delay_s=1.0,
        ),
    ]
    fleet, ledger = caught_up("replay", "divergence", registered=True)
    assert decide(fleet, ledger, [done("replay", "e", 0, problem)], now=50.0) == [
        U("e", pending=NONE),
        T("e", S.LOST, lost_at=50.0, lost_reason=why, cleaned_up=False, health_failures=0, probed_at=50.0),
        E("engine_lost", "e", f"engine e ({url('e')}) lost: {why}", reason=why),
        U("e", pending=pending("cleanup")),
        W("cleanup", "e"),
        U("e", restarts_in_budget=0, restart_at=50.0, recovered_at=None),
        E(
            "engine_restarting",
            "e",
            f"restarting engine e (restart 1 of 3) {RESTARTING_TEXT} (0)",
            attempt=1,
            delay_s=0.0,
        ),
        U("e", pending=pending("cleanup", "deregister")),
        W("deregister", "e"),
    ]


def test_the_outcome_of_a_replay_is_only_looked_at_while_catching_up() -> None:
    fleet, ledger = world(engine("e", probed_at=1.0, pending=pending("replay")), routers=[busy_router()])
    assert decide(fleet, ledger, [done("replay", "e", 0, "refused")], now=1.0) == [U("e", pending=NONE)]
    assert fleet.engine("e").state is S.SERVING


def test_a_refused_registration_fails_the_start_is_a_failed_restart_or_a_loss() -> None:
    problem = "409 WORKER_ALREADY_EXISTS"
    why = f"its router refused it: {problem}"
    fleet, ledger = caught_up("register", "start", registered=False)
    assert decide(fleet, ledger, [done("register", "e", 0, problem)], now=1.0, phase="starting") == [
        U("e", pending=NONE),
        END(
            "startup_failed",
            f"router of model 'actor' refused engine e: {problem}",
            cause="register",
            engine="e",
        ),
    ]
    fleet, ledger = caught_up("register", "restart", registered=False, restarts=1, restarts_in_budget=1)
    actions = decide(fleet, ledger, [done("register", "e", 1, problem)], now=40.0)
    assert actions[1:3] == [
        E("engine_restart_failed", "e", f"restart 1 of engine e failed: {why}"),
        T("e", S.LOST, lost_reason=why, cleaned_up=False, health_failures=0),
    ]
    row = engine(
        "x",
        state=S.CATCHING_UP,
        external=True,
        learned=True,
        registered=False,
        catch_up="external_back",
        pending=pending("register"),
    )
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, [done("register", "x", 0, problem)], now=7.0) == [
        U("x", pending=NONE),
        T("x", S.LOST, lost_at=7.0, lost_reason=why, cleaned_up=True, health_failures=0, probed_at=7.0),
        E("external_engine_lost", "x", f"engine x ({url('x')}) lost: {why}", reason=why),
    ]


def test_a_late_registration_of_an_engine_lost_meanwhile_changes_nothing() -> None:
    fleet, ledger = world(
        engine("e", state=S.LOST, registered=False, pending=pending("register")), routers=[busy_router()]
    )
    assert decide(fleet, ledger, [done("register", "e", 0)], now=1.0) == [U("e", pending=NONE)]
    assert not fleet.engine("e").registered


def test_a_deregistration_takes_the_engine_out_whatever_its_outcome() -> None:
    fleet, ledger = world(engine("e", state=S.LOST, pending=pending("deregister")), routers=[busy_router()])
    assert decide(fleet, ledger, [done("deregister", "e", 0, "404")], now=1.0) == [
        U("e", pending=NONE),
        U("e", registered=False),
    ]


@pytest.mark.parametrize("kind", ["replay", "register", "deregister", "learn"])
def test_no_catch_up_step_while_the_engines_own_step_is_out(kind: str) -> None:
    fleet, ledger = caught_up(kind, "restart", registered=False, learned=False, external=kind == "learn")
    assert decide(fleet, ledger, now=1.0) == []


@pytest.mark.parametrize("kind", ["probe", "cleanup", "spawn"])
def test_other_work_out_does_not_hold_up_the_catch_up(kind: str) -> None:
    fleet, ledger = caught_up(kind, "restart", registered=False)
    assert decide(fleet, ledger, now=1.0) == [U("e", pending=pending(kind, "register")), W("register", "e")]


# --------------------------------------------------------------------------------------- divergence
def diverged_world(**kw: Any) -> tuple[Fleet, Any]:
    """e was sent a pause (abort) and did not take it; f took it."""
    fleet, ledger = world(
        engine("e", probed_at=1.0, **kw), engine("f", probed_at=1.0), routers=[busy_router()]
    )
    ledger.record(
        pause_effect("abort"),
        sent={"e": 0, "f": 0},
        accepted=["f"],
        deferred=[],
        generations={"e": 0, "f": 0},
    )
    return fleet, ledger


PAUSED = '/pause_generation {"mode": "abort"}'


def test_an_engine_that_disagrees_is_reported_replayed_while_it_serves_and_serves_on_silently() -> None:
    fleet, ledger = diverged_world()
    assert decide(fleet, ledger, now=1.5) == [
        E(
            "engine_diverged",
            "e",
            f"engine e does not have the control state the ledger says it should: {PAUSED}; bringing it there",
            missing=PAUSED,
        ),
        T("e", S.CATCHING_UP, catch_up="divergence", divergence=PAUSED),
        U("e", pending=pending("replay")),
        W("replay", "e", calls=(call("/pause_generation", {"mode": "abort"}),)),
    ]
    ledger.accepted("e", pause_effect("abort"))
    assert decide(fleet, ledger, [done("replay", "e", 0)], now=1.75) == [
        U("e", pending=NONE),
        T("e", S.SERVING, catch_up="", health_failures=0, probed_at=1.75, divergence=""),
    ]


def test_no_divergence_is_acted_on_while_an_operation_is_out_a_replay_runs_or_at_start_up() -> None:
    for kw, phase in (
        ({"ops_in_flight": 1}, "serving"),
        ({"pending": pending("replay")}, "serving"),
        ({}, "starting"),
    ):
        fleet, ledger = diverged_world(**kw)
        actions = decide(fleet, ledger, now=1.5, phase=phase)
        assert [a for a in actions if a.engine == "e" or a.kind == "emit"] == [], (kw, phase)


def test_weights_of_a_group_that_a_serving_engine_lacks_take_it_out_until_it_gets_them() -> None:
    fleet, ledger = world(engine("e", probed_at=1.0), engine("f", probed_at=1.0), routers=[busy_router()])
    effect = ledger.distributed_effect(None)
    ledger.record(effect, sent={"e": 0, "f": 0}, accepted=["f"], deferred=[], generations={"e": 0, "f": 0})
    what = "weights from a weights update group"
    assert decide(fleet, ledger, now=1.5) == [
        E(
            "engine_diverged",
            "e",
            f"engine e does not have the control state the ledger says it should: {what}; bringing it there",
            missing=what,
        ),
        T("e", S.CATCHING_UP, catch_up="divergence", divergence=what),
        T("e", S.PENDING_WEIGHTS, catch_up="pending"),
        E(
            "engine_pending_weights",
            "e",
            "engine e is back after 0.0 s but its weights are not the deployment's (they came through a weights "
            "update group): it serves once the trainer has formed its weights update group again and sent it "
            "weights (control.engines_outside_weight_group())",
            downtime_s=0.0,
            restarts=0,
        ),
        U("e", pending=pending("deregister")),
        W("deregister", "e"),
    ]


def pending_weights_world(divergence: str) -> tuple[Fleet, Any]:
    """e waits for weights of a group (out of its router) and refused a pause meanwhile."""
    row = engine(
        "e",
        state=S.PENDING_WEIGHTS,
        catch_up="pending",
        registered=False,
        probed_at=1.0,
        divergence=divergence,
    )
    fleet, ledger = world(row, engine("f", probed_at=1.0), routers=[busy_router()])
    gens = {"e": 0, "f": 0}
    ledger.record(
        ledger.distributed_effect(None), sent={"f": 0}, accepted=["f"], deferred=["e"], generations=gens
    )
    ledger.record(pause_effect("abort"), sent={"e": 0, "f": 0}, accepted=["f"], deferred=[], generations=gens)
    return fleet, ledger


def test_an_engine_waiting_for_weights_is_replayed_what_it_refused_and_waits_on() -> None:
    fleet, ledger = pending_weights_world("")
    replay = [
        U("e", pending=pending("replay")),
        W("replay", "e", calls=(call("/pause_generation", {"mode": "abort"}),)),
    ]
    assert decide(fleet, ledger, now=1.5) == [
        E(
            "engine_diverged",
            "e",
            f"engine e does not have the control state the ledger says it should: {PAUSED}; bringing it there",
            missing=PAUSED,
        ),
        T("e", S.CATCHING_UP, catch_up="pending", divergence=PAUSED),
        *replay,
    ]
    ledger.accepted("e", pause_effect("abort"))
    assert decide(fleet, ledger, [done("replay", "e", 0)], now=1.75) == [
        U("e", pending=NONE),
        T("e", S.PENDING_WEIGHTS, catch_up="pending"),  # back to waiting, reported once already
    ]
    fleet, ledger = pending_weights_world(PAUSED)  # the same difference again: not reported twice
    assert decide(fleet, ledger, now=1.5) == [
        T("e", S.CATCHING_UP, catch_up="pending", divergence=PAUSED),
        *replay,
    ]


def test_a_restarted_engine_without_its_groups_weights_waits_then_is_admitted() -> None:
    row = engine(
        "e",
        state=S.CATCHING_UP,
        catch_up="restart",
        restarts=1,
        registered=False,
        lost_at=10.0,
        started_at=10.5,
        healthy_at=11.0,
        probed_at=12.0,
    )
    fleet, ledger = world(row, engine("f", probed_at=12.0, pending=pending("probe")), routers=[busy_router()])
    ledger.record(
        ledger.distributed_effect(None),
        sent={"f": 0},
        accepted=["f"],
        deferred=["e"],
        generations={"e": 1, "f": 0},
    )
    assert decide(fleet, ledger, now=12.0) == [
        T("e", S.PENDING_WEIGHTS, catch_up="pending"),
        E(
            "engine_pending_weights",
            "e",
            "engine e is back after 2.0 s but its weights are not the deployment's (they came through a weights "
            "update group): it serves once the trainer has formed its weights update group again and sent it "
            "weights (control.engines_outside_weight_group())",
            downtime_s=2.0,
            restarts=1,
        ),
    ]
    assert decide(fleet, ledger, now=12.5) == []  # waits, out of its router
    ledger.record(
        ledger.distributed_effect(None),
        sent={"e": 1, "f": 0},
        accepted=["e", "f"],
        deferred=[],
        generations={"e": 1, "f": 0},
    )
    assert decide(fleet, ledger, now=12.75) == [
        T("e", S.CATCHING_UP, catch_up="pending"),
        U("e", pending=pending("register")),
        W("register", "e"),
    ]
    assert decide(fleet, ledger, [done("register", "e", 1)], now=13.5) == [
        U("e", pending=NONE),
        U("e", registered=True),
        T("e", S.SERVING, catch_up="", health_failures=0, probed_at=13.5, divergence=""),
        U("e", recovered_at=13.5, lost_at=None),
        E(
            "engine_admitted",
            "e",
            "engine e got weights and serves again",
            downtime_s=3.5,
            start_s=0.5,
            restarts=1,
        ),
    ]


def test_an_engine_waiting_for_weights_that_its_router_still_has_is_taken_out() -> None:
    row = engine(
        "e", state=S.PENDING_WEIGHTS, catch_up="pending", registered=True, probed_at=1.0, ops_in_flight=1
    )
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, now=1.5) == [U("e", pending=pending("deregister")), W("deregister", "e")]
    fleet, ledger = world(
        engine(
            "e",
            state=S.PENDING_WEIGHTS,
            registered=True,
            ops_in_flight=1,
            probed_at=1.0,
            pending=pending("deregister"),
        ),
        routers=[busy_router()],
    )
    assert decide(fleet, ledger, now=1.5) == []


# ------------------------------------------------------------------------------------ health endpoint
def test_with_health_generate_engines_that_cannot_generate_are_polled_on_health() -> None:
    policy = Policy(health_endpoint="/health_generate", health_timeout_s=0.5)
    rows = [engine(name, probed_at=None) for name in ("a", "b", "c")]
    fleet, ledger = world(*rows, routers=[busy_router()])
    gens = {"a": 0, "b": 0, "c": 0}
    ledger.record(
        memory_effect(["kv_cache"], released=True),
        sent={"b": 0},
        accepted=["b"],
        deferred=[],
        generations=gens,
    )
    ledger.record(pause_effect("retract"), sent={"c": 0}, accepted=["c"], deferred=[], generations=gens)
    ledger.record(
        memory_effect(["kv_cache"], released=False),
        sent={"b": 0},
        accepted=["b"],
        deferred=[],
        generations=gens,
    )
    # a: as configured; b offloaded and back: as configured; c paused: /health. (a and b are told only what
    # they took: the records concern only the engines they were sent to or deferred.)
    probes = [(a.engine, a.path) for a in decide(fleet, ledger, now=1.0, policy=policy) if a.kind == "probe"]
    assert probes == [("a", "/health_generate"), ("b", "/health_generate"), ("c", "/health")]
    fleet, ledger = world(engine("d", probed_at=None), routers=[busy_router()])
    ledger.record(
        memory_effect(["kv_cache"], released=True),
        sent={"d": 0},
        accepted=["d"],
        deferred=[],
        generations={"d": 0},
    )
    probes = [(a.engine, a.path) for a in decide(fleet, ledger, now=1.0, policy=policy) if a.kind == "probe"]
    assert probes == [("d", "/health")]


def test_no_health_polls_without_supervision() -> None:
    fleet, ledger = world(engine("e", probed_at=None), routers=[router()])
    assert decide(fleet, ledger, now=5.0, policy=Policy(supervise=False)) == []


# ------------------------------------------------------------------------------------- lost, restarting
def lost(**kw: Any) -> Any:
    values = {
        "state": S.LOST,
        "cleaned_up": True,
        "registered": False,
        "restart_at": 5.0,
        "probed_at": 1.0,
        **kw,
    }
    return engine("e", **values)


def test_a_lost_engine_restarts_only_once_stopped_out_of_its_router_and_past_its_backoff() -> None:
    spawn = [
        T(
            "e",
            S.RESTARTING,
            restarts=1,
            restarts_in_budget=1,
            restart_at=None,
            catch_up="restart",
            registered=False,
            pending=pending("spawn"),
        ),
        W("spawn", "e"),
    ]
    cases = [
        ({"cleaned_up": False}, [], 5.0),
        ({"pending": pending("spawn")}, [], 5.0),
        ({"restart_at": None}, [], 5.0),
        ({}, [], 4.75),
        ({}, spawn, 5.0),
        ({"registered": True, "pending": pending("deregister")}, [], 5.0),
    ]
    for kw, expected, now in cases:
        fleet, ledger = world(lost(**kw), routers=[busy_router()])
        assert decide(fleet, ledger, now=now) == expected, kw
    # Its router is being restarted (it does not have the engine): no need to wait for a deregistration.
    fleet, ledger = world(
        lost(registered=True), routers=[router(state=R.RESTARTING, restarts=1, pending=pending("restart"))]
    )
    assert decide(fleet, ledger, now=5.0) == spawn
    fleet, ledger = world(lost(), routers=[busy_router()])
    assert decide(fleet, ledger, now=5.0, phase="starting") == []


# ------------------------------------------------------------------------------------- removed engines
def test_a_removed_engine_is_taken_out_drained_stopped_and_reported() -> None:
    policy = Policy(drain_timeout_s=30.0)
    fleet, ledger = world(engine("e", retired=True, probed_at=4.0), routers=[busy_router()])
    assert decide(fleet, ledger, now=5.0, policy=policy) == [
        T("e", S.DRAINING, drain_until=35.0, probed_at=None),
        U("e", pending=pending("deregister")),
        W("deregister", "e"),
    ]
    assert decide(fleet, ledger, [done("deregister", "e", 0)], now=5.25, policy=policy) == [
        U("e", pending=NONE),
        U("e", registered=False),
        U("e", probed_at=5.25),
        U("e", pending=pending("drain")),
        W("drain", "e"),
    ]
    assert decide(fleet, ledger, [done("drain", "e", 0, "3 request(s) left")], now=5.3125, policy=policy) == [
        U("e", pending=NONE)
    ]
    assert decide(fleet, ledger, now=5.34375, policy=policy) == []  # asked 94 ms ago: every 100 ms
    assert decide(fleet, ledger, now=5.375, policy=policy) == [
        U("e", probed_at=5.375),
        U("e", pending=pending("drain")),
        W("drain", "e"),
    ]
    assert decide(fleet, ledger, [done("drain", "e", 0)], now=5.5, policy=policy) == [
        U("e", pending=NONE),
        U("e", pending=pending("cleanup")),
        W("cleanup", "e"),
    ]
    assert decide(fleet, ledger, [done("cleanup", "e", 0)], now=6.0, policy=policy) == [
        U("e", pending=NONE),
        U("e", cleaned_up=True),
        T("e", S.STOPPED),
        E("engine_removed", "e", f"engine e ({url('e')}) is out of the deployment"),
    ]


def test_a_removed_engine_is_stopped_at_its_drain_deadline_even_with_requests_left() -> None:
    row = engine("e", state=S.DRAINING, retired=True, registered=False, drain_until=35.0, probed_at=34.96875)
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, now=34.984375) == []
    assert decide(fleet, ledger, now=35.0) == [U("e", pending=pending("cleanup")), W("cleanup", "e")]


def test_a_removed_external_engine_is_only_taken_out_of_its_router() -> None:
    fleet, ledger = world(engine("x", external=True, learned=True, retired=True), routers=[busy_router()])
    assert decide(fleet, ledger, now=1.0, policy=Policy(drain_timeout_s=10.0)) == [
        T("x", S.DRAINING, drain_until=11.0, probed_at=None),
        U("x", pending=pending("deregister")),
        W("deregister", "x"),
    ]
    assert decide(fleet, ledger, [done("deregister", "x", 0)], now=1.25) == [
        U("x", pending=NONE),
        U("x", registered=False),
        T("x", S.STOPPED),
        E("engine_removed", "x", f"engine x ({url('x')}) is out of the deployment"),
    ]


def test_a_removed_engine_that_never_started_is_stopped_at_once() -> None:
    fleet, ledger = world(engine("n", state=S.NEW, retired=True, registered=False), routers=[busy_router()])
    assert decide(fleet, ledger, now=1.0) == [T("n", S.STOPPED)]


@pytest.mark.parametrize("kind", ["spawn", "replay", "register", "learn", "probe"])
def test_a_removed_engine_drains_only_once_its_work_under_way_ended(kind: str) -> None:
    row = engine(
        "e", state=S.CATCHING_UP, catch_up="restart", retired=True, registered=False, pending=pending(kind)
    )
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, now=1.0) == []


def test_a_removed_engine_waits_for_its_own_cleanup_and_a_stopped_one_for_nothing() -> None:
    row = engine("e", state=S.LOST, retired=True, registered=False, pending=pending("cleanup"))
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, now=1.0, policy=Policy(drain_timeout_s=2.0)) == [
        T("e", S.DRAINING, drain_until=3.0, probed_at=None)
    ]
    fleet, ledger = world(
        engine("e", state=S.STOPPED, retired=True, registered=False), routers=[busy_router()]
    )
    assert decide(fleet, ledger, now=1.0) == []


def test_a_given_up_engine_a_change_removes_is_cleaned_up_then_stopped() -> None:
    """A ``failed`` (given-up) engine that a later change removes or starts again: its processes are stopped
    first, then it is ``stopped`` (and the change can drop it)."""
    fleet, ledger = world(
        engine("e", state=S.FAILED, retired=True, registered=False), routers=[busy_router()]
    )
    assert decide(fleet, ledger, now=1.0) == [U("e", pending=pending("cleanup")), W("cleanup", "e")]
    decide(fleet, ledger, [done("cleanup", "e", 0)], now=1.5)
    assert fleet.engine("e").state is S.STOPPED


def test_a_drain_answer_is_only_looked_at_while_draining_and_before_the_cleanup() -> None:
    row = engine("e", state=S.DRAINING, retired=True, registered=False, pending=pending("drain", "cleanup"))
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, [done("drain", "e", 0)], now=1.0) == [U("e", pending=pending("cleanup"))]
    fleet, ledger = world(engine("e", probed_at=1.0, pending=pending("drain")), routers=[busy_router()])
    assert decide(fleet, ledger, [done("drain", "e", 0)], now=1.0) == [U("e", pending=NONE)]


# ------------------------------------------------------------------------------------- added engines
def test_an_added_engine_starts_once_no_other_engine_holds_its_gpus_and_is_reported_serving() -> None:
    new = engine("n", state=S.NEW, registered=False, catch_up="new", slots=(2, 3), gpus="2,3")
    old = engine("r", state=S.DRAINING, retired=True, registered=False, slots=(3,), pending=pending("drain"))
    kept = engine("e", probed_at=1.0, slots=(0, 1), pending=pending("probe"))
    fleet, ledger = world(kept, old, new, routers=[busy_router()])
    assert decide(fleet, ledger, now=1.0) == []  # GPU 3 is still r's
    fleet.transition("r", S.STOPPED)
    assert decide(fleet, ledger, now=1.25) == [U("n", pending=pending("spawn")), W("spawn", "n")]
    assert decide(fleet, ledger, now=1.5) == []  # its start is under way
    assert decide(fleet, ledger, [done("spawn", "n", 0)], now=2.0) == [
        U("n", pending=NONE),
        T("n", S.STARTING, started_at=2.0, probed_at=None, health_failures=0, cleaned_up=False),
        U("n", probed_at=2.0),
        U("n", pending=pending("probe")),
        W("probe", "n", path="/health_generate", timeout_s=2.0),
    ]
    decide(fleet, ledger, [done("probe", "n", 0)], now=2.5)
    assert decide(fleet, ledger, [done("register", "n", 0)], now=3.0) == [
        U("n", pending=NONE),
        U("n", registered=True),
        T("n", S.SERVING, catch_up="", health_failures=0, probed_at=3.0, divergence=""),
        E(
            "engine_added",
            "n",
            f"engine n ({url('n')}) serves (0.5 s its own start)",
            downtime_s=0.0,
            start_s=0.5,
            restarts=0,
        ),
    ]


def test_an_added_engine_starts_in_the_pass_the_removed_engine_holding_its_gpus_stops() -> None:
    """The added engine n comes before the removed r in the fleet; r's cleanup ends: r stops and n starts in
    the same decision, not at the loop's next wake."""
    new = engine("n", state=S.NEW, registered=False, catch_up="new", slots=(3,), gpus="3")
    old = engine(
        "r", state=S.DRAINING, retired=True, registered=False, slots=(3,), pending=pending("cleanup"),
        drain_until=5.0,
    )  # fmt: skip
    fleet, ledger = world(new, old, routers=[busy_router()])
    actions = decide(fleet, ledger, [done("cleanup", "r", 0)], now=6.0)
    assert [a.kind for a in actions][-2:] == ["update", "spawn"] and actions[-1] == W("spawn", "n")
    assert E("engine_removed", "r", f"engine r ({url('r')}) is out of the deployment") in actions
    assert (
        actions.index(E("engine_removed", "r", f"engine r ({url('r')}) is out of the deployment"))
        < len(actions) - 2
    )


def test_an_added_engine_whose_first_start_fails_is_started_again_and_then_reported_added() -> None:
    """Its first start is no restart (the message says so) and, once it serves after the retry, the event is
    engine_added, as for one that started the first time."""
    new = engine("n", state=S.NEW, registered=False, catch_up="new", slots=(2, 3), gpus="2,3", restarts=0)
    new.pending = pending("spawn")
    fleet, ledger = world(new, routers=[busy_router()])
    failed = decide(fleet, ledger, [done("spawn", "n", 0, "it could not be started: boom")], now=5.0)
    assert failed[:2] == [
        U("n", pending=NONE),
        E("engine_restart_failed", "n", "the start of added engine n failed: it could not be started: boom"),
    ]
    row = fleet.engine("n")
    assert row.state is S.LOST and row.catch_up == "new" and row.cleaned_up is False
    decide(fleet, ledger, [done("cleanup", "n", 0)], now=5.25)
    assert fleet.engine("n").state is S.RESTARTING and fleet.engine("n").catch_up == "new"
    decide(fleet, ledger, [done("spawn", "n", 1)], now=5.5)
    decide(fleet, ledger, [done("probe", "n", 1)], now=6.0)
    served = decide(fleet, ledger, [done("register", "n", 1)], now=6.5)
    assert [a.event for a in served if a.kind == "emit"] == ["engine_added"]
    assert fleet.engine("n").state is S.SERVING


# ---------------------------------------------------------------------------------------------- routers
def router_world(**router_kw: Any) -> tuple[Fleet, Any]:
    """e serves (registered), d serves while it is brought to the ledger, c is caught up after a restart (not
    registered), g serves another model."""
    rows = [
        engine("e", probed_at=7.0, pending=pending("probe")),
        engine("d", state=S.CATCHING_UP, catch_up="divergence", registered=True, ops_in_flight=1),
        engine("c", state=S.CATCHING_UP, catch_up="restart", registered=False),
        engine("g", model="critic", probed_at=7.0, pending=pending("probe")),
    ]
    return world(*rows, routers=[router(**router_kw)])


def test_a_lost_router_is_restarted_with_the_engines_in_service() -> None:
    fleet, ledger = router_world(probed_at=7.0)
    exit_ = router_done("router_exited", "actor", "its process exited with code 1")
    reason = "its process exited with code 1"
    assert decide(fleet, ledger, [exit_], now=7.0) == [
        RU(pending=NONE),
        RT(R.LOST, lost_at=7.0),
        E("router_lost", "router.actor", f"router of model actor lost: {reason}", reason=reason),
        RT(R.RESTARTING, restarts=1, pending=NONE),
        RU(pending=pending("restart")),
        RW("restart", details={"workers": ("e", "d")}),
    ]  # c does not register while its router is away


def test_a_router_back_serves_what_it_was_started_with_lists_them_and_is_reported() -> None:
    fleet, ledger = router_world(state=R.RESTARTING, restarts=1, lost_at=7.0, pending=pending("restart"))
    started = router_done("router_restart", "actor", generation=1, details={"workers": ("e",)})
    assert decide(fleet, ledger, [started], now=8.0) == [
        RU(pending=NONE),
        RT(R.STARTING, probed_at=None, health_failures=0, started_with=("e",), started_at=8.0),
        U("e", registered=True),
        U("d", registered=False),
        U("c", registered=False),
        RU(probed_at=8.0),
        RU(pending=pending("probe")),
        RW("probe"),
    ]
    assert decide(fleet, ledger, now=8.0625) == []  # its probe is out (50 ms have passed: no second one)
    assert decide(
        fleet, ledger, [router_done("router_probe", "actor", "refused", generation=1)], now=8.03125
    ) == [RU(pending=NONE)]  # polled every 50 ms while it starts again
    assert decide(fleet, ledger, now=8.0625) == [
        RU(probed_at=8.0625),
        RU(pending=pending("probe")),
        RW("probe"),
    ]
    assert decide(fleet, ledger, [router_done("router_probe", "actor", generation=1)], now=8.125) == [
        RU(pending=NONE),
        RT(R.LIVE, health_failures=0),
        U("c", pending=pending("register")),  # its router answers again: c registers
        W("register", "c"),
        RU(probed_at=8.125),
        RU(pending=pending("list")),
        RW("list", details={"workers": ("e",)}),
    ]  # restarted: it lists its workers at once, whoever is still to register
    assert decide(
        fleet, ledger, [router_done("router_list", "actor", "d is missing", generation=1)], now=8.15625
    ) == [RU(pending=NONE)]
    assert decide(fleet, ledger, [router_done("router_list", "actor", generation=1)], now=8.5) == [
        RU(pending=NONE),
        RT(R.READY, health_failures=0, probed_at=8.5),
        RU(lost_at=None),
        E(
            "router_recovered",
            "router.actor",
            "router of model actor serves again after 1.5 s",
            downtime_s=1.5,
        ),
    ]


def test_a_router_that_cannot_be_brought_back_fails_the_deployment() -> None:
    fleet, ledger = router_world(state=R.RESTARTING, restarts=1, pending=pending("restart"))
    failed = router_done("router_restart", "actor", "port 30000 is in use", generation=1)
    assert decide(fleet, ledger, [failed], now=8.0) == [
        RU(pending=NONE),
        END("fail", "router of model actor could not be brought back: port 30000 is in use"),
    ]


def test_router_outcomes_out_of_their_state_are_ignored() -> None:
    fleet, ledger = world(
        engine("e", probed_at=1.0), routers=[router(probed_at=1.0, pending=pending("restart", "list"))]
    )
    observations = [
        router_done("router_restart", "actor", details={"workers": ()}),
        router_done("router_list", "actor"),
    ]
    assert decide(fleet, ledger, observations, now=1.5) == [RU(pending=pending("list")), RU(pending=NONE)]
    assert fleet.router("actor").state is R.READY and fleet.engine("e").registered
    fleet, ledger = world(
        engine("e", probed_at=1.0), routers=[router(state=R.LIVE, pending=pending("probe", "list"))]
    )
    assert decide(fleet, ledger, [router_done("router_probe", "actor", "refused")], now=1.5) == [
        RU(pending=pending("list"))
    ]


def test_a_ready_router_that_stops_answering_is_lost_after_the_threshold() -> None:
    fleet, ledger = world(
        engine("e", probed_at=1.0), routers=[router(probed_at=1.0, pending=pending("probe"))]
    )
    bad = router_done("router_probe", "actor", "no answer")
    assert decide(fleet, ledger, [router_done("router_probe", "actor")], now=1.5) == [RU(pending=NONE)]
    fleet.update_router("actor", pending=pending("probe"))
    assert decide(fleet, ledger, [bad], now=1.5) == [RU(pending=NONE), RU(health_failures=1)]
    fleet.update_router("actor", pending=pending("probe"))
    assert decide(fleet, ledger, [router_done("router_probe", "actor")], now=1.5) == [
        RU(pending=NONE),
        RU(health_failures=0),
    ]
    fleet.update_router("actor", health_failures=1, pending=pending("probe"))
    reason = "no answer to /liveness (2 polls in a row)"
    assert decide(fleet, ledger, [bad], now=1.75) == [
        RU(pending=NONE),
        RU(health_failures=2),
        RT(R.LOST, lost_at=1.75),
        E("router_lost", "router.actor", f"router of model actor lost: {reason}", reason=reason),
        RT(R.RESTARTING, restarts=1, pending=NONE),
        RU(pending=pending("restart")),
        RW("restart", details={"workers": ("e",)}),
    ]


def test_failed_router_polls_at_start_up_do_not_lose_it() -> None:
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False, probed_at=1.0),
        routers=[router(health_failures=1, pending=pending("probe"))],
    )
    bad = router_done("router_probe", "actor", "no answer")
    assert decide(fleet, ledger, [bad], now=1.0, phase="starting") == [
        RU(pending=NONE),
        RU(health_failures=2),
    ]


def test_a_router_exit_fails_the_start_and_is_ignored_when_not_running_or_unwatched() -> None:
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False, probed_at=1.0), routers=[router(state=R.LIVE)]
    )
    exit_ = router_done("router_exited", "actor", "its process exited with code 1")
    assert decide(fleet, ledger, [exit_], now=1.0, phase="starting") == [
        RU(pending=NONE),
        END("startup_failed", "its process exited with code 1", cause="router_exited", router="actor"),
    ]
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False, probed_at=1.0), routers=[router(state=R.STARTING)]
    )
    assert decide(
        fleet, ledger, [Observation("router_exited", router="actor", ok=False)], now=1.0, phase="starting"
    ) == [
        RU(pending=NONE),
        END("startup_failed", "", cause="router_exited", router="actor"),
    ]
    for state in (R.LOST, R.RESTARTING, R.FAILED, R.STOPPED):
        fleet, ledger = world(engine("e", probed_at=1.0), routers=[router(state=state)])
        assert decide(fleet, ledger, [exit_], now=1.0) == [RU(pending=NONE)], state
    fleet, ledger = world(engine("e", probed_at=1.0), routers=[router()])
    assert decide(fleet, ledger, [exit_], now=1.0, policy=Policy(supervise=False)) == [RU(pending=NONE)]


def test_a_router_exit_without_a_problem_and_its_last_restart() -> None:
    fleet, ledger = world(engine("e", probed_at=1.0), routers=[router(restarts=2, pending=pending("probe"))])
    actions = decide(
        fleet,
        ledger,
        [Observation("router_exited", router="actor", generation=2, ok=False)],
        now=3.0,
        policy=Policy(router_max_restarts=2),
    )
    assert actions == [
        RU(pending=pending("probe")),
        RT(R.LOST, lost_at=3.0),
        E(
            "router_lost",
            "router.actor",
            "router of model actor lost: its process exited",
            reason="its process exited",
        ),
        END(
            "fail",
            "router of model actor lost: its process exited; its 2 restarts (supervision.router_max_restarts) are used up",
        ),
    ]


def test_the_outcome_of_an_older_router_process_is_stale() -> None:
    fleet, ledger = world(engine("e", probed_at=1.0), routers=[router(restarts=1, pending=pending("probe"))])
    assert (
        decide(fleet, ledger, [router_done("router_probe", "actor", "no answer", generation=0)], now=1.0)
        == []
    )
    assert fleet.router("actor").pending == pending("probe")


def test_a_starting_router_is_polled_at_the_poll_interval_and_lists_once_every_engine_registered() -> None:
    policy = Policy(poll_interval_s=0.25)
    rows = (
        engine("e", registered=False, pending=pending("probe")),
        engine("l", state=S.LOST, registered=False),
    )
    fleet, ledger = world(*rows, routers=[router(state=R.STARTING, probed_at=1.0)])
    assert decide(fleet, ledger, now=1.125, policy=policy, phase="starting") == []
    assert decide(fleet, ledger, now=1.25, policy=policy, phase="starting") == [
        RU(probed_at=1.25),
        RU(pending=pending("probe")),
        RW("probe"),
    ]
    assert decide(
        fleet, ledger, [router_done("router_probe", "actor")], now=1.5, policy=policy, phase="starting"
    ) == [
        RU(pending=NONE),
        RT(R.LIVE, health_failures=0),
    ]  # e is not registered yet: no listing
    fleet.update("e", registered=True)  # l is lost: not waited for
    assert decide(fleet, ledger, now=1.5, policy=policy, phase="starting") == [
        RU(probed_at=1.5),
        RU(pending=pending("list")),
        RW("list", details={"workers": ("e",)}),
    ]
    assert decide(fleet, ledger, now=1.53125, policy=policy, phase="starting") == []
    fleet.update_router("actor", pending=NONE)
    assert (
        decide(fleet, ledger, now=1.53125, policy=policy, phase="starting") == []
    )  # 31 ms after: every 50 ms
    assert [a.kind for a in decide(fleet, ledger, now=1.5625, policy=policy, phase="starting")] == [
        "router_update",
        "router_update",
        "router_list",
    ]
    assert decide(
        fleet, ledger, [router_done("router_list", "actor")], now=1.75, policy=policy, phase="starting"
    ) == [
        RU(pending=NONE),
        RT(R.READY, health_failures=0, probed_at=1.75),
    ]  # ready at start-up: nothing to report


def test_a_ready_router_is_polled_every_health_interval_while_supervised_and_serving() -> None:
    policy = Policy(health_interval_s=0.5)
    fleet, ledger = world(engine("e", probed_at=10.0), routers=[router(probed_at=10.0)])
    assert decide(fleet, ledger, now=10.25, policy=policy) == []
    assert decide(fleet, ledger, now=10.5, policy=policy) == [
        U("e", probed_at=10.5),
        U("e", pending=pending("probe")),
        W("probe", "e", path="/health", timeout_s=2.0),
        RU(probed_at=10.5),
        RU(pending=pending("probe")),
        RW("probe"),
    ]
    fleet, ledger = world(
        engine("e", probed_at=10.0, pending=pending("probe")), routers=[router(probed_at=1.0)]
    )
    assert decide(fleet, ledger, now=10.5, policy=Policy(supervise=False)) == []
    assert decide(fleet, ledger, now=10.5, phase="starting") == [END("ready")]


# ----------------------------------------------------------------------------------------- start-up
def test_start_up_is_ready_only_with_every_engine_serving_and_every_router_ready() -> None:
    fleet, ledger = world(
        engine("e", probed_at=1.0),
        engine("f", state=S.CATCHING_UP, registered=False, ops_in_flight=1),
        routers=[busy_router()],
    )
    assert decide(fleet, ledger, now=1.0, phase="starting") == []
    fleet, ledger = world(engine("e", probed_at=1.0), routers=[router(state=R.LIVE, pending=pending("list"))])
    assert decide(fleet, ledger, now=1.0, phase="starting") == []
    fleet, ledger = world(engine("e", probed_at=1.0), routers=[busy_router()])
    assert decide(fleet, ledger, now=1.0, phase="starting") == [END("ready")]


def test_start_up_fails_once_past_its_deadline_not_at_it() -> None:
    fleet, ledger = world(
        engine("e", state=S.STARTING, registered=False, pending=pending("probe")), routers=[busy_router()]
    )
    assert decide(fleet, ledger, now=60.0, phase="starting", deadline=60.0) == []
    assert decide(fleet, ledger, now=60.0078125, phase="starting", deadline=60.0) == [
        END("startup_failed", "", cause="timeout")
    ]
    assert decide(fleet, ledger, now=1e9, phase="starting") == []  # no deadline given


# ---------------------------------------------------------------------------------------------- next_wake
P = Policy(poll_interval_s=0.25, health_interval_s=0.5, startup_timeout_s=0.5)


def wake(
    *rows: Any,
    routers: tuple = (),
    now: float = 10.0,
    phase: str = "serving",
    policy: Policy = P,
    deadline: float | None = None,
) -> float:
    return next_wake(Fleet(list(rows), list(routers)), policy, now, phase=phase, startup_deadline=deadline)


@pytest.mark.parametrize(
    ("rows", "now", "phase", "expected"),
    [
        # starting: polled every poll_interval_s (0.25) from its last poll
        ([engine("e", state=S.STARTING, probed_at=10.0)], 10.125, "starting", 0.125),
        # at start-up its row's deadline does not count (the launch's deadline does)
        ([engine("e", state=S.STARTING, started_at=9.0, pending=pending("probe"))], 10.0, "starting", 1.0),
        # restarted: every 50 ms at most, and the deadline startup_timeout_s (0.5) after its start
        ([engine("e", state=S.STARTING, probed_at=10.0)], 10.0, "serving", 0.05),
        ([engine("e", state=S.STARTING, started_at=10.0, pending=pending("probe"))], 10.25, "serving", 0.25),
        ([engine("e", state=S.STARTING, started_at=None, pending=pending("probe"))], 10.25, "serving", 1.0),
        ([engine("e", state=S.STARTING, started_at=10.0, probed_at=10.125)], 10.125, "serving", 0.05),
        # lost: its restart time once cleaned up (serving only)
        ([engine("e", state=S.LOST, cleaned_up=True, restart_at=10.5)], 10.25, "serving", 0.25),
        ([engine("e", state=S.LOST, cleaned_up=False, restart_at=10.5)], 10.25, "serving", 1.0),
        ([engine("e", state=S.LOST, cleaned_up=True, restart_at=10.5)], 10.25, "starting", 1.0),
        ([engine("e", state=S.LOST, cleaned_up=True, restart_at=None)], 10.25, "serving", 1.0),
        # up, or an external engine away: its next health poll
        ([engine("e", probed_at=10.0)], 10.25, "serving", 0.25),
        ([engine("e", state=S.PENDING_WEIGHTS, probed_at=10.0)], 10.125, "serving", 0.375),
        ([engine("x", state=S.LOST, external=True, probed_at=10.0)], 10.25, "serving", 0.25),
        ([engine("e", probed_at=10.0, pending=pending("probe"))], 10.25, "serving", 1.0),
        ([engine("e", probed_at=10.0)], 10.25, "starting", 1.0),
        # nothing is due for an engine being caught up or restarted
        ([engine("e", state=S.CATCHING_UP, probed_at=10.0)], 10.25, "serving", 1.0),
        ([engine("e", state=S.RESTARTING, probed_at=10.0)], 10.25, "serving", 1.0),
        # the earliest of them; at least 5 ms, at most 1 s
        (
            [engine("e", probed_at=10.0), engine("f", state=S.LOST, cleaned_up=True, restart_at=10.375)],
            10.25,
            "serving",
            0.125,
        ),
        ([engine("e", probed_at=8.0)], 10.25, "serving", 0.005),
        ([engine("e", state=S.LOST, cleaned_up=True, restart_at=15.0)], 10.25, "serving", 1.0),
    ],
)
def test_next_wake_for_engines(rows: list, now: float, phase: str, expected: float) -> None:
    assert wake(*rows, now=now, phase=phase) == pytest.approx(expected, abs=1e-9)


def test_next_wake_without_supervision_waits_for_restarts_only() -> None:
    unwatched = Policy(supervise=False, health_interval_s=0.5)
    assert wake(engine("e", probed_at=10.0), now=10.25, policy=unwatched) == 1.0
    assert (
        wake(engine("e", state=S.LOST, cleaned_up=True, restart_at=10.5), now=10.25, policy=unwatched) == 0.25
    )


@pytest.mark.parametrize(
    ("routers", "now", "phase", "expected"),
    [
        ([router(state=R.STARTING, probed_at=10.0)], 10.125, "serving", 0.125),
        ([router(state=R.STARTING, probed_at=10.0, lost_at=9.0)], 10.0, "serving", 0.05),
        ([router(state=R.LIVE, probed_at=10.0)], 10.03125, "starting", 0.01875),
        ([router(state=R.READY, probed_at=10.0)], 10.25, "serving", 0.25),
        ([router(state=R.READY, probed_at=10.0)], 10.25, "starting", 1.0),
        ([router(state=R.STARTING, probed_at=10.0, pending=pending("probe"))], 10.0, "serving", 1.0),
        ([router(state=R.LIVE, probed_at=10.0, pending=pending("list"))], 10.0, "serving", 1.0),
        ([router(state=R.RESTARTING, pending=pending("restart"))], 10.0, "serving", 1.0),
        ([router(state=R.RESTARTING)], 10.0, "serving", 1.0),
        ([router(state=R.LOST)], 10.0, "serving", 1.0),
    ],
)
def test_next_wake_for_routers(routers: list, now: float, phase: str, expected: float) -> None:
    assert wake(routers=tuple(routers), now=now, phase=phase) == pytest.approx(expected, abs=1e-9)
    assert wake(
        routers=tuple(routers), now=now, phase=phase, policy=Policy(supervise=False, poll_interval_s=0.25)
    ) == pytest.approx(1.0 if routers[0].state is R.READY else expected, abs=1e-9)


def test_next_wake_at_start_up_counts_the_launch_deadline() -> None:
    assert wake(now=10.0, phase="starting", deadline=10.25) == 0.25
    assert wake(now=10.0, phase="serving", deadline=10.25) == 1.0
    assert wake(now=10.0, phase="starting", deadline=None) == 1.0
    assert (
        wake(engine("e", state=S.STARTING, probed_at=10.0), now=10.0, phase="starting", deadline=10.125)
        == 0.125
    )


def test_next_wake_for_a_draining_engine_is_its_next_drain_query_or_its_drain_deadline() -> None:
    """A removed engine is asked for its requests every 100 ms and stopped at drain_until (the rules of
    _advance_retired): the loop must wake for them, not only within its 1 s."""

    def draining(**kw: Any) -> Any:
        values = {"state": S.DRAINING, "retired": True, "registered": False, "probed_at": 10.0, **kw}
        return engine("e", **values)

    assert wake(draining(drain_until=70.0), now=10.0625) == pytest.approx(0.0375)
    assert wake(draining(drain_until=10.03125), now=10.0) == pytest.approx(0.03125)
    assert wake(draining(drain_until=None), now=10.0625) == pytest.approx(0.0375)  # no deadline: queries only
    # While its deregistration, drain query or cleanup is out, the outcome wakes the loop.
    assert wake(draining(registered=True, drain_until=10.03125), now=10.0) == 1.0
    for kind in ("drain", "cleanup", "deregister"):
        assert wake(draining(drain_until=10.03125, pending=pending(kind)), now=10.0) == 1.0, kind
    # The decision is due then: at 10.1 the next drain query goes out.
    fleet, ledger = world(draining(drain_until=70.0), routers=[busy_router()])
    due = 10.0625 + next_wake(fleet, P, 10.0625, phase="serving") + 1e-9  # (10.1 - 10.0 < 0.1 in floats)
    assert decide(fleet, ledger, now=due - 0.0078125, policy=P) == []
    assert [a.kind for a in decide(fleet, ledger, now=due, policy=P)] == ["update", "update", "drain"]


# ------------------------------------------------------------------------ corners of the rules above
def test_an_added_engine_its_router_refuses_is_lost_and_started_again() -> None:
    row = engine("n", state=S.CATCHING_UP, catch_up="new", registered=False, pending=pending("register"))
    fleet, ledger = world(row, routers=[busy_router()])
    why = "its router refused it: 409 WORKER_ALREADY_EXISTS"
    assert decide(fleet, ledger, [done("register", "n", 0, "409 WORKER_ALREADY_EXISTS")], now=4.0) == [
        U("n", pending=NONE),
        T("n", S.LOST, lost_at=4.0, lost_reason=why, cleaned_up=False, health_failures=0, probed_at=4.0),
        E("engine_lost", "n", f"engine n ({url('n')}) lost: {why}", reason=why),
        U("n", pending=pending("cleanup")),
        W("cleanup", "n"),
        U("n", restarts_in_budget=0, restart_at=4.0, recovered_at=None),
        E(
            "engine_restarting",
            "n",
            f"restarting engine n (restart 1 of 3) {RESTARTING_TEXT} (0)",
            attempt=1,
            delay_s=0.0,
        ),
    ]


def test_an_engine_waiting_for_weights_while_its_router_restarts_with_it_serves_once_it_has_them() -> None:
    """The router was lost while e served, so it is being restarted with e; meanwhile e lacks the weights of a
    group. It is not taken out of a router that is away (no deregistration), and once it has the weights it
    serves again at once: its router was started with it."""
    row = engine(
        "e",
        state=S.PENDING_WEIGHTS,
        catch_up="pending",
        registered=True,
        probed_at=2.0,
        started_at=0.5,
        healthy_at=1.0,
    )
    away = router(state=R.RESTARTING, restarts=1, lost_at=1.5, pending=pending("restart"))
    fleet, ledger = world(row, engine("f", pending=pending("probe")), routers=[away])
    gens = {"e": 0, "f": 0}
    ledger.record(
        ledger.distributed_effect(None), sent={"f": 0}, accepted=["f"], deferred=["e"], generations=gens
    )
    assert decide(fleet, ledger, now=2.5) == []
    ledger.record(
        ledger.distributed_effect(None), sent=gens, accepted=["e", "f"], deferred=[], generations=gens
    )
    assert decide(fleet, ledger, now=2.75) == [
        T("e", S.CATCHING_UP, catch_up="pending"),
        T("e", S.SERVING, catch_up="", health_failures=0, probed_at=2.75, divergence=""),
        U("e", recovered_at=2.75, lost_at=None),
        E(
            "engine_admitted",
            "e",
            "engine e got weights and serves again",
            downtime_s=0.0,
            start_s=0.5,
            restarts=0,
        ),
    ]


def test_a_divergence_of_several_calls_is_reported_as_one_list() -> None:
    fleet, ledger = world(engine("e", probed_at=1.0), engine("f", probed_at=1.0), routers=[busy_router()])
    gens = {"e": 0, "f": 0}
    for effect in (memory_effect(["kv_cache"], released=True), pause_effect("abort")):
        ledger.record(effect, sent=gens, accepted=["f"], deferred=[], generations=gens)
    what = '/release_memory_occupation {"tags": ["kv_cache"]}; /pause_generation {"mode": "abort"}'
    assert decide(fleet, ledger, now=1.5) == [
        E(
            "engine_diverged",
            "e",
            f"engine e does not have the control state the ledger says it should: {what}; bringing it there",
            missing=what,
        ),
        T("e", S.CATCHING_UP, catch_up="divergence", divergence=what),
        U("e", pending=pending("replay")),
        W(
            "replay",
            "e",
            calls=(
                call("/release_memory_occupation", {"tags": ["kv_cache"]}),
                call("/pause_generation", {"mode": "abort"}),
            ),
        ),
    ]


def test_a_removed_engine_waits_for_its_deregistration_even_once_its_router_has_let_go() -> None:
    """Its router was restarted without it (so it is not registered any more) while its deregistration was
    out: nothing more starts for it until that outcome is in."""
    row = engine(
        "e", state=S.DRAINING, retired=True, registered=False, drain_until=70.0, pending=pending("deregister")
    )
    fleet, ledger = world(row, routers=[busy_router()])
    assert decide(fleet, ledger, now=5.0) == []
    assert decide(
        fleet, ledger, [done("deregister", "e", 0, "deregister failed (ConnectError)")], now=5.25
    ) == [
        U("e", pending=NONE),
        U("e", registered=False),
        U("e", probed_at=5.25),
        U("e", pending=pending("drain")),
        W("drain", "e"),
    ]


def test_a_router_started_again_without_workers_has_none_of_its_engines() -> None:
    away = router(state=R.RESTARTING, restarts=1, lost_at=7.0, pending=pending("restart"))
    fleet, ledger = world(engine("e", pending=pending("probe")), routers=[away])
    assert decide(fleet, ledger, [router_done("router_restart", "actor", generation=1)], now=8.0) == [
        RU(pending=NONE),
        RT(R.STARTING, probed_at=None, health_failures=0, started_with=(), started_at=8.0),
        U("e", registered=False),
        RU(probed_at=8.0),
        RU(pending=pending("probe")),
        RW("probe"),
    ]


# ------------------------------------------------------------------------------- the start-up's engines
def test_the_start_ups_engines_are_started_by_the_loop_all_in_its_first_pass() -> None:
    """At start-up the engines are new and the first decision starts every one (the plan gave each its own
    GPUs); the external engine is only polled."""
    a = engine("a", state=S.NEW, registered=False, slots=(0,))
    b = engine("b", state=S.NEW, registered=False, slots=(1, 2), gpus="1,2")
    x = engine(
        "x", state=S.STARTING, external=True, registered=False, probed_at=0.0, pending=pending("probe")
    )
    fleet, ledger = world(a, b, x, routers=[busy_router()])
    assert decide(fleet, ledger, now=0.0, phase="starting", deadline=600.0) == [
        U("a", pending=pending("spawn")),
        W("spawn", "a"),
        U("b", pending=pending("spawn")),
        W("spawn", "b"),
    ]
    assert decide(fleet, ledger, [done("spawn", "a", 0)], now=0.25, phase="starting", deadline=600.0) == [
        U("a", pending=NONE),
        T("a", S.STARTING, started_at=0.25, probed_at=None, health_failures=0, cleaned_up=False),
        U("a", probed_at=0.25),
        U("a", pending=pending("probe")),
        W("probe", "a", path="/health_generate", timeout_s=2.0),
    ]


def test_a_start_up_engine_that_cannot_be_started_ends_the_start_up_with_its_error() -> None:
    fleet, ledger = world(engine("a", state=S.NEW, registered=False, pending=pending("spawn")))
    error = "[Errno 2] No such file or directory: 'python9'"
    failed = done("spawn", "a", 0, f"it could not be started: {error}", details={"error": error})
    assert decide(fleet, ledger, [failed], now=0.5, phase="starting", deadline=600.0) == [
        U("a", pending=NONE),
        END("startup_failed", error, cause="spawn", engine="a"),
    ]


def test_a_start_up_engine_that_exits_at_once_ends_the_start_up_as_an_exit() -> None:
    """Its process exited before the loop took the spawn in: the report is the exit's (code, log tail)."""
    fleet, ledger = world(engine("a", state=S.NEW, registered=False, pending=pending("spawn")))
    gone = done("spawn", "a", 0, "process a exited at once with code 3", details={"exited": True})
    assert decide(fleet, ledger, [gone], now=0.5, phase="starting", deadline=600.0) == [
        U("a", pending=NONE),
        END("startup_failed", "process a exited at once with code 3", cause="exited", engine="a"),
    ]
