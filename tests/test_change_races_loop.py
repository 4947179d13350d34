"""Races between a change's end and the deployment's: a change whose end-of-change work (``on_change_done``) is under way when the deployment
stops never has its ``finished`` future set; ``apply`` then waits out its whole timeout and says the change
"goes on"."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path
from types import SimpleNamespace

from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.serving.events import EventLog
from miles_sglang_plugin.serving.fleet import Fleet
from miles_sglang_plugin.serving.ledger import Ledger
from miles_sglang_plugin.serving.reconciler import Reconciler, ServingLoop


class _DoneChange:
    """A change the loop finds done on its next settle."""

    def __init__(self) -> None:
        self.finished: concurrent.futures.Future[object] = concurrent.futures.Future()

    def settle(self, now: float) -> bool:
        return True

    def outcome(self) -> object:
        return "outcome"

    def describe(self) -> str:
        return "nothing left"


def _reconciler(fleet: Fleet, serving: ServingLoop) -> Reconciler:
    """A reconciler of ``fleet`` on ``serving`` with nothing behind it (no backend, pool, spawner: these tests
    drive its changes and operations only)."""
    return Reconciler(
        fleet=fleet, ledger=Ledger({}), settings=SGLangDeployConf(), backend=None,  # type: ignore[arg-type]
        log_dir=Path("/tmp"), events=EventLog(), status=None, loop=serving, pool=SimpleNamespace(),  # type: ignore[arg-type]
        spawner=None, io=None, exits=None, on_fail=lambda _m: None,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_change_ending_when_the_deployment_stops_still_finishes() -> None:
    serving = ServingLoop()
    serving.start()
    rec = _reconciler(Fleet([], []), serving)
    rec.phase = "serving"
    in_done = asyncio.Event()
    entered = concurrent.futures.Future()  # type: ignore[var-annotated]

    async def slow_done(_change: object) -> None:  # stopping a removed model's router, within its grace
        entered.set_result(True)
        await in_done.wait()

    rec.on_change_done = slow_done  # type: ignore[assignment]
    change = _DoneChange()

    async def go() -> None:
        rec.changes.append(change)  # type: ignore[arg-type]
        rec._settle_changes()

    serving.submit(go()).result(5)
    entered.result(5)
    rec.stop()  # the deployment stops (a stop() from another thread, or a failure)
    serving.close(timeout_s=2.0)
    time.sleep(0.2)
    assert change.finished.done(), "apply would wait out its whole timeout, then say the change goes on"


def test_a_change_still_finishing_is_waited_for_by_the_next_apply() -> None:
    """``Deployment._await_earlier_changes`` waits only for the changes in ``reconciler.changes``; a change is
    taken out of that list when it settles, *before* its ``on_change_done`` (stopping a removed model's router,
    ``backend.release``) ran. A next apply in that window starts at once, from a fleet the earlier change is
    still rearranging (a re-added model finds the old router row about to be dropped, ``fleet.order``
    with the old plan, ports released under a render)."""
    serving = ServingLoop()
    serving.start()
    rec = _reconciler(Fleet([], []), serving)
    rec.phase = "serving"
    release = asyncio.Event()
    entered = concurrent.futures.Future()  # type: ignore[var-annotated]

    async def slow_done(_change: object) -> None:
        entered.set_result(True)
        await release.wait()

    rec.on_change_done = slow_done  # type: ignore[assignment]
    change = _DoneChange()

    async def go() -> None:
        rec.changes.append(change)  # type: ignore[arg-type]
        rec._settle_changes()

    serving.submit(go()).result(5)
    entered.result(5)
    try:
        # what _await_earlier_changes sees: nothing to wait for, though the change has not finished
        assert change in rec.changes or change.finished.done()
    finally:
        serving.loop.call_soon_threadsafe(release.set)
        rec.stop()
        serving.close(timeout_s=2.0)


def test_an_operation_that_held_a_replaced_engines_old_row_does_not_release_its_new_row() -> None:
    """Operation A (not recorded: ``covers`` None) holds e1's old row; an apply replaces e1 (same id, fresh
    row), which joins the recorded operation B still out. A's end must not take B's hold off the new row:
    the new e1 would be caught up and serve before B's state reaches it."""
    from miles_sglang_plugin.serving.fleet import EngineState
    from tests.test_reconciler_policy import engine

    fleet = Fleet([engine("e1"), engine("e2")], [])
    serving = ServingLoop()
    rec = _reconciler(fleet, serving)
    a = rec.begin_operation(["e1", "e2"], None)
    b = rec.begin_operation(["e2"], lambda row: True)
    # the change replaces e1
    fleet.update("e1", retired=True)
    fleet.transition("e1", EngineState.DRAINING)
    fleet.transition("e1", EngineState.STOPPED)
    fleet.drop_engine("e1")
    new = engine("e1", state=EngineState.NEW, registered=False)
    fleet.add_engine(new)
    rec.admit(new)
    assert fleet.engine("e1").ops_in_flight == 1  # B holds it
    rec.end_operation(a)
    assert fleet.engine("e1").ops_in_flight == 1, "A's end released B's hold on the new e1"
    rec.end_operation(b)
    assert fleet.engine("e1").ops_in_flight == 0
