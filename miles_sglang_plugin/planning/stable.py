"""Placement that stays put: the plan a running deployment converges to when its config changes.

A fresh resolution packs the groups in order (Miles' ``gpu_offset`` cursor), so resizing one group would move
every engine after it. :func:`stabilize` takes the running plan and the freshly resolved one (every rule and
check already applied) and keeps what it can where it is:

* an engine of the same model, group and shape (GPUs per engine, and so nodes) whose index still exists in
  the new group is **kept**: same id, GPU slots, node and rank (so the same processes keep running);
* an engine whose index still exists but whose shape changed, or whose slots no longer lie in the new plan's
  GPUs, is **replaced**: same id, new slots (its old ones are free once it is gone);
* an engine whose index is gone (the group shrank, the group or its model was removed) is **stopped**;
* an engine whose index is new (the group grew, a group or model was added) is **started**.

Replaced and started engines take the lowest free GPU slots among the new plan's (the fresh resolution's
``rollout_offset`` .. ``rollout_offset + total_gpus``): a run of consecutive slots on one node for an engine that
fits on a node, whole nodes for a wider one. Slots of stopped and replaced engines count as free (the
deployment starts what takes them only once the old engine is gone). Placeholder groups keep their block when
they are unchanged, else take the lowest free block. New engines get ranks (their seeds) after every rank in
use. Everything the fresh resolution decided per group (overrides, offload, TP, PP, DP) is kept.

Pure: no I/O, nothing of the running deployment but its plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from miles_sglang_plugin.errors import DeploymentConfigError, Problem
from miles_sglang_plugin.planning.plan import (
    DeploymentPlan,
    EnginePlan,
    EngineProcessPlan,
    GroupPlan,
    ModelPlan,
)

__all__ = ["EngineChange", "PlanDiff", "stabilize"]


@dataclass(frozen=True)
class EngineChange:
    """What :func:`stabilize` does with one engine."""

    engine: str
    #: kept, replaced, stopped, started.
    change: str
    old_slots: tuple[int, ...] = ()
    new_slots: tuple[int, ...] = ()
    #: Why it is replaced (its shape changed, its slots are outside the new plan).
    reason: str = ""


@dataclass(frozen=True)
class PlanDiff:
    """The changes from a running plan to the plan it converges to, and how that plan differs from a fresh
    resolution of the same config (engines placed elsewhere than the fresh packing would put them)."""

    changes: tuple[EngineChange, ...]
    num_gpus_per_node: int
    #: engine id -> its slots in the fresh resolution, for the engines the converged plan places elsewhere.
    unlike_fresh: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: Nothing was free next to the kept engines for what had to be placed: the plan is the fresh resolution's
    #: packing, and only the engines it leaves where they were are kept.
    packed_afresh: bool = False
    models_added: tuple[str, ...] = ()
    models_removed: tuple[str, ...] = ()

    def of(self, change: str) -> tuple[str, ...]:
        return tuple(c.engine for c in self.changes if c.change == change)

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

    def where(self, slots: Sequence[int]) -> str:
        """``node N GPUs a,b`` (or ``-``)."""
        if not slots:
            return "-"
        per_node = self.num_gpus_per_node
        nodes: dict[int, list[int]] = {}
        for slot in slots:
            nodes.setdefault(slot // per_node, []).append(slot % per_node)
        return "; ".join(f"node {n} GPUs {','.join(map(str, gpus))}" for n, gpus in nodes.items())

    def lines(self) -> list[str]:
        """One line per engine (``change  engine  old -> new``), then the models added and removed."""
        width = max((len(c.engine) for c in self.changes), default=6)
        rows = []
        for c in self.changes:
            why = f"  ({c.reason})" if c.reason else ""
            rows.append(
                f"{c.change:<9} {c.engine:<{width}}  {self.where(c.old_slots)} -> {self.where(c.new_slots)}{why}"
            )
        rows += [f"model {m}: added (a router of its own)" for m in self.models_added]
        rows += [f"model {m}: removed (its router stops)" for m in self.models_removed]
        rows += [
            f"placed unlike a fresh resolution: {engine} (fresh: {self.where(slots)})"
            for engine, slots in self.unlike_fresh
        ]
        if self.packed_afresh:
            rows.append(
                "no free GPUs next to the engines that stay for what must be placed: packed as a fresh "
                "resolution packs it (the engines it leaves where they are are kept, the others move)"
            )
        return rows


# ------------------------------------------------------------------------------------------------ placement
class _Slots:
    """The new plan's GPU slots and which are taken."""

    def __init__(self, start: int, count: int, per_node: int) -> None:
        self.start, self.end, self.per_node = start, start + count, per_node
        self.taken: set[int] = set()

    def inside(self, slots: Iterable[int]) -> bool:
        return all(self.start <= s < self.end for s in slots)

    def free(self, slots: Iterable[int]) -> bool:
        return all(self.start <= s < self.end and s not in self.taken for s in slots)

    def take(self, slots: Iterable[int]) -> None:
        self.taken.update(slots)

    def first_fit(self, width: int) -> tuple[int, ...] | None:
        """The lowest run of ``width`` free slots: within one node, or whole nodes for a wider engine."""
        step = self.per_node if width > self.per_node else 1
        first = self.start if step == 1 else -(-self.start // self.per_node) * self.per_node
        for begin in range(first, self.end - width + 1, step):
            run = tuple(range(begin, begin + width))
            if width <= self.per_node and begin // self.per_node != run[-1] // self.per_node:
                continue
            if self.free(run):
                return run
        return None


def _processes(slots: tuple[int, ...], rank: int, per_node: int) -> tuple[EngineProcessPlan, ...]:
    width = min(len(slots), per_node)
    chunks = [slots[i : i + width] for i in range(0, len(slots), width)]
    return tuple(
        EngineProcessPlan(
            node=chunk[0] // per_node,
            node_rank=k,
            gpu_slots=chunk,
            local_gpu_ids=tuple(s % per_node for s in chunk),
            rank=rank + k,
        )
        for k, chunk in enumerate(chunks)
    )


def _old_engines(running: DeploymentPlan) -> dict[str, EnginePlan]:
    return {e.id: e for e in running.engines}


def _old_groups(running: DeploymentPlan) -> dict[tuple[str, str], GroupPlan]:
    return {(m.name, g.name): g for m, g in running.groups()}


@dataclass
class _Placing:
    """The work of one stabilize call."""

    running: DeploymentPlan
    fresh: DeploymentPlan
    slots: _Slots
    changes: list[EngineChange] = dataclasses.field(default_factory=list)
    #: Engines to place once the kept ones hold their slots: (model, group, fresh engine, old engine or None,
    #: why it moves); a placeholder block as (model, group, None, None, "").
    to_place: list[tuple[str, str, EnginePlan | None, EnginePlan | None, str]] = dataclasses.field(
        default_factory=list
    )
    placed: dict[str, EnginePlan] = dataclasses.field(default_factory=dict)
    blocks: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)

    def keep_or_queue(self, model: ModelPlan, group: GroupPlan) -> None:
        """Keep what stays of ``group`` where it is; queue the rest to be placed, in group order."""
        old = _old_engines(self.running)
        for engine in group.engines:
            before = old.get(engine.id)
            reason = ""
            if before is not None and before.num_gpus != engine.num_gpus:
                reason = f"{before.num_gpus} -> {engine.num_gpus} GPUs per engine"
            elif before is not None and not self.slots.inside(before.gpu_slots):
                reason = "its GPUs are outside the new plan's"
            if before is None or reason:
                self.to_place.append((model.name, group.name, engine, before, reason))
                continue
            self.slots.take(before.gpu_slots)
            self.placed[engine.id] = dataclasses.replace(
                engine, gpu_slots=before.gpu_slots, rank=before.rank, processes=before.processes
            )
            self.changes.append(EngineChange(engine.id, "kept", before.gpu_slots, before.gpu_slots))
        if not group.engines and group.num_gpus:
            self._keep_or_queue_block(model, group)

    def _keep_or_queue_block(self, model: ModelPlan, group: GroupPlan) -> None:
        """A placeholder block: kept when unchanged and still free, else placed in its turn."""
        old_group = _old_groups(self.running).get((model.name, group.name))
        if old_group is not None and not old_group.engines and old_group.num_gpus == group.num_gpus:
            start = self.running.rollout_offset + old_group.gpu_offset
            block = tuple(range(start, start + group.num_gpus))
            if self.slots.free(block):
                self.slots.take(block)
                self.blocks[(model.name, group.name)] = block[0]
                return
        self.to_place.append((model.name, group.name, None, None, ""))

    def _contiguous(self, width: int) -> tuple[int, ...] | None:
        for begin in range(self.slots.start, self.slots.end - width + 1):
            run = tuple(range(begin, begin + width))
            if self.slots.free(run):
                return run
        return None

    def _place_block(self, model: str, group: str, width: int, problems: list[Problem]) -> None:
        run = self._contiguous(width)
        if run is None:
            problems.append(
                Problem(
                    f"sglang.{model}.{group}", f"no run of {width} free GPU slots for the placeholder group"
                )
            )
            return
        self.slots.take(run)
        self.blocks[(model, group)] = run[0]

    def place_engines(self, problems: list[Problem]) -> None:
        """Place what was queued, in group order, at the lowest free slots."""
        rank = max((e.rank + e.nnodes for e in self.placed.values()), default=0)
        per_node = self.fresh.num_gpus_per_node
        sizes = {(m.name, g.name): g.num_gpus for m, g in self.fresh.groups()}
        for model, group, engine, before, reason in self.to_place:
            if engine is None:
                self._place_block(model, group, sizes[(model, group)], problems)
                continue
            run = self.slots.first_fit(engine.num_gpus)
            if run is None:
                problems.append(
                    Problem(
                        f"sglang.{model}.{group}",
                        f"engine {engine.id} ({engine.num_gpus} GPUs) finds no room",
                    )
                )
                continue
            self.slots.take(run)
            self.placed[engine.id] = dataclasses.replace(
                engine, gpu_slots=run, rank=rank, processes=_processes(run, rank, per_node)
            )
            rank += len(self.placed[engine.id].processes)
            old_slots = before.gpu_slots if before is not None else ()
            change = "replaced" if before is not None else "started"
            self.changes.append(EngineChange(engine.id, change, old_slots, run, reason))


