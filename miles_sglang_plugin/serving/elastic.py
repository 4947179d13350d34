"""Changing a running deployment in place (``Deployment.apply``): the new config resolved with the same rules
and checks, its plan made stable against the running one (:func:`~miles_sglang_plugin.planning.stable.stabilize`:
engines that stay keep their GPUs), rendered with the ports of what keeps running, then converged through the
reconciler: kept engines are left alone (same processes, ports, state), removed ones are taken out of their
router, drained and stopped, added ones start once their GPUs are free and come into service the one way back
into service (replay of the ledger's state for their model and group, registration), replaced ones (same id,
another launch: new TP, new overrides) are removed and added in their place. Models added get a router of
their own, models removed lose theirs once their engines are gone.

Every problem is found before anything changes: the resolution, the stable placement, the settings that
cannot change while running (router, backend, engine kind, API key, supervision, control), the ports.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_sglang_plugin.backends.base import LaunchError
from miles_sglang_plugin.backends.processes import ManagedProcess
from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.errors import DeploymentConfigError, Problem
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.stable import PlanDiff, stabilize
from miles_sglang_plugin.rendering.ports import PortAssignment
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.serving.fleet import EngineRow, EngineState, Fleet, RouterRow, engine_rows
from miles_sglang_plugin.serving.ledger import ControlState, Ledger, initial_state
from miles_sglang_plugin.serving.routers import router_command

if TYPE_CHECKING:
    from miles_sglang_plugin.serving.reconciler import Reconciler, ServingLoop

__all__ = ["ApplyResult", "Change", "EngineApply", "check_settings", "converge", "plan_change"]

#: Settings a running deployment may take from a new config: what changes its engines' command lines
#: (those engines are replaced) and how long a change may take.
CHANGEABLE_SETTINGS = ("server_defaults", "env", "lora", "standin", "launch.command", "launch.startup_timeout_s",
                       "launch.drain_timeout_s", "launch.live", "launch.log_dir", "launch.port_base",
                       "launch.port_max", "launch.poll_interval_s")  # fmt: skip
#: How often converging looks at the fleet.
CONVERGE_POLL_S = 0.02


@dataclass(frozen=True)
class EngineApply:
    """What an apply did to one engine."""

    engine: str
    #: kept, replaced, started, stopped.
    change: str
    before: str
    after: str
    #: Seconds from the start of the apply until it served again or was gone (None: kept, nothing done).
    seconds: float | None = None
    #: Why it is replaced.
    reason: str = ""


@dataclass(frozen=True)
class ApplyResult:
    """An apply: the plan converged to, how it differs from the running one and from a fresh resolution, and
    what happened to each engine (with a dry run: what would)."""

    plan: DeploymentPlan
    diff: PlanDiff
    engines: tuple[EngineApply, ...]
    dry_run: bool
    seconds: float = 0.0

    def of(self, change: str) -> tuple[str, ...]:
        return tuple(e.engine for e in self.engines if e.change == change)

    @property
    def kept(self) -> tuple[str, ...]:
        return self.of("kept")

    @property
    def started(self) -> tuple[str, ...]:
        return self.of("started")

    @property
    def stopped(self) -> tuple[str, ...]:
        return self.of("stopped")

    @property
    def replaced(self) -> tuple[str, ...]:
        return self.of("replaced")

    def lines(self) -> list[str]:
        width = max((len(e.engine) for e in self.engines), default=6)
        head = (
            f"{'would ' if self.dry_run else ''}apply: {len(self.kept)} kept, {len(self.started)} started, "
        )
        head += f"{len(self.stopped)} stopped, {len(self.replaced)} replaced"
        rows = [head if self.dry_run else f"{head} in {self.seconds:.2f} s"]
        for e in self.engines:
            took = f"  [{e.seconds:.2f} s]" if e.seconds is not None else ""
            why = f"  ({e.reason})" if e.reason else ""
            rows.append(f"  {e.change:<9} {e.engine:<{width}}  {e.before} -> {e.after}{why}{took}")
        rows += [
            f"  {line}" for line in self.diff.lines() if line.startswith(("model ", "placed ", "no free"))
        ]
        return rows


# ------------------------------------------------------------------------------------------------ the change
def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            out.update(_flat(getattr(value, f.name), f"{prefix}{f.name}."))
        return out
    return {prefix.rstrip("."): value}


def check_settings(running: SGLangDeployConf, new: SGLangDeployConf) -> list[Problem]:
    """The deployment-wide settings a running deployment cannot take from a new config (one problem each)."""
    old, now = _flat(running), _flat(new)
    problems = []
    for key in sorted(set(old) | set(now)):
        if key.startswith(CHANGEABLE_SETTINGS) or old.get(key) == now.get(key):
            continue
        shown = "***" if key == "api_key" else f"{old.get(key)!r} -> {now.get(key)!r}"
        problems.append(
            Problem(
                f"sglang_deploy.{key}",
                f"cannot change on a running deployment ({shown}): stop it and start the new one",
            )
        )
    return problems


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

    def engines(self, change: str) -> tuple[str, ...]:
        return tuple(e for e, c in self.changes.items() if c == change)


def kept_ports(running: PreparedDeployment, plan: DeploymentPlan, diff: PlanDiff) -> PortAssignment:
    """The ports of the processes that keep running and of the routers of the models that stay."""
    if running.ports is None:
        raise LaunchError("the running deployment does not know its ports: it cannot be changed in place")
    kept = set(diff.kept)
    engines = {key: ports for key, ports in running.ports.engines.items() if key[0] in kept}
    models = {m.name for m in plan.models if m.has_router}
    routers = {m: ports for m, ports in running.ports.routers.items() if m in models}
    return PortAssignment(engines=engines, routers=routers)


def _same_launch(running: PreparedDeployment, new: PreparedDeployment, engine: str) -> bool:
    old = [(p.node_rank, tuple(p.argv), dict(p.env)) for p in running.launch.for_engine(engine)]
    now = [(p.node_rank, tuple(p.argv), dict(p.env)) for p in new.launch.for_engine(engine)]
    return sorted(old) == sorted(now)


def plan_change(
    running: PreparedDeployment, fresh: DeploymentPlan, render: Any, *, settings: SGLangDeployConf
) -> Change:
    """The stable plan for ``fresh``, rendered by ``render(plan, fixed_ports)`` (the backend's prepare, or a
    dry run's rendering without probing), and each engine's change."""
    problems = check_settings(running.settings, settings)
    if problems:
        raise DeploymentConfigError(problems, source="the new config")
    plan, diff = stabilize(running.plan, fresh)
    prepared = render(plan, kept_ports(running, plan, diff))
    changes = {c.engine: c.change for c in diff.changes}
    reasons = {c.engine: c.reason for c in diff.changes if c.reason}
    for engine in diff.kept:
        if not _same_launch(running, prepared, engine):
            changes[engine] = "replaced"  # the same GPUs, another command line (overrides, server defaults)
            reasons[engine] = "another command line"
    old_external = {e.id: e.url for m in running.plan.models for e in m.external}
    new_external = {e.id: e.url for m in plan.models for e in m.external}
    for engine in old_external:
        if engine not in new_external:
            changes[engine] = "stopped"  # out of the router; it keeps running where it runs
        elif new_external[engine] != old_external[engine]:
            changes[engine] = "replaced"
            reasons[engine] = "another URL"
    for engine in new_external:
        changes.setdefault(engine, "started" if engine not in old_external else "kept")
    return Change(plan, diff, prepared, changes, reasons)


def result_of(change: Change, done_at: Mapping[str, float], started: float, dry_run: bool) -> ApplyResult:
    diff = change.diff
    by_engine = {c.engine: c for c in diff.changes}
    rows = []
    for engine, what in change.changes.items():
        c = by_engine.get(engine)
        before = diff.where(c.old_slots) if c else "-"
        after = diff.where(c.new_slots) if c else "-"
        took = done_at.get(engine)
        seconds = None if took is None else took - started
        rows.append(EngineApply(engine, what, before, after, seconds, change.reasons.get(engine, "")))
    elapsed = (max(done_at.values(), default=started) - started) if not dry_run else 0.0
    return ApplyResult(change.plan, diff, tuple(rows), dry_run, elapsed)


# --------------------------------------------------------------------------------------------- converging
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


@dataclass
class _Converging:
    """One apply under way on the serving loop."""

    change: Change
    fleet: Fleet
    ledger: Ledger
    reconciler: Reconciler
    serving: ServingLoop
    new_rows: dict[str, EngineRow]
    started_at: float
    done_at: dict[str, float] = dataclasses.field(default_factory=dict)
    leaving: set[str] = dataclasses.field(default_factory=set)
    coming: set[str] = dataclasses.field(default_factory=set)
    retired_processes: list[Any] = dataclasses.field(default_factory=list)

    def add(self, engine: str) -> None:
        row = self.new_rows[engine]
        initial = initial_state(row.initial_lora)
        if self.change.changes[engine] == "replaced":
            desired = self.ledger.desired(engine)  # the same engine: what it should have stays
        else:
            desired = desired_for(row, self.fleet, self.ledger, initial)
        self.ledger.add_engine(engine, initial, desired)
        row.state = EngineState.NEW
        row.catch_up = "new"
        row.cleaned_up = row.external
        self.fleet.add_engine(row)
        self.coming.add(engine)

    def settle(self, now: float) -> None:
        """Drop the removed engines that stopped (putting a replacement in their place), note the added ones
        that serve."""
        for engine in sorted(self.leaving):
            if self.fleet.engine(engine).state is EngineState.STOPPED:
                row = self.fleet.drop_engine(engine)
                self.retired_processes += list(row.processes)
                self.leaving.discard(engine)
                self.done_at[engine] = now
                if self.change.changes[engine] == "replaced":
                    self.add(engine)
                else:
                    self.ledger.drop_engine(engine)
        for engine in sorted(self.coming):
            state = self.fleet.engine(engine).state
            if state in (EngineState.SERVING, EngineState.PENDING_WEIGHTS):
                self.coming.discard(engine)
                self.done_at[engine] = now


async def converge(
    change: Change,
    *,
    fleet: Fleet,
    ledger: Ledger,
    reconciler: Reconciler,
    serving: ServingLoop,
    timeout_s: float,
    start_router: Any,
    stop_router: Any,
) -> tuple[dict[str, float], list[Any]]:
    """On the serving loop: bring the fleet to ``change`` (see the module docstring); the time each engine's
    change was done, and the processes of the engines removed. Raises :class:`LaunchError` when it does not
    converge within ``timeout_s``."""
    clock = reconciler.clock
    new_rows = {row.id: row for row in engine_rows(change.prepared)}
    work = _Converging(change, fleet, ledger, reconciler, serving, new_rows, clock())
    for launch in change.prepared.launch.routers:
        if fleet.router(launch.model) is None:
            await start_router(launch)
    for engine, what in change.changes.items():
        if what in ("stopped", "replaced"):
            fleet.update(engine, retired=True)
            work.leaving.add(engine)
        elif what == "started":
            work.add(engine)
    reconciler.poke_here()
    deadline = clock() + timeout_s
    while work.leaving or work.coming:
        work.settle(clock())
        if reconciler.failure is not None or reconciler.phase != "serving":
            raise LaunchError(
                f"the deployment failed or stopped while it changed: {reconciler.failure or 'stopped'}"
            )
        if clock() > deadline:
            left = sorted(work.leaving | work.coming)
            raise LaunchError(
                f"the change did not converge within {timeout_s:g} s (sglang_deploy.launch.startup_timeout_s): "
                + ", ".join(f"{e} {fleet.engine(e).state.value}" for e in left)
            )
        await asyncio.sleep(CONVERGE_POLL_S)
    models = {m.name for m in change.plan.models if m.has_router}
    for router in [r for r in fleet.routers() if r.model not in models]:
        await stop_router(router)
    fleet.order([e.id for e in change.plan.engines] + [e.id for m in change.plan.models for e in m.external])
    return work.done_at, work.retired_processes


def new_router_row(launch: Any, log_dir: Any) -> RouterRow:
    argv, env = router_command(launch.spec)
    process = ManagedProcess(
        name=f"router.{launch.model}",
        argv=argv,
        env=env,
        log_path=log_dir / f"router.{launch.model}.log",
        display_command=" ".join(argv[:3]) + f" <spec of {launch.model}>",
    )
    return RouterRow(model=launch.model, launch=launch, process=process)
