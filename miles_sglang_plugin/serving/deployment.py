"""Execute: the local launcher — every engine as a subprocess pinned with ``CUDA_VISIBLE_DEVICES``, one real
sglang-router per model, readiness with a deadline, and a teardown that leaves nothing behind.

    with LocalLauncher(prepared, log_dir=...) as deployment:
        url = deployment.registry.get_model_url("actor")

Start-up runs everything in parallel: all routers and all engines are spawned at once; then one loop polls
each engine's health endpoint (checking at every poll that its process is alive), registers each healthy
engine with its model's router (``POST /workers``), and ends when every router reports all its workers. An
engine or router that exits during start-up fails the launch at once (its name, command, exit code and log
tail); so does the deadline. Whatever was started is then stopped.

Stopping (normal exit, exception, Ctrl-C, SIGTERM, interpreter exit, Hydra job end): SIGTERM to each process
group, SIGKILL after the grace period, port claims released. If the launcher itself is SIGKILLed, its children
receive SIGKILL from the kernel (``PR_SET_PDEATHSIG``).

This backend runs on one machine. It refuses engines wider than a node and plans spread over several nodes,
except with the stand-in engines, where the planned nodes run side by side here (ports kept apart), so that
multi-node plans can be exercised without a cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

from miles_sglang_plugin.masking import mask_argv
from miles_sglang_plugin.ports import PortClaims
from miles_sglang_plugin.prepared import PreparedDeployment
from miles_sglang_plugin.processes import ManagedProcess, stop_processes
from miles_sglang_plugin.registry import RouterRegistry
from miles_sglang_plugin.rendering import EngineProcessLaunch, RouterLaunch
from miles_sglang_plugin.routers import RouterRequestError, register_workers, router_command, router_ready
from miles_sglang_plugin.schema import EngineKind
from miles_sglang_plugin.status_view import StatusView

#: Engine health endpoint polled during start-up (as Miles: a real generation, not just a live socket).
HEALTH_ENDPOINT = "/health_generate"


class LaunchError(RuntimeError):
    """The deployment did not come up; everything that was started has been stopped."""


class UnsupportedPlanError(LaunchError):
    """The plan needs something this backend cannot do (several nodes, engines wider than a node)."""


@dataclass
class _Engine:
    launch: EngineProcessLaunch
    followers: list[EngineProcessLaunch]
    processes: list[ManagedProcess] = field(default_factory=list)
    state: str = "starting"
    healthy_at: float | None = None
    registered: bool = False


@dataclass
class _Router:
    launch: RouterLaunch
    process: ManagedProcess
    state: str = "starting"


_ACTIVE: weakref.WeakSet[LocalLauncher] = weakref.WeakSet()


def stop_all_active() -> None:
    """Stop every launcher of this process that is still running (interpreter exit, Hydra job end)."""
    for launcher in list(_ACTIVE):
        launcher.stop()


atexit.register(stop_all_active)


def check_supported(prepared: PreparedDeployment) -> list[str]:
    """Problems that stop this backend from running ``prepared``; notes are returned for stand-in runs."""
    plan = prepared.plan
    wide = [e.id for e in plan.engines if e.nnodes > 1]
    simulated = prepared.launch.engine_kind is EngineKind.simulated
    notes: list[str] = []
    if len(plan.nodes) > 1 or wide:
        what = []
        if len(plan.nodes) > 1:
            what.append(
                f"the plan places engines on {len(plan.nodes)} nodes ({', '.join(map(str, plan.nodes))})"
            )
        if wide:
            what.append(f"engine(s) {', '.join(wide[:4])}{'…' if len(wide) > 4 else ''} span several nodes")
        text = " and ".join(what)
        if not simulated:
            raise UnsupportedPlanError(
                f"the local launcher runs on one machine, but {text}. Use a multi-node backend, or shrink the "
                "deployment to one node (colocate=true or debug_rollout_only=true puts rollout GPUs at slot 0)"
            )
        notes.append(f"stand-in engines: {text}; they run side by side on this machine")
    return notes


class LocalLauncher:
    """Starts and stops one prepared deployment on this machine."""

    def __init__(
        self,
        prepared: PreparedDeployment,
        *,
        log_dir: Path,
        claims: PortClaims | None = None,
        status: StatusView | None = None,
        install_signal_handlers: bool = True,
    ) -> None:
        self.prepared = prepared
        self.settings = prepared.settings
        self.log_dir = Path(log_dir)
        self.claims = claims
        self.status = status or StatusView(mode=self.settings.launch.live)
        self.install_signal_handlers = install_signal_handlers
        self.notes = check_supported(prepared)
        self.engines: list[_Engine] = []
        self.routers: list[_Router] = []
        self._stopped = False
        self._started = False
        self._previous_sigterm: Any = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------------- API
    @property
    def registry(self) -> RouterRegistry:
        """Where rollout code finds each model's router."""
        return RouterRegistry(r.launch.spec.route() for r in self.routers)

    def processes(self) -> list[ManagedProcess]:
        return [p for e in self.engines for p in e.processes] + [r.process for r in self.routers]

    def __enter__(self) -> LocalLauncher:
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
            raise RuntimeError("a LocalLauncher starts once")
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
        self.status.summary(self.prepared, self.registry)

    def _spawn(self) -> None:
        launch = self.prepared.launch
        lead = {e.engine_id: e for e in launch.engines if e.node_rank == 0}
        for engine_id, first in lead.items():
            followers = [e for e in launch.engines if e.engine_id == engine_id and e.node_rank > 0]
            self.engines.append(_Engine(launch=first, followers=followers))
        for r in launch.routers:
            argv, env = router_command(r.spec)
            proc = ManagedProcess(
                name=f"router.{r.model}",
                argv=argv,
                env=env,
                log_path=self.log_dir / f"router.{r.model}.log",
                display_command=" ".join(argv[:3]) + f" <spec of {r.model}>",
            )
            self.routers.append(_Router(launch=r, process=proc))
            self.status.track(proc.name, "router", r.spec.url)
        for e in self.engines:
            for pl in (e.launch, *e.followers):
                proc = ManagedProcess(
                    name=pl.name,
                    argv=pl.argv,
                    env=pl.env,
                    log_path=self.log_dir / f"{pl.name}.log",
                    display_command=pl.display_command(),
                )
                e.processes.append(proc)
            self.status.track(
                e.launch.engine_id, "engine", f"{e.launch.url} GPUs {e.launch.env['CUDA_VISIBLE_DEVICES']}"
            )
        for r in self.routers:
            self._start_process(r.process, "router", r.process.name)
        for e in self.engines:
            for p in e.processes:
                self._start_process(p, "engine", e.launch.engine_id)

    def _start_process(self, proc: ManagedProcess, what: str, row: str) -> None:
        try:
            proc.start()
        except OSError as exc:  # e.g. the command does not exist: a LaunchError like any other failed start
            self.status.update(row, "failed")
            command = proc.display_command or " ".join(mask_argv(list(proc.argv)))
            raise LaunchError(
                f"{what} {proc.name} could not be started: {exc}\n  command: {command}"
            ) from exc

    def _fail_if_exited(self) -> None:
        for r in self.routers:
            code = r.process.exit_code()
            if code is not None:
                self.status.update(r.process.name, "failed")
                raise LaunchError(_exited_message(r.process, code, "router"))
        for e in self.engines:
            for p in e.processes:
                code = p.exit_code()
                if code is not None:
                    self.status.update(e.launch.engine_id, "failed")
                    raise LaunchError(_exited_message(p, code, "engine"))

    def _wait_ready(self) -> None:
        launch_conf = self.settings.launch
        deadline = time.monotonic() + launch_conf.startup_timeout_s
        key = self.settings.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # Health polls and registrations go out concurrently: one slow or hanging engine must not delay the
        # others, and registration time must not grow with the number of engines.
        workers = min(32, max(4, len(self.engines) + len(self.routers)))
        with httpx.Client(timeout=2.0, headers=headers) as client, ThreadPoolExecutor(workers) as pool:
            while True:
                self._fail_if_exited()
                routers = [r for r in self.routers if r.state == "starting"]
                engines = [e for e in self.engines if e.state == "starting"]
                urls = [r.launch.spec.url + "/liveness" for r in routers] + [
                    e.launch.url + HEALTH_ENDPOINT for e in engines
                ]
                ok = list(pool.map(lambda url: _get_ok(client, url), urls))
                for r, live in zip(routers, ok[: len(routers)], strict=True):
                    if live:
                        r.state = "live"
                        self.status.update(r.process.name, "live")
                for e, healthy in zip(engines, ok[len(routers) :], strict=True):
                    if healthy:
                        e.state, e.healthy_at = "healthy", time.monotonic()
                        self.status.update(e.launch.engine_id, "healthy")
                self._register_healthy(pool)
                if all(e.registered for e in self.engines) and self._routers_ready():
                    return
                if time.monotonic() > deadline:
                    raise LaunchError(self._timeout_message(launch_conf.startup_timeout_s))
                time.sleep(launch_conf.poll_interval_s)

    def _register_healthy(self, pool: ThreadPoolExecutor) -> None:
        by_model = {r.launch.model: r for r in self.routers}
        due = [
            (e, router)
            for e in self.engines
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
            self.status.update(e.launch.engine_id, "registered")

    def _routers_ready(self) -> bool:
        ready = True
        for r in self.routers:
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
        for e in self.engines:
            if e.state == "starting":
                p = e.processes[0]
                lines.append(
                    f"  engine {e.launch.engine_id} never answered {HEALTH_ENDPOINT} at {e.launch.url} "
                    f"(process {p.pid} still running); last log lines of {p.log_path}:"
                )
                lines += [f"    | {line}" for line in p.tail(10).splitlines()]
        for r in self.routers:
            if r.state != "ready":
                lines.append(f"  router of {r.launch.model} at {r.launch.spec.url}: {r.state}")
        return "\n".join(lines)

    def auth_headers(self) -> dict[str, str]:
        """``Authorization`` for requests to the routers and engines (empty without an API key). The key
        itself stays out of the registry, so that ``RouterRegistry.to_env()`` carries no secret."""
        key = self.settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def exited(self) -> list[tuple[str, int]]:
        """Processes that have exited since start-up (name, exit code): a deployment that lost a member."""
        return [(p.name, code) for p in self.processes() if (code := p.exit_code()) is not None]

    # ---------------------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Stop every process this launcher started (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            # A second Ctrl-C or SIGTERM must not cut the teardown short: hold them off while stopping.
            with _signals_held():
                stop_processes(self.processes(), grace_s=self.settings.launch.shutdown_grace_s)
                self._stopped = True
                if self.claims is not None:
                    self.claims.release()
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


def _exited_message(proc: ManagedProcess, code: int, what: str) -> str:
    elapsed = time.monotonic() - proc.started_at
    lines = [
        f"{what} {proc.name} exited with code {code} during start-up (after {elapsed:.1f} s)",
        f"  command: {proc.display_command or ' '.join(mask_argv(list(proc.argv)))}",
        f"  last log lines of {proc.log_path}:",
        *(f"    | {line}" for line in proc.tail(15).splitlines()),
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def launched(
    prepared: PreparedDeployment,
    *,
    log_dir: Path,
    claims: PortClaims | None = None,
    status: StatusView | None = None,
) -> Iterator[LocalLauncher]:
    """Start ``prepared`` and stop it when the block ends, however it ends."""
    launcher = LocalLauncher(prepared, log_dir=log_dir, claims=claims, status=status)
    with launcher:
        yield launcher


__all__ = ["LaunchError", "LocalLauncher", "UnsupportedPlanError", "launched", "stop_all_active"]
