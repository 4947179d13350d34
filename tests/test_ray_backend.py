"""The ray backend on a real Ray cluster: 4 nodes x 8 fake GPUs on loopback (node 0 = the head = the driver's
node, at 127.0.0.1; nodes 1-3 at 127.0.0.2-4), stand-in engines, the real sglang-router.

Expected placements are worked out by hand from the plan (GPU slot s: node s // 8, local GPU s % 8) and the
cluster's layout; every test ends with nothing of the deployment left on any node (``clean_cluster``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.backends.base import LaunchError
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.serving.deployment import Deployment
from tests.conftest_ray import clean_cluster, ray_cluster  # noqa: F401 - fixtures
from tests.launch_helpers import REPO, generate_body, process_alive, random_port_base
from tests.ray_helpers import FakeCluster, address_of
from tests.router_helpers import router_workers

pytestmark = pytest.mark.ray


def ray_overrides(*extra: str, startup_timeout_s: float = 90.0) -> list[str]:
    return [
        "hf_checkpoint=/c",
        "sglang_deploy=simulated",
        "sglang_deploy.launch.backend=ray",
        f"sglang_deploy.launch.port_base={random_port_base()}",
        f"sglang_deploy.launch.startup_timeout_s={startup_timeout_s}",
        "sglang_deploy.launch.shutdown_grace_s=3",
        "sglang_deploy.launch.poll_interval_s=0.2",
        "sglang_deploy.launch.live=never",
        "sglang_deploy.launch.ray.placement_timeout_s=60",
        *extra,
    ]


def subprocess_env(cluster: FakeCluster, **extra: str) -> dict[str, str]:
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def trainer_gpus_on(cluster: FakeCluster, node: int) -> Iterator[Any]:
    """Hold node ``node``'s 8 GPUs, as a trainer's training actors do."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"GPU": 8}], bundle_label_selector=[{"ray.io/node-id": cluster.node_id(node)}])
    cluster.ray.get(pg.ready(), timeout=30)
    try:
        yield pg
    finally:
        remove_placement_group(pg)


def node_of_log(log: Path, cluster: FakeCluster, timeout_s: float = 60.0) -> int:
    """The fake node an engine runs on, from the first line its stand-in logs (``..., node <id>``)."""
    deadline = time.monotonic() + timeout_s
    by_id = {node_id: int(addr.rsplit(".", 1)[1]) - 1 for addr, node_id in cluster.node_ids().items()}
    while time.monotonic() < deadline:
        if log.exists() and (m := re.search(r"node ([0-9a-f]{20,})", log.read_text(errors="replace"))):
            return by_id[m.group(1)]
        time.sleep(0.1)
    raise AssertionError(f"no node id in {log}")


# ------------------------------------------------------------------------------------ the card command
CARD_EXPECTED = {
    # rollout_offset 8 (the trainer's 8 GPUs are node 0's); every group at TP 2 (the preset leaves TP to the
    # trainer: rollout_num_gpus_per_engine=2 of examples/conf): actor prefill 8 on node 1, decode 12 on node 2
    # and the first half of node 3, ref 4 after it.
    "actor.prefill.0": (1, "0,1"),
    "actor.prefill.1": (1, "2,3"),
    "actor.prefill.2": (1, "4,5"),
    "actor.prefill.3": (1, "6,7"),
    "actor.decode.0": (2, "0,1"),
    "actor.decode.1": (2, "2,3"),
    "actor.decode.2": (2, "4,5"),
    "actor.decode.3": (2, "6,7"),
    "actor.decode.4": (3, "0,1"),
    "actor.decode.5": (3, "2,3"),
    "ref.regular.0": (3, "4,5"),
    "ref.regular.1": (3, "6,7"),
}