def _as_fresh(running: DeploymentPlan, fresh: DeploymentPlan) -> _Placing:
    """The fresh resolution's placement: an engine of the same shape at the same slots is kept (its rank too),
    every other one that exists in both plans is replaced, new ones are started."""
    work = _Placing(running, fresh, _Slots(fresh.rollout_offset, fresh.total_gpus, fresh.num_gpus_per_node))
    old = _old_engines(running)
    rank = max((e.rank + e.nnodes for e in running.engines), default=0)
    for model, group in fresh.groups():
        if not group.engines:
            work.blocks[(model.name, group.name)] = fresh.rollout_offset + group.gpu_offset
        for engine in group.engines:
            before = old.get(engine.id)
            if before is not None and before.gpu_slots == engine.gpu_slots:
                work.placed[engine.id] = dataclasses.replace(
                    engine, rank=before.rank, processes=before.processes
                )
                work.changes.append(EngineChange(engine.id, "kept", before.gpu_slots, before.gpu_slots))
                continue
            processes = _processes(engine.gpu_slots, rank, fresh.num_gpus_per_node)
            work.placed[engine.id] = dataclasses.replace(engine, rank=rank, processes=processes)
            rank += len(processes)
            change, reason = ("started", "") if before is None else ("replaced", "packed afresh")
            old_slots = before.gpu_slots if before is not None else ()
            work.changes.append(EngineChange(engine.id, change, old_slots, engine.gpu_slots, reason))
    return work


