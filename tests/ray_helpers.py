"""Helpers of the Ray backend tests: one small multi-node Ray cluster with fake GPUs for the whole session, and
checks that a deployment left nothing on any of its nodes.

The cluster (``ray.cluster_utils.Cluster``, what Ray's own tests use) has a head and three worker nodes, each
declaring 8 GPUs, each with its own loopback address (127.0.0.1 for the head = node 0, 127.0.0.2-4 for
nodes 1-3), so that node addresses differ as on a real cluster. It must run inside a network namespace that
has only ``lo`` (``scripts/in-loopback-netns.sh``, which ``make test`` uses): there Ray finds no other
interface and all its traffic stays on loopback. Outside one, the Ray tests skip, or fail when
``MSP_REQUIRE_RAY_TESTS=1`` (CI), since a Ray test that is skipped in CI is no test.

What "nothing left" means here: no Ray actor of the deployment alive (Ray's actor table), no placement group of
it left (the placement-group table), and no stand-in engine or router process in this network namespace
(``/proc/<pid>/ns/net`` equals ours: processes of other sessions' tests on the same machine run elsewhere).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.launch_helpers import ROUTER_MODULE, STANDIN_MODULE, _cmdline, process_alive

REQUIRE_ENV = "MSP_REQUIRE_RAY_TESTS"
NUM_WORKERS = 3
GPUS_PER_NODE = 8
#: Node death is noticed after this many missed health checks of this period (Ray's defaults: 3 s x 5).
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 4,
}


def address_of(node: int) -> str:
    """The loopback address of fake node ``node`` (0 = head)."""
    return f"127.0.0.{node + 1}"


def skip_or_fail(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"the Ray tests must run here ({REQUIRE_ENV}=1), but: {reason}", pytrace=False)
    pytest.skip(reason)


def in_loopback_only_netns() -> bool:
    return [name for _index, name in socket.if_nameindex()] == ["lo"]


def _netns_of(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


@dataclass
class FakeCluster:
    """The session's Ray cluster; the test process is connected to it as a driver."""

    cluster: Any
    ray: Any
    workers: dict[int, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.cluster.address

    def node_ids(self) -> dict[str, str]:
        """Address -> Ray node id of every live node."""
        return {n["NodeManagerAddress"]: n["NodeID"] for n in self.ray.nodes() if n["Alive"]}

    def node_id(self, node: int) -> str:
        return self.node_ids()[address_of(node)]

    def add_worker(self, node: int) -> None:
        self.workers[node] = self.cluster.add_node(
            num_cpus=1, num_gpus=GPUS_PER_NODE, node_ip_address=address_of(node)
        )

    def remove_worker(self, node: int) -> None:
        """Kill worker node ``node`` (its raylet and everything on it), as a machine that fails."""
        self.cluster.remove_node(self.workers.pop(node), allow_graceful=False)

    def restore(self) -> None:
        """Every worker node back (after a test removed one); waits until all are alive, and until no process
        holds port claims any more (a removed node's workers release theirs only when they exit)."""
        for node in range(1, NUM_WORKERS + 1):
            if node not in self.workers:
                self.add_worker(node)
        deadline = time.monotonic() + 60
        while len(self.node_ids()) < NUM_WORKERS + 1:
            assert time.monotonic() < deadline, f"the cluster did not come back: {self.node_ids()}"
            time.sleep(0.2)
        deadline = time.monotonic() + 90
        while holders := self.port_lock_holders():
            assert time.monotonic() < deadline, f"port claims still held by pids {holders}"
            time.sleep(0.2)

    def alive_engine_actors(self) -> list[dict[str, Any]]:
        from ray._private import state

        live = ("ALIVE", "PENDING_CREATION", "RESTARTING", "DEPENDENCIES_UNREADY")
        return [
            a for a in state.actors().values() if a["ActorClassName"] == "EngineHost" and a["State"] in live
        ]

    def live_placement_groups(self) -> list[str]:
        from ray.util.placement_group import placement_group_table

        return [pg_id for pg_id, t in placement_group_table().items() if t["state"] != "REMOVED"]

    def deployment_processes(self) -> list[tuple[int, str]]:
        """Stand-in engines and routers running in this network namespace."""
        ours = _netns_of("self")
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _netns_of(entry.name) == ours:
                cmd = _cmdline(int(entry.name))
                if (STANDIN_MODULE in cmd or ROUTER_MODULE in cmd) and process_alive(int(entry.name)):
                    found.append((int(entry.name), cmd[:160]))
        return found

    def port_lock_holders(self) -> list[int]:
        """Processes of this network namespace that still hold port claims (flock on a lock file of the port
        lock directory): a removed node's Ray workers outlive their raylet for a while, claims and all, and the
        next launch would find the ports taken."""
        from miles_sglang_plugin.rendering.ports import default_lock_dir

        lock_dir = default_lock_dir()
        try:
            inodes = {str(p.stat().st_ino) for p in lock_dir.glob("*.lock")}
            locks = Path("/proc/locks").read_text().splitlines()
        except OSError:
            return []
        ours = _netns_of("self")
        holders = set()
        for line in locks:
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] in inodes:
                pid = int(fields[4])
                if pid != os.getpid() and _netns_of(pid) == ours:
                    holders.add(pid)
        return sorted(holders)

    def leftovers(self, keep_groups: Iterable[str] = ()) -> list[str]:
        problems = []
        if actors := self.alive_engine_actors():
            problems.append(f"engine actors alive: {[(a['ActorID'][:8], a['State']) for a in actors]}")
        if groups := [g for g in self.live_placement_groups() if g not in set(keep_groups)]:
            problems.append(f"placement groups left: {groups}")
        if procs := self.deployment_processes():
            problems.append(f"processes left: {procs}")
        return problems

    def assert_clean(self, keep_groups: Iterable[str] = (), wait_s: float = 20.0) -> None:
        """Nothing of any deployment left (waits up to ``wait_s`` for Ray and the kernel to catch up)."""
        keep = list(keep_groups)
        deadline = time.monotonic() + wait_s
        while (problems := self.leftovers(keep)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not problems, "; ".join(problems)


def start_cluster() -> FakeCluster:
    if not in_loopback_only_netns():
        skip_or_fail(
            "not inside a loopback-only network namespace; run `make test-ray` (or "
            "scripts/in-loopback-netns.sh python -m pytest -m ray)"
        )
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        skip_or_fail("Ray is not installed (pip install -e '.[test,ray]')")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": GPUS_PER_NODE,
            "node_ip_address": address_of(0),
            "include_dashboard": False,
            "_system_config": FAST_HEALTH_CHECKS,
        },
    )
    fake = FakeCluster(cluster=cluster, ray=ray)
    for node in range(1, NUM_WORKERS + 1):
        fake.add_worker(node)
    ray.init(address=cluster.address, logging_level="WARNING")
    cluster.wait_for_nodes()
    return fake


def stop_cluster(fake: FakeCluster) -> None:
    fake.ray.shutdown()
    fake.cluster.shutdown()
    # The head records itself as this machine's latest cluster; gone now, it must not be found by
    # address="auto" later (a stale address).
    latest = Path("/tmp/ray/ray_current_cluster")
    if latest.exists() and fake.address in latest.read_text():
        latest.unlink()
