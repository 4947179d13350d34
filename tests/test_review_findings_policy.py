"""Review findings on the change-safety work, reduced to the pure policy (fake clock)."""

from __future__ import annotations

from miles_sglang_plugin.serving.fleet import EngineState, RouterState
from miles_sglang_plugin.serving.policy import Policy, done
from tests.test_reconciler_policy import decide, ends, engine, events, work, world

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
    """A replaced engine's new row has the old row's id and starts again at generation 0; an ``exited`` of
    the old process (generation 0) that reaches the loop after the new process started (a polled exit
    watcher, the Ray backend) is taken for the new process's: the brand-new engine is declared lost."""
    fleet, ledger = world(engine("a"), engine("e1", state=S.STARTING, registered=False, catch_up="new"))
    actions = decide(fleet, ledger, [__import__("miles_sglang_plugin.serving.policy", fromlist=["exited"])
                                     .exited("e1", 0, "process e1 (old) exited with code -15", -15)], now=1.0)
    assert "engine_lost" not in [k for k, _m in events(actions)]
