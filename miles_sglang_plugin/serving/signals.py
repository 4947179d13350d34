"""SIGINT and SIGTERM while deployments start, serve and stop: recorded by the handler, acted on by the
deployment, then handed on to the program.

A Python signal handler runs in the main thread between any two bytecodes, inside whatever code is running
there: an at-fork hook of ``logging`` while a child process is spawned, a lock held by a thread pool, a log
call. An exception raised there can leave a lock held for good (the launcher then hangs). So the handler here
only records the signal, wakes whoever waits for it (a byte on a pipe) and returns; the deployments act on
it at points of their own choosing:

* **during start-up**, the start-up loop checks after every process it starts and at every poll; on a signal
  it stops everything it started and raises :class:`Interrupted` from there;
* **once started**, a watcher thread of the deployment stops it at once (whatever the main thread is doing);
* **while stopping**, a further signal is only recorded: the teardown is never cut short.

Then :func:`hand_on` gives the signal to the handler the program had before (Python's own unless it set
one), in the main thread, as if no deployment had been there: under Python's defaults SIGINT raises
``KeyboardInterrupt`` and SIGTERM ends the process (exit status 143), both after everything was stopped.
A signal the program ignores (``SIG_IGN``, e.g. SIGINT of a background job) is left alone.

Handlers are installed only from the main thread, while at least one :class:`SignalWatch` is open, and are
put back when the last one closes there; off the main thread :func:`watch` returns None.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

#: The signals a deployment stops on.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """Raised by :meth:`SignalWatch.check` at a point the deployment chose: start-up is to stop. A
    ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class SignalWatch:
    """The stop signals received since it was opened (:func:`watch`), and a way to wait for one."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        #: The first signal received, None before.
        self.received: int | None = None
        self.closed = False

    def _note(self, signum: int) -> None:  # in the signal handler: an attribute and a raw write, no lock
        if self.received is None:
            self.received = signum
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe already wakes the waiter; a closed one has none
            os.write(self._write_fd, b"s")

    def poke(self) -> None:
        """Wake a thread blocked in :meth:`wait` (from any thread; no signal is recorded)."""
        self._wake()

    def check(self) -> None:
        """Raise :class:`Interrupted` if a signal was received."""
        if self.received is not None:
            raise Interrupted(self.received)

    def wait(self, timeout_s: float | None) -> int | None:
        """Sleep until a signal arrives (or the watch is closed) or ``timeout_s`` passes; the signal or None."""
        if self.received is None and not self.closed:
            with contextlib.suppress(OSError, ValueError):  # closed meanwhile: nothing to wait for
                select.select([self._read_fd], [], [], timeout_s)
        return self.received

    def close(self) -> None:
        """Stop watching (idempotent); wakes a thread blocked in :meth:`wait`. See :func:`unwatch`."""
        unwatch(self)

    def _release(self) -> None:
        self.closed = True
        self._wake()

    def __del__(self) -> None:  # the pipe outlives close(): a thread may still be waiting on it
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def serve_in_background(self, on_signal: Callable[[int], None], name: str) -> threading.Thread:
        """A daemon thread that, when a signal arrives before the watch is closed, calls ``on_signal(signum)``
        and then :func:`hand_on`, also when ``on_signal`` raised (the program gets its signal either way)."""

        def run() -> None:
            signum = None
            while signum is None and not self.closed:
                signum = self.wait(1.0)
            if signum is not None:
                try:
                    on_signal(signum)
                finally:
                    hand_on()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread


class _State:
    """What this process's handlers share; changed only with :data:`_LOCK` held and the signals blocked."""

    watches: tuple[SignalWatch, ...] = ()
    #: The handlers in place before ours, by signal (only for the signals we handle).
    previous: dict[int, Any] = {}  # noqa: RUF012 - module-level state, one per process
    #: A signal received while watched that the program has not been given yet.
    pending: int | None = None


_LOCK = threading.Lock()  # never taken by the handler itself


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back in this thread for the block (they arrive when it ends)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """The handler: record and wake, or (nobody watches any more) give the signal to the program's own."""
    watches = _State.watches
    if watches:
        if _State.pending is None:
            _State.pending = signum
        for watched in watches:
            watched._note(signum)
        return
    _deliver(signum, frame)


def _deliver(signum: int, frame: FrameType | None) -> None:
    """Put the program's handlers back and let its handler for ``signum`` act (main thread)."""
    _State.pending = None
    previous = _State.previous.get(signum, signal.SIG_DFL)
    _restore_handlers()
    if callable(previous):
        previous(signum, frame)  # e.g. Python's default_int_handler: KeyboardInterrupt
    elif previous == signal.SIG_DFL:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # what the program printed, before the default action
                stream.flush()
        signal.raise_signal(signum)  # the default action: the process ends (status 128 + signum)


def _restore_handlers() -> None:
    """Put back the handlers that were there before ours (main thread); one replaced since is kept."""
    with _signals_blocked():
        for signum, handler in _State.previous.items():
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, handler)
        _State.previous = {}


def watch() -> SignalWatch | None:
    """Start watching SIGINT and SIGTERM (installing the recording handler on the first watch); None when
    called off the main thread, where no handler can be installed."""
    if not _in_main_thread():
        return None
    watched = SignalWatch()
    with _LOCK, _signals_blocked():
        if not _State.watches:
            _State.pending = None  # left by a teardown nobody handed on (atexit, a Hydra callback): stale now
        for signum in STOP_SIGNALS:
            current = signal.getsignal(signum)
            if current is _on_signal or current is None or current == signal.SIG_IGN:
                continue  # ours already, set outside Python, or ignored by the program: left as it is
            _State.previous[signum] = current
            signal.signal(signum, _on_signal)
        _State.watches = (*_State.watches, watched)
    return watched


def unwatch(watched: SignalWatch | None) -> None:
    """Stop watching. When the last watch closes in the main thread with no signal still to hand on, the
    program's handlers are put back; otherwise ours stays and passes later signals straight through."""
    if watched is None:
        return
    with _LOCK:
        if watched not in _State.watches:
            return
        _State.watches = tuple(w for w in _State.watches if w is not watched)
        watched._release()
        idle = not _State.watches and _State.pending is None
    if idle and _in_main_thread():
        _restore_handlers()


def hand_on() -> None:
    """Give the program the signal that stopped the deployments, through its own handler, once no deployment
    watches any more (from any thread: the handler runs in the main thread). Nothing when none is pending."""
    with _LOCK:
        signum = _State.pending
        if signum is None or _State.watches:
            return
        _State.pending = None  # handed on once, whoever calls first
    if _in_main_thread():
        _deliver(signum, sys._getframe(1))
    else:
        signal.pthread_kill(threading.main_thread().ident or 0, signum)  # our handler delivers it there


@contextlib.contextmanager
def recorded() -> Iterator[SignalWatch | None]:
    """Record SIGINT/SIGTERM for the block instead of letting them interrupt it (main thread; elsewhere
    signals do not reach Python code anyway). What arrived stays pending for :func:`hand_on`."""
    watched = watch()
    try:
        yield watched
    finally:
        unwatch(watched)


__all__ = [
    "STOP_SIGNALS",
    "Interrupted",
    "SignalWatch",
    "hand_on",
    "recorded",
    "signal_name",
    "unwatch",
    "watch",
]
