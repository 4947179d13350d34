"""The running deployment: engines started through a backend, one real sglang-router per model, one
reconcile loop that brings them up and keeps them serving, the trainer's control handle, and a teardown that
leaves nothing behind.

    with Deployment(prepared, LocalBackend(), log_dir=...) as deployment:
        url = deployment.registry.get_model_url("actor")

Its parts, each with one job:

* **desired state**: the plan (``prepared``) and the ledger of the control state each engine should have
  (:mod:`.ledger`, changed by the control operations: :mod:`.control`);
* **observed state**: the fleet table of engines and routers with their states (:mod:`.fleet`);
* **one reconcile loop** (:mod:`.reconciler`), whose decisions are the pure :func:`~.policy.plan_actions`:
  start-up (health polls, registration, readiness with a deadline), supervision (exits told by the exit
  watcher, health polls, losses, restarts with backoff and budget, replays, router restarts) and every way
  back into service go through it.

Start-up starts all routers and engine processes at once (from the spawner thread, whose children carry the
parent-death signal), then the loop brings every engine to ``serving``. An engine or router that exits during
start-up fails the launch at once (its name, where it ran, command, exit code and log tail); so does the
deadline. Whatever was started is then stopped.

Stopping (normal exit, exception, Ctrl-C, SIGTERM, interpreter exit, Hydra job end): the loop stops deciding
and cancels what it does (control operations in flight raise :class:`~.errors.DeploymentStoppedError`),
routers and engines get SIGTERM at once, SIGKILL after the grace period, and the backend gives back what it
took (port claims). If the launcher itself is SIGKILLed, its children receive SIGKILL from the kernel
(``PR_SET_PDEATHSIG``).

Signals (:mod:`miles_sglang_plugin.serving.signals`): from start-up to the end of teardown, SIGINT and SIGTERM
are recorded, never raised into whatever code runs. A signal during start-up stops everything at once; one
after start-up stops everything from a watcher thread; then the program's own handler gets the signal
(Python's defaults: ``KeyboardInterrupt``; SIGTERM ends the process with status 143), so the ``with`` block
sees it only once nothing is left running.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from miles_sglang_plugin.backends.base import Backend, EngineProcess, LaunchError
from miles_sglang_plugin.backends.processes import ExitWatcher, ManagedProcess, Spawner, stop_processes
from miles_sglang_plugin.backends.status_view import StatusView, SummaryRow
from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.rendering.launch_specs import RouterLaunch
from miles_sglang_plugin.rendering.ports import PortAssignment
from miles_sglang_plugin.rendering.prepared import PreparedDeployment, prepare_deployment
from miles_sglang_plugin.serving import elastic, quiet_http, signals
from miles_sglang_plugin.serving.control import AsyncDeploymentControl, DeploymentControl
from miles_sglang_plugin.serving.discovery import ENV_VAR as DISCOVERY_ENV
from miles_sglang_plugin.serving.discovery import DiscoveryServer
from miles_sglang_plugin.serving.errors import (
    ApplyTimeoutError,
    DeploymentFailedError,
    DeploymentStoppedError,
    StartupInterrupted,
)
from miles_sglang_plugin.serving.events import DeploymentEvent, EventLog
from miles_sglang_plugin.serving.fleet import (
    DeploymentState,
    EngineInfo,
    EngineRow,
    EngineState,
    Fleet,
    RouterRow,
    RouterState,
    build_fleet,
    engine_rows,
)
from miles_sglang_plugin.serving.ledger import ControlState, Ledger, initial_state
from miles_sglang_plugin.serving.metrics import DeploymentMetrics, MetricsServer, TargetsFile, scrape_targets
from miles_sglang_plugin.serving.policy import ObservationKind, router_done
from miles_sglang_plugin.serving.reconciler import Reconciler, ServingLoop
from miles_sglang_plugin.serving.registry import ModelRoute, RouterRegistry
from miles_sglang_plugin.serving.rollout import AsyncRolloutClient, ClientSet, RolloutClient, Worker
from miles_sglang_plugin.serving.startup_report import startup_message
from miles_sglang_plugin.serving.wire import ClientPool

__all__ = ["Deployment", "StartupInterrupted", "stop_all_active"]

log = logging.getLogger("miles_sglang_plugin")

#: How often start-up looks for a stop signal while it waits.
_SIGNAL_CHECK_S = 0.05
#: How long stopping waits for what runs on the serving loop to wind down.
STOP_LOOP_TIMEOUT_S = 5.0


class ConfigSource(Protocol):
    """Where a running deployment's changes are resolved: the app's config and its checks (the Hydra edge
    provides it to the deployments it launches)."""

    #: The config the deployment runs with now (a change replaces it).
    config: Any
    #: SGLang's ServerArgs fields the overrides are checked against (None: the installed SGLang's).
    server_arg_fields: Collection[str] | None

    def resolve(self, config: Any) -> tuple[DeploymentPlan, SGLangDeployConf]:
        """``config`` resolved with every rule and check of a launch."""

    def resized(self, sizes: Mapping[tuple[str, str], int]) -> Any:
        """The current config with these groups' ``num_gpus`` ((model, group) -> GPUs)."""


