"""The decisions that keep a change of a running deployment safe, on the pure policy with a fake clock: a router
restarted while a poll of its old process was out is polled again and becomes ready; a restarted router that
never becomes ready is restarted again at its deadline; a restarted router is never given an engine that is
being removed; a removed engine that dies is not restarted, and an added engine waits for its GPUs.

Each case is one that failed on the running product (issue 36's reproductions), reduced to the decisions."""

from __future__ import annotations

from miles_sglang_plugin.serving.fleet import EngineState, RouterState
from miles_sglang_plugin.serving.policy import Policy, done, exited, router_done
from tests.test_reconciler_policy import decide, engine, events, work, world

S = EngineState
R = RouterState


def router_work(actions) -> list[str]:  # type: ignore[no-untyped-def]
    return [kind for kind in work(actions) if kind.startswith("router_")]


def _lose_router(fleet, ledger, *, now: float, policy: Policy) -> None:  # type: ignore[no-untyped-def]
    decide(fleet, ledger, [router_done("router_exited", "actor", "its process exited with code -9")], now=now,
           policy=policy)  # fmt: skip


def test_a_poll_out_when_the_router_died_does_not_block_the_polls_of_its_new_process() -> None:
    """The wedge: a /liveness poll of the old process is out (pending) when the router dies; its answer comes
    back tagged with the old generation and is dropped. The restarted router must still be polled, become
    live, list its workers and be ready, with ``router_recovered``."""
    policy = Policy(health_interval_s=1.0)
    fleet, ledger = world(engine("a"), engine("b"))
    # t=1.0: the ready router is polled (a poll is now out, pending)
    actions = decide(fleet, ledger, now=1.0, policy=policy)
    assert router_work(actions) == ["router_probe"]
    assert fleet.router("actor").pending == frozenset({"probe"})
    # t=1.2: it is SIGKILLed while that poll is out
    _lose_router(fleet, ledger, now=1.2, policy=policy)
    assert fleet.router("actor").state is R.RESTARTING
    assert fleet.router("actor").pending == frozenset({"restart"})  # the old poll is not pending any more
    # t=1.3: the old poll comes back (failed, old generation 0): dropped
    decide(fleet, ledger, [router_done("router_probe", "actor", "connection refused", generation=0)], now=1.3,
           policy=policy)  # fmt: skip
    # t=1.5: the new process runs; it is polled at once
    actions = decide(
        fleet, ledger, [router_done("router_restart", "actor", generation=1, details={"workers": ("a", "b")})],
        now=1.5, policy=policy,
    )  # fmt: skip
    assert fleet.router("actor").state is R.STARTING
    assert router_work(actions) == ["router_probe"]
    actions = decide(
        fleet, ledger, [router_done("router_probe", "actor", generation=1)], now=1.6, policy=policy
    )
    assert fleet.router("actor").state is R.LIVE
    (listing,) = [a for a in actions if a.kind == "router_list"]
    assert tuple(listing.details["workers"]) == ("a", "b")
    actions = decide(
        fleet, ledger, [router_done("router_list", "actor", generation=1)], now=1.7, policy=policy
    )
    assert fleet.router("actor").state is R.READY
    assert [kind for kind, _m in events(actions)] == ["router_recovered"]


def test_a_restarted_router_not_ready_by_its_deadline_is_restarted_again() -> None:
    """Its process answers /liveness but never lists its workers as healthy: 60 s after its restart it is lost
    again and restarted (restart 2 of 3), not left ``live`` for good."""
    policy = Policy(router_max_restarts=3)
    fleet, ledger = world(engine("a"))
    _lose_router(fleet, ledger, now=10.0, policy=policy)
    decide(fleet, ledger, [router_done("router_restart", "actor", generation=1, details={"workers": ("a",)})],
           now=11.0, policy=policy)  # fmt: skip
    decide(fleet, ledger, [router_done("router_probe", "actor", generation=1)], now=11.1, policy=policy)
    assert fleet.router("actor").state is R.LIVE
    # the listings keep failing (the worker is not healthy in it)
    decide(fleet, ledger, [router_done("router_list", "actor", "a not healthy", generation=1)], now=11.2,
           policy=policy)  # fmt: skip
    actions = decide(fleet, ledger, now=70.9, policy=policy)  # 59.9 s after the restart: still waited for
    assert "router_restart" not in router_work(actions)
    assert fleet.router("actor").state is R.LIVE
    actions = decide(fleet, ledger, now=71.0, policy=policy)  # 60 s: lost again
    assert fleet.router("actor").state is R.RESTARTING
    assert fleet.router("actor").restarts == 2
    assert router_work(actions) == ["router_restart"]
    assert [m for k, m in events(actions) if k == "router_lost"] == [
        "router of model actor lost: not ready 60.0 s after its restart"
    ]


def test_the_readiness_deadline_wakes_the_loop_even_with_a_poll_out() -> None:
    from miles_sglang_plugin.serving.policy import next_wake

    policy = Policy()
    fleet, ledger = world(engine("a"))
    _lose_router(fleet, ledger, now=0.0, policy=policy)
    decide(fleet, ledger, [router_done("router_restart", "actor", generation=1, details={"workers": ("a",)})],
           now=1.0, policy=policy)  # fmt: skip
    assert fleet.router("actor").pending == frozenset({"probe"})  # a poll out, which may never come back
    fleet.update_router("actor", probed_at=None)
    # only the deadline is left to wake for (the engine's own poll aside)
    fleet.update("a", pending=frozenset({"probe"}))
    assert next_wake(fleet, policy, 30.0, phase="serving") == 1.0  # capped at 1 s, never "never"
    assert next_wake(fleet, policy, 60.5, phase="serving") == 0.5


