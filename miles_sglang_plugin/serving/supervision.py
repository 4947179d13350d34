"""Supervision of a running deployment: engine and router losses noticed within seconds, healed, and reported.

Once the deployment is up, a monitor thread polls, every ``supervision.health_interval_s``, each serving
engine: its processes (through the backend: an exit is a loss at once) and its ``/health`` (answering within
``health_timeout_s``; ``failure_threshold`` failed polls in a row are a loss: a hung engine, e.g. SIGSTOPped,
answers nothing). The routers (processes of this machine) likewise: exit, or no ``/liveness``.

A lost engine is logged at once, taken out of its router (``DELETE /workers/{id}``), its processes stopped
(``kill_grace_s``: a hung process ignores SIGTERM, so its connections drop and the router retries the requests
that were in flight on it), and restarted through the same backend call with its same argv, environment and
GPUs, after a backoff (``restart_backoff_s`` doubling up to ``restart_backoff_max_s``); it gets the control
state the trainer left the engines in (:mod:`.control`), is registered with its router again once healthy and
serves. At most ``max_restarts`` restarts per engine (given back after ``restart_budget_reset_s`` of service);
then, or at the first loss with ``max_restarts=0``, the deployment **fails whole**: every engine and router is
stopped, the failure is logged and reported, and control calls raise :class:`DeploymentFailedError`. A router
that dies is restarted on its port and re-populated with the serving engines (``router_max_restarts``).
External engines are never restarted: a lost one is taken out of its router and put back once it answers.

Everything is told through :class:`EventLog` (``deployment.on_event(callback)``, ``deployment.events()``,
``deployment.wait_for_event(...)``) and ``deployment.state()``; losses and failures also go to the logger
``miles_sglang_plugin.supervision``.

Processes are restarted from one long-lived thread of the supervisor: a child's parent-death signal fires when
the *thread* that started it exits (see :mod:`miles_sglang_plugin.backends.processes`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import httpx

from miles_sglang_plugin.backends.base import LaunchError
from miles_sglang_plugin.backends.processes import stop_processes
from miles_sglang_plugin.serving.members import EngineInfo, EngineMember
from miles_sglang_plugin.serving.routers import (
    RouterRequestError,
    register_workers,
    remove_worker,
    router_ready,
)

if TYPE_CHECKING:
    from miles_sglang_plugin.serving.deployment import Deployment, RouterMember

__all__ = [
    "DeploymentEvent",
    "DeploymentFailedError",
    "DeploymentState",
    "DeploymentStoppedError",
    "EventLog",
    "RouterInfo",
    "Supervisor",
]

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
        "external_engine_lost": logging.WARNING,
        "external_engine_back": logging.WARNING,
        "router_lost": logging.WARNING,
        "router_recovered": logging.WARNING,
        "deployment_failed": logging.ERROR,
    }
)
#: How long a restarted router may take to answer, and a restarted engine to be listed healthy by its router.
ROUTER_START_TIMEOUT_S = 60.0
REGISTRATION_TIMEOUT_S = 60.0
#: How long stopping waits for the supervisor's threads, all together, once the engines are stopped.
STOP_JOIN_TIMEOUT_S = 30.0


class DeploymentFailedError(LaunchError):
    """The deployment failed while serving (an engine or router could not be brought back, or
    ``supervision.max_restarts=0``): every engine and router it started has been stopped."""


class DeploymentStoppedError(LaunchError):
    """A control operation on a deployment that stopped (normally: not failed): one called once it stops, or one
    still in flight when it stopped (its engines were stopped under it)."""


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


@dataclass(frozen=True)
class RouterInfo:
    model: str
    url: str
    #: starting, live, ready, lost, restarting, stopped.
    state: str
    restarts: int = 0


@dataclass(frozen=True)
class DeploymentState:
    """A snapshot of the deployment (``deployment.state()``)."""

    #: ``starting``, ``serving`` (every engine and router serves), ``degraded`` (something is down or being
    #: restarted, or waits for weights), ``failed``, ``stopped``.
    status: str
    engines: tuple[EngineInfo, ...]
    routers: tuple[RouterInfo, ...]
    failure: str | None = None
    #: The last events (at most 50).
    recent_events: tuple[DeploymentEvent, ...] = ()

    def engines_in(self, *states: str) -> tuple[str, ...]:
        return tuple(e.id for e in self.engines if e.state in states)

    @property
    def restarts(self) -> int:
        return sum(e.restarts for e in self.engines)


class EventLog:
    """Events of one deployment: kept (the last ``maxlen``), logged, and passed to subscribers (called on the
    thread that saw the event: keep them short; an exception in one is logged, never raised)."""

    def __init__(self, maxlen: int = 1000) -> None:
        self._events: deque[DeploymentEvent] = deque(maxlen=maxlen)
        self._count = 0
        self._subscribers: list[Callable[[DeploymentEvent], None]] = []
        self._changed = threading.Condition()

    def subscribe(self, callback: Callable[[DeploymentEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for every event from now on; returns a function that unsubscribes."""
        with self._changed:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._changed, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def emit(self, kind: str, subject: str, message: str, **details: Any) -> DeploymentEvent:
        event = DeploymentEvent(
            kind, subject, message, time.time(), time.monotonic(), MappingProxyType(details)
        )
        logger.log(EVENT_LEVELS.get(kind, logging.INFO), "%s", message, extra={"msp_event": kind})
        with self._changed:
            self._events.append(event)
            self._count += 1
            subscribers = list(self._subscribers)
            self._changed.notify_all()
        for callback in subscribers:
            try:
                callback(event)
            except Exception:
                logger.exception("an event subscriber raised on %s", kind)
        return event

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
                        f"no {kind} event{f' of {subject}' if subject else ''} in {timeout_s:g} s"
                    )
                self._changed.wait(left)


