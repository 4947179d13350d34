"""The ray backend: every engine process under a small Ray actor on its node of a running Ray cluster.

``sglang_deploy.launch.backend=ray``. What :meth:`RayBackend.prepare` does, before any engine starts:

1. **Connect**: the cluster this process is already connected to (``ray.is_initialized()``), else
   ``sglang_deploy.launch.ray.address`` / ``$RAY_ADDRESS`` / the cluster started on this machine. A cluster that
   is not there is an error (its address is probed first, so a stale address never hangs); only
   ``sglang_deploy.launch.ray.start_local_cluster=true`` starts one.
2. **Place** (:mod:`.ray_placement`): in the placement group the trainer handed over (one GPU per bundle,
   indexed by GPU slot), or in one of the backend's own for the rollout GPUs alone (one bundle per engine
   process and per run of placeholder GPUs, each plan node's bundles pinned to one Ray node, Ray's scheduler
   choosing the nodes; or one bundle per plan node). One :class:`~.ray_actor.EngineHost` actor per plan node
   (``sglang_deploy.launch.ray.engine_actors=per_node``, the default; ``per_process``: one per engine process)
   holds the GPUs of its processes and starts and watches them; what Ray gave (node, GPU ids) is checked
   against the plan, with one message for every mismatch.
3. **Address and ports**: each plan node's address is its Ray node's IP (``--host``, worker URLs,
   ``--dist-init-addr``); each engine process's ports are found free and claimed on its node by its own
   actor; routers run on this (the driver's) node, with ports found and claimed here.

A running deployment can change (``Deployment.apply``): :meth:`RayBackend.prepare` with ``fixed_ports`` keeps
what runs and places what is added, :meth:`RayBackend.release` gives back what only removed engines held
(actors, placement groups, port claims) once they have stopped.

:meth:`RayBackend.start` runs the engine command through its actor (returns at once), with
``CUDA_VISIBLE_DEVICES`` from Ray's assignment. A dead actor or a lost node is an exited process (every process
of that actor) with its reason; an actor that died on a node that lives is made again in its bundle at the next
start of one of its processes. :meth:`RayBackend.close` kills every actor (their engine processes die with
them: parent-death signal), waits until Ray reports them dead and removes the backend's placement group.
Actors are owned by this process (not detached): if it dies, Ray kills them too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_sglang_plugin.addresses import strip_brackets
from miles_sglang_plugin.backends.base import Backend, EngineProcess, LaunchError, UnsupportedPlanError
from miles_sglang_plugin.backends.processes import SHOWN_ENV_NAMES, ExitWatcher, log_tail
from miles_sglang_plugin.backends.ray_actor import EngineHost, gpu_probe
from miles_sglang_plugin.backends.ray_placement import (
    NODE_ID_LABEL,
    BundlePlan,
    HeldGpus,
    HostPlan,
    PlacementError,
    ProcessGrant,
    ProcessPlacement,
    RayNodeInfo,
    assign_plan_nodes,
    bundle_gpu_ids,
    check_grants,
    engine_hosts,
    gpus_per_plan_node,
    grant_error,
    own_bundles,
    place_added,
    placeholder_slots,
    process_placements,
    slot_bundles,
    spread_order,
)
from miles_sglang_plugin.config.schema import EngineActors, RayConf, SGLangDeployConf
from miles_sglang_plugin.engine_env import NODE_ID_ENV
from miles_sglang_plugin.errors import DeploymentConfigError, Problem, ProblemCollector, first_line
from miles_sglang_plugin.masking import mask_text, secret_values
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.rendering.deploy_checks import Bounds, bounds_problems, duration_bounds
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch, check_deploy_settings
from miles_sglang_plugin.rendering.ports import (
    EnginePorts,
    NodePortFinder,
    PortAssignment,
    PortClaims,
    default_lock_dir,
    ports_held,
)
from miles_sglang_plugin.rendering.prepared import PreparedDeployment, prepare_deployment

#: What a user installs to get this backend.
RAY_EXTRA = "pip install 'miles_sglang_plugin[ray]'"
#: Exit code reported for an engine process whose actor died (its node was lost): it was killed with it.
EXIT_LOST = -9
#: GPU share of the probe task that asks Ray which GPU a bundle of a trainer's placement group holds.
PROBE_GPU_SHARE = 0.01
#: Upper bound on how long a teardown waits for Ray to report the actors dead.
ACTOR_DEATH_WAIT_S = 20.0

log = logging.getLogger(__name__)


def import_ray() -> Any:
    """The ``ray`` module, or a config error naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise DeploymentConfigError(
            [Problem("sglang_deploy.launch.backend", f"'ray' needs Ray, which is not installed: {RAY_EXTRA}")]
        ) from None
    return ray


#: The numeric settings of ``sglang_deploy.launch.ray`` and their bounds.
_RAY_BOUNDS = {
    "placement_timeout_s": duration_bounds(positive=True),
    "engine_num_cpus": Bounds(0),
    "bundle_gpu_share": Bounds(0, inclusive=False, maximum=1),
}


def ray_conf_problems(conf: RayConf) -> list[Problem]:
    """Problems with ``sglang_deploy.launch.ray`` (values, not only keys)."""
    key = "sglang_deploy.launch.ray"
    out = []
    for name, bounds in _RAY_BOUNDS.items():
        out += bounds_problems(f"{key}.{name}", getattr(conf, name), bounds)
    if conf.address is not None and not str(conf.address).strip():
        out.append(
            Problem(f"{key}.address", "must be null (find the cluster) or an address like 10.0.0.1:6379")
        )
    return out


