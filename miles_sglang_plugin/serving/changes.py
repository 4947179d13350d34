"""A change of a running deployment as the reconcile loop carries it out: what it will do (:class:`Change`,
worked out by :mod:`.elastic` before anything changes) and the change under way (:class:`Converging`), which
the loop settles on each pass: removed engines dropped once stopped, added ones put in once the GPUs and the id
they take are free, each with the control state its peers should have; done once every removed engine stopped
and every added one serves or was given up."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.stable import PlanDiff
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.serving.fleet import CatchUp, EngineRow, EngineState, Fleet
from miles_sglang_plugin.serving.ledger import ControlState, Ledger, initial_state

__all__ = ["Change", "ChangeOutcome", "Converging", "desired_for"]


@dataclass(frozen=True)
class Change:
    """What an apply will do, worked out before anything changes."""

    plan: DeploymentPlan
    diff: PlanDiff
    prepared: PreparedDeployment
    #: engine id -> kept, replaced, started, stopped (kept engines whose command line changed: replaced).
    changes: Mapping[str, str]
    #: engine id -> why it is replaced.
    reasons: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Models that change between PD and regular serving: their router is replaced (in the new mode, on the
    #: same address) once their old engines are gone, and their new engines start after that.
    router_swaps: frozenset[str] = frozenset()

    def engines(self, change: str) -> tuple[str, ...]:
        return tuple(e for e, c in self.changes.items() if c == change)


# ---------------------------------------------------------------------------------------------------- converging
def desired_for(row: EngineRow, fleet: Fleet, ledger: Ledger, initial: ControlState) -> ControlState:
    """What an added engine should have: what the engines of its model and group have (else of its model:
    weights, version, adapters, pause; memory released only from a group that offloads as it does)."""
    peers = [r for r in fleet.engines() if r.model == row.model and not r.retired and r.id != row.id]
    same_group = [r for r in peers if r.group == row.group]
    if same_group:
        return ledger.desired(same_group[0].id)
    if not peers:
        return initial
    peer = peers[0]
    want = ledger.desired(peer.id)
    released = want.released if peer.needs_offload == row.needs_offload else frozenset()
    return dataclasses.replace(want, released=released)


@dataclass(frozen=True)
class ChangeOutcome:
    """How a change ended: when each engine's part was done, the engines given up (added engines that could
    not be started within their restart budget: they stay in the plan as ``failed``, holding their GPUs, and
    a later apply starts them again), and the processes of the engines it removed."""

    done_at: Mapping[str, float]
    given_up: tuple[str, ...] = ()
    removed_processes: tuple[Any, ...] = ()


@dataclass(eq=False)  # one change is itself, whatever it holds
class Converging:
    """One change under way, settled by the reconcile loop on each of its passes (:meth:`settle`): the change
    goes on whether or not its caller still waits, until every removed engine stopped and every added one
    serves or was given up; then ``finished`` is set."""

    change: Change
    #: The deployment as it ran before the change (its ports and placement are given back at the end).
    before: PreparedDeployment
    fleet: Fleet
    ledger: Ledger
    new_rows: dict[str, EngineRow]
    started_at: float
    #: Called on the loop to add a row (it joins the control operations in flight that cover it).
    admit: Callable[[EngineRow], None]
    #: Called on the loop to replace a model's router (``router_swaps``); calls back ``swapped(model)``.
    swap_router: Callable[[str], None] | None = None
    done_at: dict[str, float] = dataclasses.field(default_factory=dict)
    leaving: set[str] = dataclasses.field(default_factory=set)
    coming: set[str] = dataclasses.field(default_factory=set)
    #: Added engines whose id is still held by a row that leaves (replaced: the old one first).
    waiting: set[str] = dataclasses.field(default_factory=set)
    given_up: set[str] = dataclasses.field(default_factory=set)
    #: What a replaced engine should have, kept from its old row's ledger entry for its new one.
    kept_desired: dict[str, ControlState] = dataclasses.field(default_factory=dict)
    #: The old row's generation (``restarts``) of a replaced engine, which its new row goes on from.
    kept_generation: dict[str, int] = dataclasses.field(default_factory=dict)
    removed_processes: list[Any] = dataclasses.field(default_factory=list)
    #: model -> where its router's replacement stands: waiting (its old engines leave), swapping, done.
    swaps: dict[str, str] = dataclasses.field(default_factory=dict)
    finished: concurrent.futures.Future[ChangeOutcome] = dataclasses.field(
        default_factory=concurrent.futures.Future
    )

    def begin(self) -> None:
        """On the loop: the removed engines are marked (they drain and stop), the added ones put in."""
        for engine, what in self.change.changes.items():
            if what in ("stopped", "replaced"):
                self.fleet.update(engine, retired=True)
                self.leaving.add(engine)
            if what in ("started", "replaced"):
                self.waiting.add(engine)
        self.swaps = {model: "waiting" for model in self.change.router_swaps}
        self._add_waiting()

    def _add_waiting(self) -> None:
        for engine in sorted(self.waiting):
            if engine in self.fleet:
                continue  # the engine it replaces is still there
            if self.swaps.get(self.new_rows[engine].model, "done") != "done":
                continue  # its model's router is replaced first
            self.waiting.discard(engine)
            row = self.new_rows[engine]
            initial = initial_state(row.initial_lora, row.command_line_version)
            if engine in self.kept_desired:
                desired = self.kept_desired.pop(engine)  # the same engine: what it should have stays
            else:
                desired = desired_for(row, self.fleet, self.ledger, initial)
            self.ledger.add_engine(engine, initial, desired)
            row.state = EngineState.NEW
            row.catch_up = CatchUp.NEW
            # a replaced engine's new row goes on from the old row's generation: what is still told of the
            # old process (a late exit, an answer to a call that was out) is stale for the new one
            row.restarts = self.kept_generation.pop(engine, -1) + 1
            row.cleaned_up = row.external
            self.fleet.add_engine(row)
            self.admit(row)
            self.coming.add(engine)

    def settle(self, now: float) -> bool:
        """On the loop: drop the removed engines that stopped (putting a replacement in their place), note the
        added ones that serve or were given up. True once the change is done."""
        for engine in sorted(self.leaving):
            if engine not in self.fleet:  # gone already (another way out)
                self.leaving.discard(engine)
                continue
            if self.fleet.engine(engine).state is EngineState.STOPPED:
                row = self.fleet.drop_engine(engine)
                self.removed_processes += list(row.processes)
                self.leaving.discard(engine)
                self.done_at[engine] = now
                if engine in self.waiting:  # replaced: the new process should have what the old one should
                    self.kept_desired[engine] = self.ledger.desired(engine)
                    self.kept_generation[engine] = row.restarts
                self.ledger.drop_engine(engine)
        self._swap_routers()
        self._add_waiting()
        for engine in sorted(self.coming):
            state = self.fleet.engine(engine).state
            if state in (EngineState.SERVING, EngineState.PENDING_WEIGHTS):
                self.coming.discard(engine)
                self.done_at[engine] = now
            elif state is EngineState.FAILED:
                self.coming.discard(engine)
                self.given_up.add(engine)
                self.done_at[engine] = now
        return not (self.leaving or self.coming or self.waiting or set(self.swaps.values()) - {"done"})

    def _swap_routers(self) -> None:
        """A model whose old engines are all gone gets its router replaced."""
        for model, where in self.swaps.items():
            if where == "waiting" and not any(row.model == model for row in self.fleet.engines()):
                self.swaps[model] = "swapping"
                if self.swap_router is None:
                    self.swaps[model] = "done"
                else:
                    self.swap_router(model)

    def swapped(self, model: str) -> None:
        """On the loop: ``model``'s router runs in its new mode."""
        self.swaps[model] = "done"

    def outcome(self) -> ChangeOutcome:
        return ChangeOutcome(dict(self.done_at), tuple(sorted(self.given_up)), tuple(self.removed_processes))

    def describe(self) -> str:
        """Where each engine of the change stands (for a caller that stopped waiting)."""
        parts = [f"{e} {self.fleet.engine(e).state.value}" for e in sorted(self.leaving) if e in self.fleet]
        parts += [f"{e} {self.fleet.engine(e).state.value}" for e in sorted(self.coming) if e in self.fleet]
        parts += [f"{e} waiting for the engine it replaces" for e in sorted(self.waiting)]
        parts += [f"router of {m} {where}" for m, where in sorted(self.swaps.items()) if where != "done"]
        return ", ".join(parts) or "nothing left"