def _first_state(row: EngineRow) -> ControlState:
    """The ledger's first state of an engine: its command line's adapters and weight version."""
    return initial_state(row.initial_lora, row.command_line_version)


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

    #: The engine listing (:meth:`serve_discovery`), once asked for.
    _discovery: DiscoveryServer | None = None
    #: The launcher's ``/metrics`` (:meth:`serve_metrics`) and the targets file kept current
    #: (:meth:`write_metrics_targets`), once asked for.
    _metrics_server: MetricsServer | None = None
    _targets_file: TargetsFile | None = None

    def __init__(
        self,
        prepared: PreparedDeployment,
        backend: Backend,
        *,
        log_dir: Path,
        status: StatusView | None = None,
        install_signal_handlers: bool = True,
        source: ConfigSource | None = None,
    ) -> None:
        self.prepared = prepared
        #: Where a change's config is resolved (``apply(config)``, ``resize``): the app's, when it launched it.
        self.source = source
        #: One apply at a time (held while it waits for its change); the render lock only while a plan is rendered
        #: and handed over, so that an engine placed again meanwhile (``_place_again``) waits for no change.
        self._apply_lock = threading.Lock()
        self._render_lock = threading.Lock()
        #: Engine processes and routers a change removed (stopped), still reported by :meth:`processes`.
        self._removed_processes: list[EngineProcess | ManagedProcess] = []
        self.backend = backend
        self.settings = prepared.settings
        self.log_dir = Path(log_dir)
        self.status = status or StatusView(mode=self.settings.launch.live)
        self.install_signal_handlers = install_signal_handlers
        self.notes = backend.check(prepared)
        self.fleet: Fleet = build_fleet(prepared, self._router_rows(), to_start=True)
        self.ledger = Ledger({row.id: _first_state(row) for row in self.fleet.engines()})
        self.event_log = EventLog()
        self.serving_loop = ServingLoop()
        self.pool = ClientPool(self.auth_headers(), max_connections=self.settings.control.max_concurrency)
        self._spawner = Spawner()
        self._io = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="msp-io")
        self.reconciler = self._new_reconciler()
        self._control = DeploymentControl(AsyncDeploymentControl(self))
        self.metrics = self._new_metrics()
        self.rollout_clients = ClientSet()  # made by client(): the trainer's abort_all ends their requests
        self._started = False
        self._stopping = False
        self._stopped = False
        self._stopped_event = threading.Event()
        self._stopping_lock = threading.Lock()
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._ready = False
        self._watch: signals.SignalWatch | None = None

    def _new_reconciler(self) -> Reconciler:
        reconciler = Reconciler(
            fleet=self.fleet,
            ledger=self.ledger,
            settings=self.settings,
            backend=self.backend,
            log_dir=self.log_dir,
            events=self.event_log,
            status=self.status,
            loop=self.serving_loop,
            pool=self.pool,
            spawner=self._spawner,
            io=self._io,
            exits=ExitWatcher(),
            on_fail=self._fail_and_stop,
            place_again=self._place_again,
        )
        reconciler.on_change_done = self._change_done
        return reconciler

    def _new_metrics(self) -> DeploymentMetrics:
        """What :meth:`serve_metrics` exports, counted from the start whether or not it is served: each event
        as it is emitted, each control operation as it ends."""
        metrics = DeploymentMetrics(self.fleet, self._weight_version)
        self.event_log.tap(metrics.observe_event)
        self._control.aio.on_done = metrics.operation_done
        return metrics

    def _router_rows(self) -> list[RouterRow]:
        return [elastic.new_router_row(launch, self.log_dir) for launch in self.prepared.launch.routers]

    # ---------------------------------------------------------------------------------------------- API
    @property
    def registry(self) -> RouterRegistry:
        """Where rollout code finds each model's router."""
        return RouterRegistry(
            ModelRoute.from_launch_spec(router.launch.spec) for router in self.fleet.routers()
        )

    def engines(self) -> tuple[EngineInfo, ...]:
        """Every engine, in deployment order, with its URL, node, GPUs, state and weight version."""
        return tuple(
            replace(info, weight_version=self._weight_version(info.id)) for info in self.fleet.engine_infos()
        )

    def _weight_version(self, engine: str) -> str | None:
        """What the ledger knows the engine has (its command line's version until an update)."""
        try:
            return self.ledger.has(engine).weight_version
        except KeyError:
            return None

    def client(self, model: str, **settings: Any) -> RolloutClient:
        """A rollout client of ``model`` (blocking calls; see :mod:`miles_sglang_plugin.serving.rollout`): it
        knows the engines and their weight versions, and carries the API key. Close it when done."""
        client = RolloutClient(
            self.registry, model, workers=_FleetWorkers(self), headers=self.auth_headers(), **settings
        )
        self.rollout_clients.add(client.aio)
        return client

    def serve_discovery(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve ``GET /v1/rl/workers`` (the engines as SMG's RL control plane lists them, with the weight
        version each has now) on ``host:port`` until the deployment stops; its URL. A trainer subprocess
        finds it in :meth:`rollout_env`, a rollout client reads it with ``RolloutClient.from_registry``."""
        with self._lock:
            if self._stopping or self._stopped:
                raise DeploymentStoppedError("the deployment was stopped: it has no engines to list")
            if self._discovery is None:
                self._discovery = DiscoveryServer(
                    self.engines, host=host, port=port, api_key=self.settings.api_key
                )
            return self._discovery.url

    def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve ``GET /metrics`` (the deployment's metrics in Prometheus' text format: see
        :mod:`.metrics`) on ``host:port`` until the deployment stops, the API key required where one is set;
        its URL. From then on :meth:`metrics_targets` lists it too."""
        with self._lock:
            if self._stopping or self._stopped:
                raise DeploymentStoppedError("the deployment was stopped: it has no metrics to serve")
            if self._metrics_server is None:
                self._metrics_server = MetricsServer(
                    self.metrics.page, host=host, port=port, api_key=self.settings.api_key
                )
            url = self._metrics_server.url
        self._refresh_targets()
        return url

    def metrics_targets(self) -> list[dict[str, Any]]:
        """Prometheus ``file_sd`` targets (``[{"targets": ["host:port"], "labels": {...}}, ...]``) of every
        engine's ``/metrics`` (job ``sglang-engine``; labels model, group, engine, worker_type, node), every
        router's metrics port (``sglang-router``; model) and, once :meth:`serve_metrics` runs, the launcher's
        own page (``miles-sglang``). No secret is in them."""
        server = self._metrics_server
        return scrape_targets(
            self.fleet, server.address if server is not None and not self._stopped else None
        )

    def write_metrics_targets(self, path: str | Path) -> Path:
        """Write :meth:`metrics_targets` to ``path`` (JSON, for Prometheus' ``file_sd_configs``) and keep it
        current until the deployment stops, then empty: written again, atomically (mode 0600), after every
        event that changes them (engines added, removed, placed again; a router replaced) and every apply. A
        path that is a symbolic link is refused (ValueError). Returns the path."""
        target = Path(path)
        kept = TargetsFile(target, self.metrics_targets)
        kept.refresh()
        with self._lock:
            first = self._targets_file is None
            self._targets_file = kept
        if first:
            self.on_event(lambda _event: self._refresh_targets())
        return target

    def _refresh_targets(self) -> None:
        kept = self._targets_file
        if kept is None:
            return
        try:
            kept.refresh()
        except OSError as exc:
            log.warning("the metrics targets file %s could not be written: %s", kept.path, exc)

    def rollout_env(self) -> dict[str, str]:
        """What a trainer subprocess needs to reach the models: the routers (``MSP_ROUTERS``) and, once
        :meth:`serve_discovery` runs, the engine listing (``MSP_RL_WORKERS``). No secret: the API key is the
        trainer's to hand on."""
        env = self.registry.to_env()
        if self._discovery is not None:
            env[DISCOVERY_ENV] = self._discovery.url
        return env

    def async_client(self, model: str, **settings: Any) -> AsyncRolloutClient:
        """The same client for the caller's event loop (``async with deployment.async_client(model) as c``)."""
        client = AsyncRolloutClient(
            self.registry, model, workers=_FleetWorkers(self), headers=self.auth_headers(), **settings
        )
        self.rollout_clients.add(client)
        return client

    def processes(self) -> list[EngineProcess | ManagedProcess]:
        """Every process started: engine processes (all nodes; those a change removed too), then routers."""
        return [
            *self._engine_processes(),
            *self._removed_processes,
            *(router.process for router in self.fleet.routers()),
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
        engines, routers = self.engines(), self.fleet.router_infos()
        if self._failure is not None:
            status = "failed"
        elif self._stopped:
            status = "stopped"
        elif not self._ready:
            status = "starting"
        elif all(e.state == EngineState.SERVING.value for e in engines) and all(
            r.state == RouterState.READY.value for r in routers
        ):
            status = "serving"
        else:
            status = "degraded"
        return DeploymentState(status, engines, routers, self._failure, self.event_log.events()[-50:])

    def on_event(self, callback: Callable[[DeploymentEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for every event (engine lost, restarting, recovered, router lost,
        deployment failed, ...), on a thread of the event log; returns a function that unsubscribes."""
        return self.event_log.subscribe(callback)

    def wait_for_event(
        self, kind: str, *, subject: str | None = None, since: int = 0, timeout_s: float = 60.0
    ) -> DeploymentEvent:
        """The first event ``kind`` (of ``subject``, e.g. an engine id) at or after position ``since``
        (``len(deployment.events())`` before the action that causes it); TimeoutError after ``timeout_s``."""
        return self.event_log.wait_for(kind, subject=subject, since=since, timeout_s=timeout_s)

    def events(self) -> tuple[DeploymentEvent, ...]:
        """The events so far (the last 1,000)."""
        return self.event_log.events()

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Wait until every process of the deployment is stopped and its backend closed (after :meth:`stop`,
        or after a failure, which stops it by itself); False if ``timeout_s`` passed first."""
        return self._stopped_event.wait(timeout_s)

    @property
    def failure(self) -> str | None:
        """Why the deployment failed while serving (None: it did not)."""
        return self._failure

    def check(self) -> None:
        """Raise :class:`DeploymentFailedError` if the deployment failed (everything is stopped then)."""
        if self._failure is not None:
            raise DeploymentFailedError(f"the deployment failed and was stopped: {self._failure}")

    def refusal(self, when: str) -> Exception | None:
        """Why control operations no longer run (``when``: at which point), or None while they do."""
        if self._failure is not None:
            return DeploymentFailedError(f"the deployment failed and was stopped{_at(when)}: {self._failure}")
        if not self._started:
            return DeploymentStoppedError(
                f"the deployment is not started{_at(when)}: it has no engines to drive yet"
            )
        if self._stopping:
            driven = (
                "its engines are no longer driven"
                if when
                else "control operations no longer reach its engines"
            )
            return DeploymentStoppedError(f"the deployment was stopped{_at(when)}: {driven}")
        return None

    def check_running(self) -> None:
        """Raise :class:`DeploymentFailedError` if it failed, :class:`DeploymentStoppedError` once it stops."""
        refusal = self.refusal("")
        if refusal is not None:
            raise refusal

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
        quiet_http.install()
        self._watch = signals.watch() if self.install_signal_handlers else None
        for note in self.notes:
            self.status.note(note)
        try:
            self._start_routers()
            self._await_startup()
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

    def _wait(self, future: concurrent.futures.Future[Any]) -> None:
        """Until ``future`` is done, waking at once for a stop signal (then raising
        :class:`signals.Interrupted`)."""
        watch = self._watch
        if watch is None:
            concurrent.futures.wait([future])
            return
        future.add_done_callback(lambda _done: watch.poke())
        while not future.done():
            watch.check()
            watch.wait(1.0)
        watch.check()

    def _start_routers(self) -> None:
        """The serving loop and the routers started (the loop starts the engines: :meth:`_await_startup`)."""
        self.serving_loop.start()
        for router in self.fleet.routers():
            self.status.track(router.name, "router", router.url)
        for row in self.fleet.engines():
            where = "external" if row.external else f"GPUs {row.gpus}"
            self.status.track(row.id, "engine", f"{row.url} {where}")
        for router in self.fleet.routers():
            self._check_signal()
            try:  # a start is not interrupted: the signal is looked at once the process runs and is tracked
                self._spawner.submit(router.process.start).result()
            except OSError as exc:
                self.status.update(router.name, "failed")
                raise LaunchError(
                    f"router {router.name} could not be started: {exc}\n  command: {router.process.display_command}"
                ) from exc
            self.reconciler.watch_router(router.model, 0, router.process)
        self._check_signal()

    def _await_startup(self) -> None:
        timeout_s = self.settings.launch.startup_timeout_s
        self.serving_loop.submit(self.reconciler.run(timeout_s))
        self._wait(self.reconciler.startup)
        failure = self.reconciler.startup.result()
        if failure is not None:
            raise LaunchError(startup_message(self.fleet, self.settings, self.status, failure))

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

    # ---------------------------------------------------------------------------------------------- change
    @property
    def plan(self) -> DeploymentPlan:
        """The plan the deployment runs now (after its last change)."""
        return self.prepared.plan

    def apply(
        self, config_or_plan: Any, *, dry_run: bool = False, timeout_s: float | None = None
    ) -> elastic.ApplyResult:
        """Change the running deployment to ``config_or_plan`` (a config like the one it was launched from, or
        a resolved :class:`DeploymentPlan`) without touching what stays: see :mod:`.elastic`. Every problem
        is found before anything changes (:class:`DeploymentConfigError`). ``dry_run``: what it would do.
        Blocks until the deployment has converged (at most ``timeout_s``, default
        ``sglang_deploy.launch.startup_timeout_s``); returns what it did per engine."""
        if dry_run:
            return self._apply(config_or_plan, dry_run=True, timeout_s=timeout_s)
        started, outcome = time.monotonic(), "failed"
        try:
            result = self._apply(config_or_plan, dry_run=False, timeout_s=timeout_s)
            outcome = "done"
            return result
        except ApplyTimeoutError:
            outcome = "timed_out"
            raise
        except DeploymentConfigError:
            outcome = "refused"
            raise
        finally:
            self.metrics.apply_done(time.monotonic() - started, outcome)
            self._refresh_targets()

    def _apply(self, config_or_plan: Any, *, dry_run: bool, timeout_s: float | None) -> elastic.ApplyResult:
        with self._apply_lock:
            self.check_running()
            started = time.monotonic()
            deadline = timeout_s if timeout_s is not None else self.settings.launch.startup_timeout_s
            if not dry_run:
                self._await_earlier_changes(started + deadline)
            fresh, settings = self._resolve_change(config_or_plan)
            render = self._dry_render if dry_run else self._render
            failed = [row.id for row in self.fleet.engines() if row.state is EngineState.FAILED]
            with self._render_lock:
                change = elastic.plan_change(
                    self.prepared,
                    fresh,
                    lambda plan, ports: render(plan, settings, ports),
                    settings=settings,
                    failed=failed,
                )
                if dry_run:
                    return elastic.result_of(change, {}, started, dry_run=True)
                try:
                    converging = self.serving_loop.submit(self._begin_change(change)).result()
                except BaseException:  # nothing of it runs: what its rendering took is given back
                    self.backend.release(change.prepared, self.prepared)
                    raise
                # From here the deployment's desired state is the new plan, whether or not this call waits.
                self.prepared = change.prepared
            if self.source is not None and not isinstance(config_or_plan, DeploymentPlan):
                self.source.config = config_or_plan
            outcome = self._await_change(converging, started + deadline, deadline)
            return elastic.result_of(
                change, outcome.done_at, started, dry_run=False, given_up=outcome.given_up
            )

    def resize(
        self, model: str, group: str, num_gpus: int, *, dry_run: bool = False, timeout_s: float | None = None
    ) -> elastic.ApplyResult:
        """:meth:`apply` of the config it runs with one group's ``num_gpus`` changed."""
        return self.apply(
            self._source().resized({(model, group): num_gpus}), dry_run=dry_run, timeout_s=timeout_s
        )

    def move_gpus(
        self,
        model: str,
        from_group: str,
        to_group: str,
        num_gpus: int,
        *,
        dry_run: bool = False,
        timeout_s: float | None = None,
    ) -> elastic.ApplyResult:
        """:meth:`apply` with ``num_gpus`` GPUs of ``model`` moved from one group to another (prefill to
        decode, say): the engines that stay keep their GPUs, the new ones take those given up."""
        plan_model = self.plan.model(model)
        sizes = {
            (model, from_group): plan_model.group(from_group).num_gpus - num_gpus,
            (model, to_group): plan_model.group(to_group).num_gpus + num_gpus,
        }
        return self.apply(self._source().resized(sizes), dry_run=dry_run, timeout_s=timeout_s)

    def _source(self) -> ConfigSource:
        if self.source is None:
            raise TypeError(
                "this deployment was not launched from a config (launch_from_config): pass apply() a plan"
            )
        return self.source

    def _resolve_change(self, config_or_plan: Any) -> tuple[DeploymentPlan, SGLangDeployConf]:
        if isinstance(config_or_plan, DeploymentPlan):
            return config_or_plan, self.settings
        return self._source().resolve(config_or_plan)

    def _render(
        self, plan: DeploymentPlan, settings: SGLangDeployConf, ports: PortAssignment
    ) -> PreparedDeployment:
        fields = self.source.server_arg_fields if self.source is not None else None
        prepared = self.backend.prepare(plan, settings, server_arg_fields=fields, fixed_ports=ports)
        self.backend.check(prepared)
        return prepared

    def _dry_render(
        self, plan: DeploymentPlan, settings: SGLangDeployConf, ports: PortAssignment
    ) -> PreparedDeployment:
        fields = self.source.server_arg_fields if self.source is not None else None
        return prepare_deployment(plan, settings, server_arg_fields=fields, fixed_ports=ports)

    async def _begin_change(self, change: elastic.Change) -> elastic.Converging:
        """On the loop: the routers of added models started, the change handed to the reconcile loop."""
        for launch in change.prepared.launch.routers:
            if self.fleet.router(launch.model) is None:
                await self._start_new_router(launch)
        converging = elastic.Converging(
            change=change,
            before=self.prepared,
            fleet=self.fleet,
            ledger=self.ledger,
            new_rows={row.id: row for row in engine_rows(change.prepared)},
            started_at=self.reconciler.clock(),
            admit=self.reconciler.admit,
        )
        converging.swap_router = lambda model: self._swap_router_soon(converging, model)
        self.reconciler.begin_change(converging)
        return converging

    def _swap_router_soon(self, converging: elastic.Converging, model: str) -> None:
        self.serving_loop.create_task(self._swap_router(converging, model))

    async def _swap_router(self, converging: elastic.Converging, model: str) -> None:
        """On the loop, once ``model``'s old engines are gone: its router is replaced by one in the new plan's
        mode, on the same address (the old one out of the fleet first, so its exit is no router's loss)."""
        old = self.fleet.router(model)
        row = elastic.new_router_row(converging.change.prepared.launch.router(model), self.log_dir)
        row.epoch = old.generation + 1 if old is not None else 0
        if old is not None:
            self.fleet.transition_router(model, RouterState.STOPPED)
            self.fleet.drop_router(model)
            self._removed_processes.append(old.process)
        self.fleet.add_router(row)
        if old is not None:
            grace = self.settings.launch.shutdown_grace_s
            await asyncio.get_running_loop().run_in_executor(
                self._io, lambda: stop_processes([old.process], grace)
            )
            await self.reconciler.forget_client(old.url)
        try:
            await asyncio.wrap_future(self._spawner.submit(row.process.start))
        except (OSError, RuntimeError) as exc:  # lost at once: restarted while its budget lasts
            self.reconciler.observe(
                router_done(
                    ObservationKind.ROUTER_EXITED,
                    model,
                    f"it could not be started: {exc}",
                    generation=row.generation,
                )
            )
        else:
            self.reconciler.watch_router(model, row.generation, row.process)
        mode = "prefill/decode (PD)" if row.launch.spec.pd_disaggregation else "regular"
        self.event_log.emit(
            "router_replaced", row.name, f"router of model {model} replaced: it serves {mode} engines now"
        )
        converging.swapped(model)
        self.reconciler.poke_here()

    def _await_change(
        self, converging: elastic.Converging, until: float, timeout_s: float
    ) -> elastic.ChangeOutcome:
        try:
            return converging.finished.result(timeout=max(0.0, until - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise ApplyTimeoutError(
                f"the change did not converge within {timeout_s:g} s (apply's timeout_s, by default "
                f"sglang_deploy.launch.startup_timeout_s); it goes on: {converging.describe()}. "
                "deployment.plan is the new plan; deployment.state() shows each engine, and a later apply "
                "starts from the fleet as it is then"
            ) from None

    def _await_earlier_changes(self, until: float) -> None:
        """A change still under way (an earlier apply that timed out) ends before the next one starts; one
        still under way at ``until`` refuses the next (nothing of it started)."""
        for converging in list(self.reconciler.changes):
            try:
                converging.finished.result(timeout=max(0.0, until - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise ApplyTimeoutError(
                    f"an earlier change is still under way ({converging.describe()}); nothing of this one was "
                    "started: apply it again once deployment.state() shows the earlier one done"
                ) from None
            except LaunchError:
                pass  # it ended badly: the deployment says why (check_running)
        self.check_running()

    async def _change_done(self, converging: elastic.Converging) -> None:
        """On the loop, once a change is done: the routers of the models it removed stop, the fleet takes the
        plan's order, and what only the removed engines held is given back."""
        change = converging.change
        models = {m.name for m in change.plan.models if m.has_router}
        for router in [r for r in self.fleet.routers() if r.model not in models]:
            await self._stop_old_router(router)
        self.fleet.order(
            [e.id for e in change.plan.engines] + [e.id for m in change.plan.models for e in m.external]
        )
        self._removed_processes += converging.removed_processes
        # after: the deployment as it runs now (the change's plan, with any engine placed again since)
        after = self.prepared
        await asyncio.get_running_loop().run_in_executor(
            self._io, lambda: self.backend.release(converging.before, after)
        )

    async def _start_new_router(self, launch: RouterLaunch) -> None:
        row = elastic.new_router_row(launch, self.log_dir)
        self.fleet.add_router(row)  # in the fleet before it runs: the teardown stops it
        try:
            await asyncio.wrap_future(self._spawner.submit(row.process.start))
        except BaseException:
            if not row.process.running:  # it never ran: no router row is left behind to wait for it
                self.fleet.drop_router(row.model)
            raise
        self.reconciler.watch_router(row.model, 0, row.process)

    async def _stop_old_router(self, router: RouterRow) -> None:
        grace = self.settings.launch.shutdown_grace_s
        await asyncio.get_running_loop().run_in_executor(
            self._io, lambda: stop_processes([router.process], grace)
        )
        self.fleet.transition_router(router.model, RouterState.STOPPED)
        self.fleet.drop_router(router.model)
        self._removed_processes.append(router.process)

    def _place_again(self, engines: Sequence[str]) -> PreparedDeployment | None:
        """For the reconciler: ``engines`` lost their node; the backend places them on free capacity (None where
        it cannot), and the deployment runs from the plan rendered with their new places."""
        with self._render_lock:  # never while a change of the deployment is rendered
            prepared = self.backend.place_again(self.prepared, engines)
            if prepared is not None:
                self.prepared = prepared
            return prepared

    # ---------------------------------------------------------------------------------------------- stop
    def _fail_and_stop(self, message: str) -> None:
        """The reconciler gave up (restarts used up, a router that cannot come back): record it and stop."""
        self._failure = self._failure or message
        self.stop()

    def stop(self) -> None:
        """Stop every process this deployment started and close its backend (idempotent). External engines
        are left running. Control operations in flight raise :class:`DeploymentStoppedError`
        (:class:`DeploymentFailedError` when it failed), later ones too."""
        with self._stopping_lock:
            self._stopping = True
        if self.serving_loop.in_loop():  # never from the loop itself: it is what stopping winds down
            threading.Thread(target=self.stop, name="msp-stop", daemon=True).start()
            return
        self.reconciler.stop()
        with self._lock:
            if self._stopped:
                return
            # A second Ctrl-C or SIGTERM must not cut the teardown short: recorded, handed on afterwards.
            with signals.recorded():
                self._teardown(self.settings.launch.shutdown_grace_s)

    def _engine_processes(self) -> list[EngineProcess]:
        in_rows = [process for row in self.fleet.engines() for process in row.processes]
        return [*in_rows, *(p for p in self.reconciler.starting_processes() if p not in in_rows)]

    def _teardown(self, grace: float) -> None:
        if self._discovery is not None:
            self._discovery.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        self.serving_loop.close(before=self.pool.aclose, timeout_s=STOP_LOOP_TIMEOUT_S)
        routers = [router.process for router in self.fleet.routers()]
        for process in routers:  # routers stop while the engines are given their grace period
            if process.running:
                process.signal_group(signal.SIGTERM)
        try:
            self.backend.stop(self._engine_processes(), grace_s=grace)
        finally:
            try:
                stop_processes(routers, grace_s=grace)
                self._spawner.shutdown(wait=True)  # a start under way ends; what it started is stopped next
                late = [p for p in self._engine_processes() if p.exit_code() is None]
                if late:
                    self.backend.stop(late, grace_s=grace)
                routers = [router.process for router in self.fleet.routers()]
                stop_processes([p for p in routers if p.running], grace_s=grace)
            finally:
                self._close(grace)

    def _close(self, grace: float) -> None:
        try:
            self.backend.close()
        finally:
            self.reconciler.exits.close()
            self._io.shutdown(wait=False, cancel_futures=True)
            self._stopped = True
            _ACTIVE.discard(self)
            signals.unwatch(self._watch)
            for row in self.fleet.engines():
                if row.state is not EngineState.STOPPED:
                    self.fleet.transition(row.id, EngineState.STOPPED)
            for router in self.fleet.routers():
                if router.state is not RouterState.STOPPED:
                    self.fleet.transition_router(router.model, RouterState.STOPPED)
            self.event_log.close()
            self._refresh_targets()  # nothing runs any more: no target left
            self._stopped_event.set()


class _FleetWorkers:
    """The engines of a model for a rollout client: the deployment's view, read again at most every 0.1 s."""

    REFRESH_S = 0.1

    def __init__(self, deployment: Deployment) -> None:
        self._deployment = deployment
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._engines: tuple[EngineInfo, ...] = ()

    def workers(self, model: str) -> list[Worker]:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= self.REFRESH_S:
                self._engines, self._read_at = self._deployment.engines(), now
            engines = self._engines
        return [
            Worker(e.url, e.model, e.worker_type, e.weight_version, e.state, e.id, e.group)
            for e in engines
            if e.model == model
        ]


def _at(when: str) -> str:
    return f" {when}" if when else ""
