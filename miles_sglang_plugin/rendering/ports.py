"""Port assignment: every engine process, bootstrap server and router on a host gets its own ports.

Ports are taken upward from ``port_base`` and stay below the ephemeral range (32768+), as Miles does. When
``probe`` is on (a real launch), a port is taken only if

* no other launch on this machine holds it: each taken port is claimed with an ``flock`` on a lock file in
  a shared directory, held until the launch ends (the kernel drops it when the process dies, so a crashed
  launch never leaks a claim). This keeps parallel multirun jobs apart;
* it can be bound on the host right now (another program is not using it).

Without probing (``miles-sglang plan``) the assignment is the plain cursor sequence, so a printed plan is
reproducible. Engines that span several nodes share one ``dist_init_addr`` on their first node.

A backend whose nodes are other machines finds each node's engine ports on that node
(``assign_ports(..., find_node_ports=...)``: it is given, per plan node, the runs of consecutive ports each engine
process there needs, in order, and returns their first ports, e.g. with :func:`free_port_runs` run on the node).
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles_sglang_plugin.config.deployment_spec import WorkerType
from miles_sglang_plugin.rendering.claims import LockClaims

if TYPE_CHECKING:  # the port search alone (a Ray actor's on its node) needs no plan
    from miles_sglang_plugin.planning.plan import DeploymentPlan

#: Linux's default ephemeral range starts here; SGLang's own defaults (30000, 8998) stay outside our range too.
EPHEMERAL_START = 32768
#: SGLang's ``dist_init_addr`` uses a run of consecutive ports (Miles reserves ``30 + dp_size``).
DIST_INIT_SPAN = 30


class PortExhaustedError(RuntimeError):
    pass


class HostNotUsableError(PortExhaustedError):
    """No port can be bound on the host at all: a name that does not resolve, an address family it lacks."""


@dataclass(frozen=True)
class EnginePorts:
    """Ports of one engine process (``http`` serves only on node rank 0)."""

    http: int
    nccl: int
    dist_init: int | None = None  # node rank 0 only: the first of a run of DIST_INIT_SPAN + dp_size ports
    engine_info_bootstrap: int | None = None
    disaggregation_bootstrap: int | None = None  # prefill engines only


@dataclass(frozen=True)
class RouterPorts:
    http: int
    prometheus: int


@dataclass(frozen=True)
class PortAssignment:
    #: (engine id, node rank) -> ports
    engines: dict[tuple[str, int], EnginePorts]
    #: model name -> ports
    routers: dict[str, RouterPorts]


def default_lock_dir() -> Path:
    """Claims of this user's launches (per user: another user's directory may not be writable)."""
    default = Path(tempfile.gettempdir()) / f"miles-sglang-ports-{os.getuid()}"
    return Path(os.environ.get("MSP_PORT_LOCK_DIR") or default)  # set but empty: the default, not "."


@dataclass
class PortClaims(LockClaims[int]):
    """flock claims of ports held for a launch (lock files ``<port>.lock`` in the checked lock directory, see
    :mod:`~miles_sglang_plugin.rendering.claims`); :meth:`release` (or process exit) frees them."""

    def release(self) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; the kernel drops the locks at exit anyway
        self.release()


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host.strip("[]"), port))
        except socket.gaierror as exc:
            raise HostNotUsableError(
                f"{host!r} does not resolve to an address here ({exc.strerror})"
            ) from exc
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise HostNotUsableError(f"cannot bind to {host!r}: {exc.strerror or exc}") from exc
    return True


class _Cursor:
    def __init__(self, base: int, limit: int, host: str, claims: PortClaims | None, probe: bool) -> None:
        self.base, self.next, self.limit, self.host, self.claims, self.probe = (
            base,
            base,
            limit,
            host,
            claims,
            probe,
        )
        #: Ports passed over, by why: claimed by another launch (or unusable lock file), in use here.
        self.claimed, self.in_use = 0, 0
        #: Ports of this deployment's own running processes (kept through a change): never handed out.
        self.reserved: set[int] = set()

    def _usable(self, port: int) -> bool:
        if port in self.reserved:
            return False
        if not self.probe:
            return True
        if self.claims is not None and not self.claims.try_claim(port):
            self.claimed += 1
            return False
        if not port_is_free(self.host, port):
            self.in_use += 1
            if self.claims is not None:
                self.claims.drop(port)
            return False
        return True

    def take(self, count: int = 1) -> int:
        """The first of ``count`` consecutive usable ports."""
        fast = not self.probe and not self.reserved.intersection(range(self.next, self.next + count))
        if fast and self.next + count - 1 <= self.limit:  # nothing to look at: the next ones
            start, self.next = self.next, self.next + count
            return start
        while self.next + count - 1 <= self.limit:
            start = self.next
            usable = []
            for port in range(start, start + count):
                if self._usable(port):
                    usable.append(port)
                else:
                    break
            if len(usable) == count:
                self.next = start + count
                return start
            # Give back a partial run and continue after the blocked port.
            if self.claims is not None:
                for port in usable:
                    self.claims.drop(port)
            self.next = start + len(usable) + 1
        claims = self.claims
        if claims is not None and claims.unusable is not None and not claims.fds:
            raise PortExhaustedError(
                f"no port on {self.host} could be claimed: the port lock directory {claims.lock_dir} is not "
                f"usable ({claims.unusable}); set MSP_PORT_LOCK_DIR to a writable directory"
            )
        remedy = (
            f"lower sglang_deploy.launch.port_base (ports stay below the ephemeral range, {EPHEMERAL_START})"
            if self.limit >= EPHEMERAL_START - 1
            else "raise sglang_deploy.launch.port_max or lower port_base"
        )
        unusable = f", the last lock file error: {claims.unusable}" if claims and claims.unusable else ""
        raise PortExhaustedError(
            f"no {count} free consecutive port(s) left on {self.host} from {self.base} below {self.limit + 1} "
            f"({self.in_use} passed over in use, {self.claimed} claimed by other launches{unusable}); {remedy}"
        )


#: Plan node -> the runs of consecutive ports (their lengths) each engine process on it needs, in order ->
#: the first port of each run. Finds the ports of engine processes on the nodes themselves.
NodePortFinder = Callable[[Mapping[int, Sequence[Sequence[int]]]], Mapping[int, Sequence[Sequence[int]]]]


@dataclass(frozen=True)
class _PortRequest:
    engine_id: str
    node: int
    node_rank: int
    #: Lengths of the runs, in EnginePorts' field order: http, nccl[, dist_init, engine_info[, disaggregation]].
    runs: tuple[int, ...]


def _engine_port_requests(plan: DeploymentPlan) -> list[_PortRequest]:
    requests = []
    for _model, g in plan.groups():
        lead = (1, 1, DIST_INIT_SPAN + g.dp_size, 1, *((1,) if g.worker_type is WorkerType.prefill else ()))
        for e in g.engines:
            engine_id = e.id
            for proc in e.processes:
                runs = lead if proc.node_rank == 0 else (1, 1)
                requests.append(_PortRequest(engine_id, proc.node, proc.node_rank, runs))
    return requests


def _engine_ports(starts: Sequence[int]) -> EnginePorts:
    return EnginePorts(*starts)  # in EnginePorts' field order (see _PortRequest.runs)


def free_port_runs(
    host: str,
    runs: Sequence[Sequence[int]],
    *,
    port_base: int,
    port_max: int,
    claims: PortClaims | None,
    probe: bool = True,
) -> list[list[int]]:
    """First ports of consecutive runs of the given lengths on ``host`` (one list per process), each run free
    and claimed; the search goes upward from ``port_base`` and never hands out a port twice."""
    cursor = _Cursor(port_base, min(port_max, EPHEMERAL_START - 1), host, claims, probe)
    return [[cursor.take(count) for count in process] for process in runs]


def assign_ports(
    plan: DeploymentPlan,
    *,
    host_of_node: Callable[[int], str],
    router_host: str,
    port_base: int = 15000,
    port_max: int = EPHEMERAL_START - 1,
    probe: bool = False,
    claims: PortClaims | None = None,
    find_node_ports: NodePortFinder | None = None,
    fixed: PortAssignment | None = None,
) -> PortAssignment:
    """Assign ports for every engine process and router of ``plan``, never twice on one host. Routers' ports
    are found here; engine ports too, unless ``find_node_ports`` finds them on their nodes. ``fixed``: ports
    that engine processes and routers already running keep (a running deployment's change): theirs as they are,
    and never handed to another."""
    if port_max >= EPHEMERAL_START:
        port_max = EPHEMERAL_START - 1
    cursors: dict[str, _Cursor] = {}
    fixed = fixed or PortAssignment(engines={}, routers={})
    fixed_on = _fixed_by_host(plan, fixed, host_of_node, router_host)

    def cursor(host: str) -> _Cursor:
        if host not in cursors:
            cursors[host] = _Cursor(port_base, port_max, host, claims, probe)
            cursors[host].reserved = fixed_on.get(host, set())
        return cursors[host]

    routers = _router_ports(plan, fixed, lambda: cursor(router_host))
    requests = [r for r in _engine_port_requests(plan) if (r.engine_id, r.node_rank) not in fixed.engines]
    if find_node_ports is None:
        of_node: dict[int, _Cursor] = {}  # each node's cursor, its host asked once
        for request in requests:
            if request.node not in of_node:
                of_node[request.node] = cursor(host_of_node(request.node))
        starts = [[of_node[request.node].take(n) for n in request.runs] for request in requests]
    else:
        starts = _found_on_nodes(requests, find_node_ports)
    engines = {
        (request.engine_id, request.node_rank): _engine_ports(start)
        for request, start in zip(requests, starts, strict=True)
    }
    if fixed.engines:
        kept = _process_keys(plan)
        engines.update({key: ports for key, ports in fixed.engines.items() if key in kept})
    return PortAssignment(engines=engines, routers=routers)


def _router_ports(
    plan: DeploymentPlan, fixed: PortAssignment, router_cursor: Callable[[], _Cursor]
) -> dict[str, RouterPorts]:
    """Each model's router ports: those it keeps, or two new ones from the router host's cursor."""
    routers = {}
    for model in plan.models:
        if model.name in fixed.routers and model.has_router:
            routers[model.name] = fixed.routers[model.name]
        elif model.has_router:
            host_cursor = router_cursor()
            routers[model.name] = RouterPorts(http=host_cursor.take(), prometheus=host_cursor.take())
    return routers


def _found_on_nodes(requests: Sequence[_PortRequest], find_node_ports: NodePortFinder) -> list[list[int]]:
    """The first ports of each request's runs, found on the requests' nodes (one call for all nodes)."""
    by_node: dict[int, list[_PortRequest]] = {}
    for request in requests:
        by_node.setdefault(request.node, []).append(request)
    found = find_node_ports({node: [request.runs for request in rs] for node, rs in by_node.items()})
    position = {id(request): (node, i) for node, rs in by_node.items() for i, request in enumerate(rs)}
    return [list(found[position[id(request)][0]][position[id(request)][1]]) for request in requests]


def _process_keys(plan: DeploymentPlan) -> set[tuple[str, int]]:
    return {(e.id, p.node_rank) for e in plan.engines for p in e.processes}


def _ports_of(ports: EnginePorts, dp_size: int) -> set[int]:
    taken = {ports.http, ports.nccl}
    if ports.dist_init is not None:
        taken |= set(range(ports.dist_init, ports.dist_init + DIST_INIT_SPAN + dp_size))
    taken |= {p for p in (ports.engine_info_bootstrap, ports.disaggregation_bootstrap) if p is not None}
    return taken


def ports_held(ports: PortAssignment, plan: DeploymentPlan) -> set[int]:
    """Every port ``ports`` holds for ``plan``'s engine processes (each whole run: ``dist_init``'s
    ``DIST_INIT_SPAN + dp_size`` ports) and routers, on whichever host."""
    held: set[int] = set()
    for _model, group in plan.groups():
        for engine in group.engines:
            for process in engine.processes:
                engine_ports = ports.engines.get((engine.id, process.node_rank))
                if engine_ports is not None:
                    held |= _ports_of(engine_ports, group.dp_size)
    held.update(p for r in ports.routers.values() for p in (r.http, r.prometheus))
    return held


def _fixed_by_host(
    plan: DeploymentPlan,
    fixed: PortAssignment,
    host_of_node: Callable[[int], str],
    router_host: str,
) -> dict[str, set[int]]:
    """The fixed ports on each host (those of kept processes and routers), which no other process may get:
    one pass over the plan (per host, it made a plan at the cap quadratic: 8,192 nodes x 65,536 engines)."""
    taken: dict[str, set[int]] = {}
    if fixed.engines:
        for _model, group in plan.groups():
            for engine in group.engines:
                for process in engine.processes:
                    ports = fixed.engines.get((engine.id, process.node_rank))
                    if ports is not None:
                        on_host = taken.setdefault(host_of_node(process.node), set())
                        on_host |= _ports_of(ports, group.dp_size)
    if fixed.routers:
        taken.setdefault(router_host, set()).update(
            p for r in fixed.routers.values() for p in (r.http, r.prometheus)
        )
    return taken