def test_a_restarted_router_is_not_given_an_engine_being_removed() -> None:
    """An apply removed ``c`` (retired, still serving and registered) when the router died: the new router is
    started with ``a`` and ``b`` only, and ``c`` drains instead of taking requests again."""
    fleet, ledger = world(engine("a"), engine("b"), engine("c", retired=True))
    actions = decide(fleet, ledger, [router_done("router_exited", "actor", "its process exited with code -9")],
                     now=5.0)  # fmt: skip
    (restart,) = [a for a in actions if a.kind == "router_restart"]
    assert tuple(restart.details["workers"]) == ("a", "b")
    decide(fleet, ledger, [router_done("router_restart", "actor", generation=1, details={"workers": ("a", "b")})],
           now=5.5)  # fmt: skip
    assert fleet.engine("c").registered is False
    assert fleet.engine("c").state is S.DRAINING


def test_a_removed_engine_that_dies_is_not_restarted() -> None:
    """``c`` is being removed (draining) when its process is killed: it is cleaned up and leaves, with no
    ``engine_restarting`` and no spawn."""
    policy = Policy(max_restarts=3)
    fleet, ledger = world(engine("a"), engine("c", retired=True, state=S.DRAINING, registered=False,
                                               drain_until=100.0))  # fmt: skip
    actions = decide(
        fleet, ledger, [exited("c", 0, "process c exited with code -9", -9)], now=1.0, policy=policy
    )
    assert work(actions, "c") == ["cleanup"]
    assert "engine_restarting" not in [k for k, _m in events(actions)]
    actions = decide(fleet, ledger, [done("cleanup", "c", 0)], now=1.1, policy=policy)
    assert fleet.engine("c").state is S.STOPPED
    assert [k for k, _m in events(actions)] == ["engine_removed"]
    for now in (2.0, 5.0, 20.0):  # and nothing starts it again
        assert "spawn" not in work(decide(fleet, ledger, now=now, policy=policy), "c")


def test_a_removed_engine_killed_before_it_is_drained_is_not_restarted() -> None:
    """Killed while still ``serving`` (retired, not drained yet): no restart either."""
    fleet, ledger = world(engine("a"), engine("c", retired=True))
    actions = decide(fleet, ledger, [exited("c", 0, "process c exited with code -9", -9)], now=1.0)
    assert "engine_restarting" not in [k for k, _m in events(actions)]
    assert "spawn" not in work(actions, "c")
    assert fleet.engine("c").state is S.DRAINING
    assert fleet.engine("c").restarts == 0


def test_an_added_engine_starts_only_once_the_removed_engine_on_its_gpu_stopped() -> None:
    """``new`` takes GPU slot 3, which the removed ``old`` still holds: no spawn until ``old`` is stopped."""
    fleet, ledger = world(
        engine("a", slots=(0,)),
        engine("old", retired=True, state=S.DRAINING, registered=False, drain_until=50.0, slots=(3,)),
        engine("new", state=S.NEW, catch_up="new", registered=False, slots=(3,)),
    )
    assert "spawn" not in work(decide(fleet, ledger, now=1.0), "new")
    decide(fleet, ledger, [done("drain", "old", 0)], now=1.1)  # no requests left: it is stopped
    assert "spawn" not in work(decide(fleet, ledger, now=1.2), "new")
    actions = decide(fleet, ledger, [done("cleanup", "old", 0)], now=1.3)
    assert fleet.engine("old").state is S.STOPPED
    assert work(actions, "new") == ["spawn"]


def test_an_engine_whose_restart_a_change_removes_has_its_new_process_stopped_before_it_leaves() -> None:
    """``c`` was killed and is being started again (its old process cleaned up, a spawn under way) when a
    change removes it: once the spawn is done, its new process is drained and cleaned up before ``c`` leaves.
    Before: the old cleanup still counted, so ``c`` left at once with its new process running on its GPU,
    owned by no row, next to the engine the change added there (seen under load in the PD move test)."""
    fleet, ledger = world(
        engine("a"),
        engine("c", retired=True, state=S.RESTARTING, registered=False, cleaned_up=True, restarts=1,
               pending=frozenset({"spawn"})),
    )  # fmt: skip
    assert work(decide(fleet, ledger, now=1.0), "c") == []  # its spawn is under way: it waits
    actions = decide(fleet, ledger, [done("spawn", "c", 1)], now=1.1)
    assert fleet.engine("c").state is S.DRAINING and fleet.engine("c").cleaned_up is False
    assert work(actions, "c") == ["drain"] and "engine_removed" not in [k for k, _m in events(actions)]
    actions = decide(fleet, ledger, [done("drain", "c", 1)], now=1.2)  # no requests: its processes stop
    assert work(actions, "c") == ["cleanup"] and fleet.engine("c").state is S.DRAINING
    actions = decide(fleet, ledger, [done("cleanup", "c", 1)], now=1.3)
    assert fleet.engine("c").state is S.STOPPED and [k for k, _m in events(actions)] == ["engine_removed"]
