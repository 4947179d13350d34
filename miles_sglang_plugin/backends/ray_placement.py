"""Placement of a plan on a Ray cluster, as pure functions (no Ray import): which bundles a placement group
needs, which Ray node plays which plan node, and whether what Ray gave matches the plan.

The plan numbers GPU *slots* (``slot // num_gpus_per_node`` is the plan node, ``slot % num_gpus_per_node`` the
local GPU id). On Ray:

* **Engine actors** (:class:`HostPlan`): one per plan node, which starts and watches every engine process of
  that node (``sglang_deploy.launch.ray.engine_actors=per_node``, the default), or one per engine process
  (``per_process``).
* **A placement group of the backend's own** holds the rollout GPUs alone. Per node: one bundle per plan node
  with all of its rollout GPUs (engine processes and placeholders), held by the node's actor, each on a Ray
  node of its own (``STRICT_SPREAD``, placed at once). Per process: per plan node, in slot order, one bundle
  per engine process (``{"GPU": k}``) and one per run of placeholder GPUs (reserved, no engine), pinned to
  the plan node's Ray node (chosen first) with a label selector. Ray hands a node's GPUs to its bundles in
  bundle order, and a bundle's to its actor in order, so an otherwise free node gives each process exactly
  the plan's local GPU ids: the i-th GPU of a bundle is its i-th local GPU.
* **A placement group the trainer hands over** (Miles and slime: one bundle per GPU, actor and rollout GPUs
  together) is indexed by slot: slot ``s`` is bundle ``bundle_indices[s]`` (Miles' ``reordered_bundle_indices``)
  or bundle ``s``.

Either way the result is checked against the plan before any engine starts: every process of a plan node on
one Ray node, distinct plan nodes on distinct Ray nodes, each process's GPU ids equal to its local GPU ids.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from miles_sglang_plugin.backends.base import LaunchError
from miles_sglang_plugin.planning.plan import DeploymentPlan

#: The label every Ray node carries with its node id (label selectors pin bundles to nodes with it).
NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class ProcessPlacement:
    """One engine process as the plan places it."""

    engine_id: str
    node_rank: int
    #: ``<engine id>`` or ``<engine id>.node<rank>`` (the launch spec's name).
    name: str
    node: int
    gpu_slots: tuple[int, ...]
    local_gpu_ids: tuple[int, ...]

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine_id, self.node_rank)


@dataclass(frozen=True)
class BundlePlan:
    """One bundle of the backend's own placement group: the GPUs of an engine actor (one engine process's, or
    all of a plan node's), or placeholder GPUs."""

    node: int
    #: The plan's local GPU ids it holds, ascending: the i-th GPU Ray gives the bundle is ``local_gpu_ids[i]``.
    local_gpu_ids: tuple[int, ...]
    #: The engine processes of the actor it holds (``(engine id, node rank)``); empty for placeholder GPUs.
    processes: tuple[tuple[str, int], ...] = ()

    @property
    def gpus(self) -> int:
        return len(self.local_gpu_ids)


@dataclass(frozen=True)
class HostPlan:
    """One engine actor: the engine processes it starts and watches, all on plan node ``node``."""

    #: ``node <n>`` (one actor per node) or the process's name (one per process).
    name: str
    node: int
    processes: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class RayNodeInfo:
    """What the backend knows of a Ray node."""

    node_id: str
    address: str

    @property
    def short(self) -> str:
        return f"{self.address} (Ray node {self.node_id[:8]})"


@dataclass(frozen=True)
class ProcessGrant:
    """What Ray gave one engine process: its node and its GPU ids there."""

    node: RayNodeInfo
    gpu_ids: tuple[str, ...]