def test_card_command_runs_the_rollout_step_on_three_nodes(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    report = tmp_path / "engines.json"
    argv = [
        sys.executable,
        "examples/train.py",
        "sglang=pd_actor_ref",
        "sglang.actor.decode.num_gpus=12",
        "sglang_deploy=simulated",
        "sglang_deploy.launch.backend=ray",
        f"engines_report={report}",
        f"sglang_deploy.launch.port_base={random_port_base()}",
        "sglang_deploy.launch.shutdown_grace_s=3",
        "sglang_deploy.launch.live=never",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    with trainer_gpus_on(clean_cluster, 0):
        proc = subprocess.run(
            argv, cwd=REPO, env=subprocess_env(clean_cluster), capture_output=True, text=True, timeout=300
        )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "rollout 0: 4 samples" in proc.stdout
    output = proc.stdout + proc.stderr
    assert re.search(r"actor +│ http://127\.0\.0\.1:\d+ +│ pd", output), output[-3000:]  # routers: node 0
    reports = {r["id"]: r for r in json.loads(report.read_text())}
    assert set(reports) == set(CARD_EXPECTED)
    node_ids = clean_cluster.node_ids()
    for engine_id, (node, gpus) in CARD_EXPECTED.items():
        got = reports[engine_id]
        assert got["plan_node"] == node, engine_id
        assert got["url"].startswith(f"http://{address_of(node)}:"), (engine_id, got["url"])
        # What the stand-in itself saw: CUDA_VISIBLE_DEVICES from Ray, on the Ray node of its plan node.
        assert got["reported_cuda_visible_devices"] == gpus, (engine_id, got)
        assert got["reported_node_id"] == node_ids[address_of(node)], (engine_id, got)


# ------------------------------------------------------------------------------ an engine over two nodes
def test_tp16_engine_runs_one_process_per_node(clean_cluster: FakeCluster, tmp_path: Path) -> None:  # noqa: F811
    cfg = compose_config(
        ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=16",
            "sglang.actor.num_gpus_per_engine=16",
        )
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as deployment:
        engine = [p for p in deployment.processes() if hasattr(p, "node")]
        assert [p.launch.node_rank for p in engine] == [0, 1]
        lead, follower = engine
        assert lead.node.node_id != follower.node.node_id
        # Plan nodes go to the chosen Ray nodes in address order.
        assert tuple(map(int, lead.node.address.split("."))) < tuple(
            map(int, follower.node.address.split("."))
        )
        dist = {p.launch.server_args["dist_init_addr"] for p in engine}
        assert (
            len(dist) == 1
            and dist.pop()
            == f"{lead.node.address}:{lead.launch.server_args['dist_init_addr'].rsplit(':', 1)[1]}"
        )
        assert all(p.exit_code() is None for p in engine)
        info = httpx.get(deployment.engines()[0].url + "/server_info", timeout=10).json()
        assert (info["nnodes"], info["node_rank"], info["tp_size"]) == (2, 0, 16)
        assert info["cuda_visible_devices"] == "0,1,2,3,4,5,6,7" and info["node_id"] == lead.node.node_id
        # The deployment is ready once the lead answers; the follower's start-up lines reach its log through
        # its actor, which on a loaded machine can be a moment later (once seen empty at this point)
        deadline = time.monotonic() + 60
        while "node_rank=1 of nnodes=2" not in (tail := follower.tail()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "node_rank=1 of nnodes=2" in tail
        assert f"follower of --dist-init-addr {lead.launch.server_args['dist_init_addr']}" in tail
        assert f"CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7, node {follower.node.node_id}" in tail
        url = deployment.registry.get_model_url("actor", "/generate")
        assert httpx.post(url, json=generate_body(), timeout=30).status_code == 200


# ------------------------------------------------------------------------- the trainer's placement group
def test_engines_run_in_the_placement_group_the_trainer_hands_over(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Miles' hand-off: one bundle per GPU for trainer and rollout together, and the slot -> bundle order."""
    from ray.util.placement_group import placement_group, remove_placement_group

    node0, node1 = clean_cluster.node_id(0), clean_cluster.node_id(1)
    # Bundles 0-7 on node 1, 8-15 on node 0; Miles' order puts node 0 (the trainer's) first.
    pg = placement_group(
        [{"GPU": 1}] * 16,
        bundle_label_selector=[{"ray.io/node-id": node1}] * 8 + [{"ray.io/node-id": node0}] * 8,
    )
    order = list(range(8, 16)) + list(range(8))
    try:
        # Not colocated: the actor's 8 GPUs are slots 0-7, the rollout's 8 are slots 8-15 = plan node 1.
        cfg = compose_config(
            ray_overrides("sglang.actor.regular.num_gpus=8", "sglang.actor.num_gpus_per_engine=4")
        )
        with launch_from_config(
            cfg, log_dir=tmp_path / "logs", placement_group=pg, bundle_indices=order
        ) as d:
            assert any("the trainer's placement group" in note for note in d.notes)
            got = {}
            for e in d.engines():
                info = httpx.get(e.url + "/server_info", timeout=10).json()
                got[e.id] = (
                    e.url.split("//")[1].rsplit(":", 1)[0],
                    info["cuda_visible_devices"],
                    info["node_id"],
                )
        assert got == {
            "actor.regular.0": (address_of(1), "0,1,2,3", node1),
            "actor.regular.1": (address_of(1), "4,5,6,7", node1),
        }
    finally:
        remove_placement_group(pg)


def test_gpus_the_cluster_cannot_give_are_a_clear_error_before_anything_starts(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    # The trainer's 4 GPUs first: the engine is planned on local GPUs 4-7 of node 0. Nothing holds GPUs 0-3
    # in Ray, so the backend's own placement group gets GPUs 0-3 of the node it lands on.
    cfg = compose_config(
        ray_overrides(
            "actor_num_gpus_per_node=4",
            "sglang.actor.regular.num_gpus=4",
            "sglang.actor.num_gpus_per_engine=4",
        )
    )
    with pytest.raises(LaunchError) as exc, launch_from_config(cfg, log_dir=tmp_path / "logs"):
        pytest.fail("must not start")
    msg = str(exc.value)
    assert msg.startswith("the Ray cluster cannot give the plan's GPUs:"), msg
    assert re.search(
        r"actor\.regular\.0: the plan gives it local GPUs 4,5,6,7 of node 0, but Ray assigned GPUs 0,1,2,3 on "
        r"127\.0\.0\.\d \(Ray node [0-9a-f]{8}\)",
        msg,
    ), msg
    assert "placement_group=pg" in msg
    assert not list(tmp_path.glob("logs/*.log")), "an engine was started"


def test_a_plan_larger_than_the_cluster_fails_at_the_placement_deadline(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    # 40 GPUs from slot 0 = 5 nodes of 8, on a cluster of 4 such nodes.
    cfg = compose_config(
        ray_overrides("debug_rollout_only=true", "sglang.actor.regular.num_gpus=40", "sglang.actor.num_gpus_per_engine=8",
                      "sglang_deploy.launch.ray.placement_timeout_s=3")
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(LaunchError) as exc, launch_from_config(cfg, log_dir=tmp_path / "logs"):
        pytest.fail("must not start")
    assert time.monotonic() - started >= 3  # the placement deadline was waited for (the message says which)
    assert str(exc.value) == (
        "placing 5 node(s) with 8, 8, 8, 8, 8 free GPU(s) did not finish within "
        "sglang_deploy.launch.ray.placement_timeout_s=3 s; the cluster has 4 live node(s) (127.0.0.1: 8 GPUs, "
        "127.0.0.2: 8 GPUs, 127.0.0.3: 8 GPUs, 127.0.0.4: 8 GPUs), 32 GPU(s) free in all"
    )


# ------------------------------------------------------------------------------------------------ faults
def test_engine_failing_at_start_on_a_remote_node(clean_cluster: FakeCluster, tmp_path: Path) -> None:  # noqa: F811
    cfg = compose_config(
        ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=16",
            "sglang.actor.num_gpus_per_engine=8",
            "sglang_deploy.standin.fail_at_start=[actor.regular.1]",
            startup_timeout_s=3600,  # failed by the exit: the deadline is an hour away
        )
    )
    with pytest.raises(LaunchError) as exc, launch_from_config(cfg, log_dir=tmp_path / "logs"):
        pytest.fail("must not become ready")
    msg = str(exc.value)
    assert msg.startswith("engine actor.regular.1 exited with code 3 during start-up"), msg
    where = re.search(r"where: pid \d+ on node (127\.0\.0\.\d) \(Ray node ([0-9a-f]{8})\)", msg)
    assert where, msg
    assert where.group(1) != address_of(0)  # plan node 1: the higher address of the two chosen
    assert clean_cluster.node_ids()[where.group(1)].startswith(where.group(2))
    assert f"actor.regular.1.log on node {where.group(1)}" in msg
    assert "failing at start as asked by MSP_STANDIN_FAIL_AT_START" in msg


def test_worker_node_lost_during_start_up(clean_cluster: FakeCluster, tmp_path: Path) -> None:  # noqa: F811
    logs = tmp_path / "logs"
    cfg = compose_config(
        ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=16",
            "sglang.actor.num_gpus_per_engine=8",
            "sglang_deploy.standin.start_delay_s=3600",
            startup_timeout_s=3600,  # only the node's loss can end the start-up before the test's timeout
        )
    )
    removed: dict[str, Any] = {}

    def remove_node_of_engine_1() -> None:
        node = node_of_log(logs / "actor.regular.1.log", clean_cluster)
        removed["node"] = node
        clean_cluster.remove_worker(node)

    killer = threading.Thread(target=remove_node_of_engine_1, daemon=True)
    killer.start()
    with pytest.raises(LaunchError) as exc, launch_from_config(cfg, log_dir=logs):
        pytest.fail("must not become ready")
    killer.join(60)
    assert removed, "the node was not removed"
    msg = str(exc.value)
    address = address_of(removed["node"])
    assert msg.startswith("engine actor.regular.1 exited with code -9 during start-up"), msg
    assert f"its node {address} (Ray node " in msg and "left the Ray cluster" in msg, msg


def test_engines_of_a_node_removed_while_serving_are_placed_again_on_a_free_node(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two 8-GPU engines on two of the four nodes; a worker node of one of them is removed while serving. Its
    engine is placed again on one of the two free nodes (all 8 GPUs there, that node's address), takes the weight
    version the deployment has, is registered there, and the deployment keeps serving; the other engine is not
    touched."""
    logs = tmp_path / "logs"
    cfg = compose_config(
        ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=16",
            "sglang.actor.num_gpus_per_engine=8",
            "sglang_deploy.supervision.health_interval_s=0.3",
            "sglang_deploy.supervision.restart_backoff_s=0.1",
        )
    )
    with launch_from_config(cfg, log_dir=logs) as deployment:
        assert deployment.control.update_weight_version("3").ok
        nodes = {e.id: node_of_log(logs / f"{e.id}.log", clean_cluster) for e in deployment.engines()}
        victim = max(nodes, key=lambda e: nodes[e])  # on a worker node (the head cannot be removed)
        (other,) = set(nodes) - {victim}
        assert nodes[victim] >= 1 and nodes[victim] != nodes[other]
        kept = httpx.get(deployment.fleet.engine(other).url + "/server_info", timeout=10).json()
        since = len(deployment.events())
        clean_cluster.remove_worker(nodes[victim])

        placed = deployment.wait_for_event("engine_placed_again", subject=victim, since=since, timeout_s=120)
        deployment.wait_for_event("engine_recovered", subject=victim, since=since, timeout_s=120)
        url = deployment.fleet.engine(victim).url
        assert placed.details["url"] == url
        free = {address_of(n) for n in range(4)} - {address_of(n) for n in nodes.values()}
        assert httpx.URL(url).host in free, (url, free)
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["cuda_visible_devices"] == "0,1,2,3,4,5,6,7"
        assert info["node_id"] == clean_cluster.node_ids()[httpx.URL(url).host]
        assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == "3"
        # the other engine: the same process, port and GPUs
        still = httpx.get(deployment.fleet.engine(other).url + "/server_info", timeout=10).json()
        assert (still["pid"], still["port"], still["cuda_visible_devices"]) == (
            kept["pid"],
            kept["port"],
            kept["cuda_visible_devices"],
        )
        router = deployment.registry.get_model_url("actor")
        for _ in range(4):
            out = httpx.post(router, json=generate_body(), timeout=30)
            assert out.status_code == 200 and out.json()["meta_info"]["weight_version"] == "3"
        assert deployment.state().status == "serving" and deployment.failure is None
    clean_cluster.assert_clean()


def test_a_node_lost_with_no_room_left_fails_the_deployment_naming_the_engine(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Four 8-GPU engines fill the four nodes; a worker node is removed while serving. No node has 8 GPUs free:
    the one restart supervision allows tries to place the engine again for placement_timeout_s and gives up;
    the deployment fails, naming the engine, the lost node and why, and the CLI exits 1."""
    logs = tmp_path / "logs"
    argv = [
        sys.executable,
        "-m",
        "miles_sglang_plugin",
        "launch",
        f"--log-dir={logs}",
        *ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=32",
            "sglang.actor.num_gpus_per_engine=8",
            "sglang_deploy.supervision.max_restarts=1",
            # The same deadline covers the first start of the four node actors: 5 s was too short for that
            # with the two cores busy (it failed once in three full runs under load).
            "sglang_deploy.launch.ray.placement_timeout_s=30",
        ),
    ]
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=subprocess_env(clean_cluster), stdout=o, stderr=e)
    try:
        deadline = time.monotonic() + 180
        while "serving" not in err.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        node = node_of_log(logs / "actor.regular.3.log", clean_cluster)
        victim = "actor.regular.3"
        if node == 0:  # the head cannot be removed: take the engine of another node
            node, victim = node_of_log(logs / "actor.regular.2.log", clean_cluster), "actor.regular.2"
        clean_cluster.remove_worker(node)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = err.read_text()
    assert code == 1, text
    flat = " ".join(text.split())
    assert re.search(
        rf"error: the deployment failed and was stopped: engine {re.escape(victim)} could not be brought back "
        r"after 1 restart\(s\) \(supervision\.max_restarts=1\); last problem: "
        rf"{re.escape(victim)} cannot be started again on node {re.escape(address_of(node))} \(Ray node "
        r"[0-9a-f]{8}\): its node .* left the Ray cluster.*; it could not be placed on another node: placing "
        r".* did not finish within sglang_deploy\.launch\.ray\.placement_timeout_s=30 s; the cluster has 3 "
        r"live node\(s\)",
        flat,
    ), text


DRIVER_SCRIPT = textwrap.dedent(
    """
    import json, signal, sys, time
    from pathlib import Path
    from miles_sglang_plugin.app.hydra_edge import launch_from_config
    from miles_sglang_plugin.config.compose import compose_config

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even if started with SIGINT ignored
    with launch_from_config(compose_config(json.loads(sys.argv[1])), log_dir=Path(sys.argv[2])) as d:
        print(json.dumps({"ready": [p.pid for p in d.processes()]}), flush=True)
        while True:
            time.sleep(0.1)
    """
)


def start_driver(cluster: FakeCluster, tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    """DRIVER_SCRIPT launching two 8-GPU engines (two nodes) and one router, then serving until stopped."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    two_nodes = (
        "debug_rollout_only=true",
        "sglang.actor.regular.num_gpus=16",
        "sglang.actor.num_gpus_per_engine=8",
    )
    return subprocess.Popen(
        [sys.executable, str(script), json.dumps(ray_overrides(*two_nodes, *extra)), str(tmp_path / "logs")],
        env=subprocess_env(cluster),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_driver_sigkilled_leaves_nothing_on_any_node(clean_cluster: FakeCluster, tmp_path: Path) -> None:  # noqa: F811
    proc = start_driver(clean_cluster, tmp_path)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        pids = json.loads(line)["ready"]
        assert len(pids) == 3  # two engines, one router
        assert (
            len(clean_cluster.alive_engine_actors()) == 2 and len(clean_cluster.deployment_processes()) == 3
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    clean_cluster.assert_clean(wait_s=30)  # actors, their engines, the router and the placement group


@pytest.mark.parametrize("when", ["ctrl-c during start-up", "sigterm while serving"])
def test_driver_stopped_by_a_signal_leaves_nothing(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
    when: str,
) -> None:
    during_start = when.startswith("ctrl-c")
    proc = start_driver(
        clean_cluster, tmp_path, *(["sglang_deploy.standin.start_delay_s=60"] if during_start else [])
    )
    try:
        if during_start:
            node_of_log(tmp_path / "logs" / "actor.regular.1.log", clean_cluster)  # both engines started
            proc.send_signal(signal.SIGINT)
        else:
            assert proc.stdout.readline(), proc.stderr.read()
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Everything stopped, the signal goes to the script's own handler: an uncaught KeyboardInterrupt ends Python by
    # SIGINT itself (-2); SIGTERM's default action ends it by SIGTERM (-15, status 143 in a shell).
    assert code == (-signal.SIGINT if during_start else -signal.SIGTERM), proc.stderr.read()[-3000:]
    clean_cluster.assert_clean(wait_s=10)


# ------------------------------------------------------------------------------------ multirun, one cluster
HYDRA_APP = textwrap.dedent(
    """
    import json, os
    from pathlib import Path

    import httpx
    import hydra
    from hydra.core.config_store import ConfigStore

    from miles_sglang_plugin.app.hydra_edge import launch_from_config

    ConfigStore.instance().store(
        name="app", node={"defaults": ["_self_", {"sglang": "default"}], "hf_checkpoint": "/c", "debug_rollout_only": True}
    )


    @hydra.main(version_base=None, config_name="app")
    def main(cfg):
        from ray._private import state
        from ray.util.placement_group import placement_group_table

        record = Path(os.environ["LAUNCH_RECORD"])
        earlier = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
        with launch_from_config(cfg) as launcher:
            url = launcher.registry.get_model_url("actor")
            httpx.post(url, json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30).raise_for_status()
            actors = [a._actor_id.hex() for a in launcher.backend.actors]
            groups = [g.id.hex() for g in launcher.backend.placement_groups]
            job = {
                "actors": actors,
                "groups": groups,
                "gpus": {e.id: e.gpus for e in launcher.engines()},
                "earlier_actor_states": sorted({state.actors(a)["State"] for j in earlier for a in j["actors"]}),
                "earlier_group_states": sorted(
                    {placement_group_table()[g]["state"] for j in earlier for g in j["groups"]}
                ),
            }
        with record.open("a") as f:
            f.write(json.dumps(job) + "\\n")


    if __name__ == "__main__":
        main()
    """
)


def test_multirun_over_tp_sizes_job_after_job_on_one_cluster(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    app = tmp_path / "app.py"
    app.write_text(HYDRA_APP)
    record = tmp_path / "jobs.jsonl"
    argv = [
        sys.executable,
        str(app),
        "-m",
        *ray_overrides("sglang.actor.regular.num_gpus=4", "sglang.actor.num_gpus_per_engine=2,4"),
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    env = subprocess_env(clean_cluster, LAUNCH_RECORD=str(record))
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = [json.loads(line) for line in record.read_text().splitlines()]
    assert [job["gpus"] for job in jobs] == [
        {"actor.regular.0": "0,1", "actor.regular.1": "2,3"},
        {"actor.regular.0": "0,1,2,3"},
    ]
    # One actor for the one node of each job; one placement group each.
    assert [len(job["actors"]) for job in jobs] == [1, 1] and all(len(job["groups"]) == 1 for job in jobs)
    # When job 1 ran, job 0's actors were dead and its placement group removed.
    assert jobs[1]["earlier_actor_states"] == ["DEAD"] and jobs[1]["earlier_group_states"] == ["REMOVED"]


# ------------------------------------------------------------------------------------------------ restart
def test_a_stopped_engine_process_starts_again_on_its_node_and_gpus(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    cfg = compose_config(
        ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=4",
            "sglang.actor.num_gpus_per_engine=2",
            "sglang_deploy.supervision.enabled=false",  # no restart of its own
        )
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as deployment:
        row = deployment.fleet.engines()[1]
        first = row.processes[0]
        before = httpx.get(first.launch.url + "/server_info", timeout=10).json()
        deployment.backend.stop([first], grace_s=3)
        assert first.exit_code() == 0 and first.exit_reason() is None
        again = deployment.backend.start(first.launch, log_path=tmp_path / "logs" / "again.log")
        deployment.fleet.update(row.id, processes=(again,))  # the deployment stops it at the end
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                after = httpx.get(first.launch.url + "/server_info", timeout=2).json()
                break
            assert time.monotonic() < deadline and again.exit_code() is None, again.tail()
            time.sleep(0.2)
        assert after["pid"] == again.pid != before["pid"]
        assert (after["node_id"], after["cuda_visible_devices"], after["port"]) == (
            before["node_id"],
            "2,3",
            before["port"],
        )
        assert again.node == first.node and again.exit_code() is None


def test_supervision_heals_an_engine_killed_on_its_ray_node(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Supervision on the ray backend: an engine process SIGKILLed on its node (not the node: its actor lives) is
    noticed, restarted through the same actor with its same argv, GPUs and port, re-registered, and serves."""
    cfg = compose_config(
        ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=4",
            "sglang.actor.num_gpus_per_engine=2",
            "sglang_deploy.router.policy=round_robin",
            "sglang_deploy.supervision.health_interval_s=0.3",
            "sglang_deploy.supervision.restart_backoff_s=0.1",
        )
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as deployment:
        victim = deployment.engines()[1]
        before = httpx.get(victim.url + "/server_info", timeout=10).json()
        since = len(deployment.events())
        os.kill(before["pid"], signal.SIGKILL)  # the node is this machine: the stand-in's own pid
        lost = deployment.wait_for_event("engine_lost", subject=victim.id, since=since, timeout_s=60)
        assert "exited with code -9" in lost.message and "on node" in lost.message, lost.message
        deployment.wait_for_event("engine_recovered", subject=victim.id, since=since, timeout_s=60)
        after = httpx.get(victim.url + "/server_info", timeout=10).json()
        assert after["pid"] != before["pid"]
        assert (after["node_id"], after["cuda_visible_devices"], after["port"]) == (
            before["node_id"],
            "2,3",
            before["port"],
        )
        assert deployment.state().status == "serving"
        url = deployment.registry.get_model_url("actor")
        for _ in range(4):  # both engines answer again through the router
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            assert httpx.post(url, json=body, timeout=30).status_code == 200
    clean_cluster.assert_clean()


def test_engines_whose_node_actor_died_on_a_live_node_are_healed(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The Ray actor of a node is killed (the node lives on): every engine it started dies with it, is noticed
    lost, and is started again through one new actor in the same bundle, on the same node and GPUs (before: the
    whole deployment failed, as for a lost node)."""
    import ray

    cfg = compose_config(
        ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=4",
            "sglang.actor.num_gpus_per_engine=2",
            "sglang_deploy.supervision.health_interval_s=0.3",
        )
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as deployment:
        engines = deployment.engines()
        before = {e.id: httpx.get(e.url + "/server_info", timeout=10).json() for e in engines}
        since = len(deployment.events())
        (actor,) = deployment.backend.actors  # one node: one actor for both engines
        ray.kill(actor, no_restart=True)  # type: ignore[attr-defined]
        for engine in engines:
            lost = deployment.wait_for_event("engine_lost", subject=engine.id, since=since, timeout_s=60)
            assert "Ray actor" in lost.message, lost.message
        for engine in engines:
            deployment.wait_for_event("engine_recovered", subject=engine.id, since=since, timeout_s=90)
        (again,) = deployment.backend.actors
        assert again is not actor
        for engine, gpus in zip(engines, ("0,1", "2,3"), strict=True):
            after = httpx.get(engine.url + "/server_info", timeout=10).json()
            assert (after["node_id"], after["cuda_visible_devices"], after["port"]) == (
                before[engine.id]["node_id"],
                gpus,
                before[engine.id]["port"],
            )
            assert after["pid"] != before[engine.id]["pid"]
        assert deployment.state().status == "serving" and deployment.failure is None
    clean_cluster.assert_clean()


def test_an_engine_whose_own_actor_died_is_healed_alone_with_one_actor_per_process(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """engine_actors=per_process: each engine process has an actor of its own; killing one takes only its
    engine, which comes back through a new actor in its bundle, on its node and GPUs."""
    import ray

    cfg = compose_config(
        ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=4",
            "sglang.actor.num_gpus_per_engine=2",
            "sglang_deploy.supervision.health_interval_s=0.3",
            "sglang_deploy.launch.ray.engine_actors=per_process",
        )
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as deployment:
        assert len(deployment.backend.actors) == 2
        survivor, victim = deployment.engines()
        before = httpx.get(victim.url + "/server_info", timeout=10).json()
        untouched = httpx.get(survivor.url + "/server_info", timeout=10).json()["pid"]
        since = len(deployment.events())
        (process,) = deployment.fleet.engine(victim.id).processes
        ray.kill(process.actor, no_restart=True)  # type: ignore[attr-defined]
        lost = deployment.wait_for_event("engine_lost", subject=victim.id, since=since, timeout_s=60)
        assert "Ray actor" in lost.message, lost.message
        deployment.wait_for_event("engine_recovered", subject=victim.id, since=since, timeout_s=90)
        after = httpx.get(victim.url + "/server_info", timeout=10).json()
        assert (after["node_id"], after["cuda_visible_devices"], after["port"]) == (
            before["node_id"],
            "2,3",
            before["port"],
        )
        assert httpx.get(survivor.url + "/server_info", timeout=10).json()["pid"] == untouched
        assert not [e for e in deployment.events()[since:] if e.subject == survivor.id]
        assert deployment.state().status == "serving" and deployment.failure is None
    clean_cluster.assert_clean()


@pytest.mark.parametrize("engine_actors", ["per_node", "per_process"])
def test_each_engine_gets_its_own_gpus_from_the_actors_of_its_nodes(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
    engine_actors: str,
) -> None:
    # 16 GPUs from slot 0 in TP 4: engines 0-1 on node 0 (local GPUs 0-3, 4-7), engines 2-3 on node 1. Per node,
    # one actor per node starts both engines there; per process, one actor each.
    cfg = compose_config(
        ray_overrides(
            "debug_rollout_only=true",
            "sglang.actor.regular.num_gpus=16",
            "sglang.actor.num_gpus_per_engine=4",
            f"sglang_deploy.launch.ray.engine_actors={engine_actors}",
        )
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as deployment:
        assert len(deployment.backend.actors) == (2 if engine_actors == "per_node" else 4)
        assert any(
            f"one per {'node' if engine_actors == 'per_node' else 'engine process'}" in n
            for n in deployment.notes
        )
        got = {}
        for e in deployment.engines():
            info = httpx.get(e.url + "/server_info", timeout=10).json()
            got[e.id] = (info["node_id"], info["cuda_visible_devices"])
        nodes = [got[f"actor.regular.{i}"][0] for i in range(4)]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
        assert [got[f"actor.regular.{i}"][1] for i in range(4)] == ["0,1,2,3", "4,5,6,7"] * 2
        tails = [
            p.tail() for p in deployment.processes() if hasattr(p, "actor")
        ]  # logs fetched from the nodes
        assert all("CUDA_VISIBLE_DEVICES=" in tail for tail in tails), tails
    clean_cluster.assert_clean()


# ------------------------------------------------------------------------------------------------ benchmark
@pytest.mark.slow
def test_benchmark_smoke_run_on_the_cluster(clean_cluster: FakeCluster) -> None:  # noqa: F811
    """benchmarks/bench_ray.py --smoke, on this session's cluster, so that the script cannot rot."""
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_ray.py", "--smoke", "--address", clean_cluster.address],
        cwd=REPO,
        env=subprocess_env(clean_cluster),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("ray/local time to ready:") == 2, result.stdout
    assert result.stdout.count("ray per process/local time to ready:") == 2, result.stdout


# ---------------------------------------------------------------------- the packed sweep launcher on the cluster
# hydra/launcher=sglang_packed with the ray backend: the launcher counts the cluster's GPUs (asked of the cluster
# from a short-lived process), runs jobs side by side while they fit, and the engines of concurrent jobs hold
# disjoint GPUs of the cluster, as Ray assigned them (tests/sweep_app).

SWEEP_APP = Path(__file__).resolve().parent / "sweep_app" / "app.py"


def _packed_sweep(
    tmp_path: Path, cluster: FakeCluster, *args: str
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    sweep = tmp_path / "sweep"
    argv = [
        sys.executable,
        str(SWEEP_APP),
        "-m",
        "hydra/launcher=sglang_packed",
        f"hydra.sweep.dir={sweep}",
        *ray_overrides("sglang.actor.regular.num_gpus=8", *args),
    ]
    env = subprocess_env(cluster, MSP_GPU_LOCK_DIR=str(tmp_path / "locks"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = subprocess.run(argv, cwd=SWEEP_APP.parent, env=env, capture_output=True, text=True, timeout=300)
    records = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/job_record.json"))]
    return result, records


def _cluster_gpus_of(record: dict) -> set[tuple[str, str]]:
    return {(e["node_id"], gpu) for e in record["engines"] for gpu in e["reported"].split(",")}


def _ran_together(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_jobs_share_the_cluster_side_by_side_on_disjoint_gpus(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    result, jobs = _packed_sweep(tmp_path, clean_cluster, "hold_s=3,3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "packed on 32 GPUs" in result.stderr + result.stdout  # the cluster's 4 x 8, asked of it
    assert len(jobs) == 2 and _ran_together(jobs[0], jobs[1])
    for job in jobs:
        assert len(_cluster_gpus_of(job)) == 8 and job["packed_gpus"].count(",") == 7
    assert not _cluster_gpus_of(jobs[0]) & _cluster_gpus_of(jobs[1])


def test_jobs_that_do_not_fit_together_run_one_after_the_other(
    clean_cluster: FakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    result, jobs = _packed_sweep(tmp_path, clean_cluster, "hydra.launcher.gpus=8", "hold_s=0.5,0.5")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(jobs) == 2 and not any(_ran_together(a, b) for a, b in combinations(jobs, 2))


# ---------------------------------------------------------------------------- changing a running deployment
# Deployment.apply / resize / move_gpus: kept engines keep their actors and processes, added ones get their GPUs
# where the stable plan puts them (under the actor whose bundle holds them, else a new actor in a placement group
# of its own pinned to the plan node's Ray node), removed ones take along what only they held (actors, groups,
# port claims). Plans with debug_rollout_only=true start at GPU slot 0; the cluster has 32 GPUs.
ELASTIC_FAST = [
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
        *ELASTIC_FAST,
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
        *ELASTIC_FAST,
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
    overrides = ray_overrides("sglang.actor.num_gpus_per_engine=2", *ELASTIC_FAST)
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
