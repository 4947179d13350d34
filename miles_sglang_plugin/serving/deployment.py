"""The running deployment: engines started through a backend, one real sglang-router per model, readiness
with a deadline, a registry for rollout code, and a teardown that leaves nothing behind.

    with Deployment(prepared, LocalBackend(), log_dir=...) as deployment:
        url = deployment.registry.get_model_url("actor")

Start-up runs everything in parallel: all routers (subprocesses of this machine, the driver) and all engine
processes (through the backend, each on its node) are started at once; then one loop polls each engine's
health endpoint (checking at every poll that its process is alive), registers each healthy engine with its
model's router (``POST /workers``), and ends when every router reports all its workers. An engine or router
that exits during start-up fails the launch at once (its name, where it ran, command, exit code and log
tail); so does the deadline. Whatever was started is then stopped.

Once up, the deployment is watched and healed (:mod:`.supervision`: ``deployment.state()``, events) and
driven by the trainer through its control handle (:mod:`.control`: ``deployment.control``). External engines
(already running elsewhere) are health-checked and registered like the others, and never stopped.

Stopping (normal exit, exception, Ctrl-C, SIGTERM, interpreter exit, Hydra job end): routers and engines get
SIGTERM at once, SIGKILL after the grace period, and the backend gives back what it took (port claims). If
the launcher itself is SIGKILLed, its children receive SIGKILL from the kernel (``PR_SET_PDEATHSIG``).

Signals (:mod:`miles_sglang_plugin.serving.signals`): from start-up to the end of teardown, SIGINT and SIGTERM
are recorded, never raised into whatever code runs. A signal during start-up stops everything at the next
check (after each process started, at each poll); one after start-up stops everything at once from a watcher
thread; then the program's own handler gets the signal (Python's defaults: ``KeyboardInterrupt``; SIGTERM
ends the process with status 143), so the ``with`` block sees it only once nothing is left running.
"""

from __future__ import annotations

import atexit
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import httpx

from miles_sglang_plugin.backends.base import Backend, EngineProcess, LaunchError
from miles_sglang_plugin.backends.processes import ManagedProcess, stop_processes
from miles_sglang_plugin.backends.status_view import StatusView, SummaryRow
from miles_sglang_plugin.masking import mask_argv
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch, RouterLaunch
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.serving import quiet_http, signals
from miles_sglang_plugin.serving.control import AsyncDeploymentControl, DeploymentControl
from miles_sglang_plugin.serving.members import EngineInfo, EngineMember, build_members
from miles_sglang_plugin.serving.registry import ModelRoute, RouterRegistry
from miles_sglang_plugin.serving.routers import (
    RouterRequestError,
    register_workers,
    router_command,
    router_ready,
)
from miles_sglang_plugin.serving.supervision import (
    DeploymentEvent,
    DeploymentFailedError,
    DeploymentState,
    DeploymentStoppedError,
    RouterInfo,
    Supervisor,
)

#: Engine health endpoint polled during start-up (as Miles: a real generation, not just a live socket).
HEALTH_ENDPOINT = "/health_generate"
#: How often start-up looks for a stop signal while it waits for concurrent requests.
_SIGNAL_CHECK_S = 0.05

_T = TypeVar("_T")
_R = TypeVar("_R")


class StartupInterrupted(LaunchError):
    """SIGINT or SIGTERM arrived during start-up and the program's own handler for it returned (under Python's
    defaults it raises ``KeyboardInterrupt`` or ends the process instead); everything started was stopped."""


@dataclass
class RouterMember:
    """The router of one model (a process of this machine) and its live state."""

    launch: RouterLaunch
    process: ManagedProcess
    #: starting, live (answers), ready (lists all its workers), lost, restarting, stopped.
    state: str = "starting"
    restarts: int = 0
    health_failures: int = 0

    def info(self) -> RouterInfo:
        return RouterInfo(self.launch.model, self.launch.spec.url, self.state, self.restarts)