@dataclass(frozen=True)
class HeldGpus:
    """A live engine actor of a running deployment: its plan node and the local GPUs its bundle holds (none in a
    trainer's group, where it holds a share of one)."""

    host: str
    node: int
    local_gpu_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AddedPlacement:
    """Where the processes a change adds go: onto live actors, or under new ones (see :func:`place_added`)."""

    #: (engine id, node rank) -> the name of the live actor that starts it.
    onto: dict[tuple[str, int], str]
    #: One per new actor: its plan node, the local GPUs of its bundle (own group) and its processes.
    new: tuple[BundlePlan, ...]
    #: Processes that cannot be placed, one line each.
    problems: tuple[str, ...] = ()


class PlacementError(LaunchError):
    """The cluster cannot give what the plan needs (or gave something else); no engine was started."""


def process_placements(plan: DeploymentPlan) -> list[ProcessPlacement]:
    """Every engine process of ``plan``, in deployment order."""
    out = []
    for e in plan.engines:
        for p in e.processes:
            name = e.id if e.nnodes == 1 else f"{e.id}.node{p.node_rank}"
            out.append(ProcessPlacement(e.id, p.node_rank, name, p.node, p.gpu_slots, p.local_gpu_ids))
    return out


def placeholder_slots(plan: DeploymentPlan) -> list[int]:
    """GPU slots the plan reserves without an engine (placeholder groups)."""
    engine_slots = {s for e in plan.engines for s in e.gpu_slots}
    slots = []
    for _model, g in plan.groups():
        start = plan.rollout_offset + g.gpu_offset
        slots += [s for s in range(start, start + g.num_gpus) if s not in engine_slots]
    return sorted(slots)


