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

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from miles_sglang_plugin.backends.base import LaunchError
from miles_sglang_plugin.backends.processes import ManagedProcess
from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.errors import DeploymentConfigError, Problem
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.stable import PlanDiff, stabilize
from miles_sglang_plugin.rendering.ports import PortAssignment
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.serving.changes import Change, ChangeOutcome, Converging
from miles_sglang_plugin.serving.fleet import RouterRow
from miles_sglang_plugin.serving.routers import router_command

__all__ = [
    "ApplyResult",
    "Change",
    "ChangeOutcome",
    "Converging",
    "EngineApply",
    "check_settings",
    "plan_change",
]

#: Settings a running deployment may take from a new config: what changes its engines' command lines
#: (those engines are replaced) and how long a change may take.
CHANGEABLE_SETTINGS = ("server_defaults", "env", "lora", "standin", "launch.command", "launch.startup_timeout_s",
                       "launch.drain_timeout_s", "launch.live", "launch.log_dir", "launch.port_base",
                       "launch.port_max", "launch.poll_interval_s")  # fmt: skip


@dataclass(frozen=True)
class EngineApply:
    """What an apply did to one engine."""

    engine: str
    #: kept, replaced, started, stopped; given_up (added or replaced, but it could not be started).
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
    #: Models whose router was replaced (they changed between PD and regular serving).
    routers_replaced: tuple[str, ...] = ()

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

    @property
    def given_up(self) -> tuple[str, ...]:
        """Added engines that could not be started (the rest of the change stands; they stay ``failed``)."""
        return self.of("given_up")

    def lines(self) -> list[str]:
        width = max((len(e.engine) for e in self.engines), default=6)
        head = (
            f"{'would ' if self.dry_run else ''}apply: {len(self.kept)} kept, {len(self.started)} started, "
        )
        head += f"{len(self.stopped)} stopped, {len(self.replaced)} replaced"
        if self.given_up:
            head += f", {len(self.given_up)} given up"
        rows = [head if self.dry_run else f"{head} in {self.seconds:.2f} s"]
        for e in self.engines:
            took = f"  [{e.seconds:.2f} s]" if e.seconds is not None else ""
            why = f"  ({e.reason})" if e.reason else ""
            rows.append(f"  {e.change:<9} {e.engine:<{width}}  {e.before} -> {e.after}{why}{took}")
        rows += [
            f"  {line}" for line in self.diff.lines() if line.startswith(("model ", "placed ", "no free"))
        ]
        rows += [
            f"  router of {model} {'would be ' if self.dry_run else ''}replaced (PD <-> regular serving; the "
            "model is unavailable from its old engines' stop until its new engines serve)"
            for model in self.routers_replaced
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


def router_swaps(running: DeploymentPlan, new: DeploymentPlan) -> frozenset[str]:
    """Models that change between PD and regular serving: a router runs in one mode, so theirs is replaced."""
    old = {m.name: m for m in running.models if m.has_router}
    return frozenset(
        model.name
        for model in new.models
        if model.has_router and model.name in old and old[model.name].is_pd != model.is_pd
    )


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
    running: PreparedDeployment,
    fresh: DeploymentPlan,
    render: Any,
    *,
    settings: SGLangDeployConf,
    failed: Collection[str] = (),
) -> Change:
    """The stable plan for ``fresh``, rendered by ``render(plan, fixed_ports)`` (the backend's prepare, or a
    dry run's rendering without probing), and each engine's change. ``failed``: engines given up by an
    earlier change; one the new plan keeps is started again (replaced)."""
    problems = check_settings(running.settings, settings)
    if problems:
        raise DeploymentConfigError(problems, source="the new config")
    swaps = router_swaps(running.plan, fresh)
    plan, diff = stabilize(running.plan, fresh)
    prepared = render(plan, kept_ports(running, plan, diff))
    changes = {c.engine: c.change for c in diff.changes}
    reasons = {c.engine: c.reason for c in diff.changes if c.reason}
    for engine in diff.kept:
        if not _same_launch(running, prepared, engine):
            changes[engine] = "replaced"  # the same GPUs, another command line (overrides, server defaults)
            reasons[engine] = "another command line"
        elif engine in failed:
            changes[engine] = "replaced"
            reasons[engine] = "it was given up: started again"
    _external_changes(running.plan, plan, swaps, changes, reasons)
    return Change(plan, diff, prepared, changes, reasons, swaps)


def _external_changes(
    running: DeploymentPlan,
    plan: DeploymentPlan,
    swaps: frozenset[str],
    changes: dict[str, str],
    reasons: dict[str, str],
) -> None:
    """External engines: out of the router (stopped: they keep running where they run), another URL
    (replaced), new (started); those of a model whose router is replaced are registered with the new one."""
    old_external = {e.id: e.url for m in running.models for e in m.external}
    new_external = {e.id: e.url for m in plan.models for e in m.external}
    for engine in old_external:
        if engine not in new_external:
            changes[engine] = "stopped"
        elif new_external[engine] != old_external[engine]:
            changes[engine] = "replaced"
            reasons[engine] = "another URL"
    for engine in new_external:
        changes.setdefault(engine, "started" if engine not in old_external else "kept")
    for model in plan.models:
        for external in model.external if model.name in swaps else ():
            if changes.get(external.id) == "kept":
                changes[external.id] = "replaced"
                reasons[external.id] = "its router is replaced"


def result_of(
    change: Change,
    done_at: Mapping[str, float],
    started: float,
    dry_run: bool,
    given_up: tuple[str, ...] = (),
) -> ApplyResult:
    diff = change.diff
    by_engine = {c.engine: c for c in diff.changes}
    rows = []
    for engine, what in change.changes.items():
        c = by_engine.get(engine)
        before = diff.where(c.old_slots) if c else "-"
        after = diff.where(c.new_slots) if c else "-"
        took = done_at.get(engine)
        seconds = None if took is None else took - started
        reason = change.reasons.get(engine, "")
        if engine in given_up:
            what, reason = "given_up", "it could not be started within its restart budget; it stays failed"
        rows.append(EngineApply(engine, what, before, after, seconds, reason))
    elapsed = (max(done_at.values(), default=started) - started) if not dry_run else 0.0
    return ApplyResult(
        change.plan, diff, tuple(rows), dry_run, elapsed, routers_replaced=tuple(sorted(change.router_swaps))
    )


# --------------------------------------------------------------------------------------------- converging
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
