"""An operation out while a change replaces an engine (same id, a fresh row)."""

from __future__ import annotations

from miles_sglang_plugin.serving.control import _Targets
from miles_sglang_plugin.serving.fleet import CatchUp, EngineState
from miles_sglang_plugin.serving.ledger import initial_state
from miles_sglang_plugin.serving.operations import OPERATIONS, pause_effect
from tests.test_ledger import _control, answer
from tests.test_reconciler_policy import engine


def test_an_engine_replaced_while_the_call_was_out_gets_the_state_by_replay() -> None:
    """``pause_generation`` is sent to e1 and e2. e1's old process answers OK, then an apply that replaces e1
    (another command line) drops its row and adds a fresh row of the same id (restarts 0 again), which joins
    the operation. The OK answer is the *old* process's: the new e1 must be deferred (replayed), not counted
    as having the pause."""
    control, fleet = _control(engine("e1"), engine("e2"))
    ledger = control._serving.ledger
    targets = _Targets(tuple(fleet.engines()), (), (), {})
    sent = {"e1": 0, "e2": 0}
    # the change: old e1 retired, stopped, dropped; a fresh e1 added (what Converging.settle/_add_waiting do)
    fleet.update("e1", retired=True)
    fleet.transition("e1", EngineState.DRAINING)
    fleet.transition("e1", EngineState.STOPPED)
    fleet.drop_engine("e1")
    kept = ledger.desired("e1")
    ledger.drop_engine("e1")
    new = engine("e1", state=EngineState.NEW, registered=False)
    new.catch_up = CatchUp.NEW
    ledger.add_engine("e1", initial_state(), kept)
    fleet.add_engine(new)
    result = control._settle(
        OPERATIONS["pause_generation"], targets, {"e1": answer(True), "e2": answer(True)}, sent,
        pause_effect("abort"), joined={"e1"},
    )  # fmt: skip
    assert ledger.desired("e1").paused == "abort"
    assert ledger.replay("e1"), "the new e1 process never got the pause, yet the ledger says it has it"
    assert "e1" in result.deferred
