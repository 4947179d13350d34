"""Fakes that let a real :class:`~miles_sglang_plugin.serving.reconciler.Reconciler` run with no process, no
socket and no wall-clock time (the way Ray Serve tests its deployment state with mock replicas):

* :class:`FakeBackend`: ``start`` returns :class:`FakeEngineProcess` objects whose exit the test decides
  (:meth:`FakeBackend.kill`: the exit callback the reconciler gave ``watch_exit`` fires); ``stop`` records the
  call and ends the processes (their exit is told, as a real one's would be).
* :class:`FakePool`: stands in for :class:`~miles_sglang_plugin.serving.wire.ClientPool` (same ``call``, ``forget``
  and ``aclose``, :class:`~miles_sglang_plugin.serving.wire.Answer` results). Engine URLs answer while a process of
  theirs runs (``/health_generate`` once its warm-up is over, ``/health``, ``/metrics`` from a script, control
  POSTs); router URLs are answered by a :class:`FakeRouter` (``/workers`` list, register, delete, ``/liveness``,
  ``/readiness``), which can hold the next answer to a path until the test lets it go.
* :class:`Harness`: the reconciler on a :class:`~tests.virtual_time.VirtualTimeLoop` in the test's own thread, with
  an inline spawner and I/O executor and a fake exit watcher; its clock is the loop's, so minutes of backoff and
  deadlines pass in microseconds, and the same run happens whatever the machine's load.

Router processes are :class:`~miles_sglang_plugin.backends.processes.ManagedProcess` objects that the reconciler makes
itself (a router restart): :meth:`Harness.patch_router_processes` replaces ``ManagedProcess.start`` and the
reconciler's ``stop_processes`` for the test, so that they start and stop the fake router instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from miles_sglang_plugin.backends.base import Backend, EngineProcess
from miles_sglang_plugin.backends.processes import ManagedProcess
from miles_sglang_plugin.backends.status_view import StatusView
from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.serving import elastic
from miles_sglang_plugin.serving import reconciler as reconciler_module
from miles_sglang_plugin.serving.events import EventLog
from miles_sglang_plugin.serving.fleet import build_fleet
from miles_sglang_plugin.serving.ledger import Ledger, initial_state
from miles_sglang_plugin.serving.reconciler import Reconciler
from miles_sglang_plugin.serving.wire import Answer
from tests.virtual_time import VirtualTimeLoop

#: What a connection to a port nobody listens on gets (as :mod:`.wire` words an httpx ConnectError).
REFUSED = "ConnectError: [Errno 111] Connection refused"
#: What a held answer of a process that died meanwhile gets.
DISCONNECTED = "RemoteProtocolError: Server disconnected without sending a response."


# ------------------------------------------------------------------------------------------------- the trace
@dataclass
class Entry:
    """One thing that happened to an engine or router, at virtual time ``t`` (``seq``: the order)."""

    seq: int
    t: float
    subject: str
    what: str
    body: Any = None
    #: The HTTP status answered (None: no answer), or a word: refused, timeout, held.
    status: Any = None


class Trace:
    """Everything the fakes were asked, in order."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.entries: list[Entry] = []
        self._seq = itertools.count()

    def add(self, subject: str, what: str, body: Any = None, status: Any = None) -> Entry:
        entry = Entry(next(self._seq), self.clock(), subject, what, body, status)
        self.entries.append(entry)
        return entry

    def of(self, subject: str, *, since: int = 0) -> list[Entry]:
        return [e for e in self.entries if e.subject == subject and e.seq >= since]

    def whats(self, subject: str, *, since: int = 0) -> list[str]:
        return [e.what for e in self.of(subject, since=since)]

    def first(self, subject: str, what: str, *, since: int = 0) -> Entry:
        for entry in self.of(subject, since=since):
            if entry.what == what:
                return entry
        raise AssertionError(f"{subject} was never asked {what!r} (from #{since}): {self.whats(subject)}")

    @property
    def mark(self) -> int:
        """A position: entries from here on are what follows."""
        return len(self.entries)


