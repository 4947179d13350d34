"""The one loop that reconciles a running deployment: observations in (process exits from the exit watcher,
the outcomes of its own work), decisions by the pure :func:`~.policy.plan_actions`, actions out (state
changes of the fleet, events, and work: health polls, replays, registrations, restarts).

Everything runs on the deployment's event loop (:class:`ServingLoop`, one thread), so the fleet and the ledger
are changed from that thread only: by this loop, and by the control operations, which run there too. Nothing
there blocks: process starts go to the spawner thread (the one long-lived thread whose children carry the
parent-death signal, see :mod:`miles_sglang_plugin.backends.processes`), process stops and anything that may
ask Ray to a small thread pool, and every HTTP call has one total deadline and a size cap (:mod:`.wire`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from miles_sglang_plugin.backends.base import Backend, EngineProcess, LaunchError
from miles_sglang_plugin.backends.processes import ExitWatcher, ManagedProcess, Spawner, stop_processes
from miles_sglang_plugin.backends.status_view import StatusView
from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.errors import DeploymentConfigError, first_line
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.serving import router_client
from miles_sglang_plugin.serving.changes import Converging
from miles_sglang_plugin.serving.events import EventLog
from miles_sglang_plugin.serving.fleet import (
    EngineRow,
    EngineState,
    Fleet,
    RouterRow,
    RouterState,
    engine_rows,
)
from miles_sglang_plugin.serving.ledger import Ledger
from miles_sglang_plugin.serving.policy import (
    Action,
    ActionKind,
    Observation,
    ObservationKind,
    Policy,
    done,
    exited,
    next_wake,
    plan_actions,
    router_done,
)
from miles_sglang_plugin.serving.routers import router_command
from miles_sglang_plugin.serving.wire import ClientPool

__all__ = ["Reconciler", "ServingLoop", "StartupFailure"]

log = logging.getLogger("miles_sglang_plugin.supervision")
T = TypeVar("T")

#: The most an external engine's ``/server_info`` may hold.
SERVER_INFO_BYTES = 1024 * 1024
#: The most a health answer may hold.
HEALTH_BYTES = 64 * 1024


class ServingLoop:
    """The deployment's event loop on a thread of its own (``msp-serving``). Coroutines submitted to it are
    tracked, so that stopping cancels every one still running (their callers learn why)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="msp-serving", daemon=True)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop (from any thread); its future. Refused (``RuntimeError``) once closed."""
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError("the serving loop is closed")
            return asyncio.run_coroutine_threadsafe(self._tracked(coro), self.loop)

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    def create_task(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """On the loop: a tracked task."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        """``callback(*args)`` on the loop, from any thread (dropped once the loop is closed)."""
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self.loop.call_soon_threadsafe(callback, *args)

    async def _cancel_all(self, timeout_s: float) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def _close_generators(self, timeout_s: float) -> None:
        """Close the async generators still open (an HTTP body's iterators, left by a read that stopped at its
        size cap or deadline) and let the closings the garbage collector scheduled run: a loop closed under
        them printed "Task was destroyed but it is pending!"."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.loop.shutdown_asyncgens(), timeout_s)
        current = asyncio.current_task()
        strays = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        for task in strays:
            task.cancel()
        if strays:
            await asyncio.wait(strays, timeout=timeout_s)

    def close(
        self, before: Callable[[], Coroutine[Any, Any, None]] | None = None, timeout_s: float = 5.0
    ) -> None:
        """Cancel what runs (waiting at most ``timeout_s``), run ``before()`` (closing the clients), stop the
        loop. From the loop's own thread this only starts the wind-down."""
        with self._lock:
            if self._closed:
                return
            self._closed = True

        async def wind_down() -> None:
            await self._cancel_all(timeout_s / 2)
            if before is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(before(), timeout_s / 2)
            await self._close_generators(timeout_s / 4)

        if not self._thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(wind_down(), self.loop)
        # The loop stops once the wind-down is done (a callback of its own, so that the future is settled first).
        future.add_done_callback(lambda _done: self.call_soon(self.loop.stop))
        if self.in_loop():
            return
        with contextlib.suppress(Exception):
            future.result(timeout=timeout_s + 1)
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass(frozen=True)
class StartupFailure:
    """Why start-up failed: ``cause`` (exited, spawn, router_exited, timeout, register, learn, replay) and what."""

    cause: str
    message: str = ""
    engine: str | None = None
    router: str | None = None


