"""The reconciler's decisions, as a pure function: :func:`plan_actions` takes the fleet (what is observed), the
ledger (what each engine should have), what was observed since the last call, the settings and the time, and
returns the actions that bring the fleet towards the desired state. It changes nothing itself: the
reconciler (:mod:`.reconciler`) applies the state changes and runs the actions, whose outcomes come back as
observations. So every policy (backoff, restart budget, failure threshold, router restarts, externals) is
unit-tested with a fake clock and fake observations.

Every way back into service is one path: an engine that answers again (a restart, an external engine back,
an engine that got its weights, an engine that disagrees with the ledger) goes to ``catching_up``, gets the
difference between what it has and what it should have replayed, is registered with its router, and serves.
No engine leaves ``catching_up`` while a control operation that concerns it is in flight, so none serves
without that operation's state.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.serving.fleet import CatchUp, EngineRow, EngineState, Fleet, RouterRow, RouterState
from miles_sglang_plugin.serving.ledger import Ledger, ReplayCall

__all__ = [
    "Action",
    "ActionKind",
    "Observation",
    "ObservationKind",
    "Policy",
    "plan_actions",
]

#: The health endpoint polled while an engine starts (as Miles: a real generation, not just a live socket).
STARTUP_HEALTH_ENDPOINT = "/health_generate"
#: How long one start-up health poll may take, in seconds.
STARTUP_PROBE_TIMEOUT_S = 2.0
#: How often a restarted engine or router is polled while it starts (healing waits on nothing else).
RESTART_POLL_S = 0.05
#: A restarted router that is not ready this long after its process started (it does not answer, or does not
#: list the engines it was given as healthy) is lost again: restarted while its budget lasts. Its own start
#: takes seconds; the deadline leaves room for a saturated machine.
ROUTER_READY_TIMEOUT_S = 60.0


class ActionKind(enum.StrEnum):
    """What an :class:`Action` is: a state change the reconciler applies at once (``transition``, ``update``,
    ``router_transition``, ``router_update``, ``emit``), the end of start-up or of the deployment (``ready``,
    ``startup_failed``, ``fail``), or work whose outcome comes back as an :class:`Observation` of the same
    name (every other kind)."""

    TRANSITION = "transition"
    UPDATE = "update"
    ROUTER_TRANSITION = "router_transition"
    ROUTER_UPDATE = "router_update"
    EMIT = "emit"
    READY = "ready"
    STARTUP_FAILED = "startup_failed"
    FAIL = "fail"
    PROBE = "probe"
    SPAWN = "spawn"
    CLEANUP = "cleanup"
    REPLAY = "replay"
    REGISTER = "register"
    DEREGISTER = "deregister"
    LEARN = "learn"
    DRAIN = "drain"
    ROUTER_PROBE = "router_probe"
    ROUTER_RESTART = "router_restart"
    ROUTER_LIST = "router_list"


class ObservationKind(enum.StrEnum):
    """What an :class:`Observation` tells: a process exited (``exited``, ``router_exited``), or the outcome of
    the work action of the same name."""

    EXITED = "exited"
    PROBE = "probe"
    SPAWN = "spawn"
    CLEANUP = "cleanup"
    REPLAY = "replay"
    REGISTER = "register"
    DEREGISTER = "deregister"
    LEARN = "learn"
    DRAIN = "drain"
    ROUTER_PROBE = "router_probe"
    ROUTER_RESTART = "router_restart"
    ROUTER_LIST = "router_list"
    ROUTER_EXITED = "router_exited"


@dataclass(frozen=True)
class Policy:
    """The settings the decisions use (from ``sglang_deploy.supervision`` and ``.launch``)."""

    supervise: bool = True
    health_endpoint: str = "/health"
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    failure_threshold: int = 2
    max_restarts: int = 3
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    restart_budget_reset_s: float = 600.0
    drain_timeout_s: float = 60.0
    router_max_restarts: int = 3
    router_ready_timeout_s: float = ROUTER_READY_TIMEOUT_S
    startup_timeout_s: float = 600.0
    poll_interval_s: float = 0.25

    @classmethod
    def from_settings(cls, settings: SGLangDeployConf) -> Policy:
        s, launch = settings.supervision, settings.launch
        return cls(
            supervise=s.enabled,
            health_endpoint=s.health_endpoint,
            health_interval_s=s.health_interval_s,
            health_timeout_s=s.health_timeout_s,
            failure_threshold=s.failure_threshold,
            max_restarts=s.max_restarts,
            restart_backoff_s=s.restart_backoff_s,
            restart_backoff_max_s=s.restart_backoff_max_s,
            restart_budget_reset_s=s.restart_budget_reset_s,
            router_max_restarts=s.router_max_restarts,
            startup_timeout_s=launch.startup_timeout_s,
            drain_timeout_s=launch.drain_timeout_s,
            poll_interval_s=launch.poll_interval_s,
        )

    def backoff(self, attempt: int) -> float:
        """The wait before restart ``attempt`` (1, 2, ...) of an engine: none before the first, then
        ``restart_backoff_s`` doubling from the second, at most ``restart_backoff_max_s``."""
        if attempt <= 1:
            return 0.0
        return min(self.restart_backoff_s * 2.0 ** (attempt - 2), self.restart_backoff_max_s)


# ------------------------------------------------------------------------------------------- observations
@dataclass(frozen=True)
class Observation:
    """Something observed of one engine (``engine``) or router (``router``: its model); ``generation`` is
    the engine's restarts when what is observed began (an older one's observation is stale)."""

    kind: ObservationKind
    engine: str | None = None
    router: str | None = None
    generation: int = 0
    ok: bool = True
    #: What went wrong (exit, failed poll, refused registration, ...).
    problem: str | None = None
    #: An exit code (kind ``exited``), or a restart that cannot succeed (``fatal``).
    code: int | None = None
    fatal: bool = False
    details: Mapping[str, Any] = field(default_factory=dict)


def exited(engine: str, generation: int, problem: str, code: int) -> Observation:
    return Observation(
        ObservationKind.EXITED, engine=engine, generation=generation, ok=False, problem=problem, code=code
    )


def done(
    kind: ObservationKind, engine: str, generation: int, problem: str | None = None, **kw: Any
) -> Observation:
    """The outcome of an engine action (``probe``, ``spawn``, ``cleanup``, ``replay``, ``register``,
    ``deregister``, ``learn``)."""
    return Observation(kind, engine=engine, generation=generation, ok=problem is None, problem=problem, **kw)


def router_done(kind: ObservationKind, model: str, problem: str | None = None, **kw: Any) -> Observation:
    """The outcome of a router action or an exit (``router_probe``, ``router_restart``, ``router_list``,
    ``router_exited``)."""
    return Observation(kind, router=model, ok=problem is None, problem=problem, **kw)


# ------------------------------------------------------------------------------------------------ actions
@dataclass(frozen=True)
class Action:
    """One step for the reconciler: a state change (``transition``, ``update``), an event (``emit``), or
    work whose outcome comes back as an observation (``probe``, ``spawn``, ``cleanup``, ``replay``,
    ``register``, ``deregister``, ``learn``, ``router_probe``, ``router_restart``, ``router_list``); or
    the end of start-up (``ready``, ``startup_failed``) or of the deployment (``fail``)."""

    kind: ActionKind
    engine: str | None = None
    router: str | None = None
    state: EngineState | RouterState | None = None
    changes: Mapping[str, Any] = field(default_factory=dict)
    #: Event kind and message (``emit``), the problem (``fail``, ``startup_failed``), the endpoint
    #: (``probe``).
    event: str | None = None
    message: str = ""
    path: str = ""
    timeout_s: float = 0.0
    calls: tuple[ReplayCall, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)


#: Actions whose outcome is awaited; while one is out for an engine, no second one of its kind starts.
PENDING_KINDS = frozenset(
    {
        ObservationKind.PROBE,
        ObservationKind.SPAWN,
        ObservationKind.CLEANUP,
        ObservationKind.REPLAY,
        ObservationKind.REGISTER,
        ObservationKind.DEREGISTER,
        ObservationKind.LEARN,
        ObservationKind.DRAIN,
    }
)


# -------------------------------------------------------------------------------------------- the scratch
class _Scratch:
    """Copies of the rows a decision changes, so that later rules see earlier changes; the real rows change
    only when the reconciler applies the actions."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = self._fleet = fleet
        self._engines: dict[str, EngineRow] = {}
        self._routers: dict[str, RouterRow] = {}
        self.actions: list[Action] = []

    def engine(self, engine_id: str) -> EngineRow:
        row = self._engines.get(engine_id)
        if row is None:
            row = self._engines[engine_id] = dataclasses.replace(self._fleet.engine(engine_id))
        return row

    def router(self, model: str) -> RouterRow | None:
        row = self._routers.get(model)
        if row is None:
            real = self._fleet.router(model)
            if real is None:
                return None
            row = self._routers[model] = dataclasses.replace(real)
        return row

    def engines(self) -> list[EngineRow]:
        return [self.engine(row.id) for row in self._fleet.engines()]

    def routers(self) -> list[RouterRow]:
        return [r for row in self._fleet.routers() if (r := self.router(row.model)) is not None]

    # -- recording decisions
    def move(self, row: EngineRow, state: EngineState, **changes: Any) -> None:
        row.state = state
        for name, value in changes.items():
            setattr(row, name, value)
        self.actions.append(Action(ActionKind.TRANSITION, engine=row.id, state=state, changes=changes))

    def set(self, row: EngineRow, **changes: Any) -> None:
        for name, value in changes.items():
            setattr(row, name, value)
        self.actions.append(Action(ActionKind.UPDATE, engine=row.id, changes=changes))

    def start(self, row: EngineRow, kind: ActionKind, **kw: Any) -> None:
        """Start work ``kind`` for ``row`` (marking it pending)."""
        self.set(row, pending=row.pending | {kind})
        self.actions.append(Action(kind, engine=row.id, **kw))

    def move_router(self, row: RouterRow, state: RouterState, **changes: Any) -> None:
        row.state = state
        for name, value in changes.items():
            setattr(row, name, value)
        self.actions.append(
            Action(ActionKind.ROUTER_TRANSITION, router=row.model, state=state, changes=changes)
        )

    def set_router(self, row: RouterRow, **changes: Any) -> None:
        for name, value in changes.items():
            setattr(row, name, value)
        self.actions.append(Action(ActionKind.ROUTER_UPDATE, router=row.model, changes=changes))

    def start_router(self, row: RouterRow, kind: ActionKind, **kw: Any) -> None:
        """Start work ``kind`` (``router_probe``, ``router_restart``, ``router_list``) for the router (pending
        as ``probe``, ``restart``, ``list``)."""
        self.set_router(row, pending=row.pending | {kind.removeprefix("router_")})
        self.actions.append(Action(kind, router=row.model, **kw))

    def emit(self, kind: str, subject: str, message: str, **details: Any) -> None:
        self.actions.append(
            Action(ActionKind.EMIT, event=kind, message=message, details={"subject": subject, **details})
        )

    def end(self, kind: ActionKind, message: str = "", **details: Any) -> None:
        self.actions.append(Action(kind, message=message, details=details))