# ------------------------------------------------------------------------------------------------- engines
class FakeEngineProcess(EngineProcess):
    """One engine process of the fake backend: it runs until the test (or ``stop``) ends it."""

    def __init__(
        self, launch: EngineProcessLaunch, *, started_at: float, serial: int, warmup_s: float
    ) -> None:
        super().__init__(launch)
        self.started_at = started_at  # the virtual clock's, not time.monotonic()
        self.serial = serial
        #: ``/health_generate`` answers 200 from here on.
        self.ready_at = started_at + warmup_s
        #: Every call to it waits out its deadline (a hung engine).
        self.hung = False
        self.code: int | None = None
        self._on_exit: list[Callable[[], None]] = []

    def exit_code(self) -> int | None:
        return self.code

    def tail(self, lines: int = 20) -> str:
        return f"(the log of {self.name} #{self.serial})"

    @property
    def where(self) -> str:
        return f"fake {self.name} #{self.serial}"

    @property
    def log_location(self) -> str:
        return f"fake://{self.name}/{self.serial}.log"

    def watch(self, on_exit: Callable[[], None]) -> None:
        if self.code is not None:
            on_exit()
        else:
            self._on_exit.append(on_exit)

    def exit(self, code: int) -> None:
        if self.code is not None:
            return
        self.code = code
        callbacks, self._on_exit = self._on_exit, []
        for callback in callbacks:
            callback()


class FakeBackend(Backend):
    """Starts :class:`FakeEngineProcess` objects; what each start and stop was is in the trace."""

    name = "fake"

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.processes: dict[str, list[FakeEngineProcess]] = {}
        #: Seconds until a fresh process answers /health_generate (0.5 s unless set per engine).
        self.warmup_s: dict[str, float] = {}
        #: Engines whose start raises OSError.
        self.failing: set[str] = set()
        #: ``/metrics``' running requests per engine, one value per call (the last one stays).
        self.running_requests: dict[str, list[int]] = {}
        #: Each ``stop``: (virtual time, the processes' names and serials, grace).
        self.stops: list[tuple[float, tuple[tuple[str, int], ...], float]] = []

    def prepare(self, plan: Any, settings: Any, **kw: Any) -> PreparedDeployment:
        raise NotImplementedError("the fake backend runs deployments prepared by the test")

    def check(self, prepared: PreparedDeployment) -> list[str]:
        return []

    def start(self, launch: EngineProcessLaunch, *, log_path: Path) -> EngineProcess:
        self.trace.add(launch.engine_id, "start")
        if launch.name in self.failing:
            raise OSError(f"fake: {launch.name} cannot be started")
        serial = len(self.processes.get(launch.name, [])) + 1
        process = FakeEngineProcess(
            launch, started_at=self.trace.clock(), serial=serial, warmup_s=self.warmup_s.get(launch.name, 0.5)
        )
        self.processes.setdefault(launch.name, []).append(process)
        return process

    def stop(self, processes: Sequence[EngineProcess], *, grace_s: float) -> None:
        fakes = [p for p in processes if isinstance(p, FakeEngineProcess)]
        self.stops.append((self.trace.clock(), tuple((p.name, p.serial) for p in fakes), grace_s))
        for process in fakes:
            self.trace.add(process.launch.engine_id, "stop", body=process.serial)
            process.exit(-15)

    def watch_exit(self, process: EngineProcess, watcher: Any, on_exit: Callable[[], None]) -> None:
        assert isinstance(process, FakeEngineProcess)
        process.watch(on_exit)

    # -- for the test
    def process(self, name: str) -> FakeEngineProcess:
        """The latest process of ``name``."""
        return self.processes[name][-1]

    def kill(self, name: str, code: int = -9) -> FakeEngineProcess:
        process = self.process(name)
        self.trace.add(process.launch.engine_id, "killed", body=code)
        process.exit(code)
        return process

    def running_at(self, url: str) -> FakeEngineProcess | None:
        for processes in self.processes.values():
            for process in processes:
                if process.launch.url == url and process.code is None:
                    return process
        return None

    def engine_at(self, url: str) -> str:
        for processes in self.processes.values():
            if processes and processes[0].launch.url == url:
                return processes[0].launch.engine_id
        return url

    def metrics(self, name: str) -> str:
        script = self.running_requests.get(name, [0])
        running = script.pop(0) if len(script) > 1 else script[0]
        return f'sglang:num_running_reqs{{model_name="m"}} {running}\nsglang:num_queue_reqs{{model_name="m"}} 0\n'


