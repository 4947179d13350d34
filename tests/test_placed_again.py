"""An engine whose node is gone is placed again elsewhere by its backend, through the reconciler's one way back
into service: taken out of its router, started at its new address, given the ledger's state, registered there.

The backend here is the local one with a node that "leaves": its ``cannot_restart`` says so for the chosen
engines, and its ``place_again`` renders them on other ports of this machine (what the Ray backend does with
another node, which ``tests/test_ray_backend.py`` shows on a Ray cluster). Stand-in engines, the real router."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
from collections.abc import Collection
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.backends.local import LocalBackend
from miles_sglang_plugin.backends.ray_placement import PlacementError
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch
from miles_sglang_plugin.rendering.ports import PortAssignment
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.serving.errors import DeploymentFailedError
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import LeakTracker, compose, generate_body
from tests.router_helpers import router_workers

FAST = [
    "sglang.actor.regular.num_gpus=2",
    "sglang_deploy.supervision.health_interval_s=0.3",
    "sglang_deploy.supervision.health_timeout_s=0.5",
    "sglang_deploy.supervision.kill_grace_s=0.5",
    "sglang_deploy.supervision.restart_backoff_s=0.2",
]


class NodeLeaves(LocalBackend):
    """The local backend, with the "node" of ``gone`` engines gone once ``leave()`` is called; ``room``: whether
    there is capacity to place them again (else every attempt fails as the Ray backend's does)."""

    def __init__(self, *, room: bool = True) -> None:
        super().__init__()
        self.room = room
        self.gone: set[str] = set()
        self.asked: list[tuple[str, ...]] = []

    def cannot_restart(self, launch: EngineProcessLaunch) -> str | None:
        return "its node left the cluster" if launch.engine_id in self.gone else None

    def place_again(
        self, prepared: PreparedDeployment, engines: Collection[str]
    ) -> PreparedDeployment | None:
        self.asked.append(tuple(engines))
        if not self.room:
            raise PlacementError("no node with 1 free GPU(s): the cluster has 1 live node(s), 0 GPU(s) free")
        assert prepared.ports is not None
        fixed = PortAssignment(
            engines={k: v for k, v in prepared.ports.engines.items() if k[0] not in self.gone},
            routers=dict(prepared.ports.routers),
        )
        placed = self.prepare(prepared.plan, prepared.settings, fixed_ports=fixed)
        self.gone.clear()
        return placed


def healthy_workers(url: str) -> list[str]:
    return sorted(w["url"] for w in router_workers(url) if w.get("is_healthy"))


def test_an_engine_whose_node_left_serves_again_elsewhere_with_its_state(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    backend = NodeLeaves()
    with launch_from_config(compose(*FAST), log_dir=tmp_path / "logs", backend=backend) as d:
        assert d.control.update_weight_version("7").ok
        router = d.registry["actor"].base_url
        before = {row.id: row.url for row in d.fleet.engines()}
        kept_pid = d.fleet.engine("actor.regular.0").processes[0].pid  # type: ignore[attr-defined]
        lost = d.fleet.engine("actor.regular.1")
        backend.gone.add("actor.regular.1")
        since = len(d.events())
        backend.stop(lost.processes, grace_s=0.5)  # its node is gone, and the process with it

        placed = d.wait_for_event("engine_placed_again", subject="actor.regular.1", since=since, timeout_s=60)
        d.wait_for_event("engine_recovered", subject="actor.regular.1", since=since, timeout_s=60)
        new_url = d.fleet.engine("actor.regular.1").url
        assert new_url != before["actor.regular.1"]
        assert placed.details == {"url": new_url, "was": before["actor.regular.1"]}
        assert backend.asked == [("actor.regular.1",)]
        # the router has the new address and not the old one; the other engine was not touched
        assert healthy_workers(router) == sorted([before["actor.regular.0"], new_url])
        assert d.fleet.engine("actor.regular.0").url == before["actor.regular.0"]
        assert d.fleet.engine("actor.regular.0").processes[0].pid == kept_pid  # type: ignore[attr-defined]
        # it has the ledger's weight version, and the deployment's launch spec has its new place
        info = httpx.get(new_url + "/model_info", timeout=10).json()
        assert info["weight_version"] == "7"
        assert [p.url for p in d.prepared.launch.for_engine("actor.regular.1")] == [new_url]
        assert d.state().status == "serving"
        for _ in range(4):
            out = httpx.post(d.registry.get_model_url("actor"), json=generate_body(), timeout=30)
            assert out.status_code == 200 and out.json()["meta_info"]["weight_version"] == "7"


def test_with_no_room_anywhere_the_deployment_fails_naming_the_engine_after_its_restarts(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    backend = NodeLeaves(room=False)
    with (
        pytest.raises(DeploymentFailedError) as exc,
        launch_from_config(
            compose(*FAST, "sglang_deploy.supervision.max_restarts=2"),
            log_dir=tmp_path / "logs",
            backend=backend,
        ) as d,
    ):
        backend.gone.add("actor.regular.1")
        backend.stop(d.fleet.engine("actor.regular.1").processes, grace_s=0.5)
        failed = d.wait_for_event("deployment_failed", timeout_s=60)
        assert d.wait_stopped(timeout_s=120)
        d.check()
    message = failed.message
    assert "engine actor.regular.1 could not be brought back after 2 restart(s)" in message
    assert "supervision.max_restarts=2" in message
    assert (
        "its node left the cluster; it could not be placed on another node: no node with 1 free GPU(s)"
        in message
    )
    assert backend.asked == [("actor.regular.1",)] * 2
    assert "actor.regular.1" in str(exc.value)
