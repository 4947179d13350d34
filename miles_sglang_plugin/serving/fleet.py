"""The observed state of a running deployment: one row per engine and per router, each with a state from a
small state machine. Only the reconciler (:mod:`.reconciler`) changes a row's state, through
:meth:`Fleet.transition`, which refuses a change its machine does not allow.

Engine states and the changes allowed (``EngineState``):

=================  ==========================================================  ==============================
state              meaning                                                     may become
=================  ==========================================================  ==============================
new                added by a change of the deployment (``apply``): waits      starting, lost, stopped
                   until its GPUs are free, then is started
starting           its processes run (or, external: not answered yet); not     catching_up, lost, draining,
                   answering its health endpoint yet                           stopped
catching_up        answers; being brought to the ledger (replay of the         serving, pending_weights,
                   control state it should have), then registered              lost, draining, stopped
serving            in its model's router, serving requests                     catching_up (it disagrees with
                                                                               the ledger), updating, lost,
                                                                               draining, stopped
updating           up, out of its router for a rolling weight update:          catching_up, lost, draining,
                   finishing its requests, then given the new weights;         stopped
                   back into service through catching_up
pending_weights    up, out of its router: its weights can only come through    catching_up, lost, draining,
                   a weights update group the trainer forms again              stopped
lost               exited or stopped answering: out of its router, its         restarting, catching_up
                   processes stopped; restarted after the backoff (an          (external, answers again),
                   external engine: waited for)                                failed, draining, stopped
restarting         being started again with its same argv, environment, GPUs   starting, lost, stopped
draining           removed by a change of the deployment: out of its router,   stopped
                   finishing the requests it has, then stopped
failed             could not be brought back: the deployment fails             stopped
stopped            the deployment stopped, or the engine was removed           (none)
                   (external engines keep running)
=================  ==========================================================  ==============================

Routers (``RouterState``): starting -> live (answers ``/liveness``) -> ready (lists every engine it should
serve, healthy); ready -> lost (exited or stopped answering) -> restarting -> starting (with its workers
given at start) ...; lost -> failed once its restarts are used up.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from miles_sglang_plugin.backends.base import EngineProcess
from miles_sglang_plugin.backends.processes import ManagedProcess
from miles_sglang_plugin.planning.plan import ExternalEnginePlan, GroupPlan, ModelPlan
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch, RouterLaunch
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.rendering.router_specs import WorkerRegistration
from miles_sglang_plugin.serving.errors import IllegalTransitionError
from miles_sglang_plugin.serving.events import DeploymentEvent

__all__ = [
    "ENGINE_TRANSITIONS",
    "EXTERNAL_GROUP",
    "ROUTER_TRANSITIONS",
    "CatchUp",
    "DeploymentState",
    "EngineInfo",
    "EngineRow",
    "EngineState",
    "Fleet",
    "RouterInfo",
    "RouterRow",
    "RouterState",
    "build_fleet",
]

#: The group name external engines are listed under.
EXTERNAL_GROUP = "external"


class EngineState(enum.Enum):
    """See the module docstring."""

    NEW = "new"
    STARTING = "starting"
    CATCHING_UP = "catching_up"
    SERVING = "serving"
    UPDATING = "updating"
    PENDING_WEIGHTS = "pending_weights"
    LOST = "lost"
    RESTARTING = "restarting"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def up(self) -> bool:
        """Control operations are sent to it (it answers and is not being caught up)."""
        return self in _UP


_UP = frozenset({EngineState.SERVING, EngineState.UPDATING, EngineState.PENDING_WEIGHTS})

_E = EngineState
ENGINE_TRANSITIONS: Mapping[EngineState, frozenset[EngineState]] = MappingProxyType(
    {
        _E.NEW: frozenset({_E.STARTING, _E.LOST, _E.STOPPED}),
        _E.STARTING: frozenset({_E.CATCHING_UP, _E.LOST, _E.DRAINING, _E.STOPPED}),
        _E.CATCHING_UP: frozenset({_E.SERVING, _E.PENDING_WEIGHTS, _E.LOST, _E.DRAINING, _E.STOPPED}),
        _E.SERVING: frozenset({_E.CATCHING_UP, _E.UPDATING, _E.LOST, _E.DRAINING, _E.STOPPED}),
        _E.UPDATING: frozenset({_E.CATCHING_UP, _E.LOST, _E.DRAINING, _E.STOPPED}),
        _E.PENDING_WEIGHTS: frozenset({_E.CATCHING_UP, _E.LOST, _E.DRAINING, _E.STOPPED}),
        _E.LOST: frozenset({_E.RESTARTING, _E.CATCHING_UP, _E.FAILED, _E.DRAINING, _E.STOPPED}),
        _E.RESTARTING: frozenset({_E.STARTING, _E.LOST, _E.STOPPED}),
        _E.DRAINING: frozenset({_E.STOPPED}),
        _E.FAILED: frozenset({_E.STOPPED}),
        _E.STOPPED: frozenset(),
    }
)


class CatchUp(enum.StrEnum):
    """Why an engine is caught up (or waits for weights); ``""`` once it serves."""

    NONE = ""
    #: its first start (the deployment's start-up)
    START = "start"
    #: restarted after a loss
    RESTART = "restart"
    #: an external engine that answers again
    EXTERNAL_BACK = "external_back"
    #: it waits for weights from a weights update group (and is admitted once it has them)
    PENDING = "pending"
    #: it serves, but disagrees with the ledger
    DIVERGENCE = "divergence"
    #: added by a change of the deployment (given up, not failing the deployment, if it never starts)
    NEW = "new"
    #: back from a rolling weight update
    UPDATE = "update"


class RouterState(enum.Enum):
    """See the module docstring."""

    STARTING = "starting"
    LIVE = "live"
    READY = "ready"
    LOST = "lost"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


_R = RouterState
ROUTER_TRANSITIONS: Mapping[RouterState, frozenset[RouterState]] = MappingProxyType(
    {
        _R.STARTING: frozenset({_R.LIVE, _R.LOST, _R.STOPPED}),
        _R.LIVE: frozenset({_R.READY, _R.LOST, _R.STOPPED}),
        _R.READY: frozenset({_R.LOST, _R.STOPPED}),
        _R.LOST: frozenset({_R.RESTARTING, _R.FAILED, _R.STOPPED}),
        _R.RESTARTING: frozenset({_R.STARTING, _R.LOST, _R.STOPPED}),
        _R.FAILED: frozenset({_R.STOPPED}),
        _R.STOPPED: frozenset(),
    }
)


# ----------------------------------------------------------------------------------------------- the views
@dataclass(frozen=True)
class EngineInfo:
    """One engine of a running deployment, as the trainer sees it."""

    id: str
    model: str
    group: str
    worker_type: str
    url: str
    #: The node of its first process (None for an external engine: not placed by this deployment).
    node: int | None
    #: The engine's ``CUDA_VISIBLE_DEVICES`` on its first node ("" for an external engine).
    gpus: str
    nnodes: int
    #: One of :class:`EngineState`'s values: new, starting, catching_up, serving, updating, pending_weights,
    #: lost, restarting, draining, failed, stopped.
    state: str
    #: ``time.monotonic()`` when its current processes were started, and when it (last) answered its health
    #: endpoint for the first time.
    started_at: float | None = None
    healthy_at: float | None = None
    #: Runs elsewhere: never started or stopped by the deployment.
    external: bool = False
    #: GPUs of the whole engine (all nodes; for an external engine, its tp_size * pp_size as it reports them).
    num_gpus: int = 0
    #: How often it was restarted after a loss.
    restarts: int = 0
    #: What the plan decided for its group and model: takes part in offload/onload; receives weight updates.
    needs_offload: bool = False
    update_weights: bool = False
    #: Serves LoRA adapters (``--enable-lora``).
    serves_lora: bool = False
    #: The weight version it has as far as the deployment knows: its command line's (``default`` unless
    #: ``weight_version`` is set), then what the weight updates it accepted set; None for an external engine
    #: that took none.
    weight_version: str | None = None


@dataclass(frozen=True)
class RouterInfo:
    model: str
    url: str
    #: One of :class:`RouterState`'s values: starting, live, ready, lost, restarting, failed, stopped.
    state: str
    restarts: int = 0


@dataclass(frozen=True)
class DeploymentState:
    """A snapshot of the deployment (``deployment.state()``)."""

    #: ``starting``, ``serving`` (every engine and router serves), ``degraded`` (something is down, being
    #: brought back, or waits for weights), ``failed``, ``stopped``.
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


# ----------------------------------------------------------------------------------------------- the rows
@dataclass
class EngineRow:
    """One engine: what the plan decided for it, and what is observed of it (changed by the reconciler only)."""

    id: str
    model: str
    group: str
    worker_type: str
    url: str
    node: int | None
    gpus: str
    nnodes: int
    num_gpus: int
    needs_offload: bool
    update_weights: bool
    serves_lora: bool
    registration: WorkerRegistration
    #: Its processes' launches, node rank 0 first (empty for an external engine).
    launches: tuple[EngineProcessLaunch, ...] = ()
    external: bool = False
    #: LoRA adapters its command line loads at start (name -> path).
    initial_lora: tuple[tuple[str, str], ...] = ()
    # -- observed
    state: EngineState = EngineState.STARTING
    processes: tuple[EngineProcess, ...] = ()
    #: Restarts so far; also the generation of its processes (observations about an older one are stale).
    restarts: int = 0
    #: Restarts counted against ``supervision.max_restarts`` (given back after a long stretch of service).
    restarts_in_budget: int = 0
    started_at: float | None = None
    healthy_at: float | None = None
    #: When it came back into service after its last loss; when it was lost, and why.
    recovered_at: float | None = None
    lost_at: float | None = None
    lost_reason: str = ""
    #: Its router has it registered (as far as the deployment knows).
    registered: bool = False
    #: Health polls failed in a row, and when it was last polled.
    health_failures: int = 0
    probed_at: float | None = None
    #: The work of the reconciler under way for it ("probe", "spawn", "cleanup", "replay", "register",
    #: "deregister", "learn"): at most one of each kind at a time.
    pending: frozenset[str] = frozenset()
    #: Why it is catching up (or waits for weights): start, restart, external_back, pending (its weights),
    #: divergence (it disagrees with the ledger); "" once it serves.
    catch_up: CatchUp = CatchUp.START
    #: An external engine's GPUs and LoRA serving were read from its /server_info.
    learned: bool = False
    #: Its processes are stopped and it is out of its router (a lost engine may restart only then).
    cleaned_up: bool = False
    #: Control operations in flight that target or defer it (no catch-up starts meanwhile).
    ops_in_flight: int = 0
    #: A restart may begin from this ``time.monotonic()`` on (the backoff).
    restart_at: float | None = None
    #: The last divergence from the ledger that was reported (to report each once).
    divergence: str = ""
    #: Its global GPU slots in the plan (which a new engine may take only once a removed one has let go).
    slots: tuple[int, ...] = ()
    #: Removed by a change of the deployment: it drains and stops, and is then dropped from the fleet.
    retired: bool = False
    #: A draining engine is stopped at this ``time.monotonic()`` even if it still has requests (an updating
    #: one is given its new weights then).
    drain_until: float | None = None
    #: A rolling weight update asks it out of its router, with this many seconds to finish its requests
    #: (None: not asked). Set and cleared by the reconciler for the update; a loss clears it.
    update_hold: float | None = None
    #: An updating engine has finished its requests (or its time to finish them is over).
    drained: bool = False

    @property
    def lead(self) -> EngineProcessLaunch | None:
        return self.launches[0] if self.launches else None

    @property
    def command_line_version(self) -> str | None:
        """The weight version its command line starts it with (``--weight-version``; SGLang's default is
        ``default``); None for an external engine (not started here)."""
        lead = self.lead
        return None if lead is None else str(lead.server_args.get("weight_version") or "default")

    def info(self) -> EngineInfo:
        return EngineInfo(
            id=self.id,
            model=self.model,
            group=self.group,
            worker_type=self.worker_type,
            url=self.url,
            node=self.node,
            gpus=self.gpus,
            nnodes=self.nnodes,
            state=self.state.value,
            started_at=self.started_at,
            healthy_at=self.healthy_at,
            external=self.external,
            num_gpus=self.num_gpus,
            restarts=self.restarts,
            needs_offload=self.needs_offload,
            update_weights=self.update_weights,
            serves_lora=self.serves_lora,
        )


@dataclass
class RouterRow:
    """The router of one model (a process of this machine) and what is observed of it."""

    model: str
    launch: RouterLaunch
    process: ManagedProcess
    state: RouterState = RouterState.STARTING
    restarts: int = 0
    health_failures: int = 0
    probed_at: float | None = None
    #: When it was lost (None: it was not, or it serves again).
    lost_at: float | None = None
    #: The work under way for it ("probe", "restart", "list").
    pending: frozenset[str] = frozenset()
    #: The engines it was given at its (re)start: it serves them from its first moment.
    started_with: tuple[str, ...] = ()
    #: When its current process was started again after a loss (its readiness deadline counts from here).
    started_at: float | None = None
    #: Generations before this row's (a router a change replaced in another mode): what is still told of the
    #: old router's process is stale for this one.
    epoch: int = 0

    @property
    def generation(self) -> int:
        """The generation of its current process (observations of an older one are stale)."""
        return self.epoch + self.restarts

    @property
    def url(self) -> str:
        return self.launch.spec.url

    @property
    def name(self) -> str:
        return f"router.{self.model}"

    def info(self) -> RouterInfo:
        return RouterInfo(self.model, self.url, self.state.value, self.restarts)


_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineRow)) - {"state"}
_ROUTER_FIELDS = frozenset(f.name for f in fields(RouterRow)) - {"state"}


class Fleet:
    """Every engine and router row, in deployment order. Rows change only through :meth:`transition` and
    :meth:`update` (under the fleet's lock, so that :meth:`engine_infos` and friends, read from any thread,
    see whole rows)."""

    def __init__(self, engines: Sequence[EngineRow], routers: Sequence[RouterRow] = ()) -> None:
        self._engines = {row.id: row for row in engines}
        self._routers = {row.model: row for row in routers}
        self.lock = threading.RLock()

    # ------------------------------------------------------------------------------------------ reading
    def engines(self) -> tuple[EngineRow, ...]:
        with self.lock:
            return tuple(self._engines.values())

    def routers(self) -> tuple[RouterRow, ...]:
        with self.lock:
            return tuple(self._routers.values())

    def engine(self, engine_id: str) -> EngineRow:
        return self._engines[engine_id]

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._engines

    def router(self, model: str) -> RouterRow | None:
        return self._routers.get(model)

    def engine_infos(self) -> tuple[EngineInfo, ...]:
        with self.lock:
            return tuple(row.info() for row in self._engines.values())

    def router_infos(self) -> tuple[RouterInfo, ...]:
        with self.lock:
            return tuple(row.info() for row in self._routers.values())

    # ------------------------------------------------------------------------------------------ writing
    def add_engine(self, row: EngineRow) -> None:
        """A new engine row (a change of the deployment), after the others (its router registers it in turn)."""
        with self.lock:
            if row.id in self._engines:
                raise IllegalTransitionError(f"engine {row.id} is in the fleet already")
            self._engines[row.id] = row

    def drop_engine(self, engine_id: str) -> EngineRow:
        """Take a stopped engine out of the fleet."""
        with self.lock:
            row = self._engines[engine_id]
            if row.state is not EngineState.STOPPED:
                raise IllegalTransitionError(
                    f"engine {engine_id} is {row.state.value}: only a stopped one leaves"
                )
            return self._engines.pop(engine_id)

    def order(self, engine_ids: Sequence[str]) -> None:
        """Put the engines in this order (the plan's, after a change); the others keep theirs, after them."""
        with self.lock:
            first = {e: self._engines[e] for e in engine_ids if e in self._engines}
            self._engines = {**first, **{e: r for e, r in self._engines.items() if e not in first}}

    def add_router(self, row: RouterRow) -> None:
        with self.lock:
            self._routers[row.model] = row

    def drop_router(self, model: str) -> RouterRow:
        with self.lock:
            return self._routers.pop(model)

    def transition(self, engine_id: str, state: EngineState, **changes: Any) -> EngineRow:
        """Move an engine to ``state`` (and set ``changes``); raises :class:`IllegalTransitionError` for a
        change :data:`ENGINE_TRANSITIONS` does not allow."""
        with self.lock:
            row = self._engines[engine_id]
            if state is not row.state and state not in ENGINE_TRANSITIONS[row.state]:
                raise IllegalTransitionError(f"engine {engine_id}: {row.state.value} -> {state.value}")
            row.state = state
            self._set(row, changes, _ENGINE_FIELDS)
            return row

    def update(self, engine_id: str, **changes: Any) -> EngineRow:
        """Set fields of an engine's row other than its state."""
        with self.lock:
            row = self._engines[engine_id]
            self._set(row, changes, _ENGINE_FIELDS)
            return row

    def transition_router(self, model: str, state: RouterState, **changes: Any) -> RouterRow:
        with self.lock:
            row = self._routers[model]
            if state is not row.state and state not in ROUTER_TRANSITIONS[row.state]:
                raise IllegalTransitionError(f"router of {model}: {row.state.value} -> {state.value}")
            row.state = state
            self._set(row, changes, _ROUTER_FIELDS)
            return row

    def update_router(self, model: str, **changes: Any) -> RouterRow:
        with self.lock:
            row = self._routers[model]
            self._set(row, changes, _ROUTER_FIELDS)
            return row

    @staticmethod
    def _set(row: object, changes: Mapping[str, Any], allowed: frozenset[str]) -> None:
        unknown = set(changes) - allowed
        if unknown:
            raise TypeError(
                f"not a field of {type(row).__name__} that may be set: {', '.join(sorted(unknown))}"
            )
        for name, value in changes.items():
            setattr(row, name, value)


# ---------------------------------------------------------------------------------------- from the plan
def _lora_paths(launch: EngineProcessLaunch) -> tuple[tuple[str, str], ...]:
    """Adapters on the command line (``--lora-paths name=path ...``), which a fresh process has loaded."""
    paths = launch.server_args.get("lora_paths") or ()
    pairs = []
    for entry in paths if isinstance(paths, list | tuple) else [paths]:
        name, sep, path = str(entry).partition("=")
        if sep:
            pairs.append((name, path))
    return tuple(sorted(pairs))


def _registration(
    prepared: PreparedDeployment, model: str, url: str, fallback: WorkerRegistration
) -> WorkerRegistration:
    """The router's registration of the worker at ``url`` (with the plan's labels), as rendered."""
    try:
        return prepared.launch.router(model).registration(url)
    except KeyError:
        return fallback


def _local_row(
    model: ModelPlan, group: GroupPlan, launches: Sequence[EngineProcessLaunch], num_gpus: int
) -> EngineRow:
    lead = launches[0]
    return EngineRow(
        id=lead.engine_id,
        model=model.name,
        group=group.name,
        worker_type=lead.worker_type.value,
        url=lead.url,
        node=lead.node,
        gpus=lead.env.get("CUDA_VISIBLE_DEVICES", ""),
        nnodes=lead.nnodes,
        num_gpus=num_gpus,
        needs_offload=group.needs_offload,
        update_weights=model.update_weights,
        serves_lora=bool(lead.server_args.get("enable_lora")),
        registration=WorkerRegistration(
            url=lead.url,
            worker_type=lead.worker_type.value,
            bootstrap_port=lead.bootstrap_port if lead.worker_type.value == "prefill" else None,
        ),
        launches=tuple(launches),
        initial_lora=_lora_paths(lead),
    )


def slots_of(prepared: PreparedDeployment) -> dict[str, tuple[int, ...]]:
    """engine id -> its global GPU slots in the plan."""
    return {engine.id: engine.gpu_slots for engine in prepared.plan.engines}


def _external_row(model: ModelPlan, engine: ExternalEnginePlan) -> EngineRow:
    return EngineRow(
        id=engine.id,
        model=model.name,
        group=EXTERNAL_GROUP,
        worker_type=engine.worker_type.value,
        url=engine.url,
        node=None,
        gpus="",
        nnodes=1,
        num_gpus=0,  # learnt from the engine's /server_info once it answers
        needs_offload=False,  # holds no GPU of the deployment: never offloaded (as in slime)
        update_weights=model.update_weights,
        serves_lora=False,  # learnt from its /server_info
        registration=WorkerRegistration(
            url=engine.url, worker_type=engine.worker_type.value, bootstrap_port=engine.bootstrap_port
        ),
        external=True,
    )


def engine_rows(prepared: PreparedDeployment, *, to_start: bool = False) -> list[EngineRow]:
    """Every engine of ``prepared`` in deployment order (per model: its groups' engines, then its external
    engines), with its launches and the plan's decisions. ``to_start``: the engines this process starts are
    ``new`` (the reconcile loop starts them; external ones are ``starting``: they are only polled)."""
    rows: list[EngineRow] = []
    for model in prepared.plan.models:
        for group in model.groups:
            for engine in group.engines:
                launches = sorted(prepared.launch.for_engine(engine.id), key=lambda p: p.node_rank)
                rows.append(_local_row(model, group, launches, engine.num_gpus))
        rows += [_external_row(model, engine) for engine in model.external]
    slots = slots_of(prepared)
    for row in rows:
        row.registration = _registration(prepared, row.model, row.url, row.registration)
        row.slots = slots.get(row.id, ())
        if to_start and not row.external:
            row.state = EngineState.NEW
    return rows


def build_fleet(
    prepared: PreparedDeployment, routers: Sequence[RouterRow] = (), *, to_start: bool = False
) -> Fleet:
    """The fleet of ``prepared``; ``to_start``: as a deployment's start-up begins (:func:`engine_rows`)."""
    return Fleet(engine_rows(prepared, to_start=to_start), routers)