class Reconciler:
    """Runs the reconcile loop of one deployment (see the module docstring)."""

    def __init__(
        self,
        *,
        fleet: Fleet,
        ledger: Ledger,
        settings: SGLangDeployConf,
        backend: Backend,
        log_dir: Path,
        events: EventLog,
        status: StatusView,
        loop: ServingLoop,
        pool: ClientPool,
        spawner: Spawner,
        io: concurrent.futures.ThreadPoolExecutor,
        exits: ExitWatcher,
        on_fail: Callable[[str], None],
        place_again: Callable[[Sequence[str]], PreparedDeployment | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet, self.ledger, self.settings = fleet, ledger, settings
        self.policy = Policy.from_settings(settings)
        self.backend, self.log_dir, self.events, self.status = backend, log_dir, events, status
        self._serving, self.pool, self._spawner, self._io, self.exits = loop, pool, spawner, io, exits
        #: Reads of the routers' lists, shared by the registrations that wait on one router at a time.
        self.router_reads = router_client.SharedReads(pool, loop.create_task)
        self._on_fail, self.clock = on_fail, clock
        #: Places engines whose node is gone elsewhere, returning the deployment rendered with their new places
        #: (None where the backend cannot; PlacementError while the cluster has no room for them).
        self._place_again = place_again
        self._placing = threading.Lock()
        self.phase = "starting"
        self.failure: str | None = None
        #: Set once start-up ends: None (ready) or a :class:`StartupFailure`.
        self.startup: concurrent.futures.Future[StartupFailure | None] = concurrent.futures.Future()
        self._inbox: list[Observation] = []
        self._wake: asyncio.Event | None = None
        self._startup_deadline: float | None = None
        #: Changes of the deployment under way (``apply``), settled on each pass until done, then ended (routers
        #: of removed models stopped, resources given back: :attr:`on_change_done`) before they leave the list.
        self.changes: list[Converging] = []
        self._finishing: set[Converging] = set()
        #: Called on the loop when a change is done (routers of removed models stopped, resources given back).
        self.on_change_done: Callable[[Converging], Coroutine[Any, Any, None]] | None = None
        #: Control operations in flight: each one's engines, and which rows it covers (an engine added while
        #: it is out joins it: it gets the operation's state by replay before it serves).
        self._operations: dict[int, _Operation] = {}
        self._next_operation = 0
        #: Waits on the fleet's rows (:meth:`wait_until`): each one's condition, checked after every pass.
        self._waits: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        #: Processes a spawn started that are not in their row yet (the teardown stops them too).
        self._starting: list[EngineProcess] = []
        self._starting_lock = threading.Lock()

    # ----------------------------------------------------------------------------------------- intake
    def observe(self, observation: Observation) -> None:
        """Hand an observation to the loop (from any thread)."""
        self._serving.call_soon(self._take, observation)

    def _take(self, observation: Observation) -> None:
        self._inbox.append(observation)
        self.poke_here()

    def poke_here(self) -> None:
        """On the loop: decide again now (a control operation ended, ...)."""
        if self._wake is not None:
            self._wake.set()

    # ----------------------------------------------------------------------------------------- the loop
    async def run(self, startup_timeout_s: float) -> None:
        self._wake = asyncio.Event()
        self._startup_deadline = self.clock() + startup_timeout_s
        while self.phase in ("starting", "serving"):
            observations, self._inbox = self._inbox, []
            try:
                self._apply(self._decide(observations))
                self._settle_changes()
                self._settle_waits()
            except Exception:  # the loop outlives any surprise; it is logged
                log.exception("supervision: a decision failed")
            if self._inbox or self.phase not in ("starting", "serving"):
                continue
            wait_s = next_wake(
                self.fleet,
                self.policy,
                self.clock(),
                phase=self.phase,
                startup_deadline=self._startup_deadline,
            )
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._wake.wait()

    def _decide(self, observations: list[Observation]) -> list[Action]:
        return plan_actions(
            self.fleet,
            observations,
            self.ledger,
            self.policy,
            self.clock(),
            phase=self.phase,
            startup_deadline=self._startup_deadline,
        )

    def stop(self) -> None:
        """No more decisions (from any thread); what is under way is cancelled by the loop's close."""
        self.phase = "stopping"
        self._serving.call_soon(self.poke_here)
        self._serving.call_soon(self._end_changes, "the deployment stopped while it changed")

    # ----------------------------------------------------------------------------------------- changes
    def begin_change(self, change: Converging) -> None:
        """On the loop: a change of the deployment starts; the loop settles it from now on."""
        change.begin()
        self.changes.append(change)
        self.poke_here()

    def _settle_changes(self) -> None:
        for change in self.changes:
            if change not in self._finishing and change.settle(self.clock()):
                # it stays among the changes until its end is done too (a later apply waits for that)
                self._finishing.add(change)
                self._serving.create_task(self._finish_change(change))
                self.poke_here()  # replacements were added: decide for them

    async def _finish_change(self, change: Converging) -> None:
        try:
            if self.on_change_done is not None:
                await self.on_change_done(change)
        except Exception as exc:  # the change itself is done: what failed after it is reported with it
            log.exception("supervision: finishing a change failed")
            if not change.finished.done():
                change.finished.set_exception(LaunchError(f"the change ended, but {first_line(exc)}"))
        except BaseException:  # cancelled: the deployment stops under it
            if not change.finished.done():
                change.finished.set_exception(LaunchError("the deployment stopped while the change ended"))
            raise
        else:
            if not change.finished.done():
                change.finished.set_result(change.outcome())
        finally:
            self._finishing.discard(change)
            if change in self.changes:
                self.changes.remove(change)

    def _end_changes(self, why: str) -> None:
        """The deployment fails or stops: every change still under way ends with ``why``."""
        for change in self.changes:
            if not change.finished.done():
                change.finished.set_exception(LaunchError(f"{why}: {change.describe()}"))
        self.changes.clear()

    # ----------------------------------------------------------------------------------------- waits
    def wait_until(self, done: Callable[[], bool]) -> asyncio.Future[None]:
        """On the loop: a future set once ``done()`` (a condition on the fleet's rows) holds after a pass of
        the loop; the caller bounds its wait."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if done():
            future.set_result(None)
        else:
            self._waits.append((done, future))
            self.poke_here()
        return future

    def _settle_waits(self) -> None:
        kept = []
        for condition, future in self._waits:
            if future.done():
                continue  # its caller stopped waiting
            try:
                if condition():
                    future.set_result(None)
                    continue
            except Exception as exc:  # a condition that fails ends its wait with the error
                future.set_exception(exc)
                continue
            kept.append((condition, future))
        self._waits = kept

    # ----------------------------------------------------------------------------------------- rolling updates
    def hold_for_update(self, engines: Iterable[str], drain_s: float) -> None:
        """On the loop: a rolling weight update asks these serving engines out of their router, with
        ``drain_s`` seconds to finish their requests (the decisions move them to ``updating``)."""
        for engine in engines:
            if engine in self.fleet and self.fleet.engine(engine).state is EngineState.SERVING:
                self.fleet.update(engine, update_hold=drain_s)
        self.poke_here()

    def release_update(self, engines: Iterable[str]) -> None:
        """On the loop: the update is done with these engines: they come back into service."""
        for engine in engines:
            if engine in self.fleet and self.fleet.engine(engine).update_hold is not None:
                self.fleet.update(engine, update_hold=None)
        self.poke_here()

    # ----------------------------------------------------------------------------------------- applying
    def _apply(self, actions: Iterable[Action]) -> None:
        for action in actions:
            if self.phase not in ("starting", "serving"):
                return
            handler = _APPLY.get(action.kind)
            if handler is not None:
                handler(self, action)
            else:
                self._serving.create_task(self._work(action))

    def _transition(self, a: Action) -> None:
        assert a.engine is not None and isinstance(a.state, EngineState)
        row = self.fleet.transition(a.engine, a.state, **a.changes)
        if self.phase == "starting":
            self.status.update(row.id, row.state.value)

    def _update(self, a: Action) -> None:
        assert a.engine is not None
        self.fleet.update(a.engine, **a.changes)

    def _router_transition(self, a: Action) -> None:
        assert a.router is not None and isinstance(a.state, RouterState)
        row = self.fleet.transition_router(a.router, a.state, **a.changes)
        if self.phase == "starting":
            self.status.update(row.name, row.state.value)

    def _router_update(self, a: Action) -> None:
        assert a.router is not None
        self.fleet.update_router(a.router, **a.changes)

    def _emit(self, a: Action) -> None:
        details = dict(a.details)
        subject = details.pop("subject", "deployment")
        self.events.emit(a.event or "", subject, a.message, **details)

    def _ready(self, _a: Action) -> None:
        self.phase = "serving"
        if not self.startup.done():
            self.startup.set_result(None)

    def _startup_failed(self, a: Action) -> None:
        self.phase = "failed_start"
        details = a.details
        if not self.startup.done():
            self.startup.set_result(
                StartupFailure(
                    details.get("cause", ""), a.message, details.get("engine"), details.get("router")
                )
            )

    def _fail(self, a: Action) -> None:
        if self.failure is not None:
            return
        self.failure = a.message
        self.phase = "stopping"
        self._end_changes(f"the deployment failed while it changed ({a.message})")
        self.events.emit(
            "deployment_failed",
            "deployment",
            f"the deployment failed: {a.message}; stopping every engine and router",
            reason=a.message,
        )
        threading.Thread(target=self._on_fail, args=(a.message,), name="msp-fail", daemon=True).start()

    # ----------------------------------------------------------------------------------------- work
    async def _work(self, a: Action) -> None:
        try:
            await getattr(self, f"_do_{a.kind}")(a)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an unexpected error becomes the action's failed outcome
            log.exception("supervision: %s of %s failed", a.kind, a.engine or a.router)
            problem = f"{type(exc).__name__}: {exc}"
            if a.engine is not None and a.engine in self.fleet:
                self.observe(
                    done(ObservationKind(a.kind), a.engine, self.fleet.engine(a.engine).restarts, problem)
                )
            elif a.router is not None:
                row = self.fleet.router(a.router)
                generation = row.generation if row is not None else 0
                self.observe(router_done(ObservationKind(a.kind), a.router, problem, generation=generation))

    async def _blocking(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, lambda: function(*args))

    async def _do_probe(self, a: Action) -> None:
        row = self.fleet.engine(a.engine or "")
        generation = row.restarts
        answer = await self.pool.call(row.url, "GET", a.path, deadline_s=a.timeout_s, max_bytes=HEALTH_BYTES)
        problem = None
        if answer.timed_out:
            problem = f"no answer to {a.path} within {a.timeout_s:g} s"
        elif answer.error is not None:
            problem = f"{a.path} failed ({answer.error.split(':')[0]})"
        elif answer.status != 200:
            problem = f"{a.path} answered {answer.status}"
        self.observe(done(ObservationKind.PROBE, row.id, generation, problem))

    async def _do_cleanup(self, a: Action) -> None:
        row = self.fleet.engine(a.engine or "")
        generation = row.restarts
        if row.processes:
            await self._blocking(
                lambda: self.backend.stop(row.processes, grace_s=self.settings.supervision.kill_grace_s)
            )
        await self.forget_client(row.url)
        self.observe(done(ObservationKind.CLEANUP, row.id, generation))

    async def forget_client(self, base_url: str) -> None:
        """Close and forget the kept HTTP client of ``base_url`` (a process that is gone)."""
        client = self.pool.forget(base_url)
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _do_spawn(self, a: Action) -> None:
        row = self.fleet.engine(a.engine or "")
        generation = row.restarts
        if row.retired:  # removed meanwhile: never started again (its GPUs may be promised to another)
            self.observe(done(ObservationKind.SPAWN, row.id, generation, "it is being removed"))
            return
        blocker = await self._blocking(self._restart_blocker, row)
        if blocker is not None:
            problem, fatal, moved = await self._blocking(self._place_elsewhere, row.id, blocker)
            self._take_new_places(moved)
            if problem is not None:
                # no room now: a failed restart, tried again after the backoff while the budget lasts
                self.observe(done(ObservationKind.SPAWN, row.id, generation, problem, fatal=fatal))
                return
            row = self.fleet.engine(row.id)
        self.ledger.reset(row.id)
        self.fleet.update(row.id, processes=(), started_at=self.clock())
        started: list[EngineProcess] = []
        try:
            error = await asyncio.wrap_future(
                self._spawner.submit(self._start_processes, row, generation, started)
            )
        except RuntimeError as exc:  # the spawner was shut down: the deployment stops
            error = str(exc)
        if row.id in self.fleet:  # recorded here, on the loop: the spawner thread writes no row
            self.fleet.update(row.id, processes=tuple(started))
        with self._starting_lock:
            for process in started:
                self._starting.remove(process)
        gone = [p for p in started if p.exit_code() is not None]
        if error is not None:
            observed = done(
                ObservationKind.SPAWN,
                row.id,
                generation,
                f"it could not be started: {error}",
                details={"error": error},
            )
        elif gone:  # exited before it was watched as started: a failed start, not a hang
            problem = f"process {gone[0].name} exited at once with code {gone[0].exit_code()}"
            observed = done(ObservationKind.SPAWN, row.id, generation, problem, details={"exited": True})
        else:
            observed = done(ObservationKind.SPAWN, row.id, generation)
        self.observe(observed)

    def _restart_blocker(self, row: EngineRow) -> str | None:
        """Why the backend cannot start ``row`` again where the plan put it (its node is gone), or None."""
        for launch in row.launches:
            reason = self.backend.cannot_restart(launch)
            if reason is not None:
                return reason
        return None

    def _place_elsewhere(
        self, engine: str, blocker: str
    ) -> tuple[str | None, bool, list[tuple[EngineRow, str]]]:
        """``engine`` cannot start where it was (its node left the cluster): have the backend place it on free
        capacity (off the loop: it may ask Ray). (problem, fatal, moved): (None, False, moved) once placed, with
        the rows of the engines whose launches changed (it, and the others that were on the same node) as the
        new plan renders them, and each one's old URL, for the loop to take in (:meth:`_take_new_places`); fatal
        where the backend cannot place it anywhere else."""
        if self._place_again is None:
            return blocker, True, []
        with self._placing:
            try:
                prepared = self._place_again([engine])
            except (LaunchError, DeploymentConfigError) as exc:
                return f"{blocker}; it could not be placed on another node: {first_line(exc)}", False, []
            if prepared is None:
                return blocker, True, []
            moved = []
            for new in engine_rows(prepared):
                if new.id not in self.fleet or new.external:
                    continue
                row = self.fleet.engine(new.id)
                if tuple(p.argv for p in row.launches) != tuple(p.argv for p in new.launches):
                    moved.append((new, row.url))
        return None, False, moved

    def _take_new_places(self, moved: Sequence[tuple[EngineRow, str]]) -> None:
        """On the loop: the engines placed again get their new URLs, launches and GPUs."""
        for new, old_url in moved:
            if new.id not in self.fleet:
                continue
            self.fleet.update(
                new.id, url=new.url, launches=new.launches, registration=new.registration, gpus=new.gpus
            )
            self.events.emit(
                "engine_placed_again",
                new.id,
                f"engine {new.id} placed again: {new.url} (was {old_url}, on a node that left the cluster)",
                url=new.url,
                was=old_url,
            )

    def _start_processes(self, row: EngineRow, generation: int, started: list[EngineProcess]) -> str | None:
        """On the spawner thread: start ``row``'s processes, each one watched and in :meth:`starting_processes`
        as soon as it runs, so that the teardown finds it whatever happens next (the loop puts them in the row
        once this returns; the spawner thread writes no row); one that fails leaves those before it to be
        stopped with the engine (``started`` holds them: the failed launch is the next of ``row.launches``).
        Why a process could not be started, or None."""
        for launch in row.launches:
            if self.phase not in ("starting", "serving"):
                return "the deployment is stopping"
            try:
                process = self.backend.start(launch, log_path=self.log_dir / f"{launch.name}.log")
            except (OSError, LaunchError) as exc:
                return str(exc)
            with self._starting_lock:
                self._starting.append(process)
            started.append(process)
            self.watch_engine(row.id, generation, process)
        return None

    def starting_processes(self) -> list[EngineProcess]:
        """Engine processes started by a spawn whose outcome the loop has not taken in yet (from any thread)."""
        with self._starting_lock:
            return list(self._starting)

    def watch_engine(self, engine: str, generation: int, process: EngineProcess) -> None:
        """Tell the loop when ``process`` (of ``engine``'s processes of ``generation``) exits."""
        self.backend.watch_exit(
            process,
            self.exits,
            lambda: self._serving.call_soon(self._report_exit, engine, generation, process),
        )

    def _report_exit(self, engine: str, generation: int, process: EngineProcess) -> None:
        async def report() -> None:
            code, what = await self._blocking(_describe_exit, process)
            self.observe(exited(engine, generation, what, code))

        self._serving.create_task(report())

    async def _do_replay(self, a: Action) -> None:
        row = self.fleet.engine(a.engine or "")
        generation = row.restarts
        problem = None
        for call in a.calls:
            answer = await self.pool.call(
                row.url, "POST", call.route, body=call.body, deadline_s=self.settings.control.timeout_s
            )
            problem = answer.problem()
            if problem is not None:
                problem = f"{call.route}: {problem}"
                break
            if self.fleet.engine(row.id).restarts == generation:
                self.ledger.accepted(row.id, call.effect)
        self.observe(done(ObservationKind.REPLAY, row.id, generation, problem))

    async def _do_drain(self, a: Action) -> None:
        """How many requests a draining engine still has (its /metrics: running and queued); done when none,
        or when it no longer answers (nothing is left to finish)."""
        row = self.fleet.engine(a.engine or "")
        generation = row.restarts
        answer = await self.pool.call(row.url, "GET", "/metrics", deadline_s=self.policy.health_timeout_s)
        left = requests_left(answer.body) if answer.ok else 0
        self.observe(
            done(ObservationKind.DRAIN, row.id, generation, None if not left else f"{left} request(s) left")
        )

    async def _do_register(self, a: Action) -> None:
        row = self.fleet.engine(a.engine or "")
        generation, router = row.restarts, self.fleet.router(row.model)
        problem = None
        if router is not None:
            problem = await router_client.register(
                self.router_reads, router.url, row.registration, self.settings.api_key
            )
        self.observe(done(ObservationKind.REGISTER, row.id, generation, problem))

    async def _do_deregister(self, a: Action) -> None:
        row = self.fleet.engine(a.engine or "")
        generation, router = row.restarts, self.fleet.router(row.model)
        if router is not None:
            problem = await router_client.deregister(self.pool, router.url, row.url)
            if problem is not None:
                log.warning("could not take %s out of the router of %s: %s", row.id, row.model, problem)
        self.observe(done(ObservationKind.DEREGISTER, row.id, generation))

    async def _do_learn(self, a: Action) -> None:
        row = self.fleet.engine(a.engine or "")
        generation = row.restarts
        problem: str | None = "it answers neither /server_info nor /get_server_info"
        for path in ("/server_info", "/get_server_info"):
            answer = await self.pool.call(
                row.url, "GET", path, deadline_s=self.policy.health_timeout_s + 3, max_bytes=SERVER_INFO_BYTES
            )
            if answer.error is not None:
                problem = f"{path}: {answer.error}"
                break
            if answer.status == 200:
                gpus, serves_lora, problem = external_settings(answer.body, path)
                if problem is None:
                    self.fleet.update(row.id, num_gpus=gpus, serves_lora=serves_lora)
                break
        self.observe(done(ObservationKind.LEARN, row.id, generation, problem))

    async def _do_router_probe(self, a: Action) -> None:
        row = self._router(a)
        generation = row.generation
        timeout = self.policy.health_timeout_s
        answer = await self.pool.call(row.url, "GET", "/liveness", deadline_s=timeout, max_bytes=HEALTH_BYTES)
        problem = None if answer.status == 200 and answer.error is None else (answer.problem() or "no answer")
        self.observe(router_done(ObservationKind.ROUTER_PROBE, row.model, problem, generation=generation))

    def _router(self, a: Action) -> RouterRow:
        row = self.fleet.router(a.router or "")
        assert row is not None
        return row

    async def _do_router_restart(self, a: Action) -> None:
        row = self._router(a)
        generation = row.generation
        workers = tuple(a.details.get("workers", ()))
        await self._blocking(stop_processes, [row.process], self.settings.supervision.kill_grace_s)
        await self.forget_client(row.url)
        if self.fleet.router(row.model) is not row:
            return  # a change replaced the router meanwhile: its own process runs
        workers = tuple(engine for engine in workers if engine in self.fleet)  # not one a change dropped
        registrations = [self.fleet.engine(engine).registration for engine in workers]
        argv, env = router_command(row.launch.spec, workers=registrations)
        process = ManagedProcess(
            name=row.process.name,
            argv=argv,
            env=env,
            log_path=row.process.log_path,
            display_command=row.process.display_command,
        )
        self.fleet.update_router(
            row.model, process=process
        )  # in the row before it runs: the teardown stops it
        problem = None
        try:
            await asyncio.wrap_future(self._spawner.submit(process.start))
        except (OSError, RuntimeError) as exc:
            problem = f"it could not be started again: {exc}"
        if problem is None:
            self.watch_router(row.model, generation, process)
        self.observe(
            router_done(
                ObservationKind.ROUTER_RESTART,
                row.model,
                problem,
                generation=generation,
                details={"workers": workers},
            )
        )

    def watch_router(self, model: str, generation: int, process: ManagedProcess) -> None:
        def on_exit() -> None:
            row = self.fleet.router(model)
            if row is None or row.process is not process:
                return  # a router process a change replaced: stopped on purpose
            code = process.exit_code()
            self.observe(
                router_done(
                    ObservationKind.ROUTER_EXITED,
                    model,
                    f"its process exited with code {code}",
                    generation=generation,
                )
            )

        self.exits.watch(process, on_exit)

    async def _do_router_list(self, a: Action) -> None:
        row = self._router(a)
        generation = row.generation
        expected = [self.fleet.engine(engine).registration for engine in a.details.get("workers", ())]
        ok, detail = await router_client.listed(self.router_reads, row.url, expected)
        self.observe(
            router_done(ObservationKind.ROUTER_LIST, row.model, None if ok else detail, generation=generation)
        )

    # ----------------------------------------------------------------------------------------- control
    def begin_operation(
        self, engines: Iterable[str], covers: Callable[[EngineRow], bool] | None = None
    ) -> int:
        """On the loop: an operation concerning ``engines`` is out (none of them is caught up meanwhile); an
        engine added meanwhile that it ``covers`` joins it. Its token, for :meth:`end_operation`."""
        token = self._next_operation
        self._next_operation += 1
        operation = _Operation({}, covers)
        self._operations[token] = operation
        for engine in engines:
            self._hold(operation, engine)
        return token

    def _hold(self, operation: _Operation, engine: str) -> None:
        if engine in self.fleet and engine not in operation.engines:
            row = self.fleet.engine(engine)
            operation.engines[engine] = row
            self.fleet.update(engine, ops_in_flight=row.ops_in_flight + 1)

    def admit(self, row: EngineRow) -> None:
        """On the loop: ``row`` was added to the fleet (a change): it joins the operations out that cover it."""
        for operation in self._operations.values():
            if operation.covers is not None and operation.covers(row):
                # a fresh row (also one that replaces a row of the same id): it counts from none
                operation.engines[row.id] = row
                operation.joined.add(row.id)
                self.fleet.update(row.id, ops_in_flight=row.ops_in_flight + 1)

    def joined(self, token: int) -> set[str]:
        """The engines of an operation that were added while it was out."""
        operation = self._operations.get(token)
        return set() if operation is None else set(operation.joined)

    def end_operation(self, token: int) -> None:
        operation = self._operations.pop(token, None)
        if operation is None:
            return
        for engine, held in operation.engines.items():
            # the row it holds, not one a change put in its place meanwhile (that one is another's to hold)
            if engine in self.fleet and self.fleet.engine(engine) is held:
                self.fleet.update(engine, ops_in_flight=max(0, held.ops_in_flight - 1))
        self.poke_here()


@dataclass
class _Operation:
    """A control operation in flight: the engines it holds out of catch-up, and which added rows join it."""

    #: engine id -> the row it holds (a change may put a fresh row of the same id in its place)
    engines: dict[str, EngineRow]
    covers: Callable[[EngineRow], bool] | None
    joined: set[str] = dataclasses.field(default_factory=set)


_APPLY: dict[ActionKind, Callable[[Reconciler, Action], None]] = {
    ActionKind.TRANSITION: Reconciler._transition,
    ActionKind.UPDATE: Reconciler._update,
    ActionKind.ROUTER_TRANSITION: Reconciler._router_transition,
    ActionKind.ROUTER_UPDATE: Reconciler._router_update,
    ActionKind.EMIT: Reconciler._emit,
    ActionKind.READY: Reconciler._ready,
    ActionKind.STARTUP_FAILED: Reconciler._startup_failed,
    ActionKind.FAIL: Reconciler._fail,
}


def _describe_exit(process: EngineProcess) -> tuple[int, str]:
    """(exit code, what happened) of an exited process (off the loop: it may ask Ray)."""
    code = process.exit_code()
    reason = process.exit_reason()
    why = f": {reason}" if reason else ""
    return (
        code if code is not None else -1
    ), f"process {process.name} exited with code {code} ({process.where}){why}"


def requests_left(metrics: Any) -> int:
    """Running plus queued requests of a Prometheus page of SGLang's (``sglang:num_running_reqs``,
    ``sglang:num_queue_reqs``, summed over their labels); 0 when it holds neither."""
    if not isinstance(metrics, str):
        return 0
    total = 0.0
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("sglang:num_running_reqs", "sglang:num_queue_reqs"):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return int(total)


def _whole_number(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def external_settings(info: Any, path: str = "/server_info") -> tuple[int, bool, str | None]:
    """An external engine's GPUs and LoRA serving from its ``/server_info`` (slime: ``num_gpus``, else
    ``num_gpus_per_engine``, else tp_size * pp_size): ``(gpus, serves_lora, problem)``."""
    if not isinstance(info, dict):
        return 0, False, f"{path} answered {type(info).__name__} {str(info)[:200]!r}, not a JSON object"
    for key in ("num_gpus", "num_gpus_per_engine"):
        if info.get(key) is not None:
            gpus = _whole_number(info[key])
            if gpus is None or not 0 < gpus <= 65536:
                return 0, False, f"{path} reports {key} {info[key]!r}, not a whole number of GPUs in 1..65536"
            return gpus, bool(info.get("enable_lora")), None
    sizes = []
    for key in ("tp_size", "pp_size"):
        value = info.get(key)
        size = 1 if value is None else _whole_number(value)
        if size is None or not 0 < size <= 65536:
            return 0, False, f"{path} reports {key} {value!r}, not a whole number in 1..65536"
        sizes.append(size)
    return sizes[0] * sizes[1], bool(info.get("enable_lora")), None