# ------------------------------------------------------------------------------------------ the decisions
_ACTIVE = frozenset(
    {
        EngineState.STARTING,
        EngineState.CATCHING_UP,
        EngineState.SERVING,
        EngineState.UPDATING,
        EngineState.PENDING_WEIGHTS,
    }
)


def plan_actions(
    fleet: Fleet,
    observations: Sequence[Observation],
    ledger: Ledger,
    policy: Policy,
    now: float,
    *,
    phase: str = "serving",
    startup_deadline: float | None = None,
) -> list[Action]:
    """The actions that follow from ``observations`` and from the time ``now`` (see the module docstring).

    ``phase``: ``starting`` (the first start-up: any exit or refusal fails the launch, which is ready once
    every engine serves and every router is ready, or fails at ``startup_deadline``), ``serving`` (heal),
    ``stopping`` (nothing more)."""
    scratch = _Scratch(fleet)
    if phase == "stopping":
        return []
    for observation in observations:
        _observe(scratch, observation, ledger, policy, now, phase)
    if any(a.kind in (ActionKind.FAIL, ActionKind.STARTUP_FAILED) for a in scratch.actions):
        return scratch.actions
    # Retired engines first: one that stops in this pass frees its GPUs for an added engine in the same pass.
    rows = scratch.engines()
    for row in sorted(rows, key=lambda r: not r.retired):
        _advance_engine(scratch, row, ledger, policy, now, phase)
    for router in scratch.routers():
        _advance_router(scratch, router, policy, now, phase)
    if phase == "starting":
        _end_of_startup(scratch, now, startup_deadline)
    return scratch.actions