# ------------------------------------------------------------------------------------------------- routers
class FakeRouter:
    """A model's router on the wire (sglang-router 0.3.2's answers, see :mod:`miles_sglang_plugin.serving.routers`)."""

    def __init__(self, name: str, url: str, trace: Trace, backend: FakeBackend) -> None:
        self.name, self.url, self.trace, self.backend = name, url, trace, backend
        self.alive = False
        self.workers: dict[str, dict[str, Any]] = {}
        self._ids = itertools.count()
        #: The workers each start of its process was given (``--workers-json``), in order.
        self.started_with: list[list[str]] = []
        #: path -> the gate the next call to it waits on (then answered as from a process that died).
        self._hold: dict[str, asyncio.Future[None]] = {}
        self.held: list[Entry] = []

    def started(self, workers: Iterable[Mapping[str, Any]]) -> None:
        self.alive = True
        self.workers = {}
        for worker in workers:
            self._add(worker)
        self.started_with.append([str(w["url"]) for w in workers])

    def _add(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        entry = {
            "id": f"w{next(self._ids)}",
            "url": payload["url"],
            "worker_type": payload.get("worker_type", "regular"),
            "is_healthy": True,
        }
        if payload.get("bootstrap_port") is not None:
            entry["bootstrap_port"] = payload["bootstrap_port"]
        self.workers[entry["id"]] = entry
        return entry

    def hold_next(self, path: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """The next call to ``path`` is not answered until the returned future is done."""
        gate = self._hold[path] = loop.create_future()
        return gate

    async def answer(self, method: str, path: str, body: Any, deadline_s: float) -> Answer:
        entry = self.trace.add(self.name, f"{method} {path}", body=body)
        gate = self._hold.pop(path, None)
        if gate is not None:
            entry.status = "held"
            self.held.append(entry)
            await gate
            return Answer(None, None, DISCONNECTED, 0.0)
        if not self.alive:
            entry.status = "refused"
            return Answer(None, None, REFUSED, 0.0)
        status, answer = self._route(method, path, body)
        entry.status = status
        return Answer(status, answer, None, 0.0)

    def _route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if (method, path) == ("GET", "/liveness"):
            return 200, "OK"
        if (method, path) == ("GET", "/readiness"):
            return (200, {"status": "ready"}) if self.workers else (503, {"status": "not ready"})
        if (method, path) == ("GET", "/workers"):
            return 200, {"workers": list(self.workers.values()), "total": len(self.workers)}
        if (method, path) == ("POST", "/workers"):
            # sglang-router 0.3.2: a second POST of a listed URL answers 202 and changes nothing
            if not any(w["url"] == body["url"] for w in self.workers.values()):
                entry = self._add(body)
                self.trace.add(self.backend.engine_at(body["url"]), "registered", body=entry["id"])
            return 202, {"status": "accepted"}
        if method == "DELETE" and path.startswith("/workers/"):
            worker_id = path.removeprefix("/workers/")
            if worker_id not in self.workers:
                return 404, {"error": "not found"}
            gone = self.workers.pop(worker_id)
            self.trace.add(self.backend.engine_at(gone["url"]), "deregistered", body=gone["id"])
            return 202, {"status": "accepted"}
        return 404, {"error": f"no route {method} {path}"}

    def listed(self) -> list[str]:
        return sorted(str(w["url"]) for w in self.workers.values())


# ------------------------------------------------------------------------------------------------- the pool
class FakePool:
    """Stands in for :class:`~miles_sglang_plugin.serving.wire.ClientPool`."""

    def __init__(self, trace: Trace, backend: FakeBackend, routers: Mapping[str, FakeRouter]) -> None:
        self.trace, self.backend, self.routers = trace, backend, routers
        self.forgotten: list[str] = []
        self.closed = False

    async def call(
        self,
        base_url: str,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        deadline_s: float,
        max_bytes: int = 0,
    ) -> Answer:
        assert not self.closed, "a call after aclose()"
        router = self.routers.get(base_url)
        if router is not None:
            return await router.answer(method, path, body, deadline_s)
        return await self._engine(base_url, method, path, body, deadline_s)

    async def _engine(
        self, url: str, method: str, path: str, body: Mapping[str, Any] | None, deadline_s: float
    ) -> Answer:
        entry = self.trace.add(self.backend.engine_at(url), f"{method} {path}", body=body)
        process = self.backend.running_at(url)
        if process is None:
            entry.status = "refused"
            return Answer(None, None, REFUSED, 0.0)
        if process.hung:
            entry.status = "timeout"
            await asyncio.sleep(deadline_s)
            return Answer(None, None, f"no answer within {deadline_s:g} s", deadline_s, timed_out=True)
        status, answer = self._engine_route(process, method, path)
        entry.status = status
        return Answer(status, answer, None, 0.0)

    def _engine_route(self, process: FakeEngineProcess, method: str, path: str) -> tuple[int, Any]:
        if path == "/health_generate":
            return (200, None) if self.trace.clock() >= process.ready_at else (503, {"error": "warming up"})
        if path == "/health":
            return 200, None
        if path == "/metrics":
            return 200, self.backend.metrics(process.name)
        if method == "POST":
            return 200, {"success": True, "message": "fake"}
        return 404, {"detail": "Not Found"}

    def forget(self, base_url: str) -> None:
        self.forgotten.append(base_url)
        return None

    async def aclose(self) -> None:
        self.closed = True


# ------------------------------------------------------------------------------------------------- the loop
class InlineLoop:
    """Stands in for :class:`~miles_sglang_plugin.serving.reconciler.ServingLoop` on a loop the test runs itself."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.tasks: set[asyncio.Task[Any]] = set()

    def create_task(self, coro: Any) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        self.loop.call_soon(callback, *args)

    def in_loop(self) -> bool:
        return True


class InlineExecutor(concurrent.futures.Executor):
    """Runs what is submitted at once, on the caller's thread (the spawner and the I/O pool)."""

    def __init__(self) -> None:
        self.calls = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.calls += 1
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


class FakeExitWatcher:
    """Holds the exit callbacks of router processes (the fake backend tells engine exits itself)."""

    def __init__(self) -> None:
        self.watched: list[tuple[ManagedProcess, Callable[[], None]]] = []

    def watch(self, process: ManagedProcess, on_exit: Callable[[], None]) -> None:
        self.watched.append((process, on_exit))

    def watch_polled(self, exited: Callable[[], bool], on_exit: Callable[[], None]) -> None:
        raise AssertionError("the fake backend tells exits itself")

    def fire(self, process: ManagedProcess) -> None:
        for entry in [w for w in self.watched if w[0] is process]:
            self.watched.remove(entry)
            entry[1]()

    def close(self) -> None:
        self.watched.clear()


class ClockedEvents(EventLog):
    """The event log, each event also kept with the virtual time it was emitted at."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__()
        self.clock = clock
        self.timeline: list[tuple[float, str, str, str, dict[str, Any]]] = []

    def emit(self, kind: str, subject: str, message: str, **details: Any) -> Any:
        self.timeline.append((self.clock(), kind, subject, message, details))
        return super().emit(kind, subject, message, **details)

    def kinds(self, subject: str | None = None) -> list[str]:
        return [kind for _t, kind, s, _m, _d in self.timeline if subject is None or s == subject]

    def one(self, kind: str, subject: str | None = None) -> tuple[float, str, dict[str, Any]]:
        """(time, message, details) of the only event ``kind`` (of ``subject``)."""
        found = [(t, m, d) for t, k, s, m, d in self.timeline if k == kind and subject in (None, s)]
        assert len(found) == 1, f"{len(found)} {kind} events of {subject}: {self.timeline}"
        return found[0]


class _Surprises(logging.Handler):
    """Exceptions the reconciler logged (a decision or a work action that raised)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


# ------------------------------------------------------------------------------------------------- harness
@dataclass
class Harness:
    """A real Reconciler of ``prepared`` (with ``settings``) on fakes, driven in virtual time."""

    prepared: PreparedDeployment
    settings: SGLangDeployConf
    log_dir: Path
    loop: VirtualTimeLoop = field(default_factory=VirtualTimeLoop)
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clock = self.loop.time
        self.trace = Trace(self.clock)
        self.backend = FakeBackend(self.trace)
        router_rows = [
            elastic.new_router_row(launch, self.log_dir) for launch in self.prepared.launch.routers
        ]
        self.routers = {r.url: FakeRouter(r.name, r.url, self.trace, self.backend) for r in router_rows}
        self.pool = FakePool(self.trace, self.backend, self.routers)
        self.fleet = build_fleet(self.prepared, router_rows, to_start=True)
        self.ledger = Ledger(
            {
                row.id: initial_state(row.initial_lora, row.command_line_version)
                for row in self.fleet.engines()
            }
        )
        self.events = ClockedEvents(self.clock)
        self.exits = FakeExitWatcher()
        self.serving = InlineLoop(self.loop)
        self.failed = threading.Event()
        self.loop_errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, context: self.loop_errors.append(context))
        self.surprises = _Surprises()
        logging.getLogger("miles_sglang_plugin").addHandler(self.surprises)
        self.reconciler = Reconciler(
            fleet=self.fleet,
            ledger=self.ledger,
            settings=self.settings,
            backend=self.backend,
            log_dir=self.log_dir,
            events=self.events,
            status=StatusView(mode="never"),
            loop=self.serving,  # type: ignore[arg-type]
            pool=self.pool,  # type: ignore[arg-type]
            spawner=InlineExecutor(),  # type: ignore[arg-type]
            io=InlineExecutor(),  # type: ignore[arg-type]
            exits=self.exits,  # type: ignore[arg-type]
            on_fail=self._on_fail,
            clock=self.clock,
        )
        self.task: asyncio.Task[None] | None = None

    def _on_fail(self, message: str) -> None:  # on a thread of the reconciler's (msp-fail)
        self.failures.append(message)
        self.failed.set()

    # -- router processes
    def patch_router_processes(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``ManagedProcess.start`` starts the fake router of the process's name (with the workers its command line
        gives it), the reconciler's ``stop_processes`` stops it: no router process runs."""
        by_name = {router.name: router for router in self.routers.values()}

        def start(process: ManagedProcess) -> None:
            argv = list(process.argv)
            workers = json.loads(argv[argv.index("--workers-json") + 1]) if "--workers-json" in argv else []
            self.trace.add(process.name, "start", body=[w["url"] for w in workers])
            by_name[process.name].started(workers)

        def stop_processes(
            processes: Iterable[ManagedProcess], grace_s: float = 10.0
        ) -> dict[str, int | None]:
            for process in processes:
                self.trace.add(process.name, "stop", body=grace_s)
                by_name[process.name].alive = False
            return {}

        monkeypatch.setattr(ManagedProcess, "start", start)
        monkeypatch.setattr(reconciler_module, "stop_processes", stop_processes)

    def router(self, model: str = "actor") -> FakeRouter:
        row = self.fleet.router(model)
        assert row is not None
        return self.routers[row.url]

    def kill_router(self, model: str = "actor") -> None:
        row = self.fleet.router(model)
        assert row is not None
        self.trace.add(row.name, "killed")
        self.routers[row.url].alive = False
        self.exits.fire(row.process)

    # -- running
    def start(self) -> None:
        """What ``Deployment._start_routers`` and ``_await_startup`` do: the routers started and their exits
        watched, the reconcile loop running (it starts the engines)."""
        for router in self.fleet.routers():
            router.process.start()
            self.reconciler.watch_router(router.model, 0, router.process)
        self.task = self.loop.create_task(self.reconciler.run(self.settings.launch.startup_timeout_s))

    def run_until(self, done: Callable[[], bool], *, within: float, step: float = 0.01) -> float:
        """Run the loop until ``done()`` (looked at every ``step`` virtual seconds); the virtual time then. Fails
        if ``within`` virtual seconds pass first, or if the reconcile loop ended by surprise."""

        async def wait() -> float:
            until = self.clock() + within
            while not done():
                if self.clock() > until:
                    raise AssertionError(f"not within {within:g} virtual s; {self.describe()}")
                if self.task is not None and self.task.done() and self.task.exception() is not None:
                    raise AssertionError("the reconcile loop raised") from self.task.exception()
                await asyncio.sleep(step)
            return self.clock()

        return self.loop.run_until_complete(wait())

    def advance(self, seconds: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))

    def describe(self) -> str:
        engines = ", ".join(f"{r.id} {r.state.value} {sorted(r.pending)}" for r in self.fleet.engines())
        routers = ", ".join(f"{r.name} {r.state.value} {sorted(r.pending)}" for r in self.fleet.routers())
        return f"t={self.clock():.3f}: {engines}; {routers}; events {self.events.kinds()}"

    def close(self) -> None:
        """Stop the reconciler, cancel what runs, close the loop."""
        try:
            self.reconciler.stop()
            if self.task is not None and not self.task.done():
                self.loop.run_until_complete(asyncio.wait_for(self.task, 60))
            for task in list(self.serving.tasks):
                task.cancel()
            if self.serving.tasks:
                self.loop.run_until_complete(asyncio.wait(list(self.serving.tasks)))
            self.loop.run_until_complete(self.pool.aclose())
        finally:
            self.loop.close()
            logging.getLogger("miles_sglang_plugin").removeHandler(self.surprises)

    def check_no_surprises(self) -> None:
        assert not self.surprises.records, [r.getMessage() for r in self.surprises.records]
        assert not self.loop_errors, self.loop_errors