#: Deployments of this process that have started and not stopped. Held strongly: a deployment whose code kept
#: no reference to it still runs its processes, and must still be stopped at job end and at exit.
_ACTIVE: set[Deployment] = set()


def stop_all_active() -> None:
    """Stop every deployment of this process that is still running (interpreter exit, Hydra job end)."""
    for deployment in list(_ACTIVE):
        deployment.stop()


atexit.register(stop_all_active)


class Deployment:
    """Starts and stops one prepared deployment, whose engines run through ``backend``.

    The deployment owns the backend: :meth:`stop` closes it (its port claims are released)."""

    def __init__(
        self,
        prepared: PreparedDeployment,
        backend: Backend,
        *,
        log_dir: Path,
        status: StatusView | None = None,
        install_signal_handlers: bool = True,
    ) -> None:
        self.prepared = prepared
        self.backend = backend
        self.settings = prepared.settings
        self.log_dir = Path(log_dir)
        self.status = status or StatusView(mode=self.settings.launch.live)
        self.install_signal_handlers = install_signal_handlers
        self.notes = backend.check(prepared)
        self._engines: list[EngineMember] = build_members(prepared)
        self._routers: list[RouterMember] = []
        self._stopped = False
        #: stop() began (set once, first thing: no control operation starts from then on).
        self._stopping = False
        self._stopping_lock = threading.Lock()
        self._started = False
        self._failure: str | None = None
        self._ready = False
        self._control = DeploymentControl(AsyncDeploymentControl(self))
        self.supervisor = Supervisor(self)
        self._watch: signals.SignalWatch | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------------- API
    @property
    def registry(self) -> RouterRegistry:
        """Where rollout code finds each model's router."""
        return RouterRegistry(ModelRoute.from_launch_spec(router.launch.spec) for router in self._routers)

    def engines(self) -> tuple[EngineInfo, ...]:
        """Every engine, in deployment order, with its URL, node, GPUs and state."""
        return tuple(engine.info() for engine in self._engines)

    def processes(self) -> list[EngineProcess | ManagedProcess]:
        """Every process started: engine processes (all nodes), then routers."""
        return [process for engine in self._engines for process in engine.processes] + [
            router.process for router in self._routers
        ]

    def auth_headers(self) -> dict[str, str]:
        """``Authorization`` for requests to the routers and engines (empty without an API key). The key
        itself stays out of the registry, so that ``RouterRegistry.to_env()`` carries no secret."""
        key = self.settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def control(self) -> DeploymentControl:
        """The control handle: offload/onload, weight updates, pause, cache, abort, LoRA (blocking calls)."""
        return self._control

    @property
    def async_control(self) -> AsyncDeploymentControl:
        """The same operations as coroutines, for a trainer's event loop."""
        return self._control.aio

    def state(self) -> DeploymentState:
        """Where the deployment stands: every engine and router with its state, a failure, recent events."""
        engines = self.engines()
        routers = tuple(router.info() for router in self._routers)
        if self._failure is not None:
            status = "failed"
        elif self._stopped:
            status = "stopped"
        elif not self._ready:
            status = "starting"
        elif all(e.state == "registered" for e in engines) and all(r.state == "ready" for r in routers):
            status = "serving"
        else:
            status = "degraded"
        return DeploymentState(status, engines, routers, self._failure, self.supervisor.events.events()[-50:])

    def on_event(self, callback: Callable[[DeploymentEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for every supervision event (engine lost, restarting, recovered, router
        lost, deployment failed, ...), on the supervisor's thread; returns a function that unsubscribes."""
        return self.supervisor.events.subscribe(callback)

    def events(self) -> tuple[DeploymentEvent, ...]:
        """The supervision events so far (the last 1,000)."""
        return self.supervisor.events.events()

    def wait_for_event(
        self, kind: str, *, subject: str | None = None, since: int = 0, timeout_s: float = 60.0
    ) -> DeploymentEvent:
        """The first event ``kind`` (of ``subject``, e.g. an engine id) at or after position ``since``
        (``len(deployment.events())`` before the action that causes it); TimeoutError after ``timeout_s``."""
        return self.supervisor.events.wait_for(kind, subject=subject, since=since, timeout_s=timeout_s)

    @property
    def failure(self) -> str | None:
        """Why the deployment failed while serving (None: it did not)."""
        return self._failure

    def check(self) -> None:
        """Raise :class:`DeploymentFailedError` if the deployment failed (everything is stopped then)."""
        if self._failure is not None:
            raise DeploymentFailedError(f"the deployment failed and was stopped: {self._failure}")

    def check_running(self) -> None:
        """Raise :class:`DeploymentFailedError` if it failed, :class:`DeploymentStoppedError` once it stops
        (control operations call it first)."""
        self.check()
        if self._stopping:
            raise DeploymentStoppedError(
                "the deployment was stopped: control operations no longer reach its engines"
            )

    def mark_failed(self, message: str) -> None:
        """Record the failure (the supervisor stops everything next)."""
        self._failure = self._failure or message

    # Internal views for the control handle and the supervisor.
    @property
    def members(self) -> list[EngineMember]:
        return self._engines

    @property
    def router_members(self) -> list[RouterMember]:
        return self._routers

    def router_of(self, model: str) -> RouterMember | None:
        return next((router for router in self._routers if router.launch.model == model), None)

    def exited(self) -> list[tuple[str, int]]:
        """Processes that have exited since start-up (name, exit code): a deployment that lost a member."""
        return [
            (process.name, code) for process in self.processes() if (code := process.exit_code()) is not None
        ]

    def exit_report(self) -> list[str]:
        """One line per exited process: name, exit code, where it ran and, when the code does not say it all,
        why (a lost node)."""
        lines = []
        for process in self.processes():
            code = process.exit_code()
            if code is None:
                continue
            if isinstance(process, EngineProcess):
                reason = process.exit_reason()
                why = f": {reason}" if reason else ""
                lines.append(f"{process.name} exited with code {code} ({process.where}){why}")
            else:
                lines.append(f"{process.name} exited with code {code} (pid {process.pid} on this machine)")
        return lines

    @property
    def stop_signal(self) -> int | None:
        """The SIGINT/SIGTERM that stops (or stopped) this deployment; None while none arrived."""
        return self._watch.received if self._watch is not None else None

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
        signals.hand_on()  # a signal that came during the block or the teardown reaches the program now
        if exc_type is None:
            self.check()  # a deployment that failed while the block ran fails the block

    # --------------------------------------------------------------------------------------------- start
    def start(self) -> None:
        if self._started:
            raise RuntimeError("a Deployment starts once")
        self._started = True
        _ACTIVE.add(self)
        quiet_http.install()  # the requests below (polls, registrations, supervision, control) stay quiet
        self._watch = signals.watch() if self.install_signal_handlers else None
        for note in self.notes:
            self.status.note(note)
        try:
            self._spawn()
            self._wait_ready()
        except signals.Interrupted as exc:
            self._abandon_start(f"start-up interrupted by {exc}")
            signum = exc.signum
        except BaseException as exc:
            self._abandon_start(
                "start-up interrupted" if isinstance(exc, KeyboardInterrupt | SystemExit) else ""
            )
            raise
        else:
            self._ready = True
            self.supervisor.start()
            self.status.finish()
            self.status.summary(self._summary_rows())
            if self._watch is not None:
                self._watch.serve_in_background(self._stop_on_signal, name=f"signals of {self!r}")
            return
        signals.hand_on()  # outside the except block: the program's handler raises without a chained context
        raise StartupInterrupted(
            f"start-up interrupted by {signals.signal_name(signum)}: every engine and router was stopped"
        )

    def _abandon_start(self, note: str) -> None:
        self.status.finish()
        self.stop()
        if note:
            self.status.note(f"{note}: every engine and router was stopped")

    def _stop_on_signal(self, signum: int) -> None:
        self.status.note(f"{signals.signal_name(signum)} received: stopping every engine and router")
        try:
            self.stop()
        finally:  # even when the teardown raised: the watcher hands the signal on to the program next
            signals.unwatch(self._watch)

    def _check_signal(self) -> None:
        if self._watch is not None:
            self._watch.check()

    def _pause(self, seconds: float) -> None:
        """Sleep, waking at once for a stop signal (then raising :class:`signals.Interrupted`)."""
        if self._watch is not None:
            self._watch.wait(seconds)
        else:
            time.sleep(seconds)
        self._check_signal()

    def _gather(
        self, pool: ThreadPoolExecutor, function: Callable[[_T], _R], items: Iterable[_T]
    ) -> list[_R]:
        """``pool.map``, looking for a stop signal while it waits."""
        futures = [pool.submit(function, item) for item in items]
        while wait_for_futures(futures, timeout=_SIGNAL_CHECK_S).not_done:
            self._check_signal()
        self._check_signal()
        return [future.result() for future in futures]

    def _spawn(self) -> None:
        launch = self.prepared.launch
        for router_launch in launch.routers:
            argv, env = router_command(router_launch.spec)
            process = ManagedProcess(
                name=f"router.{router_launch.model}",
                argv=argv,
                env=env,
                log_path=self.log_dir / f"router.{router_launch.model}.log",
                display_command=" ".join(argv[:3]) + f" <spec of {router_launch.model}>",
            )
            self._routers.append(RouterMember(launch=router_launch, process=process))
            self.status.track(process.name, "router", router_launch.spec.url)
        for engine in self._engines:
            where = "external" if engine.external else f"GPUs {engine.gpus}"
            self.status.track(engine.id, "engine", f"{engine.url} {where}")
        for router in self._routers:
            self._start_router(router)
        for engine in self._engines:
            for process_launch in engine.launches:
                self._start_engine_process(engine, process_launch)

    def _start_router(self, router: RouterMember) -> None:
        self._check_signal()
        try:
            router.process.start()
        except OSError as exc:
            self.status.update(router.process.name, "failed")
            raise LaunchError(
                f"router {router.process.name} could not be started: {exc}\n"
                f"  command: {router.process.display_command}"
            ) from exc

    def _start_engine_process(self, engine: EngineMember, process_launch: EngineProcessLaunch) -> None:
        self._check_signal()
        try:
            engine.processes.append(
                self.backend.start(process_launch, log_path=self.log_dir / f"{process_launch.name}.log")
            )
        except OSError as exc:  # e.g. the command does not exist: a LaunchError like any other failed start
            self.status.update(engine.id, "failed")
            raise LaunchError(
                f"engine {process_launch.name} could not be started: {exc}\n"
                f"  command: {process_launch.display_command()}"
            ) from exc

    def _fail_if_exited(self) -> None:
        for router in self._routers:
            code = router.process.exit_code()
            if code is not None:
                self.status.update(router.process.name, "failed")
                raise LaunchError(
                    _exited_message(
                        f"router {router.process.name}",
                        f"pid {router.process.pid} on this machine",
                        code,
                        time.monotonic() - router.process.started_at,
                        router.process.display_command or " ".join(mask_argv(list(router.process.argv))),
                        str(router.process.log_path),
                        router.process.tail(15),
                    )
                )
        for engine in self._engines:
            for process in engine.processes:
                code = process.exit_code()
                if code is not None:
                    self.status.update(engine.id, "failed")
                    raise LaunchError(
                        _exited_message(
                            f"engine {process.name}",
                            process.where,
                            code,
                            time.monotonic() - process.started_at,
                            process.launch.display_command(),
                            process.log_location,
                            process.tail(15),
                            reason=process.exit_reason(),
                        )
                    )

    def _wait_ready(self) -> None:
        launch_conf = self.settings.launch
        deadline = time.monotonic() + launch_conf.startup_timeout_s
        # Health polls and registrations go out concurrently: one slow or hanging engine must not delay the
        # others, and registration time must not grow with the number of engines.
        workers = min(32, max(4, len(self._engines) + len(self._routers)))
        pool = ThreadPoolExecutor(workers)
        try:
            with httpx.Client(timeout=2.0, headers=self.auth_headers()) as client:
                while True:
                    self._fail_if_exited()
                    self._poll_health(client, pool)
                    self._register_healthy(pool)
                    if all(e.registered for e in self._engines) and self._routers_ready(pool):
                        return
                    if time.monotonic() > deadline:
                        raise LaunchError(self._timeout_message(launch_conf.startup_timeout_s))
                    self._pause(launch_conf.poll_interval_s)
        finally:  # requests still in flight after a failure end on their own (their timeout); nobody waits
            pool.shutdown(wait=False, cancel_futures=True)

    def _poll_health(self, client: httpx.Client, pool: ThreadPoolExecutor) -> None:
        routers = [router for router in self._routers if router.state == "starting"]
        engines = [engine for engine in self._engines if engine.state == "starting"]
        urls = [router.launch.spec.url + "/liveness" for router in routers] + [
            engine.url + HEALTH_ENDPOINT for engine in engines
        ]
        answered = self._gather(pool, lambda url: _get_ok(client, url), urls)
        for router, live in zip(routers, answered[: len(routers)], strict=True):
            if live:
                router.state = "live"
                self.status.update(router.process.name, "live")
        for engine, healthy in zip(engines, answered[len(routers) :], strict=True):
            if healthy:
                if engine.external:
                    _learn_external(client, engine)
                engine.state, engine.healthy_at = "healthy", time.monotonic()
                self.status.update(engine.id, "healthy")

    def _register_healthy(self, pool: ThreadPoolExecutor) -> None:
        by_model = {r.launch.model: r for r in self._routers}
        due = [
            (engine, router)
            for engine in self._engines
            if engine.state == "healthy"
            and not engine.registered
            and (router := by_model.get(engine.model)) is not None
            and router.state != "starting"
        ]

        def register(item: tuple[EngineMember, RouterMember]) -> str | None:
            engine, router = item
            try:
                register_workers(router.launch.spec.url, [engine.registration], api_key=self.settings.api_key)
            except (RouterRequestError, httpx.HTTPError) as exc:
                return f"router of model {engine.model!r} refused engine {engine.id}: {exc}"
            return None

        for (engine, _router), error in zip(due, self._gather(pool, register, due), strict=True):
            if error is not None:
                raise LaunchError(error)
            engine.registered = True
            engine.state = "registered"
            self.status.update(engine.id, "registered")

    def _routers_ready(self, pool: ThreadPoolExecutor) -> bool:
        waiting = [router for router in self._routers if router.state != "ready"]

        def ready(router: RouterMember) -> bool:
            return router_ready(router.launch.spec.url, router.launch.workers, api_key=self.settings.api_key)[
                0
            ]

        for router, ok in zip(waiting, self._gather(pool, ready, waiting), strict=True):
            if ok:
                router.state = "ready"
                self.status.update(router.process.name, "ready")
        return all(router.state == "ready" for router in self._routers)

    def _timeout_message(self, timeout_s: float) -> str:
        lines = [
            f"the deployment was not ready after {timeout_s:g} s (sglang_deploy.launch.startup_timeout_s):"
        ]
        for engine in self._engines:
            if engine.state == "starting" and engine.external:
                lines.append(
                    f"  external engine {engine.id} never answered {HEALTH_ENDPOINT} at {engine.url} "
                    "(it runs elsewhere: is it up, and reachable from here?)"
                )
            elif engine.state == "starting":
                process = engine.processes[0]
                lines.append(
                    f"  engine {engine.id} never answered {HEALTH_ENDPOINT} "
                    f"at {engine.url} "
                    f"({process.where}, still running); last log lines of {process.log_location}:"
                )
                lines += [f"    | {line}" for line in process.tail(10).splitlines()]
        for router in self._routers:
            if router.state != "ready":
                lines.append(f"  router of {router.launch.model} at {router.launch.spec.url}: {router.state}")
        return "\n".join(lines)

    def _summary_rows(self) -> list[SummaryRow]:
        registry = self.registry
        rows = []
        for model in self.prepared.plan.models:
            if model.name not in registry:
                continue
            rows.append(
                SummaryRow(
                    model=model.name,
                    router=registry[model.name].base_url,
                    mode="pd" if model.is_pd else "regular",
                    engines=len(model.engines) + len(model.external),
                    gpus=sum(engine.num_gpus for engine in model.engines),
                    engine_kind=self.prepared.launch.engine_kind.value,
                )
            )
        return rows

    # ---------------------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Stop every process this deployment started and close its backend (idempotent). External engines
        are left running (they are only taken out of routers that stop anyway). Control operations in flight
        raise :class:`DeploymentStoppedError` (:class:`DeploymentFailedError` when it failed), later ones too."""
        with self._stopping_lock:
            already, self._stopping = self._stopping, True
        if already and self.supervisor.owns(threading.current_thread()):
            return  # e.g. a recovery that failed while the deployment stops: the stopping thread joins this one
        self.supervisor.request_stop()  # no restarts from now on; its threads end once their engines are gone
        self._control.close()  # callers blocked in an operation raise now, whatever their engines do
        with self._lock:
            if self._stopped:
                return
            # A second Ctrl-C or SIGTERM must not cut the teardown short: recorded, handed on afterwards.
            with signals.recorded():
                self._teardown(self.settings.launch.shutdown_grace_s)

    def _engine_processes(self) -> list[EngineProcess]:
        return [process for engine in self._engines for process in engine.processes]

    def _teardown(self, grace: float) -> None:
        routers = [router.process for router in self._routers]
        for process in routers:  # routers stop while the engines are given their grace period
            if process.running:
                process.signal_group(signal.SIGTERM)
        try:
            self.backend.stop(self._engine_processes(), grace_s=grace)
        finally:
            try:
                stop_processes(routers, grace_s=grace)
                self.supervisor.join()  # a replay or restart in flight ends now that its engine is gone
                # What a restart started meanwhile (before it saw the stop), engines and routers alike.
                late = [process for process in self._engine_processes() if process.exit_code() is None]
                if late:
                    self.backend.stop(late, grace_s=grace)
                stop_processes([process for process in routers if process.running], grace_s=grace)
            finally:
                self.backend.close()
                self._stopped = True
                _ACTIVE.discard(self)
                signals.unwatch(self._watch)
                self._after_stop()

    def _after_stop(self) -> None:
        for member in self._engines:
            member.state = "stopped"
        for router in self._routers:
            router.state = "stopped"
        self.supervisor.close()
        self._control.close()


def _learn_external(client: httpx.Client, engine: EngineMember) -> None:
    """An external engine's GPUs and LoRA serving, as it reports them (slime: ``num_gpus``, else
    ``num_gpus_per_engine``, else tp_size * pp_size of ``/server_info``)."""
    for path in ("/server_info", "/get_server_info"):
        try:
            response = client.get(engine.url + path)
            info = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        if isinstance(info, dict):
            gpus = info.get("num_gpus") or info.get("num_gpus_per_engine")
            if not isinstance(gpus, int):
                gpus = int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)
            engine.num_gpus = gpus
            engine.serves_lora = bool(info.get("enable_lora"))
            return


def _get_ok(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except (httpx.HTTPError, RuntimeError):  # RuntimeError: the client was closed (start-up given up)
        return False


def _exited_message(
    what: str,
    where: str,
    code: int,
    elapsed_s: float,
    command: str,
    log: str,
    tail: str,
    reason: str | None = None,
) -> str:
    why = f": {reason}" if reason else ""
    lines = [
        f"{what} exited with code {code} during start-up (after {elapsed_s:.1f} s){why}",
        f"  where: {where}",
        f"  command: {command}",
        f"  last log lines of {log}:",
        *(f"    | {line}" for line in tail.splitlines()),
        *([] if tail.strip() else ["    (none: it wrote nothing there)"]),
    ]
    return "\n".join(lines)


__all__: Sequence[str] = ["Deployment", "EngineInfo", "RouterMember", "StartupInterrupted", "stop_all_active"]