class Supervisor:
    """The monitor and healer of one deployment (see the module docstring)."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.settings = deployment.settings.supervision
        self.events = EventLog()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._failed = False
        self._threads: list[threading.Thread] = []
        self._router_locks: dict[str, threading.RLock] = {}
        # Every restarted process is started from this one thread (parent-death signals, see the docstring).
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="msp-spawn")

    # -------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.settings.enabled:
            self._thread(self._monitor, "msp-monitor")

    def request_stop(self) -> None:
        """No more checks or restarts: its threads end at their next step (see :meth:`join`)."""
        self._stopping.set()

    def join(self, timeout_s: float = STOP_JOIN_TIMEOUT_S) -> None:
        """Wait for the supervisor's threads (except the calling one), all of them within ``timeout_s``;
        call it once their engines are stopped, so that no network call of theirs waits for an answer."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            current = threading.current_thread()
            with self._lock:
                threads = [t for t in self._threads if t.is_alive() and t is not current]
            if not threads:
                return
            threads[0].join(timeout=max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """:meth:`request_stop`, then :meth:`join`."""
        self.request_stop()
        self.join()

    def owns(self, thread: threading.Thread) -> bool:
        """Is ``thread`` one of the supervisor's (monitor, recovery, admission)?"""
        with self._lock:
            return thread in self._threads

    def close(self) -> None:
        """Give back the spawner thread (after every process it started was stopped)."""
        self._spawner.shutdown(wait=True)

    @property
    def failed(self) -> bool:
        return self._failed

    def _thread(self, target: Callable[..., None], name: str, *args: Any) -> None:
        """Run ``target`` on a thread of the supervisor (joined when the deployment stops); none once stopping."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            if self._stopping.is_set():
                return
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def router_lock(self, model: str) -> threading.RLock:
        with self._lock:
            return self._router_locks.setdefault(model, threading.RLock())

    # -------------------------------------------------------------------------------------------- monitor
    def _monitor(self) -> None:
        settings = self.settings
        workers = min(32, max(4, len(self.deployment.members)))
        with (
            httpx.Client(timeout=settings.health_timeout_s, headers=self.deployment.auth_headers()) as client,
            ThreadPoolExecutor(workers, thread_name_prefix="msp-health") as pool,
        ):
            while not self._stopping.wait(settings.health_interval_s):
                try:
                    self._check_routers(client)
                    self._check_engines(client, pool)
                except Exception:  # the monitor outlives any surprise; it is logged
                    logger.exception("supervision: a check failed")

    def _check_engines(self, client: httpx.Client, pool: ThreadPoolExecutor) -> None:
        due = [m for m in self.deployment.members if m.state in ("registered", "pending_weights")]
        comeback = [m for m in self.deployment.members if m.external and m.state == "lost"]
        probes = list(pool.map(lambda m: self._probe(client, m), due + comeback))
        for member, (problem, fatal) in zip(due, probes[: len(due)], strict=True):
            if problem is None:
                member.health_failures = 0
                continue
            member.health_failures += 1
            if fatal or member.health_failures >= self.settings.failure_threshold:
                polls = "" if fatal else f" ({member.health_failures} polls in a row)"
                self._lose(member, problem + polls)
        for member, (problem, _fatal) in zip(comeback, probes[len(due) :], strict=True):
            if problem is None and not self._stopping.is_set():
                self._external_back(member)

    def _probe(self, client: httpx.Client, member: EngineMember) -> tuple[str | None, bool]:
        """(what is wrong, whether it is final): a process exit is final; a failed poll counts."""
        for process in member.processes:
            code = process.exit_code()
            if code is not None:
                reason = process.exit_reason()
                why = f": {reason}" if reason else ""
                return f"process {process.name} exited with code {code} ({process.where}){why}", True
        endpoint = self._health_endpoint(member)
        try:
            response = client.get(member.url + endpoint)
        except httpx.TimeoutException:
            return f"no answer to {endpoint} within {self.settings.health_timeout_s:g} s", False
        except httpx.HTTPError as exc:
            return f"{endpoint} failed ({type(exc).__name__})", False
        if response.status_code != 200:
            return f"{endpoint} answered {response.status_code}", False
        return None, False

    def _health_endpoint(self, member: EngineMember) -> str:
        """The configured endpoint; ``/health`` for an engine that cannot generate now (offloaded, paused)."""
        endpoint = self.settings.health_endpoint
        if endpoint == "/health":
            return endpoint
        remembered = self.deployment.control.aio.remembered
        if remembered.released.get(member.id) or member.id in remembered.paused:
            return "/health"
        return endpoint

    def _check_routers(self, client: httpx.Client) -> None:
        for router in self.deployment.router_members:
            if router.state != "ready":
                continue
            code = router.process.exit_code()
            if code is not None:
                self._router_lost(router, f"its process exited with code {code}")
                continue
            try:
                live = client.get(router.launch.spec.url + "/liveness").status_code == 200
            except httpx.HTTPError:
                live = False
            router.health_failures = 0 if live else router.health_failures + 1
            if router.health_failures >= self.settings.failure_threshold:
                self._router_lost(router, f"no answer to /liveness ({router.health_failures} polls in a row)")

    # -------------------------------------------------------------------------------------------- engines
    def _lose(self, member: EngineMember, reason: str) -> None:
        with self.deployment.control.aio.remembered.lock:  # no control call admits or targets it meanwhile
            member.state = "lost"
        kind = "external_engine_lost" if member.external else "engine_lost"
        self.events.emit(kind, member.id, f"engine {member.id} ({member.url}) lost: {reason}", reason=reason)
        self._take_out(member)
        if member.external:
            return
        if not self._budget_left(member):
            self._fail(
                f"engine {member.id} ({member.url}) lost: {reason}; "
                + (
                    "supervision.max_restarts=0 (fail fast)"
                    if self.settings.max_restarts == 0
                    else f"its {self.settings.max_restarts} restarts (supervision.max_restarts) are used up"
                )
            )
            return
        self._thread(self._recover, f"msp-recover-{member.id}", member, reason)

    def _take_out(self, member: EngineMember) -> None:
        router = self.deployment.router_of(member.model)
        if router is None or router.state not in ("ready", "live"):
            member.registered = False
            return
        with self.router_lock(member.model):
            try:
                remove_worker(router.launch.spec.url, member.url, api_key=self.deployment.settings.api_key)
            except (RouterRequestError, httpx.HTTPError, TimeoutError) as exc:
                logger.warning("could not take %s out of router %s: %s", member.id, router.launch.model, exc)
        member.registered = False

    def _budget_left(self, member: EngineMember) -> bool:
        since = member.recovered_at
        if since is not None and time.monotonic() - since >= self.settings.restart_budget_reset_s:
            member.restarts_in_budget = 0
        return member.restarts_in_budget < self.settings.max_restarts

    def _backoff(self, attempt: int) -> float:
        return min(self.settings.restart_backoff_s * 2 ** (attempt - 1), self.settings.restart_backoff_max_s)

    def _recover(self, member: EngineMember, reason: str) -> None:
        lost_at = time.monotonic()
        self._stop_engine(member)
        problem = reason
        while not self._stopping.is_set():
            blocker = self._restart_blocker(member)
            if blocker is not None:
                self._fail(f"engine {member.id} lost ({problem}) and {blocker}")
                return
            if not self._budget_left(member):
                self._fail(
                    f"engine {member.id} could not be brought back after {member.restarts_in_budget} restart(s) "
                    f"(supervision.max_restarts={self.settings.max_restarts}); last problem: {problem}"
                )
                return
            member.restarts_in_budget += 1
            member.restarts += 1
            attempt, delay = member.restarts_in_budget, self._backoff(member.restarts_in_budget)
            self.events.emit(
                "engine_restarting",
                member.id,
                f"restarting engine {member.id} in {delay:g} s (restart {attempt} of {self.settings.max_restarts}) "
                f"with its same command line, environment and GPUs ({member.gpus or '-'})",
                attempt=attempt,
                delay_s=delay,
            )
            if self._stopping.wait(delay):
                return
            member.state = "restarting"
            problem = self._restart_once(member, lost_at)
            if problem is None or self._stopping.is_set():
                return
            self.events.emit(
                "engine_restart_failed",
                member.id,
                f"restart {attempt} of engine {member.id} failed: {problem}",
            )
            self._stop_engine(member)

    def _restart_blocker(self, member: EngineMember) -> str | None:
        """Why the backend cannot start ``member`` again where the plan put it (its node is gone), or None."""
        for launch in member.launches:
            reason = self.deployment.backend.cannot_restart(launch)
            if reason is not None:
                return reason
        return None

    def _stop_engine(self, member: EngineMember) -> None:
        if member.processes:
            self.deployment.backend.stop(member.processes, grace_s=self.settings.kill_grace_s)

    def _start_processes(self, member: EngineMember) -> str | None:
        """Start the member's processes, each one tracked as soon as it runs (one that fails to start leaves
        those started before it to be stopped with the member). The problem, or None."""
        log_dir = self.deployment.log_dir
        member.processes = []
        for launch in member.launches:
            if self._stopping.is_set():
                return "the deployment is stopping"
            try:
                process = self._spawner.submit(
                    self.deployment.backend.start, launch, log_path=log_dir / f"{launch.name}.log"
                ).result()
            except (OSError, LaunchError, RuntimeError) as exc:  # RuntimeError: the spawner was shut down
                return f"it could not be started: {exc}"
            member.processes.append(process)
        return None

    def _restart_once(self, member: EngineMember, lost_at: float) -> str | None:
        """One restart: start, wait healthy, replay the control state, serve. The problem, or None."""
        problem = self._start_processes(member)
        if problem is not None:
            return problem
        started = time.monotonic()
        problem = self._wait_healthy(member)
        if problem is not None:
            return problem
        member.healthy_at = time.monotonic()
        with member.catch_up:
            problem = self._catch_up(member)
        if problem is not None:
            return problem
        member.recovered_at, member.health_failures = time.monotonic(), 0
        self._report_recovered(member, lost_at, member.healthy_at - started)
        return None

    def _catch_up(self, member: EngineMember) -> str | None:
        """Give the restarted ``member`` the control state, then let it serve (or wait for weights). The
        state is read under its lock and replayed outside it (network calls); a control operation recorded
        meanwhile finds the member catching up and is sent to it once this is done (``member.catch_up``, held
        by the caller), so that no operation falls between the replay and the member coming up."""
        remembered = self.deployment.control.aio.remembered
        with remembered.lock:
            calls = remembered.replay_calls(member)
            member.catching_up = True
        try:
            problems = self._replay(member, calls)
            if problems:
                return "it did not take the control state back: " + "; ".join(problems)
            pending = remembered.needs_weights(member)
            problem = None if pending else self._register(member)
            if problem is not None:
                return problem
            with remembered.lock:  # control calls see it up only once it has their state, and in one step
                member.state = "pending_weights" if pending else "registered"  # no longer catching up: an
                member.catching_up = False  # operation recorded now is sent to it once, as to any up engine
            return None
        finally:
            with remembered.lock:
                member.catching_up = False

    def _report_recovered(self, member: EngineMember, lost_at: float, start_s: float) -> None:
        now = time.monotonic()
        details = {"downtime_s": now - lost_at, "start_s": start_s, "restarts": member.restarts}
        if member.state == "pending_weights":
            self.events.emit(
                "engine_pending_weights",
                member.id,
                f"engine {member.id} is back after {now - lost_at:.1f} s but its weights are the checkpoint's: it "
                "serves once the trainer has re-formed its weights update group and sent it weights "
                "(control.engines_outside_weight_group())",
                **details,
            )
            return
        self.events.emit(
            "engine_recovered",
            member.id,
            f"engine {member.id} serves again after {now - lost_at:.1f} s ({start_s:.1f} s of it its own start)",
            **details,
        )

    def _wait_healthy(self, member: EngineMember) -> str | None:
        launch_conf = self.deployment.settings.launch
        deadline = time.monotonic() + launch_conf.startup_timeout_s
        with httpx.Client(timeout=2.0, headers=self.deployment.auth_headers()) as client:
            while not self._stopping.is_set():
                for process in member.processes:
                    code = process.exit_code()
                    if code is not None:
                        tail = " | ".join(process.tail(5).splitlines())
                        return (
                            f"process {process.name} exited with code {code} ({process.where}); log: {tail}"
                        )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(member.url + "/health_generate").status_code == 200:
                        return None
                if time.monotonic() > deadline:
                    return f"it did not answer /health_generate within {launch_conf.startup_timeout_s:g} s"
                self._stopping.wait(launch_conf.poll_interval_s)
        return "the deployment is stopping"

    def _replay(self, member: EngineMember, calls: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """Send ``calls`` to ``member`` in order; the problems (none once the deployment stops: it says so)."""
        problems = []
        with httpx.Client(
            timeout=self.deployment.settings.control.timeout_s, headers=self.deployment.auth_headers()
        ) as client:
            for route, body in calls:
                if self._stopping.is_set():  # its engine is being stopped: the calls left would only wait
                    return ["the deployment is stopping"]
                try:
                    response = client.post(member.url + route, json=body)
                except httpx.HTTPError as exc:
                    problems.append(f"{route}: {type(exc).__name__}: {exc}")
                    continue
                if response.status_code >= 400:
                    problems.append(f"{route}: HTTP {response.status_code}: {response.text[:300]}")
        return problems

    def _register(self, member: EngineMember) -> str | None:
        """Register ``member`` with its router (waiting while the router itself is being restarted) and wait
        until the router lists it healthy. The problem, or None."""
        router = self.deployment.router_of(member.model)
        if router is None:
            return None
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while router.state != "ready":
            if self._stopping.is_set() or time.monotonic() > deadline:
                return f"its router ({router.launch.spec.url}) is not ready ({router.state})"
            self._stopping.wait(0.2)
        api_key = self.deployment.settings.api_key
        with self.router_lock(member.model):
            try:
                register_workers(router.launch.spec.url, [member.registration], api_key=api_key)
            except (RouterRequestError, httpx.HTTPError) as exc:
                return f"its router refused it: {exc}"
        member.registered = True
        return self._wait_listed(router, [member])

    def _wait_listed(self, router: RouterMember, members: list[EngineMember]) -> str | None:
        deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
        registrations = [m.registration for m in members]
        api_key = self.deployment.settings.api_key
        while not self._stopping.is_set():
            ok, detail = router_ready(router.launch.spec.url, registrations, api_key=api_key)
            if ok:
                return None
            if time.monotonic() > deadline:
                return f"its router does not list it as healthy after {REGISTRATION_TIMEOUT_S:g} s: {detail}"
            self._stopping.wait(0.1)
        return "the deployment is stopping"

    def admit(self, member: EngineMember) -> None:
        """An engine that waited for weights got them: register it and let it serve."""
        problem = self._register(member)
        if self._stopping.is_set():
            return  # stopped meanwhile: nothing to report
        if problem is not None:
            self._lose(member, f"it got its weights but could not be registered: {problem}")
            return
        member.state = "registered"
        self.events.emit("engine_admitted", member.id, f"engine {member.id} got weights and serves again")

    def admit_in_background(self, member: EngineMember) -> None:
        """:meth:`admit` on a thread of the supervisor (joined when the deployment stops)."""
        self._thread(self.admit, f"msp-admit-{member.id}", member)

    def _external_back(self, member: EngineMember) -> None:
        if self._register(member) is None:
            member.state, member.health_failures = "registered", 0
            self.events.emit(
                "external_engine_back", member.id, f"external engine {member.id} ({member.url}) answers again"
            )

    # -------------------------------------------------------------------------------------------- routers
    def _router_lost(self, router: RouterMember, reason: str) -> None:
        router.state = "lost"
        name = f"router.{router.launch.model}"
        self.events.emit(
            "router_lost", name, f"router of model {router.launch.model} lost: {reason}", reason=reason
        )
        if router.restarts >= self.settings.router_max_restarts:
            self._fail(
                f"router of model {router.launch.model} lost: {reason}; its "
                f"{self.settings.router_max_restarts} restarts (supervision.router_max_restarts) are used up"
            )
            return
        self._thread(self._recover_router, f"msp-recover-{name}", router)

    def _recover_router(self, router: RouterMember) -> None:
        lost_at = time.monotonic()
        problem = None
        with self.router_lock(router.launch.model):
            stop_processes([router.process], grace_s=self.settings.kill_grace_s)
            router.restarts += 1
            router.state = "restarting"
            try:
                self._spawner.submit(router.process.start).result()
            except OSError as exc:
                problem = f"it could not be started again: {exc}"
            problem = problem or self._wait_router_live(router) or self._repopulate(router)
        if problem is not None:
            self._fail(f"router of model {router.launch.model} could not be brought back: {problem}")
            return
        router.state, router.health_failures = "ready", 0
        self.events.emit(
            "router_recovered",
            f"router.{router.launch.model}",
            f"router of model {router.launch.model} serves again after {time.monotonic() - lost_at:.1f} s",
            downtime_s=time.monotonic() - lost_at,
        )

    def _wait_router_live(self, router: RouterMember) -> str | None:
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        with httpx.Client(timeout=2.0) as client:
            while not self._stopping.is_set():
                code = router.process.exit_code()
                if code is not None:
                    return f"it exited again with code {code}: {router.process.tail(5)}"
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(router.launch.spec.url + "/liveness").status_code == 200:
                        return None
                if time.monotonic() > deadline:
                    return f"no /liveness within {ROUTER_START_TIMEOUT_S:g} s"
                self._stopping.wait(0.1)
        return "the deployment is stopping"

    def _repopulate(self, router: RouterMember) -> str | None:
        members = [
            m for m in self.deployment.members if m.model == router.launch.model and m.state == "registered"
        ]
        if not members:
            return None
        try:
            register_workers(
                router.launch.spec.url,
                [m.registration for m in members],
                api_key=self.deployment.settings.api_key,
            )
        except (RouterRequestError, httpx.HTTPError) as exc:
            return f"it refused the engines: {exc}"
        return self._wait_listed(router, members)

    # -------------------------------------------------------------------------------------------- failure
    def _fail(self, message: str) -> None:
        with self._lock:
            if self._failed:
                return
            self._failed = True
        self.deployment.mark_failed(message)
        self.events.emit(
            "deployment_failed",
            "deployment",
            f"the deployment failed: {message}; stopping every engine and router",
            reason=message,
        )
        self.deployment.stop()
