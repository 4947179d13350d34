"""Changing a running deployment on the ray backend (``Deployment.apply`` / ``resize`` / ``move_gpus``), on the
session's 4-node cluster of 8 fake GPUs per node (``tests/ray_helpers.py``): kept engines keep their actors and
processes, added ones get their GPUs where the stable plan puts them (under an actor whose bundle holds them
already, or under a new actor in a placement group of its own, pinned to the plan node's Ray node), removed
ones are gone with what only they held (actors, placement groups, port claims), so that the cluster's free GPUs
come back to what they were. Every test ends with nothing of the deployment left (``clean_cluster``).

Expected placements are worked out by hand: ``debug_rollout_only=true`` puts the rollout at GPU slot 0, slot
``s`` is plan node ``s // 8``, local GPU ``s % 8``; the cluster has 32 GPUs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.backends.ray_placement import BundlePlan, HeldGpus, ProcessPlacement, place_added
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.serving.routers import router_workers
from tests.conftest_ray import clean_cluster, ray_cluster  # noqa: F401 - fixtures
from tests.launch_helpers import generate_body, process_alive
from tests.ray_helpers import FakeCluster
from tests.test_ray_backend import ray_overrides

FAST = [
    "sglang_deploy.supervision.health_interval_s=0.3",
    "sglang_deploy.supervision.health_timeout_s=0.5",
    "sglang_deploy.supervision.kill_grace_s=0.5",
    "sglang_deploy.launch.drain_timeout_s=5",
]


def stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/stand_in/stats", timeout=10).json()  # type: ignore[no-any-return]


def placed(d: Deployment) -> dict[str, tuple[str, str, int]]:
    """engine id -> (Ray node id, CUDA_VISIBLE_DEVICES, pid), as each stand-in reports it."""
    out = {}
    for e in d.engines():
        s = stats(e.url)
        out[e.id] = (s["node_id"], s["cuda_visible_devices"], s["pid"])
    return out


def actor_of(d: Deployment) -> dict[str, str]:
    """engine id -> the Ray actor id of the actor that started its process."""
    return {row.id: row.processes[0].actor._actor_id.hex() for row in d.fleet.engines() if row.processes}


def listed(d: Deployment, model: str = "actor") -> list[str]:
    return sorted(w["url"] for w in router_workers(d.registry[model].base_url))


def free_gpus(cluster: FakeCluster, expected: float, timeout_s: float = 20.0) -> float:
    """The cluster's free GPUs once they equal ``expected`` (Ray's view catches up within a moment), else the
    last count seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = float(cluster.ray.available_resources().get("GPU", 0))
        if free == expected or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


# ---------------------------------------------------------------------------- where added processes go (pure)
def _process(engine: str, node: int, gpus: tuple[int, ...]) -> ProcessPlacement:
    return ProcessPlacement(engine, 0, engine, node, tuple(node * 8 + g for g in gpus), gpus)


def test_added_processes_go_onto_the_actor_whose_bundle_holds_their_gpus() -> None:
    """Node 0's actor holds local GPUs 0-3 (engines 0-1 at TP 2, engine 1 removed): an engine added at 2,3 goes
    onto it; one at 4,5 and one at 6,7 get one new actor for node 0 (a bundle of 4,5,6,7); one on node 1 gets
    its own. One actor per process: each a bundle of its own. An engine at 3,4 would split the bundle."""
    held = [HeldGpus("node 0", 0, (0, 1, 2, 3))]
    added = [_process("a.2", 0, (2, 3)), _process("a.3", 0, (4, 5)), _process("a.4", 0, (6, 7)),
             _process("a.5", 1, (0, 1))]  # fmt: skip
    per_node = place_added(added, held, per_node=True, in_trainer_group=False)
    assert per_node.onto == {("a.2", 0): "node 0"} and per_node.problems == ()
    assert per_node.new == (
        BundlePlan(0, (4, 5, 6, 7), (("a.3", 0), ("a.4", 0))),
        BundlePlan(1, (0, 1), (("a.5", 0),)),
    )
    per_process = place_added(
        added[1:3], [HeldGpus("a.1", 0, (2, 3))], per_node=False, in_trainer_group=False
    )
    assert per_process.new == (BundlePlan(0, (4, 5), (("a.3", 0),)), BundlePlan(0, (6, 7), (("a.4", 0),)))
    split = place_added([_process("a.6", 0, (3, 4))], held, per_node=True, in_trainer_group=False)
    assert (split.onto, split.new) == ({}, ())
    assert split.problems == (
        "a.6: its local GPUs 3,4 of node 0 are in part (GPUs 3) held by node 0, whose bundle cannot be split",
    )


