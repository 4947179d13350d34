"""Review finding: a change whose end-of-change work (``on_change_done``) is under way when the deployment
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


def test_a_change_ending_when_the_deployment_stops_still_finishes() -> None:
    serving = ServingLoop()
    serving.start()
    rec = Reconciler(
        fleet=Fleet([], []), ledger=Ledger({}), settings=SGLangDeployConf(), backend=None,  # type: ignore[arg-type]
        log_dir=Path("/tmp"), events=EventLog(), status=None, loop=serving, pool=SimpleNamespace(),  # type: ignore[arg-type]
        spawner=None, io=None, exits=None, on_fail=lambda _m: None,  # type: ignore[arg-type]
    )  # fmt: skip
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
    rec = Reconciler(
        fleet=Fleet([], []), ledger=Ledger({}), settings=SGLangDeployConf(), backend=None,  # type: ignore[arg-type]
        log_dir=Path("/tmp"), events=EventLog(), status=None, loop=serving, pool=SimpleNamespace(),  # type: ignore[arg-type]
        spawner=None, io=None, exits=None, on_fail=lambda _m: None,  # type: ignore[arg-type]
    )  # fmt: skip
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
