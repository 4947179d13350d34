"""What happens to a running deployment, told as events: kept (the last 1,000), logged (logger
``miles_sglang_plugin.supervision``) and passed to subscribers on a thread of their own, so that a slow
callback never holds up the reconciler that emits them."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["EVENT_LEVELS", "DeploymentEvent", "EventLog", "logger"]

logger = logging.getLogger("miles_sglang_plugin.supervision")

#: Event kinds and how loudly they are logged.
EVENT_LEVELS: Mapping[str, int] = MappingProxyType(
    {
        "engine_lost": logging.WARNING,
        "engine_restarting": logging.WARNING,
        "engine_restart_failed": logging.WARNING,
        "engine_recovered": logging.WARNING,
        "engine_pending_weights": logging.WARNING,
        "engine_admitted": logging.INFO,
        "engine_diverged": logging.WARNING,
        "engine_added": logging.INFO,
        "engine_removed": logging.INFO,
        "engine_updating": logging.INFO,
        "engine_updated": logging.INFO,
        "engine_placed_again": logging.WARNING,
        "external_engine_lost": logging.WARNING,
        "external_engine_back": logging.WARNING,
        "router_lost": logging.WARNING,
        "router_recovered": logging.WARNING,
        "deployment_failed": logging.ERROR,
    }
)


@dataclass(frozen=True)
class DeploymentEvent:
    """Something that happened to a running deployment."""

    #: One of :data:`EVENT_LEVELS`.
    kind: str
    #: The engine id, ``router.<model>``, or ``deployment``.
    subject: str
    message: str
    #: ``time.time()`` and ``time.monotonic()`` when it happened.
    time: float
    monotonic: float
    details: Mapping[str, Any] = field(default_factory=dict)


#: How many of the events that did come a wait that timed out names (the last ones).
_SEEN_SHOWN = 12


def _seen(events: list[DeploymentEvent]) -> str:
    """The events that came while a wait for another one timed out, the last few by kind and subject: what
    the deployment did instead."""
    if not events:
        return "no event came"
    shown = ", ".join(f"{event.kind} ({event.subject})" for event in events[-_SEEN_SHOWN:])
    earlier = len(events) - _SEEN_SHOWN
    return f"{len(events)} came" + (f" (the last {_SEEN_SHOWN}: {shown})" if earlier > 0 else f": {shown}")


class EventLog:
    """Events of one deployment (see the module docstring). Subscribers are called in order on one thread of
    the log's (started with the first subscriber); an exception in one is logged, never raised."""

    def __init__(self, maxlen: int = 1000) -> None:
        self._events: deque[DeploymentEvent] = deque(maxlen=maxlen)
        self._count = 0
        self._subscribers: list[Callable[[DeploymentEvent], None]] = []
        self._taps: list[Callable[[DeploymentEvent], None]] = []
        self._changed = threading.Condition()
        self._outbox: queue.SimpleQueue[DeploymentEvent | None] = queue.SimpleQueue()
        self._dispatcher: threading.Thread | None = None

    def subscribe(self, callback: Callable[[DeploymentEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for every event from now on; returns a function that unsubscribes."""
        with self._changed:
            self._subscribers.append(callback)
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch, name="msp-events", daemon=True)
                self._dispatcher.start()

        def unsubscribe() -> None:
            with self._changed, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def tap(self, callback: Callable[[DeploymentEvent], None]) -> None:
        """Call ``callback(event)`` within :meth:`emit`, on the emitting thread, before the event is kept (so
        that whoever waits for an event sees what the callback made of it): for quick bookkeeping that never
        blocks, such as the deployment's metrics. An exception in it is logged, never raised."""
        with self._changed:
            self._taps.append(callback)

    def emit(self, kind: str, subject: str, message: str, **details: Any) -> DeploymentEvent:
        event = DeploymentEvent(
            kind, subject, message, time.time(), time.monotonic(), MappingProxyType(details)
        )
        for callback in self._taps:
            try:
                callback(event)
            except Exception:
                logger.exception("an event tap raised on %s", kind)
        logger.log(EVENT_LEVELS.get(kind, logging.INFO), "%s", message, extra={"msp_event": kind})
        with self._changed:
            self._events.append(event)
            self._count += 1
            self._changed.notify_all()
            dispatching = self._dispatcher is not None
        if dispatching:
            self._outbox.put(event)
        return event

    def _dispatch(self) -> None:
        while (event := self._outbox.get()) is not None:
            with self._changed:
                subscribers = list(self._subscribers)
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:
                    logger.exception("an event subscriber raised on %s", event.kind)

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued (for at most ``timeout_s``), then end the subscribers' thread."""
        with self._changed:
            dispatcher = self._dispatcher
        if dispatcher is not None:
            self._outbox.put(None)
            if dispatcher is not threading.current_thread():
                dispatcher.join(timeout_s)

    def events(self) -> tuple[DeploymentEvent, ...]:
        with self._changed:
            return tuple(self._events)

    @property
    def count(self) -> int:
        """Events so far (a position to wait from, see :meth:`wait_for`)."""
        return self._count

    def wait_for(
        self, kind: str, *, subject: str | None = None, since: int = 0, timeout_s: float = 60.0
    ) -> DeploymentEvent:
        """The first event ``kind`` (of ``subject``) from position ``since`` on; waits up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                skip = max(0, len(self._events) - (self._count - since))
                for event in list(self._events)[skip:]:
                    if event.kind == kind and (subject is None or event.subject == subject):
                        return event
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no {kind} event{f' of {subject}' if subject else ''} in {timeout_s:g} s; "
                        + _seen(list(self._events)[skip:])
                    )
                self._changed.wait(left)