def _group(
    group: GroupPlan, placed: dict[str, EnginePlan], block: int | None, rollout_offset: int
) -> GroupPlan:
    engines = tuple(placed[e.id] for e in group.engines if e.id in placed)
    slots = [s for e in engines for s in e.gpu_slots]
    offset = (
        (min(slots) - rollout_offset)
        if slots
        else (block - rollout_offset if block is not None else group.gpu_offset)
    )
    return dataclasses.replace(group, engines=engines, gpu_offset=offset)


def stabilize(running: DeploymentPlan, fresh: DeploymentPlan) -> tuple[DeploymentPlan, PlanDiff]:
    """The plan ``running`` converges to for the config that resolved to ``fresh`` (see the module docstring),
    and the diff. When what must be placed finds no room next to the kept engines (fragmented GPUs), the plan
    is the fresh resolution's packing, keeping only the engines it leaves in place (``packed_afresh``)."""
    if running.num_gpus_per_node != fresh.num_gpus_per_node:
        raise DeploymentConfigError(
            [
                Problem(
                    "num_gpus_per_node",
                    f"changes from {running.num_gpus_per_node} to {fresh.num_gpus_per_node}: a running deployment keeps its nodes' size",
                )
            ]
        )
    work = _Placing(running, fresh, _Slots(fresh.rollout_offset, fresh.total_gpus, fresh.num_gpus_per_node))
    for model, group in fresh.groups():
        work.keep_or_queue(model, group)
    problems: list[Problem] = []
    work.place_engines(problems)
    packed = False
    if problems:  # no room next to the kept engines: as a fresh resolution packs it, moving what must move
        work, packed = _as_fresh(running, fresh), True
    fresh_ids = {e.id for e in fresh.engines}
    stopped = [
        EngineChange(e.id, "stopped", e.gpu_slots, ()) for e in running.engines if e.id not in fresh_ids
    ]
    models = tuple(
        dataclasses.replace(
            m,
            groups=tuple(
                _group(g, work.placed, work.blocks.get((m.name, g.name)), fresh.rollout_offset)
                for g in m.groups
            ),
        )
        for m in fresh.models
    )
    plan = dataclasses.replace(fresh, models=models)
    order = {e.id: i for i, e in enumerate(plan.engines)}
    changes = sorted(work.changes, key=lambda c: order[c.engine]) + stopped
    fresh_slots = {e.id: e.gpu_slots for e in fresh.engines}
    unlike = tuple((e.id, fresh_slots[e.id]) for e in plan.engines if e.gpu_slots != fresh_slots[e.id])
    old_models = {m.name for m in running.models if m.has_router}
    new_models = {m.name for m in plan.models if m.has_router}
    diff = PlanDiff(
        tuple(changes),
        fresh.num_gpus_per_node,
        unlike,
        packed,
        tuple(m.name for m in plan.models if m.name in new_models - old_models),
        tuple(m.name for m in running.models if m.name in old_models - new_models),
    )
    return plan, diff
