"""Races between a change and losses, restarts and replacements, on the pure policy (fake clock)."""

from __future__ import annotations

from miles_sglang_plugin.serving.fleet import EngineState, RouterState
from miles_sglang_plugin.serving.policy import Policy, done
from tests.test_reconciler_policy import decide, ends, engine, events, world

S = EngineState
R = RouterState


def test_a_removed_engines_refused_respawn_does_not_fail_the_deployment() -> None:
    """``c`` was lost and its (last, with max_restarts=1) restart is on the way (RESTARTING, spawn pending)
    when an apply removes it; ``_do_spawn`` refuses the spawn ("it is being removed"). That refusal must not
    count as a failed restart: no ``engine_restart_failed``, no deployment failure; ``c`` just leaves."""
    policy = Policy(max_restarts=1)
    fleet, ledger = world(
        engine("a"),
        engine("c", state=S.RESTARTING, retired=True, registered=False, pending=frozenset({"spawn"}),
               restarts=1, restarts_in_budget=1, catch_up="restart", cleaned_up=True),
    )  # fmt: skip
    actions = decide(fleet, ledger, [done("spawn", "c", 1, "it is being removed")], now=5.0, policy=policy)
    assert ends(actions) == [], ends(actions)
    assert "engine_restart_failed" not in [k for k, _m in events(actions)]


def test_a_removed_engines_refused_respawn_is_no_restart_failure_even_with_budget_left() -> None:
    policy = Policy(max_restarts=3)
    fleet, ledger = world(
        engine("a"),
        engine("c", state=S.RESTARTING, retired=True, registered=False, pending=frozenset({"spawn"}),
               restarts=1, restarts_in_budget=1, catch_up="restart", cleaned_up=True),
    )  # fmt: skip
    actions = decide(fleet, ledger, [done("spawn", "c", 1, "it is being removed")], now=5.0, policy=policy)
    assert [k for k, _m in events(actions)] == [], events(actions)


def test_a_removed_engine_whose_registration_fails_does_not_fail_the_deployment() -> None:
    """``c`` (restarted, catching up, its ``register`` out) is removed by an apply; the router refuses the
    registration (it is being restarted, say). A removed engine's failed catch-up is no loss that counts
    against the restart budget: the deployment must not fail."""
    policy = Policy(max_restarts=1)
    fleet, ledger = world(
        engine("a"),
        engine("c", state=S.CATCHING_UP, retired=True, registered=False, pending=frozenset({"register"}),
               restarts=1, restarts_in_budget=1, catch_up="restart", cleaned_up=False),
    )  # fmt: skip
    actions = decide(fleet, ledger, [done("register", "c", 1, "HTTP 503")], now=5.0, policy=policy)
    assert ends(actions) == [], ends(actions)


def test_a_late_exit_of_a_replaced_engines_old_process_does_not_hit_its_new_row() -> None:
    """A change replaces e1 (same id, another command line): its new row goes on from the old row's generation
    (2 -> 3), so an ``exited`` of the old process (generation 2) that reaches the loop after the new process
    started (a polled exit watcher, the Ray backend) is stale, and the new engine is not declared lost."""
    from types import SimpleNamespace

    from miles_sglang_plugin.serving.changes import Converging
    from miles_sglang_plugin.serving.policy import exited

    old = engine("e1", state=S.STOPPED, retired=True, registered=False, restarts=2)
    fleet, ledger = world(engine("a"), old)
    change = SimpleNamespace(changes={"e1": "replaced"}, router_swaps=frozenset())
    fresh = engine("e1", state=S.NEW, registered=False)
    converging = Converging(
        change=change, before=None, fleet=fleet, ledger=ledger, new_rows={"e1": fresh},  # type: ignore[arg-type]
        started_at=0.0, admit=lambda row: None,
    )  # fmt: skip
    converging.leaving.add("e1")
    converging.waiting.add("e1")
    assert converging.settle(0.5) is False  # the new row is in, and on its way
    assert fleet.engine("e1") is fresh and fresh.restarts == 3
    fleet.transition("e1", S.STARTING)
    actions = decide(fleet, ledger, [exited("e1", 2, "process e1 (old) exited with code -15", -15)], now=1.0)
    assert "engine_lost" not in [k for k, _m in events(actions)]
    assert fleet.engine("e1").state is S.STARTING