def _observe(s: _Scratch, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str) -> None:
    if o.engine is not None:
        if o.engine in s.fleet:  # else about an engine a change removed from the fleet
            _observe_engine(s, s.engine(o.engine), o, ledger, policy, now, phase)
    elif o.router is not None:
        router = s.router(o.router)
        if router is not None:  # else about a router a change removed
            _observe_router(s, router, o, policy, now, phase)


# -------------------------------------------------------------------------------------- engine observations
def _observe_engine(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    if o.generation != row.restarts:
        return  # about processes that are gone
    if o.kind in PENDING_KINDS:
        s.set(row, pending=row.pending - {o.kind})
    if row.retired and not o.ok and o.kind in _BRINGING_BACK:
        _retired_work_failed(s, row)
        return
    handler = _ENGINE_OBSERVERS.get(o.kind)
    if handler is not None:
        handler(s, row, o, ledger, policy, now, phase)


#: Work that brings an engine (back) into service: its failure makes a serving engine lost, but of a removed
#: engine it only means that there is nothing left to drain.
_BRINGING_BACK = frozenset(
    {
        ObservationKind.SPAWN,
        ObservationKind.PROBE,
        ObservationKind.REPLAY,
        ObservationKind.REGISTER,
        ObservationKind.LEARN,
    }
)


def _retired_work_failed(s: _Scratch, row: EngineRow) -> None:
    """A removed engine whose start, poll, replay, registration or reading failed: it is not lost (no restart,
    no restart budget, never the deployment's failure), only stopped: its processes cleaned up, then it leaves
    as every removed engine does (:func:`_advance_retired`)."""
    if row.state in (EngineState.DRAINING, EngineState.STOPPED, EngineState.FAILED, EngineState.NEW):
        return
    s.move(row, EngineState.LOST, cleaned_up=row.external, health_failures=0, restart_at=None)
    if not row.external and "cleanup" not in row.pending:
        s.start(row, ActionKind.CLEANUP)


def _on_exit(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    if row.retired:
        # A removed engine that dies is not restarted: its processes are stopped (reaped) and it leaves as any
        # removed engine does; its GPUs are free for an added engine only once that is done.
        if row.state not in (EngineState.STOPPED, EngineState.NEW) and "cleanup" not in row.pending:
            s.set(row, cleaned_up=False)
            s.start(row, ActionKind.CLEANUP)
        return
    if row.state not in _ACTIVE or (phase == "serving" and not policy.supervise):
        return  # without supervision nothing is watched once it serves (deployment.exited() tells)
    if phase == "starting":
        s.end(ActionKind.STARTUP_FAILED, o.problem or "", cause="exited", engine=row.id)
        return
    _lose(s, row, o.problem or "its process exited", policy, now)


def _on_probe(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    if row.state is EngineState.STARTING:
        if o.ok:
            s.move(row, EngineState.CATCHING_UP, healthy_at=now, health_failures=0)
        return
    if row.state is EngineState.LOST and row.external:
        if o.ok and phase == "serving":
            s.move(row, EngineState.CATCHING_UP, catch_up=CatchUp.EXTERNAL_BACK, health_failures=0)
        return
    if not row.state.up:
        return
    if o.ok:
        if row.health_failures:
            s.set(row, health_failures=0)
        return
    failures = row.health_failures + 1
    s.set(row, health_failures=failures)
    if failures >= policy.failure_threshold and phase == "serving":
        _lose(s, row, f"{o.problem} ({failures} polls in a row)", policy, now)


def _on_spawn(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    if row.state not in (EngineState.RESTARTING, EngineState.NEW):
        return
    if o.ok:  # new processes run: whatever was cleaned up before is not cleaned up any more
        s.move(row, EngineState.STARTING, started_at=now, probed_at=None, health_failures=0, cleaned_up=False)
        return
    if phase == "starting":  # its first start, at the deployment's start-up: the start-up fails
        exited = bool(o.details.get("exited"))
        message = o.problem if exited else str(o.details.get("error", o.problem or ""))
        s.end(ActionKind.STARTUP_FAILED, message or "", cause="exited" if exited else "spawn", engine=row.id)
        return
    if o.fatal:
        if _never_served(row):
            _give_up(s, row, o.problem or "it could not be started")
            return
        s.end(ActionKind.FAIL, f"engine {row.id} lost ({row.lost_reason}) and {o.problem}")
        return
    _restart_failed(s, row, o.problem or "it could not be started", policy, now)


def _on_cleanup(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    s.set(row, cleaned_up=True)


def _on_replay(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    if row.state is not EngineState.CATCHING_UP or o.ok:
        return
    problem = f"it did not take the control state back: {o.problem}"
    if phase == "starting":
        s.end(ActionKind.STARTUP_FAILED, f"engine {row.id}: {problem}", cause="replay", engine=row.id)
    elif row.catch_up == CatchUp.RESTART:
        _restart_failed(s, row, problem, policy, now)
    else:
        _lose(s, row, problem, policy, now)


def _on_register(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    if row.state is not EngineState.CATCHING_UP:
        return
    if o.ok:
        s.set(row, registered=True)
        return
    problem = f"its router refused it: {o.problem}"
    if phase == "starting":
        s.end(
            ActionKind.STARTUP_FAILED,
            f"router of model {row.model!r} refused engine {row.id}: {o.problem}",
            cause="register",
            engine=row.id,
        )
    elif row.catch_up == CatchUp.RESTART:
        _restart_failed(s, row, problem, policy, now)
    else:
        _lose(s, row, problem, policy, now)


def _on_deregister(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    s.set(row, registered=False)


def _on_learn(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    if o.ok:
        s.set(row, learned=True)
        return
    if phase == "starting":
        s.end(
            ActionKind.STARTUP_FAILED,
            f"external engine {row.id} ({row.url}): {o.problem}",
            cause="learn",
            engine=row.id,
        )
    elif row.state is EngineState.CATCHING_UP:
        _lose(s, row, o.problem or "its /server_info could not be read", policy, now)


_ENGINE_OBSERVERS = {
    ObservationKind.EXITED: _on_exit,
    ObservationKind.PROBE: _on_probe,
    ObservationKind.SPAWN: _on_spawn,
    ObservationKind.CLEANUP: _on_cleanup,
    ObservationKind.REPLAY: _on_replay,
    ObservationKind.REGISTER: _on_register,
    ObservationKind.DEREGISTER: _on_deregister,
    ObservationKind.LEARN: _on_learn,
}


# ----------------------------------------------------------------------------------------- losing, budget
def budget_used(row: EngineRow, policy: Policy, now: float) -> int:
    """Restarts counted against the budget: given back once the engine served ``restart_budget_reset_s``
    since it last came back."""
    if row.recovered_at is not None and now - row.recovered_at >= policy.restart_budget_reset_s:
        return 0
    return row.restarts_in_budget


def _lose(s: _Scratch, row: EngineRow, reason: str, policy: Policy, now: float) -> None:
    """``row`` is lost: out of its router, its processes stopped, restarted after the backoff (external
    engines: waited for), or the deployment fails when its budget is used up."""
    s.move(
        row,
        EngineState.LOST,
        lost_at=now,
        lost_reason=reason,
        cleaned_up=row.external,
        health_failures=0,
        probed_at=now,
        # a rolling update no longer waits for it: it gets the weights by replay
        **({"update_hold": None, "drained": False} if row.update_hold is not None or row.drained else {}),
    )
    kind = "external_engine_lost" if row.external else "engine_lost"
    s.emit(kind, row.id, f"engine {row.id} ({row.url}) lost: {reason}", reason=reason)
    if row.external:
        return
    s.start(row, ActionKind.CLEANUP)
    used = budget_used(row, policy, now)
    if used >= policy.max_restarts and _never_served(row):
        _give_up(s, row, reason)
        return
    if used >= policy.max_restarts:
        why = (
            "supervision.max_restarts=0 (fail fast)"
            if policy.max_restarts == 0
            else f"its {policy.max_restarts} restarts (supervision.max_restarts) are used up"
        )
        s.end(ActionKind.FAIL, f"engine {row.id} ({row.url}) lost: {reason}; {why}")
        return
    _schedule_restart(s, row, used, policy, now)


def _never_served(row: EngineRow) -> bool:
    """An engine a change added that has not served yet (its first start, or the restarts of it)."""
    return row.catch_up == CatchUp.NEW and not row.external


def _give_up(s: _Scratch, row: EngineRow, problem: str) -> None:
    """An added engine that could not be started within its restart budget: it alone is given up (``failed``,
    its processes stopped, its GPUs still its own), and the deployment serves on with what it had. A later
    change starts it again."""
    if row.state is not EngineState.LOST:
        s.move(row, EngineState.LOST, lost_reason=problem, cleaned_up=False)
    if not row.cleaned_up and "cleanup" not in row.pending:
        s.start(row, ActionKind.CLEANUP)
    s.move(row, EngineState.FAILED, restart_at=None)
    s.emit(
        "engine_given_up",
        row.id,
        f"added engine {row.id} could not be started ({problem}); it is given up and stays failed, the "
        "deployment serves on without it (apply the config again to start it again)",
        reason=problem,
    )


def _schedule_restart(s: _Scratch, row: EngineRow, used: int, policy: Policy, now: float) -> None:
    attempt = used + 1
    delay = policy.backoff(attempt)
    s.set(row, restarts_in_budget=used, restart_at=now + delay, recovered_at=None)
    s.emit(
        "engine_restarting",
        row.id,
        f"restarting engine {row.id}{f' in {delay:g} s' if delay else ''} (restart {attempt} of "
        f"{policy.max_restarts}) with its same command line, environment and GPUs ({row.gpus or '-'})",
        attempt=attempt,
        delay_s=delay,
    )


def _restart_failed(s: _Scratch, row: EngineRow, problem: str, policy: Policy, now: float) -> None:
    """A restart did not bring ``row`` back: stop what it started, then try again after the backoff, or fail
    once the budget is used up."""
    attempt = (
        f"the start of added engine {row.id}"  # never served yet: its first start is no restart
        if row.catch_up == CatchUp.NEW and not row.restarts
        else f"restart {row.restarts_in_budget} of engine {row.id}"
    )
    s.emit("engine_restart_failed", row.id, f"{attempt} failed: {problem}")
    s.move(row, EngineState.LOST, lost_reason=problem, cleaned_up=False, health_failures=0)
    s.start(row, ActionKind.CLEANUP)
    used = budget_used(row, policy, now)
    if used >= policy.max_restarts and _never_served(row):
        _give_up(s, row, problem)
        return
    if used >= policy.max_restarts:
        s.end(
            ActionKind.FAIL,
            f"engine {row.id} could not be brought back after {used} restart(s) "
            f"(supervision.max_restarts={policy.max_restarts}); last problem: {problem}",
        )
        return
    _schedule_restart(s, row, used, policy, now)


# ------------------------------------------------------------------------------------------- advancing
def _advance_engine(
    s: _Scratch, row: EngineRow, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    state = row.state
    if row.retired:
        _advance_retired(s, row, policy, now)
    elif state is EngineState.NEW:
        _advance_new(s, row)
    elif state is EngineState.STARTING:
        _advance_starting(s, row, policy, now, phase)
    elif state is EngineState.CATCHING_UP:
        _advance_catching_up(s, row, ledger, now, phase)
    elif state is EngineState.UPDATING:
        _advance_updating(s, row, ledger, now, phase)
    elif state.up:
        _advance_up(s, row, ledger, policy, now, phase)
    elif state is EngineState.LOST:
        _advance_lost(s, row, policy, now, phase)
    _deregister_if_out(s, row)


# -------------------------------------------------------------------------------- added and removed engines
#: The work of a removed engine under way: it must end before the engine is stopped.
_WINDING = frozenset({"spawn", "replay", "register", "learn", "probe"})


def _advance_retired(s: _Scratch, row: EngineRow, policy: Policy, now: float) -> None:
    """A removed engine: out of its router (the general rule), its requests finished or its drain time over,
    its processes stopped; then it is ``stopped`` and the change that removed it drops it."""
    state = row.state
    if state is EngineState.NEW:
        s.move(row, EngineState.STOPPED)  # never started
        return
    if state is EngineState.STOPPED or row.pending & _WINDING:
        return
    if state is EngineState.FAILED:  # a given-up engine a later change removes or starts again
        _retire_failed(s, row)
        return
    if state is not EngineState.DRAINING:
        s.move(row, EngineState.DRAINING, drain_until=now + policy.drain_timeout_s, probed_at=None)
    if row.registered or row.pending & {"drain", "cleanup", "deregister"}:
        return
    if row.external or row.cleaned_up:
        s.move(row, EngineState.STOPPED)
        s.emit("engine_removed", row.id, f"engine {row.id} ({row.url}) is out of the deployment")
    elif row.drain_until is not None and now >= row.drain_until:
        s.start(row, ActionKind.CLEANUP)
    elif _due(row.probed_at, RESTART_POLL_S * 2, now):
        s.set(row, probed_at=now)
        s.start(row, ActionKind.DRAIN)


def _retire_failed(s: _Scratch, row: EngineRow) -> None:
    if row.external or row.cleaned_up:
        s.move(row, EngineState.STOPPED)
        s.emit("engine_removed", row.id, f"engine {row.id} ({row.url}) is out of the deployment")
    elif "cleanup" not in row.pending:
        s.start(row, ActionKind.CLEANUP)


def _on_drain(
    s: _Scratch, row: EngineRow, o: Observation, ledger: Ledger, policy: Policy, now: float, phase: str
) -> None:
    """A draining or updating engine reported how many requests it still has (``ok``: none, or it does not
    answer)."""
    if row.state is EngineState.DRAINING and o.ok and "cleanup" not in row.pending:
        s.start(row, ActionKind.CLEANUP)
    elif row.state is EngineState.UPDATING and o.ok and row.update_hold is not None:
        s.set(row, drained=True)


_ENGINE_OBSERVERS[ObservationKind.DRAIN] = _on_drain


def _advance_new(s: _Scratch, row: EngineRow) -> None:
    """A new engine (of the start-up, or one a change added) is started once no other engine holds any of its
    GPUs (a removed one has stopped; the start-up's engines each have their own)."""
    if "spawn" in row.pending:
        return
    busy = {
        slot
        for other in s.engines()
        if other.id != row.id and other.state is not EngineState.STOPPED
        for slot in other.slots
    }
    if not busy & set(row.slots):
        s.start(row, ActionKind.SPAWN)


def _due(probed_at: float | None, interval: float, now: float) -> bool:
    return probed_at is None or now - probed_at >= interval


def _advance_starting(s: _Scratch, row: EngineRow, policy: Policy, now: float, phase: str) -> None:
    if phase == "serving" and row.started_at is not None and now - row.started_at > policy.startup_timeout_s:
        _restart_failed(
            s,
            row,
            f"it did not answer {STARTUP_HEALTH_ENDPOINT} within {policy.startup_timeout_s:g} s",
            policy,
            now,
        )
        return
    interval = policy.poll_interval_s if phase == "starting" else min(policy.poll_interval_s, RESTART_POLL_S)
    if "probe" not in row.pending and _due(row.probed_at, interval, now):
        s.set(row, probed_at=now)
        s.start(row, ActionKind.PROBE, path=STARTUP_HEALTH_ENDPOINT, timeout_s=STARTUP_PROBE_TIMEOUT_S)


def _router_accepts(s: _Scratch, model: str) -> bool:
    router = s.router(model)
    return router is None or router.state in (RouterState.LIVE, RouterState.READY)


def _advance_catching_up(s: _Scratch, row: EngineRow, ledger: Ledger, now: float, phase: str) -> None:
    if row.ops_in_flight or row.pending & {"replay", "register", "deregister", "learn"}:
        return  # an operation that concerns it is out: it gets its state first
    if row.external and not row.learned:
        s.start(row, ActionKind.LEARN)
        return
    calls = ledger.replay(row.id)
    if calls:
        s.start(row, ActionKind.REPLAY, calls=tuple(calls))
        return
    if ledger.needs_weights(row.id):
        _await_weights(s, row, now)
        return
    if not row.registered:
        if _router_accepts(s, row.model):
            s.start(row, ActionKind.REGISTER)
        return
    _serve(s, row, now, ledger)


def _await_weights(s: _Scratch, row: EngineRow, now: float) -> None:
    came_from = row.catch_up
    s.move(row, EngineState.PENDING_WEIGHTS, catch_up=CatchUp.PENDING)
    if came_from == CatchUp.PENDING:
        return
    downtime = now - row.lost_at if row.lost_at is not None else 0.0
    s.emit(
        "engine_pending_weights",
        row.id,
        f"engine {row.id} is back after {downtime:.1f} s but its weights are not the deployment's (they came "
        "through a weights update group): it serves once the trainer has formed its weights update group "
        "again and sent it weights (control.engines_outside_weight_group())",
        downtime_s=downtime,
        restarts=row.restarts,
    )


def _serve(s: _Scratch, row: EngineRow, now: float, ledger: Ledger) -> None:
    came_from = row.catch_up
    downtime = now - row.lost_at if row.lost_at is not None else 0.0
    start_s = (row.healthy_at or now) - (row.started_at or now)
    back = {"downtime_s": downtime, "start_s": start_s, "restarts": row.restarts}
    s.move(row, EngineState.SERVING, catch_up=CatchUp.NONE, health_failures=0, probed_at=now, divergence="")
    if came_from == CatchUp.RESTART:
        s.set(row, recovered_at=now, lost_at=None)
        s.emit(
            "engine_recovered",
            row.id,
            f"engine {row.id} serves again after {downtime:.1f} s ({start_s:.1f} s of it its own start)",
            **back,
        )
    elif came_from == CatchUp.EXTERNAL_BACK:
        s.set(row, lost_at=None)
        s.emit("external_engine_back", row.id, f"external engine {row.id} ({row.url}) answers again")
    elif came_from == CatchUp.PENDING:
        s.set(row, recovered_at=now, lost_at=None)
        s.emit("engine_admitted", row.id, f"engine {row.id} got weights and serves again", **back)
    elif came_from == CatchUp.UPDATE:
        version = ledger.has(row.id).weight_version
        s.emit(
            "engine_updated",
            row.id,
            f"engine {row.id} serves again after its weight update (weight version {version or 'default'})",
            weight_version=version,
        )
    elif came_from == CatchUp.NEW:
        s.emit(
            "engine_added",
            row.id,
            f"engine {row.id} ({row.url}) serves ({start_s:.1f} s its own start)",
            **back,
        )


def _advance_up(s: _Scratch, row: EngineRow, ledger: Ledger, policy: Policy, now: float, phase: str) -> None:
    if phase == "serving" and row.state is EngineState.SERVING and row.update_hold is not None:
        _leave_for_update(s, row, now)
        return
    if phase == "serving" and not row.ops_in_flight and "replay" not in row.pending:
        if row.state is EngineState.PENDING_WEIGHTS and not ledger.needs_weights(row.id):
            s.move(row, EngineState.CATCHING_UP, catch_up=CatchUp.PENDING)  # it got its weights: admission
            _advance_catching_up(s, row, ledger, now, phase)
            return
        calls = ledger.replay(row.id)
        lacks_weights = row.state is EngineState.SERVING and ledger.needs_weights(row.id)
        if calls or lacks_weights:
            what = "; ".join(call.describe() for call in calls) or "weights from a weights update group"
            if what != row.divergence:
                s.emit(
                    "engine_diverged",
                    row.id,
                    f"engine {row.id} does not have the control state the ledger says it should: {what}; "
                    "bringing it there",
                    missing=what,
                )
            keep = row.catch_up if row.state is EngineState.PENDING_WEIGHTS else CatchUp.DIVERGENCE
            s.move(row, EngineState.CATCHING_UP, catch_up=keep, divergence=what)
            _advance_catching_up(s, row, ledger, now, phase)
            return
    if (
        policy.supervise
        and phase == "serving"
        and "probe" not in row.pending
        and _due(row.probed_at, policy.health_interval_s, now)
    ):
        s.set(row, probed_at=now)
        s.start(
            row,
            ActionKind.PROBE,
            path=_health_endpoint(row, ledger, policy),
            timeout_s=policy.health_timeout_s,
        )


def _leave_for_update(s: _Scratch, row: EngineRow, now: float) -> None:
    """A rolling weight update asks a serving engine out of its router (the general rule takes it out:
    :func:`_deregister_if_out`); it finishes its requests until its drain time is over."""
    hold = row.update_hold or 0.0
    s.move(row, EngineState.UPDATING, drain_until=now + hold, drained=False, probed_at=None)
    s.emit(
        "engine_updating",
        row.id,
        f"engine {row.id} leaves its router for a rolling weight update (up to {hold:g} s to finish its "
        "requests)",
        drain_s=hold,
    )


def _advance_updating(s: _Scratch, row: EngineRow, ledger: Ledger, now: float, phase: str) -> None:
    """Out of its router for a rolling weight update: its requests are counted until none is left or its
    drain time is over (then it is ``drained``: the update is sent); once the update lets it go it comes
    back through catching_up (the ledger's state by replay, then its router)."""
    if row.update_hold is None:
        if phase == "serving" and not row.ops_in_flight:
            s.move(row, EngineState.CATCHING_UP, catch_up=CatchUp.UPDATE, drained=False, drain_until=None)
            _advance_catching_up(s, row, ledger, now, phase)
        return
    if row.drained or row.registered or row.pending & {"drain", "deregister"}:
        return
    if row.drain_until is not None and now >= row.drain_until:
        s.set(row, drained=True)
    elif _due(row.probed_at, RESTART_POLL_S * 2, now):
        s.set(row, probed_at=now)
        s.start(row, ActionKind.DRAIN)


def _health_endpoint(row: EngineRow, ledger: Ledger, policy: Policy) -> str:
    """The configured endpoint; ``/health`` for an engine that cannot generate now (offloaded, paused)."""
    if policy.health_endpoint == "/health":
        return "/health"
    has = ledger.has(row.id)
    return "/health" if has.released or has.paused is not None else policy.health_endpoint


def _advance_lost(s: _Scratch, row: EngineRow, policy: Policy, now: float, phase: str) -> None:
    if phase != "serving":
        return
    if row.external:
        if (
            policy.supervise
            and "probe" not in row.pending
            and _due(row.probed_at, policy.health_interval_s, now)
        ):
            s.set(row, probed_at=now)
            s.start(row, ActionKind.PROBE, path="/health", timeout_s=policy.health_timeout_s)
        return
    if not row.cleaned_up or "spawn" in row.pending or row.restart_at is None or now < row.restart_at:
        return
    if row.registered and _router_accepts(s, row.model):
        return  # its router must not send requests to the new process before it has its state
    s.move(
        row,
        EngineState.RESTARTING,
        restarts=row.restarts + 1,
        restarts_in_budget=row.restarts_in_budget + 1,
        restart_at=None,
        catch_up=CatchUp.NEW
        if row.catch_up == CatchUp.NEW
        else CatchUp.RESTART,  # an added engine serves as added
        registered=False,
        pending=frozenset({"spawn"}),
    )
    s.actions.append(Action(ActionKind.SPAWN, engine=row.id))


def _in_service(row: EngineRow) -> bool:
    """It serves requests (also while it is brought back to the ledger after it disagreed with it); never a
    removed engine (it is drained)."""
    if row.retired:
        return False
    return row.state is EngineState.SERVING or (
        row.state is EngineState.CATCHING_UP and row.catch_up == CatchUp.DIVERGENCE
    )


def _deregister_if_out(s: _Scratch, row: EngineRow) -> None:
    """An engine its router still has while it should not serve (lost, waiting for weights)."""
    wanted = row.registered and not _in_service(row) and "deregister" not in row.pending
    if wanted and s.router(row.model) is not None and _router_accepts(s, row.model):
        s.start(row, ActionKind.DEREGISTER)


# -------------------------------------------------------------------------------------------- routers
def _observe_router(
    s: _Scratch, row: RouterRow, o: Observation, policy: Policy, now: float, phase: str
) -> None:
    if o.generation != row.generation:
        return  # about a process of the router that is gone
    s.set_router(row, pending=row.pending - {o.kind.removeprefix("router_")})
    handler = _ROUTER_OBSERVERS.get(o.kind)
    if handler is not None:
        handler(s, row, o, policy, now, phase)


def _on_router_exit(
    s: _Scratch, row: RouterRow, o: Observation, policy: Policy, now: float, phase: str
) -> None:
    if row.state not in (RouterState.STARTING, RouterState.LIVE, RouterState.READY):
        return
    if phase == "serving" and not policy.supervise:
        return
    if phase == "starting":
        s.end(ActionKind.STARTUP_FAILED, o.problem or "", cause="router_exited", router=row.model)
    else:
        _router_lost(s, row, o.problem or "its process exited", policy, now)


def _on_router_restart(
    s: _Scratch, row: RouterRow, o: Observation, policy: Policy, now: float, phase: str
) -> None:
    if row.state is not RouterState.RESTARTING:
        return
    if not o.ok:
        s.end(ActionKind.FAIL, f"router of model {row.model} could not be brought back: {o.problem}")
        return
    started_with = tuple(o.details.get("workers", ()))
    s.move_router(
        row,
        RouterState.STARTING,
        probed_at=None,
        health_failures=0,
        started_with=started_with,
        started_at=now,
    )
    for engine in s.engines():
        if engine.model == row.model:
            s.set(engine, registered=engine.id in started_with)


def _on_router_list(
    s: _Scratch, row: RouterRow, o: Observation, policy: Policy, now: float, phase: str
) -> None:
    if row.state is RouterState.LIVE and o.ok:
        _router_ready(s, row, now)


def _on_router_probe(
    s: _Scratch, row: RouterRow, o: Observation, policy: Policy, now: float, phase: str
) -> None:
    if row.state is RouterState.STARTING:
        if o.ok:
            s.move_router(row, RouterState.LIVE, health_failures=0)
        return
    if row.state is not RouterState.READY:
        return
    failures = 0 if o.ok else row.health_failures + 1
    if failures != row.health_failures:
        s.set_router(row, health_failures=failures)
    if failures >= policy.failure_threshold and phase == "serving":
        _router_lost(s, row, f"no answer to /liveness ({failures} polls in a row)", policy, now)


_ROUTER_OBSERVERS = {
    ObservationKind.ROUTER_EXITED: _on_router_exit,
    ObservationKind.ROUTER_PROBE: _on_router_probe,
    ObservationKind.ROUTER_RESTART: _on_router_restart,
    ObservationKind.ROUTER_LIST: _on_router_list,
}


def _router_lost(s: _Scratch, row: RouterRow, reason: str, policy: Policy, now: float) -> None:
    s.move_router(row, RouterState.LOST, lost_at=now)
    s.emit("router_lost", row.name, f"router of model {row.model} lost: {reason}", reason=reason)
    if row.restarts >= policy.router_max_restarts:
        s.end(
            ActionKind.FAIL,
            f"router of model {row.model} lost: {reason}; its {policy.router_max_restarts} restarts "
            "(supervision.router_max_restarts) are used up",
        )
        return
    workers = tuple(e.id for e in s.engines() if e.model == row.model and e.registered and _in_service(e))
    # A new generation: work still out for the old process comes back stale and is dropped, so none of it may
    # stay pending (a poll out when the router died would otherwise block every poll of the new process).
    s.move_router(row, RouterState.RESTARTING, restarts=row.restarts + 1, pending=frozenset())
    s.start_router(row, ActionKind.ROUTER_RESTART, details={"workers": workers})


def _router_ready(s: _Scratch, row: RouterRow, now: float) -> None:
    was_restarted = row.lost_at is not None
    s.move_router(row, RouterState.READY, health_failures=0, probed_at=now)
    if was_restarted:
        downtime = now - (row.lost_at or now)
        s.set_router(row, lost_at=None)
        s.emit(
            "router_recovered",
            row.name,
            f"router of model {row.model} serves again after {downtime:.1f} s",
            downtime_s=downtime,
        )


def _router_overdue(row: RouterRow, policy: Policy, now: float) -> bool:
    """A restarted router that is still not ready at its deadline."""
    return (
        row.lost_at is not None
        and row.started_at is not None
        and row.state in (RouterState.STARTING, RouterState.LIVE)
        and now - row.started_at >= policy.router_ready_timeout_s
    )


def _advance_router(s: _Scratch, row: RouterRow, policy: Policy, now: float, phase: str) -> None:
    if phase == "serving" and _router_overdue(row, policy, now):
        waited = now - (row.started_at or now)
        _router_lost(s, row, f"not ready {waited:.1f} s after its restart", policy, now)
        return
    if row.state is RouterState.STARTING:
        interval = policy.poll_interval_s if row.lost_at is None else RESTART_POLL_S
        if "probe" not in row.pending and _due(row.probed_at, interval, now):
            s.set_router(row, probed_at=now)
            s.start_router(row, ActionKind.ROUTER_PROBE)
        return
    if row.state is RouterState.LIVE:
        engines = [e for e in s.engines() if e.model == row.model]
        settled = row.lost_at is not None or all(e.registered or e.state not in _ACTIVE for e in engines)
        if settled and "list" not in row.pending and _due(row.probed_at, RESTART_POLL_S, now):
            expected = tuple(e.id for e in engines if e.registered)
            s.set_router(row, probed_at=now)
            s.start_router(row, ActionKind.ROUTER_LIST, details={"workers": expected})
        return
    watched = row.state is RouterState.READY and policy.supervise and phase == "serving"
    if watched and "probe" not in row.pending and _due(row.probed_at, policy.health_interval_s, now):
        s.set_router(row, probed_at=now)
        s.start_router(row, ActionKind.ROUTER_PROBE)


# -------------------------------------------------------------------------------------------- start-up
def _end_of_startup(s: _Scratch, now: float, deadline: float | None) -> None:
    engines, routers = s.engines(), s.routers()
    if all(e.state is EngineState.SERVING for e in engines) and all(
        r.state is RouterState.READY for r in routers
    ):
        s.end(ActionKind.READY)
    elif deadline is not None and now > deadline:
        s.end(ActionKind.STARTUP_FAILED, "", cause="timeout")


def _engine_due(row: EngineRow, policy: Policy, now: float, phase: str) -> float | None:
    """When ``row`` needs a decision without an observation (a poll, a restart, a deadline), or None."""
    if row.state is EngineState.DRAINING:
        return _draining_due(row, now)
    if row.state is EngineState.UPDATING:
        if row.update_hold is None:
            return None if row.ops_in_flight else now  # let go: back into service at once
        return None if row.drained else _draining_due(row, now)
    if row.state is EngineState.STARTING:
        interval = (
            policy.poll_interval_s if phase == "starting" else min(policy.poll_interval_s, RESTART_POLL_S)
        )
        deadline = (
            row.started_at + policy.startup_timeout_s if phase == "serving" and row.started_at else None
        )
        poll = None if "probe" in row.pending else (row.probed_at or now) + interval
        return min((t for t in (poll, deadline) if t is not None), default=None)
    if row.state is EngineState.LOST and not row.external:
        return row.restart_at if row.cleaned_up and phase == "serving" else None
    if phase != "serving" or not policy.supervise or "probe" in row.pending:
        return None
    if row.state.up or row.state is EngineState.LOST:
        return (row.probed_at or now) + policy.health_interval_s
    return None


def _draining_due(row: EngineRow, now: float) -> float | None:
    """A removed engine's next drain query, or its drain deadline (see :func:`_advance_retired`)."""
    if row.registered or row.pending & {"drain", "cleanup", "deregister"}:
        return None  # the outcome under way wakes the loop
    query = (row.probed_at or now) + RESTART_POLL_S * 2
    return query if row.drain_until is None else min(query, row.drain_until)


def _router_due(row: RouterRow, policy: Policy, now: float, phase: str) -> float | None:
    deadline = (
        row.started_at + policy.router_ready_timeout_s
        if row.lost_at is not None
        and row.started_at is not None
        and row.state in (RouterState.STARTING, RouterState.LIVE)
        else None
    )
    if row.pending & {"probe", "list", "restart"}:
        return deadline
    if row.state is RouterState.STARTING:
        poll = (row.probed_at or now) + (policy.poll_interval_s if row.lost_at is None else RESTART_POLL_S)
        return poll if deadline is None else min(poll, deadline)
    if row.state is RouterState.LIVE:
        poll = (row.probed_at or now) + RESTART_POLL_S
        return poll if deadline is None else min(poll, deadline)
    if row.state is RouterState.READY and policy.supervise and phase == "serving":
        return (row.probed_at or now) + policy.health_interval_s
    return None


def next_wake(
    fleet: Fleet, policy: Policy, now: float, *, phase: str, startup_deadline: float | None = None
) -> float:
    """Seconds until a decision is due without an observation (between 5 ms and 1 s)."""
    times = [_engine_due(row, policy, now, phase) for row in fleet.engines()]
    times += [_router_due(row, policy, now, phase) for row in fleet.routers()]
    if phase == "starting" and startup_deadline is not None:
        times.append(startup_deadline)
    due = min((t for t in times if t is not None), default=now + 1.0)
    return min(max(due - now, 0.005), 1.0)
