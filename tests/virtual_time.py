"""An asyncio event loop whose clock only moves when nothing is left to do: time-based code (``asyncio.sleep``,
``loop.time()``) runs at once and measures exactly what it waited, whatever the machine's load.

When every task waits and the nearest timer is ``t`` seconds away, the loop's clock jumps ``t`` ahead instead
of the loop sleeping; sockets are still polled (without waiting) first, so a client and a server on loopback in
the same loop work as usual (what one writes is readable by the other at once). Work that waits on a thread
(``run_in_executor``) would see time jump meanwhile: keep it out of code run this way.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _FastForward:
    """A selector that never sleeps for a timer: it advances the loop's clock by the timeout instead."""

    def __init__(self, inner: selectors.BaseSelector) -> None:
        self._inner = inner
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._inner.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only I/O can wake the loop
            return self._inner.select(None)
        self.now += timeout
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._fast_forward = _FastForward(selectors.DefaultSelector())
        super().__init__(selector=self._fast_forward)  # type: ignore[arg-type]

    def time(self) -> float:
        return self._fast_forward.now


def run_in_virtual_time(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` on a :class:`VirtualTimeLoop`."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