def _gcs_reachable(address: str, timeout_s: float = 3.0) -> bool:
    """Does something accept TCP connections at ``host:port``?"""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((strip_brackets(host), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _resolve_address(ray: Any, conf: RayConf) -> str | None:
    """The cluster address ``ray.init`` would use (configured, ``$RAY_ADDRESS``, or this machine's latest
    cluster), or None when there is none."""
    wanted = conf.address or os.environ.get("RAY_ADDRESS") or "auto"
    if wanted != "auto":
        return wanted
    try:
        from ray._private.services import canonicalize_bootstrap_address

        address: str | None = canonicalize_bootstrap_address("auto")
        return address
    except (ConnectionError, ImportError, AttributeError):
        return None


def connect(ray: Any, conf: RayConf) -> bool:
    """Connect to the Ray cluster (see the module docstring). True if this call connected."""
    if ray.is_initialized():
        return False
    address = _resolve_address(ray, conf)
    plain = address is not None and "://" not in address
    if address is not None and (not plain or _gcs_reachable(address)):
        ray.init(address=address, logging_level=logging.WARNING)
        return True
    if conf.start_local_cluster:
        ray.init(address="local", logging_level=logging.WARNING)  # a new one, whatever RAY_ADDRESS says
        return True
    where = f"at {address}" if address else "(no address configured, no RAY_ADDRESS, none started here)"
    raise LaunchError(
        f"no Ray cluster found {where}. Start one (ray start --head on the first node, ray start "
        "--address=<head>:6379 on the others), point sglang_deploy.launch.ray.address or RAY_ADDRESS at it, or "
        "set sglang_deploy.launch.ray.start_local_cluster=true to start a one-machine cluster"
    )


@dataclass
class _Host:
    """One engine actor of the backend: its plan, its handle, and where it was made (to make it again)."""

    plan: HostPlan
    actor: Any
    #: Placement group, bundle index, GPUs and CPUs it reserves there.
    group: Any
    bundle: int
    num_gpus: float
    num_cpus: float
    #: The plan's local GPU ids of its bundle in the backend's own group (empty in the trainer's group).
    bundle_gpus: tuple[int, ...] = ()


def _engine_ports_by_address(prepared: PreparedDeployment) -> dict[str, set[int]]:
    """Node address -> every port the engine processes of ``prepared`` hold there (whole runs)."""
    ports = prepared.ports or PortAssignment(engines={}, routers={})
    by_host: dict[str, dict[tuple[str, int], EnginePorts]] = {}
    for launch in prepared.launch.engines:
        key = (launch.engine_id, launch.node_rank)
        if key in ports.engines:
            by_host.setdefault(launch.host, {})[key] = ports.engines[key]
    return {host: ports_held(PortAssignment(engines, {}), prepared.plan) for host, engines in by_host.items()}


class RayEngineProcess(EngineProcess):
    """An engine process started by its :class:`~.ray_actor.EngineHost` actor on a Ray node."""

    def __init__(
        self,
        launch: EngineProcessLaunch,
        *,
        ray: Any,
        actor: Any,
        node: RayNodeInfo,
        log_path: Path,
        spawn_ref: Any,
        run: int,
    ) -> None:
        super().__init__(launch)
        self._ray, self.actor, self.node, self.log_path = ray, actor, node, log_path
        self._spawn_ref, self._run = spawn_ref, run
        self._exit_ref = actor.wait_exit.remote(launch.name, run)
        self._result: tuple[int, str | None] | None = None
        #: True once Ray reported its actor dead (a lost node): the process cannot be started on it again.
        self.actor_lost = False
        self._pid: int | None = None
        self._last_tail = ""

    @property
    def argv(self) -> Sequence[str]:
        return self.launch.argv

    @property
    def exit_ref(self) -> Any:
        """The Ray reference that is ready once the process exits (or its actor dies)."""
        return self._exit_ref

    @property
    def pid(self) -> int | None:
        """The engine's pid on its node (None before it started or if it could not be started)."""
        if self._pid is None:
            with contextlib.suppress(Exception):
                self._pid = self._ray.get(self._spawn_ref, timeout=10)["pid"]
        return self._pid

    def exit_code(self) -> int | None:
        if self._result is None:
            ready, _ = self._ray.wait([self._exit_ref], timeout=0)
            if not ready:
                return None
            exceptions = self._ray.exceptions
            try:
                result = self._ray.get(ready[0])
                self._result = (result["code"] if result["code"] is not None else 0, result["reason"])
            except getattr(exceptions, "ActorUnavailableError", ()):
                # Unreachable, not (yet) known dead: ask again; Ray says which once its health checks decide.
                self._exit_ref = self.actor.wait_exit.remote(self.launch.name, self._run)
                return None
            except exceptions.RayError as exc:
                self.actor_lost = True
                self._result = (EXIT_LOST, self._lost_reason(exc))
        return self._result[0]

    def exit_reason(self) -> str | None:
        return self._result[1] if self._result is not None else None

    def _lost_reason(self, exc: BaseException) -> str:
        text = str(exc)
        if "node has died" in text or "node was" in text.lower():
            return f"its node {self.node.short} left the Ray cluster; the engine process died with its actor"
        return f"its Ray actor on {self.node.short} died ({first_line(exc)}); the engine process died with it"

    def tail(self, lines: int = 20) -> str:
        try:
            self._last_tail = self._ray.get(self.actor.tail.remote(self.launch.name, lines), timeout=10)
            return self._last_tail
        except Exception:  # the node is gone or does not answer: what we can still read
            local = log_tail(self.log_path, lines) if self.log_path.exists() else ""
            local = mask_text(local, secret_values(self.launch.argv, self.launch.env, shown=SHOWN_ENV_NAMES))
            note = f"(the log on {self.node.address} cannot be fetched: its actor is gone"
            if local:
                return f"{note}; read from this machine's copy of {self.log_path})\n{local}"
            return (
                f"{note}; last lines fetched earlier:)\n{self._last_tail}" if self._last_tail else note + ")"
            )

    @property
    def where(self) -> str:
        pid = self.pid
        return f"{'pid ' + str(pid) if pid else 'no process'} on node {self.node.short}"

    @property
    def log_location(self) -> str:
        return f"{self.log_path} on node {self.node.address}"


class _RayExits:
    """One thread that waits on every engine process's exit reference at once (``ray.wait``): Ray tells when
    an actor's process exits or the actor dies; nothing is asked per process."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray
        self._watched: dict[RayEngineProcess, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(self, process: RayEngineProcess, on_exit: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                return
            self._watched[process] = on_exit
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="msp-ray-exits", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                watched = dict(self._watched)
            if not watched:
                time.sleep(0.1)
                continue
            refs = {process.exit_ref: process for process in watched}
            try:
                ready, _ = self._ray.wait(list(refs), num_returns=1, timeout=0.5)
            except Exception:  # disconnected: the job ends, and its actors with it
                time.sleep(0.5)
                continue
            for ref in ready:
                process = refs[ref]
                if process.exit_code() is None:
                    continue  # unreachable, not known dead: its reference was renewed, watched again
                with self._lock:
                    on_exit = self._watched.pop(process, None)
                if on_exit is not None:
                    with contextlib.suppress(Exception):
                        on_exit()

    def close(self) -> None:
        self._closed = True


class RayBackend(Backend):
    """Engines under Ray actors on the nodes of a Ray cluster (see the module docstring).

    ``placement_group``: a placement group of the trainer's to place the engines in, one GPU per bundle, GPU
    slot ``s`` in bundle ``bundle_indices[s]`` (Miles' ``reordered_bundle_indices``) or bundle ``s``. Without
    it the backend creates one for the rollout GPUs alone and removes it at :meth:`close`."""

    name = "ray"

    def __init__(self, *, placement_group: Any = None, bundle_indices: Sequence[int] | None = None) -> None:
        self.ray = import_ray()
        self.placement_group = placement_group
        self.bundle_indices = list(bundle_indices) if bundle_indices is not None else None
        self.claims: PortClaims | None = None
        self.conf = RayConf()
        self._settings: SGLangDeployConf | None = None
        self._connected_here = False
        self._own_groups: list[Any] = []
        #: The engine actors by name, and which one starts each engine process.
        self._hosts: dict[str, _Host] = {}
        self._host_of: dict[tuple[str, int], str] = {}
        self._grants: dict[tuple[str, int], ProcessGrant] = {}
        self._placements: list[ProcessPlacement] = []
        self._runs: dict[tuple[str, int], int] = {}
        self._latest: dict[tuple[str, int], RayEngineProcess] = {}
        self._actor_class: Any = None
        self._exits = _RayExits(self.ray)
        self._closed = False
        self._server_arg_fields: Collection[str] | None = None
        #: The trainer's group: the bundle of each GPU slot (to ask again which GPU a slot holds).
        self._bundle_of: dict[int, int] = {}
        #: Own group of pinned bundles (one actor per engine process): a lost node's bundles cannot move.
        self._pinned_groups: list[Any] = []
        self._placing = threading.Lock()
        #: Changes prepared so far (names the actors each one made), the plan's placeholder GPU slots and the
        #: placement groups that hold them (never removed before close).
        self._changes = 0
        self._placeholders: frozenset[int] = frozenset()
        self._placeholder_groups: list[Any] = []

    @property
    def placement_groups(self) -> tuple[Any, ...]:
        """The placement groups this backend created and holds (removed at :meth:`close`)."""
        return tuple(self._own_groups)

    @property
    def actors(self) -> tuple[Any, ...]:
        """The engine actors (one per plan node, or one per engine process), in deployment order."""
        return tuple(host.actor for host in self._hosts.values())

    @property
    def _per_node(self) -> bool:
        return self.conf.engine_actors is EngineActors.per_node

    # ------------------------------------------------------------------------------------------ prepare
    def prepare(
        self,
        plan: DeploymentPlan,
        settings: SGLangDeployConf,
        *,
        server_arg_fields: Collection[str] | None = None,
        fixed_ports: PortAssignment | None = None,
    ) -> PreparedDeployment:
        if fixed_ports is not None:
            return self._prepare_change(plan, settings, server_arg_fields, fixed_ports)
        problems = ProblemCollector("sglang_deploy")
        problems.extend(check_deploy_settings(settings, server_arg_fields))
        problems.extend(ray_conf_problems(settings.launch.ray))
        problems.raise_if_any()
        self.conf, self._settings = settings.launch.ray, settings
        self._connected_here = connect(self.ray, self.conf) or self._connected_here
        self._placements = process_placements(plan)
        if self.placement_group is not None:
            self._place_in_trainer_group(plan)
        else:
            self._place_in_own_group(plan)
        problems_found = check_grants(self._placements, self._grants)
        if problems_found:
            raise grant_error(problems_found, self._mismatch_hint())
        self.claims = self.claims or PortClaims(default_lock_dir())
        self._server_arg_fields = server_arg_fields
        self._placeholders = frozenset(placeholder_slots(plan))
        self._placeholder_groups = list(self._own_groups) if self._placeholders else []
        return self._render(plan, settings, fixed=None)

    def _render(
        self, plan: DeploymentPlan, settings: SGLangDeployConf, fixed: PortAssignment | None
    ) -> PreparedDeployment:
        """The launch specs of ``plan`` on the nodes its processes were granted: each process's ports found and
        claimed on its node by its own actor (the claims end with the actor that runs the process), the ports
        of ``fixed`` processes kept and never handed out."""
        address = {p.node: self._grants[p.key].node.address for p in self._placements}
        finder = self._process_port_finder(plan, fixed)
        return prepare_deployment(
            plan,
            settings,
            server_arg_fields=self._server_arg_fields,
            probe=True,
            claims=self.claims,
            host_of_node=lambda node: address[node],
            router_host=self.ray.util.get_node_ip_address(),
            find_node_ports=finder,
            fixed_ports=fixed,
        )

    # ------------------------------------------------------------------------ changing a running deployment
    def _prepare_change(
        self,
        plan: DeploymentPlan,
        settings: SGLangDeployConf,
        server_arg_fields: Collection[str] | None,
        fixed: PortAssignment,
    ) -> PreparedDeployment:
        """``plan`` for the running deployment (``Deployment.apply``): the processes of ``fixed`` keep their
        actors, nodes, GPUs and ports; the others are placed (:func:`place_added`: onto a live actor whose
        bundle holds their GPUs, else under new actors, each in a placement group of its own pinned to its plan
        node's Ray node, or in the trainer's group), their ports found on their nodes. Nothing changes where it
        fails: what it made is removed again, and the deployment runs on as it was."""
        if self._closed or self._settings is None:
            raise LaunchError("this ray backend runs no deployment to change (not prepared, or closed)")
        problems = ProblemCollector("sglang_deploy")
        problems.extend(check_deploy_settings(settings, server_arg_fields))
        problems.extend(ray_conf_problems(settings.launch.ray))
        problems.raise_if_any()
        if settings.launch.ray.engine_actors is not self.conf.engine_actors:
            raise UnsupportedPlanError(
                "sglang_deploy.launch.ray.engine_actors cannot change while the deployment runs: stop it and "
                "start the new one"
            )
        placements = process_placements(plan)
        self._check_kept(plan, placements, fixed)
        added = [p for p in placements if p.key not in fixed.engines]
        with self._placing:
            saved = self._snapshot()
            self._changes += 1
            try:
                self._place_added(plan, placements, added)
                found = check_grants(placements, self._grants)
                if found:
                    raise grant_error(found, self._mismatch_hint())
                self._server_arg_fields = server_arg_fields
                prepared = self._render(plan, settings, fixed)
            except BaseException:
                self._undo(saved)
                raise
        self._settings, self.conf = settings, settings.launch.ray
        return prepared

    def _check_kept(
        self, plan: DeploymentPlan, placements: Sequence[ProcessPlacement], fixed: PortAssignment
    ) -> None:
        """The processes ``fixed`` keeps must be running ones, where they run; the placeholder GPUs unchanged."""
        running = {p.key: p for p in self._placements}
        moved = [
            p.name
            for p in placements
            if p.key in fixed.engines
            and (
                p.key not in running
                or (running[p.key].node, running[p.key].gpu_slots) != (p.node, p.gpu_slots)
            )
        ]
        if moved:
            raise UnsupportedPlanError(
                f"{', '.join(moved[:4])}: kept by the change, but not where they run (or not running at all)"
            )
        if frozenset(placeholder_slots(plan)) != self._placeholders:
            raise UnsupportedPlanError(
                "the ray backend cannot move or resize placeholder GPUs of a running deployment (their bundles "
                "stay where they were placed): stop it and start the new one"
            )

    def _snapshot(self) -> dict[str, Any]:
        return {
            "hosts": dict(self._hosts),
            "plans": {name: host.plan for name, host in self._hosts.items()},
            "host_of": dict(self._host_of),
            "grants": dict(self._grants),
            "placements": list(self._placements),
            "bundle_of": dict(self._bundle_of),
            "groups": list(self._own_groups),
        }

    def _undo(self, saved: Mapping[str, Any]) -> None:
        """Back to ``saved`` (a failed change): the actors and placement groups made since are removed."""
        new_actors = [h.actor for name, h in self._hosts.items() if name not in saved["hosts"]]
        for actor in new_actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        self._wait_dead(new_actors)
        self._remove_groups([g for g in self._own_groups if not any(g is k for k in saved["groups"])])
        self._hosts = dict(saved["hosts"])
        for name, host in self._hosts.items():
            host.plan = saved["plans"][name]
        self._host_of, self._grants = dict(saved["host_of"]), dict(saved["grants"])
        self._placements, self._bundle_of = list(saved["placements"]), dict(saved["bundle_of"])

    def _remove_groups(self, groups: Sequence[Any]) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
            self._own_groups = [g for g in self._own_groups if g is not group]
            self._pinned_groups = [g for g in self._pinned_groups if g is not group]

    def _place_added(
        self, plan: DeploymentPlan, placements: Sequence[ProcessPlacement], added: Sequence[ProcessPlacement]
    ) -> None:
        """Actors and grants for the ``added`` processes; every host then runs the processes of ``placements``
        it was given (the processes of removed engines are no host's any more, though they run until stopped)."""
        in_trainer = self.placement_group is not None
        node_of_plan = {p.node: self._grants[p.key].node for p in self._placements}
        held = [
            HeldGpus(name, host.plan.node, host.bundle_gpus)
            for name, host in self._hosts.items()
            if host.plan.node in node_of_plan
        ]
        where = place_added(added, held, per_node=self._per_node, in_trainer_group=in_trainer)
        if where.problems:
            raise grant_error(list(where.problems), "A change can place new engines on GPUs no engine holds, or on "
                              "all GPUs of one that it removes.")  # fmt: skip
        by_key = {p.key: p for p in placements}
        if in_trainer:  # the bundles of the added slots (and a plan that outgrew the group is refused here)
            specs = list(self.placement_group.bundle_specs)
            slots = sorted({s for p in [*self._placements, *placements] for s in p.gpu_slots})
            self._bundle_of = slot_bundles(len(specs), self.bundle_indices, slots)
            wide = sorted({self._bundle_of[s] for s in slots if specs[self._bundle_of[s]].get("GPU") != 1})
            if wide:
                raise PlacementError(
                    f"bundles {wide[:4]} of the placement group handed over do not hold one GPU each (Miles' "
                    "and slime's layout)"
                )
        new_names = self._new_hosts(plan, where.new, by_key, node_of_plan)
        assigned = {**where.onto, **new_names}
        # Every host runs what the plan gives it: kept processes stay, added ones join.
        for key, name in assigned.items():
            self._host_of[key] = name
        keys_of: dict[str, list[tuple[str, int]]] = {name: [] for name in self._hosts}
        for p in placements:
            if p.key in self._host_of:
                keys_of[self._host_of[p.key]].append(p.key)
        for name, host in self._hosts.items():
            host.plan = dataclasses.replace(host.plan, processes=tuple(keys_of[name]))
        self._placements = list(placements)
        if in_trainer:
            self._grant_in_trainer_group([by_key[key] for key in assigned])
        else:
            wheres = self._wheres_of(sorted(set(assigned.values())))
            for key, name in assigned.items():
                w, host = wheres[name], self._hosts[name]
                gpus = bundle_gpu_ids(host.bundle_gpus, w["gpu_ids"], by_key[key].local_gpu_ids)
                self._grants[key] = ProcessGrant(RayNodeInfo(w["node_id"], w["address"]), gpus)

    def _new_hosts(
        self,
        plan: DeploymentPlan,
        bundles: Sequence[BundlePlan],
        by_key: Mapping[tuple[str, int], ProcessPlacement],
        node_of_plan: Mapping[int, RayNodeInfo],
    ) -> dict[tuple[str, int], str]:
        """New actors for ``bundles`` (each a new actor's processes); the name of each process's actor."""
        if not bundles:
            return {}
        cpus = self.conf.engine_num_cpus
        names = [
            f"{f'node {b.node}' if self._per_node else by_key[b.processes[0]].name} (change {self._changes})"
            for b in bundles
        ]
        if self.placement_group is not None:
            for name, b in zip(names, bundles, strict=True):
                first = by_key[b.processes[0]].gpu_slots[0]
                host = HostPlan(name, b.node, b.processes)
                self._create_host(
                    host, self.placement_group, self._bundle_of[first], self.conf.bundle_gpu_share,
                    cpus * len(b.processes),
                )  # fmt: skip
        else:
            from ray.util.placement_group import placement_group

            nodes = dict(node_of_plan)
            nodes.update(
                self._choose_new_nodes(bundles, set(node_of_plan), {n.node_id for n in nodes.values()})
            )
            groups = []
            for name, b in zip(names, bundles, strict=True):
                spec = {"GPU": float(b.gpus), **({"CPU": cpus * len(b.processes)} if cpus else {})}
                group = placement_group(
                    [spec], strategy="PACK", bundle_label_selector=[{NODE_ID_LABEL: nodes[b.node].node_id}]
                )
                self._own_groups.append(group)
                self._pinned_groups.append(group)  # pinned: made anew elsewhere when its node is lost
                groups.append(group)
                self._create_host(
                    HostPlan(name, b.node, b.processes), group, 0, spec["GPU"], spec.get("CPU", 0.0),
                    b.local_gpu_ids,
                )  # fmt: skip
            self._wait([g.ready() for g in groups], f"placing {len(groups)} new engine actor(s)")
        return {key: name for name, b in zip(names, bundles, strict=True) for key in b.processes}

    def _choose_new_nodes(
        self, bundles: Sequence[BundlePlan], placed: set[int], used: set[str]
    ) -> dict[int, RayNodeInfo]:
        """Ray nodes for the plan nodes of ``bundles`` that have none yet (not one of ``used``): Ray's
        scheduler picks them (a ``STRICT_SPREAD`` group, removed at once), in address order."""
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        need = {n: g for n, g in gpus_per_plan_node(bundles).items() if n not in placed}
        if not need:
            return {}
        cpus = self.conf.engine_num_cpus
        specs = [
            {"GPU": float(gpus), **({"CPU": cpus * sum(len(b.processes) for b in bundles if b.node == n)}
                                    if cpus else {})}
            for n, gpus in need.items()
        ]  # fmt: skip
        selector = [{NODE_ID_LABEL: f"!in({','.join(sorted(used))})"}] * len(specs) if used else None
        chooser = placement_group(specs, strategy="STRICT_SPREAD", bundle_label_selector=selector)
        try:
            self._wait_group(
                chooser, f"{len(need)} more node(s) with {', '.join(map(str, need.values()))} free GPU(s)"
            )
            chosen = placement_group_table(chooser)["bundles_to_node_id"]
        finally:
            remove_placement_group(chooser)
        info = self._node_info()
        return assign_plan_nodes(list(need), [info[chosen[i]] for i in range(len(need))])

    def _grant_in_trainer_group(self, added: Sequence[ProcessPlacement]) -> None:
        """The grants of ``added`` processes in the trainer's group: which GPU each slot's bundle holds (asked of
        Ray), on the node of the actor that starts them."""
        pg = self.placement_group
        slots = sorted({s for p in added for s in p.gpu_slots})
        probe = self.ray.remote(gpu_probe)
        refs = [
            probe.options(**self._in_bundle(pg, self._bundle_of[s], PROBE_GPU_SHARE)).remote() for s in slots
        ]
        probed = dict(zip(slots, self._wait(refs, "asking Ray which GPU each bundle holds"), strict=True))
        wheres = self._wheres_of(sorted({self._host_of[p.key] for p in added}))
        for p in added:
            actor_node = wheres[self._host_of[p.key]]
            nodes = {probed[s]["node_id"] for s in p.gpu_slots}
            if nodes != {actor_node["node_id"]}:
                raise PlacementError(
                    f"{p.name}: its GPU slots {list(p.gpu_slots)} are bundles on other nodes than its actor's "
                    f"({actor_node['address']}) and each other"
                )
            node = RayNodeInfo(actor_node["node_id"], actor_node["address"])
            self._grants[p.key] = ProcessGrant(node, tuple(probed[s]["gpu_ids"][0] for s in p.gpu_slots))

    def _process_port_finder(self, plan: DeploymentPlan, fixed: PortAssignment | None) -> NodePortFinder:
        """Finds each process's ports through its own actor, the ports of ``fixed`` processes of its node kept
        out of the search."""
        fixed = fixed or PortAssignment(engines={}, routers={})
        node_of = {p.key: p.node for p in self._placements}
        # The order in which prepare_deployment asks for the processes of a node (assign_ports): the plan's.
        order: dict[int, list[tuple[str, int]]] = {}
        kept_on: dict[int, dict[tuple[str, int], EnginePorts]] = {}
        for key in [(e.id, p.node_rank) for e in plan.engines for p in e.processes]:
            if key in fixed.engines:
                kept_on.setdefault(node_of[key], {})[key] = fixed.engines[key]
            else:
                order.setdefault(node_of[key], []).append(key)

        def find(requests: Mapping[int, Sequence[Sequence[int]]]) -> dict[int, list[list[int]]]:
            calls: list[tuple[int, list[int], Any]] = []  # (plan node, positions, reference)
            for node, runs in requests.items():
                keys = order.get(node, [])
                if len(keys) != len(runs):  # not the order expected: the node's first actor finds them all
                    keys = [keys[0] if keys else self._placements[0].key] * len(runs)
                reserved = sorted(ports_held(PortAssignment(kept_on.get(node, {}), {}), plan))
                calls += [(node, positions, ref) for positions, ref in self._ask_ports(keys, runs, reserved)]
            values = self._wait([ref for _n, _p, ref in calls], "finding free ports on the nodes")
            found: dict[int, list[list[int]]] = {node: [[] for _ in runs] for node, runs in requests.items()}
            for (node, positions, _ref), starts in zip(calls, values, strict=True):
                for position, first_ports in zip(positions, starts, strict=True):
                    found[node][position] = first_ports
            return found

        return find

    def _ask_ports(
        self, keys: Sequence[tuple[str, int]], runs: Sequence[Sequence[int]], reserved: Sequence[int]
    ) -> list[tuple[list[int], Any]]:
        """One ``find_ports`` call per actor of ``keys`` (the processes of one node, each with its ``runs``):
        the positions each call answers for, and its reference."""
        assert self._settings is not None
        launch = self._settings.launch
        by_host: dict[str, list[int]] = {}
        for position, key in enumerate(keys):
            by_host.setdefault(self._host_of[key], []).append(position)
        return [
            (
                positions,
                self._hosts[name].actor.find_ports.remote(
                    self._grants[keys[positions[0]]].node.address,
                    [runs[i] for i in positions],
                    launch.port_base,
                    launch.port_max,
                    reserved,
                ),
            )
            for name, positions in by_host.items()
        ]

    def _mismatch_hint(self) -> str:
        if self.placement_group is not None:
            return (
                "The placement group handed over must hold, for GPU slot s (bundle_indices[s]), the plan's node "
                "s // num_gpus_per_node and local GPU s % num_gpus_per_node (Miles sorts its bundles by node "
                "address and GPU id)."
            )
        return (
            "Ray hands out a node's free GPUs from the lowest id, so a process planned on higher local GPUs gets "
            "others when the GPUs below them are not held in Ray: the plan's slots start at rollout_offset, "
            "after the trainer's GPUs, which the trainer's placement group or actors must hold. Hand that "
            "placement group over (launch_from_config(cfg, placement_group=pg)), or colocate / "
            "debug_rollout_only to start the rollout at slot 0."
        )

    def _wait(self, refs: Sequence[Any], what: str) -> list[Any]:
        try:
            values: list[Any] = self.ray.get(list(refs), timeout=self.conf.placement_timeout_s)
            return values
        except self.ray.exceptions.RayTaskError as exc:  # what the actor raised, without Ray's traceback text
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise
        except self.ray.exceptions.GetTimeoutError:
            raise PlacementError(
                f"{what} did not finish within sglang_deploy.launch.ray.placement_timeout_s="
                f"{self.conf.placement_timeout_s:g} s; {self._cluster_summary()}"
            ) from None

    def _cluster_summary(self) -> str:
        try:
            nodes = [n for n in self.ray.nodes() if n.get("Alive")]
            free = self.ray.available_resources().get("GPU", 0)
        except Exception as exc:  # a summary for a message only
            return f"(cluster state unavailable: {first_line(exc)})"
        per_node = ", ".join(
            f"{n['NodeManagerAddress']}: {n['Resources'].get('GPU', 0):g} GPUs"
            for n in sorted(nodes, key=lambda n: n["NodeManagerAddress"])
        )
        return f"the cluster has {len(nodes)} live node(s) ({per_node}), {free:g} GPU(s) free in all"

    def _node_info(self) -> dict[str, RayNodeInfo]:
        return {
            n["NodeID"]: RayNodeInfo(n["NodeID"], n["NodeManagerAddress"])
            for n in self.ray.nodes()
            if n.get("Alive")
        }

    def _place_in_own_group(self, plan: DeploymentPlan) -> None:
        bundles = own_bundles(plan, per_node=self._per_node)
        cpus = self.conf.engine_num_cpus
        specs = [
            {"GPU": float(b.gpus), **({"CPU": cpus * len(b.processes)} if cpus and b.processes else {})}
            for b in bundles
        ]
        if self._per_node:
            group, index_of = self._spread_group(bundles, specs)
        else:
            group, index_of = self._pinned_group(bundles, specs), list(range(len(bundles)))
            self._pinned_groups.append(group)
        by_key = {p.key: p for p in self._placements}
        for position, b in enumerate(bundles):
            if not b.processes:
                continue
            name = f"node {b.node}" if self._per_node else by_key[b.processes[0]].name
            spec = specs[position]
            host = HostPlan(name, b.node, b.processes)
            self._create_host(
                host, group, index_of[position], spec["GPU"], spec.get("CPU", 0.0), b.local_gpu_ids
            )
        wheres = self._wheres()
        for name, started in self._hosts.items():
            node, given = (
                RayNodeInfo(wheres[name]["node_id"], wheres[name]["address"]),
                wheres[name]["gpu_ids"],
            )
            for key in started.plan.processes:
                gpus = bundle_gpu_ids(started.bundle_gpus, given, by_key[key].local_gpu_ids)
                self._grants[key] = ProcessGrant(node=node, gpu_ids=gpus)

    def _spread_group(
        self, bundles: Sequence[BundlePlan], specs: Sequence[dict[str, float]]
    ) -> tuple[Any, list[int]]:
        """One bundle per plan node, each on a Ray node of its own (``STRICT_SPREAD``: placed at once, so two
        launches never pick the same node); plan nodes that need the same take their nodes in address order.
        The group, and the bundle index of each plan node's bundle."""
        from ray.util.placement_group import placement_group, placement_group_table

        group = placement_group(list(specs), strategy="STRICT_SPREAD")
        self._own_groups.append(group)
        need = ", ".join(str(b.gpus) for b in bundles)
        self._wait_group(group, f"{len(bundles)} node(s) with {need} free GPU(s)")
        landed = placement_group_table(group)["bundles_to_node_id"]
        info = self._node_info()
        kinds = [tuple(sorted(spec.items())) for spec in specs]
        return group, spread_order(kinds, [info[landed[i]] for i in range(len(bundles))])

    def _pinned_group(self, bundles: Sequence[BundlePlan], specs: Sequence[dict[str, float]]) -> Any:
        """Bundles in slot order, each plan node's pinned to the Ray node chosen for it."""
        from ray.util.placement_group import placement_group

        node_of = self._choose_nodes(bundles, specs)
        group = placement_group(
            list(specs),
            strategy="PACK",
            bundle_label_selector=[{NODE_ID_LABEL: node_of[b.node].node_id} for b in bundles],
        )
        self._own_groups.append(group)
        self._wait_group(group, "the engines' placement group")
        return group

    def _choose_nodes(
        self, bundles: Sequence[Any], specs: Sequence[Mapping[str, float]]
    ) -> dict[int, RayNodeInfo]:
        """Ray's scheduler picks the nodes: one per plan node, each with what its bundles need free (a
        ``STRICT_SPREAD`` group, removed at once); the plan nodes take them in address order."""
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        need = gpus_per_plan_node(bundles)
        per_node: dict[int, dict[str, float]] = {node: {} for node in need}
        for b, spec in zip(bundles, specs, strict=True):
            for resource, amount in spec.items():
                per_node[b.node][resource] = per_node[b.node].get(resource, 0.0) + amount
        chooser = placement_group(list(per_node.values()), strategy="STRICT_SPREAD")
        self._own_groups.append(chooser)
        try:
            self._wait_group(
                chooser, f"{len(need)} node(s) with {', '.join(map(str, need.values()))} free GPU(s)"
            )
            chosen = placement_group_table(chooser)["bundles_to_node_id"]
        finally:
            remove_placement_group(chooser)
            self._own_groups.remove(chooser)
        info = self._node_info()
        return assign_plan_nodes(list(need), [info[chosen[i]] for i in range(len(need))])

    def _place_in_trainer_group(self, plan: DeploymentPlan) -> None:
        pg = self.placement_group
        self._wait_group(pg, "the placement group handed over")
        specs = list(pg.bundle_specs)
        slots = sorted({s for p in self._placements for s in p.gpu_slots})
        bundle_of = self._bundle_of = slot_bundles(len(specs), self.bundle_indices, slots)
        wide = [
            f"bundle {bundle_of[s]} ({specs[bundle_of[s]]})"
            for s in slots
            if specs[bundle_of[s]].get("GPU") != 1
        ]
        if wide:
            raise PlacementError(
                "the placement group handed over must hold one GPU per bundle (Miles' and slime's layout); "
                f"{', '.join(wide[:4])}{' …' if len(wide) > 4 else ''} do not"
            )
        probe = self.ray.remote(gpu_probe)
        refs = [probe.options(**self._in_bundle(pg, bundle_of[s], PROBE_GPU_SHARE)).remote() for s in slots]
        probed = dict(zip(slots, self._wait(refs, "asking Ray which GPU each bundle holds"), strict=True))
        by_key = {p.key: p for p in self._placements}
        for host in engine_hosts(self._placements, per_node=self._per_node):
            first = by_key[host.processes[0]].gpu_slots[0]
            cpus = self.conf.engine_num_cpus * len(host.processes)
            self._create_host(host, pg, bundle_of[first], self.conf.bundle_gpu_share, cpus)
        split = [
            f"{p.name}: its GPU slots {list(p.gpu_slots)} are bundles on different nodes"
            for p in self._placements
            if len({probed[s]["node_id"] for s in p.gpu_slots}) > 1
        ]
        if split:
            raise grant_error(split, self._mismatch_hint())
        self._wheres()  # every actor started (a process of a node may only run where its node's actor is)
        for p in self._placements:
            where = probed[p.gpu_slots[0]]
            node = RayNodeInfo(where["node_id"], where["address"])
            self._grants[p.key] = ProcessGrant(node, tuple(probed[s]["gpu_ids"][0] for s in p.gpu_slots))

    def _wait_group(self, pg: Any, what: str) -> None:
        self._wait([pg.ready()], f"placing {what}")

    def _in_bundle(self, pg: Any, index: int, num_gpus: float) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": 0,
            "num_gpus": num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            ),
        }

    def _create_host(
        self,
        plan: HostPlan,
        pg: Any,
        bundle: int,
        num_gpus: float,
        num_cpus: float,
        bundle_gpus: tuple[int, ...] = (),
    ) -> None:
        host = _Host(plan, None, pg, bundle, num_gpus, num_cpus, bundle_gpus)
        host.actor = self._new_actor(host)
        self._hosts[plan.name] = host
        for key in plan.processes:
            self._host_of[key] = plan.name

    def _new_actor(self, host: _Host) -> Any:
        options = {**self._in_bundle(host.group, host.bundle, host.num_gpus), "num_cpus": host.num_cpus}
        if self._actor_class is None:  # one remote class: Ray ships its definition to the cluster once
            self._actor_class = self.ray.remote(EngineHost)
        return self._actor_class.options(max_restarts=0, **options).remote(host.plan.name)

    def _wheres(self) -> dict[str, dict[str, Any]]:
        """Host name -> where its actor runs (node, address, GPU ids): waits until every actor has started."""
        return self._wheres_of(list(self._hosts))

    def _wheres_of(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        refs = [self._hosts[name].actor.where.remote() for name in names]
        return dict(zip(names, self._wait(refs, "starting the engine actors"), strict=True))

    def _node_alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n.get("Alive") for n in self.ray.nodes())

    def _replace_actor(self, host: _Host) -> None:
        """The actor of ``host`` died on a node that is alive: make it again in its bundle (same node, same
        GPUs), checked against what Ray gave the first one."""
        host.actor = self._new_actor(host)
        (where,) = self._wait([host.actor.where.remote()], f"starting the actor of {host.plan.name} again")
        by_key = {p.key: p for p in self._placements}
        for key in host.plan.processes:
            grant = self._grants[key]
            gpus = (
                bundle_gpu_ids(host.bundle_gpus, where["gpu_ids"], by_key[key].local_gpu_ids)
                if self.placement_group is None
                else grant.gpu_ids
            )
            if where["node_id"] != grant.node.node_id or tuple(gpus) != tuple(grant.gpu_ids):
                raise LaunchError(
                    f"{by_key[key].name}: its actor came back on {where['address']} with GPUs {','.join(gpus)}, "
                    f"not on {grant.node.short} with GPUs {','.join(grant.gpu_ids)} as planned"
                )

    def check(self, prepared: PreparedDeployment) -> list[str]:
        nodes: dict[int, RayNodeInfo] = {}
        for p in self._placements:
            nodes.setdefault(p.node, self._grants[p.key].node)
        where = ", ".join(f"plan node {n} on {info.short}" for n, info in sorted(nodes.items()))
        group = (
            "the trainer's placement group" if self.placement_group is not None else "its own placement group"
        )
        actors = f"{len(self._hosts)} actor(s), one per {'node' if self._per_node else 'engine process'}"
        return [f"ray: {len(self._placements)} engine process(es) under {actors}, in {group}: {where}"]

    # -------------------------------------------------------------------------------------- processes
    def start(self, launch: EngineProcessLaunch, *, log_path: Path) -> RayEngineProcess:
        key = (launch.engine_id, launch.node_rank)
        if self._closed or key not in self._host_of:
            raise LaunchError(f"{launch.name}: not prepared by this ray backend (or it was closed)")
        host = self._hosts[self._host_of[key]]
        earlier = self._latest.get(key)
        if earlier is not None and earlier.exit_code() is None:
            raise LaunchError(
                f"{launch.name} is still running ({earlier.where}); stop it before starting it again"
            )
        if earlier is not None and earlier.actor_lost and earlier.actor is host.actor:
            self._replace_actor(host)  # its actor died, its node did not (cannot_restart): once per actor
        grant = self._grants[key]
        env = {**launch.env, "CUDA_VISIBLE_DEVICES": ",".join(grant.gpu_ids), NODE_ID_ENV: grant.node.node_id}
        run = self._runs[key] = self._runs.get(key, 0) + 1
        spawn_ref = host.actor.spawn.remote(
            launch.name, run, list(launch.argv), env, str(log_path), launch.display_command()
        )
        handle = self._latest[key] = RayEngineProcess(
            launch,
            ray=self.ray,
            actor=host.actor,
            node=grant.node,
            log_path=log_path,
            spawn_ref=spawn_ref,
            run=run,
        )
        return handle

    def watch_exit(self, process: EngineProcess, watcher: ExitWatcher, on_exit: Callable[[], None]) -> None:
        if isinstance(process, RayEngineProcess):
            self._exits.watch(process, on_exit)  # one ray.wait over every process
        else:
            super().watch_exit(process, watcher, on_exit)

    def cannot_restart(self, launch: EngineProcessLaunch) -> str | None:
        key = (launch.engine_id, launch.node_rank)
        earlier = self._latest.get(key)
        if earlier is None or not earlier.actor_lost or self._node_alive(earlier.node.node_id):
            return None  # an actor that died on a live node is made again there
        grant = self._grants.get(key)
        if grant is not None and grant.node.node_id != earlier.node.node_id:
            return None  # placed again on another node (place_again)
        return (
            f"{launch.name} cannot be started again on node {earlier.node.short}: {earlier.exit_reason()}; "
            "its GPUs there are gone with it"
        )

    def place_again(
        self, prepared: PreparedDeployment, engines: Collection[str]
    ) -> PreparedDeployment | None:
        """The actors of ``engines`` whose node left the cluster are made again where Ray can place their
        bundles now: their own group's bundle, which Ray places again on a node with the room (one actor per
        node, and the trainer's group), or a new group of one bundle (one actor per engine process, whose
        bundles are pinned to their nodes). Every process of those actors (the other engines of a lost node
        too) gets its new node and GPUs, ports found there; everything else keeps its own. PlacementError when
        no node has the room within ``sglang_deploy.launch.ray.placement_timeout_s``."""
        if self._closed or self._settings is None:
            return None
        with self._placing:
            names = {self._host_of[p.key] for p in self._placements if p.key[0] in set(engines)}
            for name in sorted(names):
                host = self._hosts[name]
                if not self._node_alive(self._grants[host.plan.processes[0]].node.node_id):
                    self._place_host_again(host)
            hosts = {(p.engine_id, p.node_rank): p.host for p in prepared.launch.engines}
            assert prepared.ports is not None
            fixed = PortAssignment(
                engines={
                    key: ports
                    for key, ports in prepared.ports.engines.items()
                    if key in self._grants and self._grants[key].node.address == hosts.get(key)
                },
                routers=dict(prepared.ports.routers),
            )
            return self._render(prepared.plan, prepared.settings, fixed)

    def _place_host_again(self, host: _Host) -> None:
        """Make ``host``'s actor again off its lost node and take the grants of its processes from it."""
        from ray.util.placement_group import placement_group, remove_placement_group

        gone = self._grants[host.plan.processes[0]].node
        by_key = {p.key: p for p in self._placements}
        what = f"{', '.join(by_key[key].name for key in host.plan.processes)} again (off {gone.short})"
        fresh_group = any(host.group is g for g in self._pinned_groups)
        if fresh_group:  # pinned to the lost node: a group of one bundle, wherever it fits
            spec = {"GPU": host.num_gpus, **({"CPU": host.num_cpus} if host.num_cpus else {})}
            group = placement_group([spec], strategy="PACK")
            try:
                self._wait_group(
                    group, f"{host.plan.name} again ({host.num_gpus:g} GPU(s), off {gone.short})"
                )
            except LaunchError:
                remove_placement_group(group)
                raise
            self._own_groups.append(group)
            host.group, host.bundle = group, 0
        actor = self._new_actor(host)
        try:
            (where,) = self._wait([actor.where.remote()], f"placing {what}")
        except LaunchError:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)  # pending: it must not take the room once it appears
            raise
        host.actor = actor
        node = RayNodeInfo(where["node_id"], where["address"])
        if self.placement_group is not None:  # the trainer's bundles: ask which GPU each slot holds now
            probe = self.ray.remote(gpu_probe)
            slots = [s for key in host.plan.processes for s in by_key[key].gpu_slots]
            refs = [probe.options(**self._in_bundle(host.group, self._bundle_of[s], PROBE_GPU_SHARE)).remote()
                    for s in slots]  # fmt: skip
            probed = dict(zip(slots, self._wait(refs, "asking Ray which GPU each bundle holds"), strict=True))
            for key in host.plan.processes:
                gpus = tuple(probed[s]["gpu_ids"][0] for s in by_key[key].gpu_slots)
                self._grants[key] = ProcessGrant(node, gpus)
        else:
            for key in host.plan.processes:
                local = by_key[key].local_gpu_ids
                self._grants[key] = ProcessGrant(
                    node, bundle_gpu_ids(host.bundle_gpus, where["gpu_ids"], local)
                )
        log.warning(
            "%s placed again on %s (its node %s left the cluster)", host.plan.name, node.short, gone.short
        )

    def release(self, before: PreparedDeployment, after: PreparedDeployment) -> None:
        """A change from ``before`` to ``after`` ended and the processes it removed have stopped: the actors
        that run none of ``after``'s processes are killed (and Ray waited for), the placement groups no actor
        uses any more are removed (their GPUs are the cluster's again; the trainer's group stays, as do bundles
        of placeholder GPUs), the ports of ``before``'s processes that ``after`` lacks are given back on their
        nodes, and the routers' ports here."""
        if self._closed or not self.ray.is_initialized():
            return
        with self._placing:
            keys = {p.key for p in process_placements(after.plan)}
            needed = {self._host_of[key] for key in keys if key in self._host_of}
            gone = [name for name in self._hosts if name not in needed]
            actors = [self._hosts[name].actor for name in gone]
            for actor in actors:
                with contextlib.suppress(Exception):
                    self.ray.kill(actor, no_restart=True)
            self._wait_dead(actors)
            for name in gone:
                del self._hosts[name]
            kept_groups = [h.group for h in self._hosts.values()] + list(self._placeholder_groups)
            self._remove_groups([g for g in self._own_groups if not any(g is k for k in kept_groups)])
            for key in [key for key in self._host_of if key not in keys]:
                del self._host_of[key]
                self._grants.pop(key, None)
                self._latest.pop(key, None)
            self._release_ports(before, after)

    def _release_ports(self, before: PreparedDeployment, after: PreparedDeployment) -> None:
        if before.ports is None:
            return
        now = after.ports or PortAssignment(engines={}, routers={})
        if self.claims is not None:
            routers = ports_held(PortAssignment({}, before.ports.routers), before.plan)
            for port in sorted(routers - ports_held(PortAssignment({}, now.routers), after.plan)):
                self.claims.drop(port, unlock=True)
        held_after = _engine_ports_by_address(after)
        gone_on = {
            address: ports - held_after.get(address, set())
            for address, ports in _engine_ports_by_address(before).items()
        }
        refs = []
        for (
            host
        ) in self._hosts.values():  # each live actor drops those it claimed (dead ones took theirs along)
            address = self._grants[host.plan.processes[0]].node.address if host.plan.processes else None
            if address is not None and gone_on.get(address):
                refs.append(host.actor.drop_ports.remote(sorted(gone_on[address])))
        if refs:
            with contextlib.suppress(Exception):
                self.ray.get(refs, timeout=30)

    def stop(self, processes: Sequence[EngineProcess], *, grace_s: float) -> None:
        if not self.ray.is_initialized():  # disconnected (Ray's own exit hook ran first): the actors and
            return  # their engines die with this job
        running = [p for p in processes if isinstance(p, RayEngineProcess) and p.exit_code() is None]
        by_actor: dict[Any, list[str]] = {}
        actor_of: dict[Any, Any] = {}
        for p in running:  # one call per actor: its processes are stopped together
            by_actor.setdefault(id(p.actor), []).append(p.launch.name)
            actor_of[id(p.actor)] = p.actor
        refs = [actor_of[a].stop.remote(names, grace_s) for a, names in by_actor.items()]
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=grace_s + 15)
            # ... and until each handle has seen its exit (an actor notices within its poll interval).
            deadline = time.monotonic() + 5
            while any(p.exit_code() is None for p in running) and time.monotonic() < deadline:
                time.sleep(0.05)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._exits.close()
        ray = self.ray
        # Not connected any more (Ray's own exit hook ran first): the actors and groups go with the job.
        connected = ray.is_initialized()
        actors = list(self.actors) if connected else []
        try:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            self._wait_dead(actors)
            from ray.util.placement_group import remove_placement_group

            for group in self._own_groups if connected else []:
                with contextlib.suppress(Exception):
                    remove_placement_group(group)
        finally:
            self._own_groups.clear()
            self._hosts.clear()
            if self.claims is not None:
                self.claims.release()
            if self._connected_here:
                with contextlib.suppress(Exception):
                    ray.shutdown()

    def _wait_dead(self, actors: Sequence[Any]) -> None:
        """Until Ray reports every actor dead (a call to it fails), at most ACTOR_DEATH_WAIT_S."""
        deadline = time.monotonic() + ACTOR_DEATH_WAIT_S
        alive = list(actors)
        while alive and time.monotonic() < deadline:
            still = []
            for actor in alive:
                try:
                    self.ray.get(actor.status.remote(), timeout=2)
                    still.append(actor)
                except self.ray.exceptions.GetTimeoutError:
                    still.append(actor)
                except Exception:
                    pass  # dead, as wanted
            alive = still
            if alive:
                time.sleep(0.1)
        if alive:
            log.warning("%d Ray actor(s) were not reported dead within %gs", len(alive), ACTOR_DEATH_WAIT_S)


__all__ = ["NODE_ID_ENV", "RAY_EXTRA", "RayBackend", "RayEngineProcess", "connect", "import_ray"]