def test_added_processes_in_the_trainers_group_join_their_nodes_actor() -> None:
    held = [HeldGpus("node 1", 1)]
    added = [_process("a.2", 1, (4, 5)), _process("a.3", 2, (0, 1))]
    per_node = place_added(added, held, per_node=True, in_trainer_group=True)
    assert per_node.onto == {("a.2", 0): "node 1"}
    assert per_node.new == (BundlePlan(2, (0, 1), (("a.3", 0),)),)
    per_process = place_added(added, held, per_node=False, in_trainer_group=True)
    assert per_process.onto == {} and [b.processes for b in per_process.new] == [(("a.2", 0),), (("a.3", 0),)]


# ------------------------------------------------------------------------------------------------ on the cluster
@pytest.mark.ray
def test_resize_grows_onto_a_second_node_and_shrinks_back_giving_every_gpu_back(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Actor regular 4 GPUs at TP 2 (one actor per node, its own group): engines 0-1 on plan node 0, local GPUs
    0,1 and 2,3 of one Ray node X (a bundle of 4). Resized to 12: engines 2-3 at local GPUs 4,5 and 6,7 of plan
    node 0 (a new actor in a new group of 4 GPUs pinned to X), engines 4-5 at 0,1 and 2,3 of plan node 1 (a new
    actor on another Ray node Y). Resized back to 4: engines 2-5 stop, both new actors and their groups go, and
    the cluster has 28 GPUs free again, as before the grow."""
    overrides = ray_overrides(
        "debug_rollout_only=true",
        "sglang.actor.num_gpus_per_engine=2",
        "sglang_deploy.router.policy=round_robin",
        *FAST,
    )
    cfg = compose_config([*overrides, "sglang.actor.regular.num_gpus=4"])
    assert free_gpus(clean_cluster, 32) == 32
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        assert free_gpus(clean_cluster, 28) == 28
        first = placed(d)
        x = first["actor.regular.0"][0]
        assert [(node, gpus) for node, gpus, _ in first.values()] == [(x, "0,1"), (x, "2,3")]
        actors = actor_of(d)
        urls = {e.id: e.url for e in d.engines()}
        groups = len(clean_cluster.live_placement_groups())

        grown = d.resize("actor", "regular", 12)
        assert (grown.kept, grown.started, grown.stopped) == (
            ("actor.regular.0", "actor.regular.1"),
            tuple(f"actor.regular.{i}" for i in range(2, 6)),
            (),
        )
        now = placed(d)
        y = now["actor.regular.4"][0]
        assert y != x
        assert {e: (node, gpus) for e, (node, gpus, _) in now.items()} == {
            "actor.regular.0": (x, "0,1"),
            "actor.regular.1": (x, "2,3"),
            "actor.regular.2": (x, "4,5"),
            "actor.regular.3": (x, "6,7"),
            "actor.regular.4": (y, "0,1"),
            "actor.regular.5": (y, "2,3"),
        }
        # Kept: the same processes under the same actor, at the same URLs.
        assert {e: now[e][2] for e in grown.kept} == {e: first[e][2] for e in grown.kept}
        new_actors = actor_of(d)
        assert {e: new_actors[e] for e in grown.kept} == actors
        # One new actor per plan node for what the change added there, each in a group of its own.
        assert len(set(new_actors.values())) == 3
        assert new_actors["actor.regular.2"] == new_actors["actor.regular.3"] != actors["actor.regular.0"]
        assert new_actors["actor.regular.4"] == new_actors["actor.regular.5"]
        assert len(clean_cluster.live_placement_groups()) == groups + 2
        assert free_gpus(clean_cluster, 20) == 20
        assert {e.id: e.url for e in d.engines() if e.id in grown.kept} == urls
        assert listed(d) == sorted(e.url for e in d.engines())
        url = d.registry.get_model_url("actor", "/generate")
        for _ in range(6):  # round robin: every engine answers through the router
            assert httpx.post(url, json=generate_body(), timeout=30).status_code == 200

        shrunk = d.resize("actor", "regular", 4)
        assert (shrunk.kept, shrunk.stopped) == (
            ("actor.regular.0", "actor.regular.1"),
            tuple(f"actor.regular.{i}" for i in range(2, 6)),
        )
        assert not any(process_alive(now[e][2]) for e in shrunk.stopped)
        assert placed(d) == first and actor_of(d) == actors
        assert len(d.backend.actors) == 1  # type: ignore[attr-defined]
        assert len(clean_cluster.live_placement_groups()) == groups
        assert free_gpus(clean_cluster, 28) == 28
        assert listed(d) == sorted(urls.values())
    assert free_gpus(clean_cluster, 32) == 32


@pytest.mark.ray
def test_move_gpus_and_a_model_added_and_removed_with_one_actor_per_process(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """PD at TP 1, one actor per engine process, pinned bundles of 1 GPU on one Ray node X: prefill.0-1 on
    local GPUs 0, 1, decode.0-1 on 2, 3. One GPU moves from prefill to decode: prefill.1 stops and decode.2
    takes its GPU 1, started by the actor that held it (its bundle). Then a ref model of 2 GPUs is added (ref at
    slots 4, 5: two new actors, each in a group of one GPU pinned to X, GPUs 4 and 5) with a router of its own,
    and removed again: its actors, groups and router ports are given back, 28 GPUs free as before."""
    overrides = ray_overrides(
        "sglang=pd",
        "debug_rollout_only=true",
        "sglang.actor.num_gpus_per_engine=1",
        "sglang_deploy.launch.ray.engine_actors=per_process",
        *FAST,
    )
    sizes = ["sglang.actor.prefill.num_gpus=2", "sglang.actor.decode.num_gpus=2"]
    moved_sizes = ["sglang.actor.prefill.num_gpus=1", "sglang.actor.decode.num_gpus=3"]
    ref = ["+sglang_model@sglang.ref=base", "sglang.ref.model_path=/ref", "sglang.ref.regular.num_gpus=2",
           "sglang.ref.num_gpus_per_engine=1"]  # fmt: skip
    with launch_from_config(compose_config([*overrides, *sizes]), log_dir=tmp_path / "logs") as d:
        first = placed(d)
        x = first["actor.prefill.0"][0]
        assert {e: (node, gpus) for e, (node, gpus, _) in first.items()} == {
            "actor.prefill.0": (x, "0"),
            "actor.prefill.1": (x, "1"),
            "actor.decode.0": (x, "2"),
            "actor.decode.1": (x, "3"),
        }
        actors = actor_of(d)
        assert free_gpus(clean_cluster, 28) == 28

        moved = d.move_gpus("actor", "prefill", "decode", 1)
        assert (moved.kept, moved.started, moved.stopped) == (
            ("actor.prefill.0", "actor.decode.0", "actor.decode.1"),
            ("actor.decode.2",),
            ("actor.prefill.1",),
        )
        now = placed(d)
        assert now["actor.decode.2"][:2] == (x, "1")
        assert not process_alive(first["actor.prefill.1"][2])
        assert {e: now[e][2] for e in moved.kept} == {e: first[e][2] for e in moved.kept}
        after_move = actor_of(d)
        assert after_move == {
            **{e: actors[e] for e in moved.kept},
            "actor.decode.2": actors["actor.prefill.1"],
        }
        assert free_gpus(clean_cluster, 28) == 28
        assert listed(d) == sorted(e.url for e in d.engines())

        groups = len(clean_cluster.live_placement_groups())
        added = d.apply(compose_config([*overrides, *moved_sizes, *ref]))
        assert (added.started, added.diff.models_added) == (("ref.regular.0", "ref.regular.1"), ("ref",))
        with_ref = placed(d)
        assert (with_ref["ref.regular.0"][:2], with_ref["ref.regular.1"][:2]) == ((x, "4"), (x, "5"))
        assert len(clean_cluster.live_placement_groups()) == groups + 2
        assert free_gpus(clean_cluster, 26) == 26
        assert listed(d, "ref") == sorted(e.url for e in d.engines() if e.id.startswith("ref."))
        answer = httpx.post(d.registry.get_model_url("ref", "/generate"), json=generate_body(), timeout=30)
        assert answer.status_code == 200
        ref_router = d.prepared.ports.routers["ref"]  # type: ignore[union-attr]
        claims = d.backend.claims  # type: ignore[attr-defined]
        assert {ref_router.http, ref_router.prometheus} <= set(claims.fds)

        removed = d.apply(compose_config([*overrides, *moved_sizes]))
        assert (removed.stopped, removed.diff.models_removed) == (
            ("ref.regular.0", "ref.regular.1"),
            ("ref",),
        )
        assert not any(process_alive(with_ref[e][2]) for e in removed.stopped)
        assert placed(d) == now and actor_of(d) == after_move
        assert len(clean_cluster.live_placement_groups()) == groups
        assert free_gpus(clean_cluster, 28) == 28
        assert not {ref_router.http, ref_router.prometheus} & set(claims.fds)
        assert d.registry.names() == ("actor",)


@pytest.mark.ray
def test_resize_in_the_trainers_placement_group_keeps_its_bundles(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The trainer's group of 16 one-GPU bundles (0-7 on node 1, 8-15 on node 0; Miles' order puts node 0
    first), not colocated: the rollout's slots 8-15 are bundles 0-7 on node 1. Regular 4 at TP 2: engines 0-1
    on GPUs 0,1 and 2,3 of node 1 under one actor. Resized to 8: engines 2-3 take slots 12-15 = GPUs 4,5 and
    6,7 of node 1, started by the same actor; resized back to 4, the group (the trainer's) stays whole and the
    cluster's free GPUs stay 16 throughout."""
    from ray.util.placement_group import placement_group, remove_placement_group

    node0, node1 = clean_cluster.node_id(0), clean_cluster.node_id(1)
    pg = placement_group(
        [{"GPU": 1}] * 16,
        bundle_label_selector=[{"ray.io/node-id": node1}] * 8 + [{"ray.io/node-id": node0}] * 8,
    )
    order = list(range(8, 16)) + list(range(8))
    overrides = ray_overrides("sglang.actor.num_gpus_per_engine=2", *FAST)
    try:
        cfg = compose_config([*overrides, "sglang.actor.regular.num_gpus=4"])
        with launch_from_config(
            cfg, log_dir=tmp_path / "logs", placement_group=pg, bundle_indices=order
        ) as d:
            first = placed(d)
            actors = actor_of(d)
            assert [(node, gpus) for node, gpus, _ in first.values()] == [(node1, "0,1"), (node1, "2,3")]
            grown = d.resize("actor", "regular", 8)
            assert grown.started == ("actor.regular.2", "actor.regular.3")
            now = placed(d)
            assert {e: (node, gpus) for e, (node, gpus, _) in now.items()} == {
                "actor.regular.0": (node1, "0,1"),
                "actor.regular.1": (node1, "2,3"),
                "actor.regular.2": (node1, "4,5"),
                "actor.regular.3": (node1, "6,7"),
            }
            assert set(actor_of(d).values()) == set(actors.values()) and len(set(actors.values())) == 1
            assert free_gpus(clean_cluster, 16) == 16
            assert listed(d) == sorted(e.url for e in d.engines())
            shrunk = d.resize("actor", "regular", 4)
            assert shrunk.stopped == ("actor.regular.2", "actor.regular.3")
            assert not any(process_alive(now[e][2]) for e in shrunk.stopped)
            assert placed(d) == first and actor_of(d) == actors
            assert free_gpus(clean_cluster, 16) == 16
            assert clean_cluster.live_placement_groups() == [pg.id.hex()]
        clean_cluster.assert_clean(keep_groups=[pg.id.hex()])
    finally:
        remove_placement_group(pg)