def own_bundles(plan: DeploymentPlan, *, per_node: bool = True) -> list[BundlePlan]:
    """Bundles of the backend's own placement group, per plan node (ascending). ``per_node``: one bundle per
    plan node holding all of its rollout GPUs and every engine process there. Else, in slot order, one per
    engine process and one per run of consecutive placeholder GPUs."""
    gpn = plan.num_gpus_per_node
    placements = process_placements(plan)
    if per_node:
        slots: dict[int, list[int]] = {}
        processes: dict[int, list[tuple[str, int]]] = {}
        for p in placements:
            slots.setdefault(p.node, []).extend(p.gpu_slots)
            processes.setdefault(p.node, []).append(p.key)
        for placeholder in placeholder_slots(plan):
            slots.setdefault(placeholder // gpn, []).append(placeholder)
        return [
            BundlePlan(node, tuple(sorted(s % gpn for s in slots[node])), tuple(processes.get(node, ())))
            for node in sorted(slots)
        ]
    items: list[tuple[int, int, tuple[tuple[str, int], ...]]] = []  # (first slot, GPUs, processes)
    for p in placements:
        items.append((p.gpu_slots[0], len(p.gpu_slots), (p.key,)))
    run: list[int] = []
    for slot in [*placeholder_slots(plan), None]:
        if run and (slot is None or slot != run[-1] + 1 or slot // gpn != run[0] // gpn):
            items.append((run[0], len(run), ()))
            run = []
        if slot is not None:
            run.append(slot)
    items.sort(key=lambda item: item[0])
    return [
        BundlePlan(first // gpn, tuple(range(first % gpn, first % gpn + gpus)), keys)
        for first, gpus, keys in items
    ]


def engine_hosts(placements: Sequence[ProcessPlacement], *, per_node: bool = True) -> list[HostPlan]:
    """The engine actors of ``placements`` (in deployment order): one per plan node, or one per process."""
    if not per_node:
        return [HostPlan(p.name, p.node, (p.key,)) for p in placements]
    by_node: dict[int, list[tuple[str, int]]] = {}
    for p in placements:
        by_node.setdefault(p.node, []).append(p.key)
    return [HostPlan(f"node {node}", node, tuple(keys)) for node, keys in by_node.items()]


def bundle_gpu_ids(bundle: Sequence[int], given: Sequence[str], wanted: Sequence[int]) -> tuple[str, ...]:
    """The GPU ids Ray gave the local GPUs ``wanted`` of a bundle holding the local GPUs ``bundle``: the i-th
    id Ray gave (ascending) is local GPU ``bundle[i]``. All that Ray gave where it gave another number (so that
    the check against the plan names them)."""
    ordered = sorted(given, key=int) if all(g.isdigit() for g in given) else list(given)
    if len(ordered) != len(bundle):
        return tuple(ordered)
    at = dict(zip(bundle, ordered, strict=True))
    return tuple(at[g] for g in wanted)


def gpus_per_plan_node(bundles: Sequence[BundlePlan]) -> dict[int, int]:
    """Plan node -> GPUs its bundles hold, in ascending node order."""
    need: dict[int, int] = {}
    for b in bundles:
        need[b.node] = need.get(b.node, 0) + b.gpus
    return dict(sorted(need.items()))


def address_order(address: str) -> tuple[int, int, str]:
    """Sort key of node addresses: numerically (10.0.0.9 before 10.0.0.10), names after addresses."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return (2, 0, address)
    return (0 if ip.version == 4 else 1, int(ip), address)


def assign_plan_nodes(plan_nodes: Sequence[int], chosen: Sequence[RayNodeInfo]) -> dict[int, RayNodeInfo]:
    """Plan nodes (ascending) to the Ray nodes chosen for them, in address order: the mapping is the same
    whichever order Ray reported them in."""
    ordered = sorted(chosen, key=lambda n: (address_order(n.address), n.node_id))
    return dict(zip(sorted(plan_nodes), ordered, strict=True))


def spread_order(kinds: Sequence[Hashable], landed: Sequence[RayNodeInfo]) -> list[int]:
    """Which bundle of a ``STRICT_SPREAD`` group each plan node takes, given each bundle's kind (its resources)
    and the Ray node it landed on (bundle ``i`` was asked for plan node ``i``): bundles of one kind are
    interchangeable, so the plan nodes of a kind (ascending) take them in their nodes' address order, the same
    mapping whichever bundle Ray put where."""
    order = list(range(len(kinds)))
    by_kind: dict[Hashable, list[int]] = {}
    for index, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(index)
    for indices in by_kind.values():
        by_address = sorted(indices, key=lambda i: (address_order(landed[i].address), landed[i].node_id))
        for position, bundle in zip(indices, by_address, strict=True):
            order[position] = bundle
    return order


def slot_bundles(
    num_bundles: int, bundle_indices: Sequence[int] | None, slots: Sequence[int]
) -> dict[int, int]:
    """Slot -> bundle index of a trainer's placement group; raises :class:`PlacementError` if the group is too
    small for the plan."""
    order = list(bundle_indices) if bundle_indices is not None else list(range(num_bundles))
    if sorted(set(order)) != sorted(order) or any(not 0 <= i < num_bundles for i in order):
        raise PlacementError(
            f"bundle_indices must be distinct bundle indices of the placement group (0..{num_bundles - 1}), "
            f"got {order[:8]}{'…' if len(order) > 8 else ''}"
        )
    top = max(slots, default=-1)
    if top >= len(order):
        raise PlacementError(
            f"the plan uses GPU slots up to {top} (rollout_offset + gpu_offset + ...), but the placement group "
            f"handed over has {len(order)} bundle(s){' in bundle_indices' if bundle_indices is not None else ''}: "
            "hand over the group that holds the trainer's and the rollout's GPUs, one bundle per GPU"
        )
    return {s: order[s] for s in slots}


def check_grants(
    placements: Sequence[ProcessPlacement], grants: Mapping[tuple[str, int], ProcessGrant]
) -> list[str]:
    """Problems of what Ray gave against the plan (empty when every process got its plan node's Ray node and
    its local GPU ids)."""
    problems: list[str] = []
    node_of_plan: dict[int, RayNodeInfo] = {}
    plan_of_node: dict[str, int] = {}
    for p in placements:
        grant = grants[p.key]
        where = node_of_plan.setdefault(p.node, grant.node)
        if where.node_id != grant.node.node_id:
            problems.append(
                f"{p.name}: the plan puts it on node {p.node} with other engines, which run on {where.short}, "
                f"but Ray placed it on {grant.node.short}"
            )
        other = plan_of_node.setdefault(grant.node.node_id, p.node)
        if other != p.node:
            problems.append(
                f"{p.name}: plan nodes {other} and {p.node} both landed on {grant.node.short}; each plan node "
                "needs a Ray node of its own"
            )
        expected = tuple(str(i) for i in p.local_gpu_ids)
        if tuple(grant.gpu_ids) != expected:
            problems.append(
                f"{p.name}: the plan gives it local GPUs {','.join(expected)} of node {p.node}, but Ray assigned "
                f"GPUs {','.join(grant.gpu_ids) or '(none)'} on {grant.node.short}"
            )
    return problems


def place_added(
    added: Sequence[ProcessPlacement],
    held: Sequence[HeldGpus],
    *,
    per_node: bool,
    in_trainer_group: bool,
) -> AddedPlacement:
    """Where the engine processes a change of a running deployment adds go (:class:`AddedPlacement`).

    ``held``: the live engine actors and the local GPUs their bundles hold. In the backend's own group, a process
    whose GPUs one actor's bundle holds already (an engine removed from them, or never used) is started by that
    actor; one whose GPUs another actor's bundle holds only in part cannot be placed (a problem); the others
    get new actors, each with a bundle of its own: per node, one per plan node for all of that node's processes
    (their GPUs together), per process, one each. In the trainer's group (one GPU per bundle), with one actor per
    node, a plan node that has an actor keeps it for what is added there; everything else gets new actors
    there too."""
    onto: dict[tuple[str, int], str] = {}
    problems: list[str] = []
    fresh: list[ProcessPlacement] = []
    for p in added:
        here = [h for h in held if h.node == p.node]
        if in_trainer_group:
            if per_node and here:
                onto[p.key] = here[0].host
            else:
                fresh.append(p)
            continue
        wanted = set(p.local_gpu_ids)
        covering = [h for h in here if wanted <= set(h.local_gpu_ids)]
        partly = [h for h in here if wanted & set(h.local_gpu_ids)]
        if covering:
            onto[p.key] = covering[0].host
        elif partly:
            shared = ",".join(map(str, sorted(wanted & {g for h in partly for g in h.local_gpu_ids})))
            problems.append(
                f"{p.name}: its local GPUs {','.join(map(str, p.local_gpu_ids))} of node {p.node} are in part "
                f"(GPUs {shared}) held by {', '.join(h.host for h in partly)}, whose bundle cannot be split"
            )
        else:
            fresh.append(p)
    new: list[BundlePlan] = []
    if per_node:
        by_node: dict[int, list[ProcessPlacement]] = {}
        for p in fresh:
            by_node.setdefault(p.node, []).append(p)
        for node, processes in sorted(by_node.items()):
            gpus = tuple(sorted({g for p in processes for g in p.local_gpu_ids}))
            new.append(BundlePlan(node, gpus, tuple(p.key for p in processes)))
    else:
        new = [BundlePlan(p.node, tuple(p.local_gpu_ids), (p.key,)) for p in fresh]
    return AddedPlacement(onto, tuple(new), tuple(problems))


def grant_error(problems: Sequence[str], hint: str) -> PlacementError:
    lines = ["the Ray cluster cannot give the plan's GPUs:", *(f"  - {p}" for p in problems[:12])]
    if len(problems) > 12:
        lines.append(f"  ... and {len(problems) - 12} more")
    lines.append(hint)
    return PlacementError("\n".join(lines))


__all__ = [
    "NODE_ID_LABEL",
    "AddedPlacement",
    "BundlePlan",
    "HeldGpus",
    "HostPlan",
    "PlacementError",
    "ProcessGrant",
    "ProcessPlacement",
    "RayNodeInfo",
    "address_order",
    "assign_plan_nodes",
    "bundle_gpu_ids",
    "check_grants",
    "engine_hosts",
    "gpus_per_plan_node",
    "own_bundles",
    "place_added",
    "placeholder_slots",
    "process_placements",
    "slot_bundles",
    "spread_order",
]
