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

Stopping (normal exit, exception, Ctrl-C, SIGTERM, interpreter exit, Hydra job end): routers and engines get
SIGTERM at once, SIGKILL after the grace period, and the backend gives back what it took (port claims). If
the launcher itself is SIGKILLed, its children receive SIGKILL from the kernel (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

from miles_sglang_plugin.backends.base import Backend, EngineProcess, LaunchError
from miles_sglang_plugin.backends.processes import ManagedProcess, stop_processes
from miles_sglang_plugin.backends.status_view import StatusView, SummaryRow
from miles_sglang_plugin.masking import mask_argv
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch, RouterLaunch
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.serving.registry import ModelRoute, RouterRegistry
from miles_sglang_plugin.serving.routers import (
    RouterRequestError,
    register_workers,
    router_command,
    router_ready,
)

#: Engine health endpoint polled during start-up (as Miles: a real generation, not just a live socket).
HEALTH_ENDPOINT = "/health_generate"


@dataclass(frozen=True)
class EngineInfo:
    """One engine of a running deployment, as the trainer sees it."""

    id: str
    model: str
    group: str
    worker_type: str
    url: str
    node: int
    #: The engine's ``CUDA_VISIBLE_DEVICES`` on its first node.
    gpus: str
    nnodes: int
    #: ``starting``, ``healthy`` (answers its health endpoint), ``registered`` (with its router), ``failed``.
    state: str
    #: ``time.monotonic()`` when its first process was started, and when it first answered its health endpoint.
    started_at: float | None = None
    healthy_at: float | None = None


@dataclass
class _Engine:
    launch: EngineProcessLaunch
    followers: list[EngineProcessLaunch]
    processes: list[EngineProcess] = field(default_factory=list)
    state: str = "starting"
    healthy_at: float | None = None
    registered: bool = False

    def info(self) -> EngineInfo:
        lead = self.launch
        return EngineInfo(
            id=lead.engine_id,
            model=lead.model,
            group=lead.group,
            worker_type=lead.worker_type.value,
            url=lead.url,
            node=lead.node,
            gpus=lead.env.get("CUDA_VISIBLE_DEVICES", ""),
            nnodes=lead.nnodes,
            state=self.state,
            started_at=self.processes[0].started_at if self.processes else None,
            healthy_at=self.healthy_at,
        )


@dataclass
class _Router:
    launch: RouterLaunch
    process: ManagedProcess
    state: str = "starting"


_ACTIVE: weakref.WeakSet[Deployment] = weakref.WeakSet()


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
        self._engines: list[_Engine] = []
        self._routers: list[_Router] = []
        self._stopped = False
        self._started = False
        self._previous_sigterm: Any = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------------- API
    @property
    def registry(self) -> RouterRegistry:
        """Where rollout code finds each model's router."""
        return RouterRegistry(ModelRoute.from_launch_spec(r.launch.spec) for r in self._routers)

    def engines(self) -> tuple[EngineInfo, ...]:
        """Every engine, in deployment order, with its URL, node, GPUs and state."""
        return tuple(e.info() for e in self._engines)

    def processes(self) -> list[EngineProcess | ManagedProcess]:
        """Every process started: engine processes (all nodes), then routers."""
        return [p for e in self._engines for p in e.processes] + [r.process for r in self._routers]

    def auth_headers(self) -> dict[str, str]:
        """``Authorization`` for requests to the routers and engines (empty without an API key). The key
        itself stays out of the registry, so that ``RouterRegistry.to_env()`` carries no secret."""
        key = self.settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def exited(self) -> list[tuple[str, int]]:
        """Processes that have exited since start-up (name, exit code): a deployment that lost a member."""
        return [(p.name, code) for p in self.processes() if (code := p.exit_code()) is not None]

    def exit_report(self) -> list[str]:
        """One line per exited process: name, exit code, where it ran and, when the code does not say it all,
        why (a lost node)."""
        lines = []
        for p in self.processes():
            code = p.exit_code()
            if code is None:
                continue
            if isinstance(p, EngineProcess):
                reason = p.exit_reason()
                lines.append(f"{p.name} exited with code {code} ({p.where}){': ' + reason if reason else ''}")
            else:
                lines.append(f"{p.name} exited with code {code} (pid {p.pid} on this machine)")
        return lines

    def __enter__(self) -> Deployment:
        if self.install_signal_handlers and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
        try:
            self.start()
        except BaseException:
            self._restore_signals()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.stop()
        finally:
            self._restore_signals()

    # --------------------------------------------------------------------------------------------- start
    def start(self) -> None:
        if self._started:
            raise RuntimeError("a Deployment starts once")
        self._started = True
        _ACTIVE.add(self)
        for note in self.notes:
            self.status.note(note)
        try:
            self._spawn()
            self._wait_ready()
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt | SystemExit)
            self.status.finish(ok=False)
            self.stop()
            if interrupted:
                self.status.note("start-up interrupted: every engine and router was stopped")
            raise
        self.status.finish(ok=True)
        self.status.summary(self._summary_rows())

    def _spawn(self) -> None:
        launch = self.prepared.launch
        for lead in (e for e in launch.engines if e.node_rank == 0):
            followers = [e for e in launch.engines if e.engine_id == lead.engine_id and e.node_rank > 0]
            self._engines.append(_Engine(launch=lead, followers=followers))
        for r in launch.routers:
            argv, env = router_command(r.spec)
            proc = ManagedProcess(
                name=f"router.{r.model}",
                argv=argv,
                env=env,
                log_path=self.log_dir / f"router.{r.model}.log",
                display_command=" ".join(argv[:3]) + f" <spec of {r.model}>",
            )
            self._routers.append(_Router(launch=r, process=proc))
            self.status.track(proc.name, "router", r.spec.url)
        for e in self._engines:
            self.status.track(
                e.launch.engine_id, "engine", f"{e.launch.url} GPUs {e.launch.env['CUDA_VISIBLE_DEVICES']}"
            )
        for r in self._routers:
            self._start_router(r)
        for e in self._engines:
            for pl in (e.launch, *e.followers):
                self._start_engine_process(e, pl)

    def _start_router(self, r: _Router) -> None:
        try:
            r.process.start()
        except OSError as exc:
            self.status.update(r.process.name, "failed")
            raise LaunchError(
                f"router {r.process.name} could not be started: {exc}\n  command: {r.process.display_command}"
            ) from exc

    def _start_engine_process(self, e: _Engine, pl: EngineProcessLaunch) -> None:
        try:
            e.processes.append(self.backend.start(pl, log_path=self.log_dir / f"{pl.name}.log"))
        except OSError as exc:  # e.g. the command does not exist: a LaunchError like any other failed start
            self.status.update(e.launch.engine_id, "failed")
            raise LaunchError(
                f"engine {pl.name} could not be started: {exc}\n  command: {pl.display_command()}"
            ) from exc

    def _fail_if_exited(self) -> None:
        for r in self._routers:
            code = r.process.exit_code()
            if code is not None:
                self.status.update(r.process.name, "failed")
                raise LaunchError(
                    _exited_message(
                        f"router {r.process.name}",
                        f"pid {r.process.pid} on this machine",
                        code,
                        time.monotonic() - r.process.started_at,
                        r.process.display_command or " ".join(mask_argv(list(r.process.argv))),
                        str(r.process.log_path),
                        r.process.tail(15),
                    )
                )
        for e in self._engines:
            for p in e.processes:
                code = p.exit_code()
                if code is not None:
                    self.status.update(e.launch.engine_id, "failed")
                    raise LaunchError(
                        _exited_message(
                            f"engine {p.name}",
                            p.where,
                            code,
                            time.monotonic() - p.started_at,
                            p.launch.display_command(),
                            p.log_location,
                            p.tail(15),
                            reason=p.exit_reason(),
                        )
                    )

    def _wait_ready(self) -> None:
        launch_conf = self.settings.launch
        deadline = time.monotonic() + launch_conf.startup_timeout_s
        # Health polls and registrations go out concurrently: one slow or hanging engine must not delay the
        # others, and registration time must not grow with the number of engines.
        workers = min(32, max(4, len(self._engines) + len(self._routers)))
        with (
            httpx.Client(timeout=2.0, headers=self.auth_headers()) as client,
            ThreadPoolExecutor(workers) as pool,
        ):
            while True:
                self._fail_if_exited()
                self._poll_health(client, pool)
                self._register_healthy(pool)
                if all(e.registered for e in self._engines) and self._routers_ready():
                    return
                if time.monotonic() > deadline:
                    raise LaunchError(self._timeout_message(launch_conf.startup_timeout_s))
                time.sleep(launch_conf.poll_interval_s)

    def _poll_health(self, client: httpx.Client, pool: ThreadPoolExecutor) -> None:
        routers = [r for r in self._routers if r.state == "starting"]
        engines = [e for e in self._engines if e.state == "starting"]
        urls = [r.launch.spec.url + "/liveness" for r in routers] + [
            e.launch.url + HEALTH_ENDPOINT for e in engines
        ]
        answered = list(pool.map(lambda url: _get_ok(client, url), urls))
        for r, live in zip(routers, answered[: len(routers)], strict=True):
            if live:
                r.state = "live"
                self.status.update(r.process.name, "live")
        for e, healthy in zip(engines, answered[len(routers) :], strict=True):
            if healthy:
                e.state, e.healthy_at = "healthy", time.monotonic()
                self.status.update(e.launch.engine_id, "healthy")

    def _register_healthy(self, pool: ThreadPoolExecutor) -> None:
        by_model = {r.launch.model: r for r in self._routers}
        due = [
            (e, router)
            for e in self._engines
            if e.state == "healthy"
            and not e.registered
            and (router := by_model.get(e.launch.model)) is not None
            and router.state != "starting"
        ]

        def register(item: tuple[_Engine, _Router]) -> str | None:
            e, router = item
            worker = next(w for w in router.launch.workers if w.url == e.launch.url)
            try:
                register_workers(router.launch.spec.url, [worker], api_key=self.settings.api_key)
            except (RouterRequestError, httpx.HTTPError) as exc:
                return f"router of model {e.launch.model!r} refused engine {e.launch.engine_id}: {exc}"
            return None

        for (e, _router), error in zip(due, pool.map(register, due), strict=True):
            if error is not None:
                raise LaunchError(error)
            e.registered = True
            e.state = "registered"
            self.status.update(e.launch.engine_id, "registered")

    def _routers_ready(self) -> bool:
        ready = True
        for r in self._routers:
            if r.state == "ready":
                continue
            ok, _detail = router_ready(r.launch.spec.url, r.launch.workers, api_key=self.settings.api_key)
            if ok:
                r.state = "ready"
                self.status.update(r.process.name, "ready")
            else:
                ready = False
        return ready

    def _timeout_message(self, timeout_s: float) -> str:
        lines = [
            f"the deployment was not ready after {timeout_s:g} s (sglang_deploy.launch.startup_timeout_s):"
        ]
        for e in self._engines:
            if e.state == "starting":
                p = e.processes[0]
                lines.append(
                    f"  engine {e.launch.engine_id} never answered {HEALTH_ENDPOINT} at {e.launch.url} "
                    f"({p.where}, still running); last log lines of {p.log_location}:"
                )
                lines += [f"    | {line}" for line in p.tail(10).splitlines()]
        for r in self._routers:
            if r.state != "ready":
                lines.append(f"  router of {r.launch.model} at {r.launch.spec.url}: {r.state}")
        return "\n".join(lines)

    def _summary_rows(self) -> list[SummaryRow]:
        registry = self.registry
        rows = []
        for m in self.prepared.plan.models:
            if m.name not in registry:
                continue
            rows.append(
                SummaryRow(
                    model=m.name,
                    router=registry[m.name].base_url,
                    mode="pd" if m.is_pd else "regular",
                    engines=len(m.engines),
                    gpus=sum(e.num_gpus for e in m.engines),
                    engine_kind=self.prepared.launch.engine_kind.value,
                )
            )
        return rows

    # ---------------------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Stop every process this deployment started and close its backend (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            # A second Ctrl-C or SIGTERM must not cut the teardown short: hold them off while stopping.
            with _signals_held():
                grace = self.settings.launch.shutdown_grace_s
                routers = [r.process for r in self._routers]
                for p in routers:  # routers stop while the engines are given their grace period
                    if p.running:
                        p.signal_group(signal.SIGTERM)
                try:
                    self.backend.stop([p for e in self._engines for p in e.processes], grace_s=grace)
                finally:
                    stop_processes(routers, grace_s=grace)
                    self.backend.close()
                    self._stopped = True
                    _ACTIVE.discard(self)

    def _restore_signals(self) -> None:
        if self._previous_sigterm is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM in the block (main thread only; elsewhere signals do not reach Python code)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    print("SIGTERM received: stopping every engine and router", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _get_ok(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
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
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def launched(
    prepared: PreparedDeployment,
    backend: Backend,
    *,
    log_dir: Path,
    status: StatusView | None = None,
) -> Iterator[Deployment]:
    """Start ``prepared`` through ``backend`` and stop it when the block ends, however it ends."""
    with Deployment(prepared, backend, log_dir=log_dir, status=status) as deployment:
        yield deployment


__all__: Sequence[str] = ["Deployment", "EngineInfo", "launched", "stop_all_active"]
