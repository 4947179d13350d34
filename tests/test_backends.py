"""Backends without a Ray cluster: the ray backend's placement rules (pure functions), engine ports found per
node, what ``plan --commands`` shows for nodes whose addresses the launch decides, the errors a user gets
before anything starts (Ray not installed, no cluster, bad settings, a placement group with the local
backend), and restarts through the backend interface (local backend).

Expected bundles, nodes and ports are worked out by hand from the plans (GPU slot s: node s // 8, local GPU
s % 8; a node-rank-0 process takes http, nccl, a dist-init run of 30 + dp_size ports, engine-info, and a
prefill engine a disaggregation port)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config, prepare_from_config, resolve_config
from miles_sglang_plugin.backends import get_backend
from miles_sglang_plugin.backends.local import LocalBackend, LocalEngineProcess
from miles_sglang_plugin.backends.ray_placement import (
    BundlePlan,
    HostPlan,
    PlacementError,
    ProcessGrant,
    RayNodeInfo,
    address_order,
    assign_plan_nodes,
    bundle_gpu_ids,
    check_grants,
    engine_hosts,
    own_bundles,
    process_placements,
    slot_bundles,
    spread_order,
)
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.rendering.ports import EnginePorts, assign_ports
from tests.conftest_launch import leak_check  # noqa: F401 - fixture
from tests.launch_helpers import REPO, LeakTracker, launch_overrides, port_accepts
from tests.ray_helpers import skip_or_fail
from tests.test_rendering import PD_TP_2_4

#: The card command, with the actor at TP 4 (the Miles guide's example; the preset leaves TP to the trainer).
CARD = (
    "sglang=pd_actor_ref",
    "sglang.actor.decode.num_gpus=12",
    "hf_checkpoint=/c",
    "sglang.actor.num_gpus_per_engine=4",
)


def plan_of(*overrides: str):
    return resolve_config(compose_config(list(overrides)))


# ---------------------------------------------------------------------------------------- placement
def test_own_placement_group_of_the_card_plan_one_actor_per_node() -> None:
    # rollout_offset 8: actor prefill 8 = slots 8-15 (node 1), decode 12 = slots 16-27, ref 4 (TP 1 here, no
    # rollout_num_gpus_per_engine) = slots 28-31 (node 3, local 4-7). One bundle per plan node, with all of its
    # rollout GPUs and its engine processes.
    plan = plan_of(*CARD)
    node3 = (("actor.decode.2", 0), *((f"ref.regular.{i}", 0) for i in range(4)))
    assert own_bundles(plan) == [
        BundlePlan(1, (0, 1, 2, 3, 4, 5, 6, 7), (("actor.prefill.0", 0), ("actor.prefill.1", 0))),
        BundlePlan(2, (0, 1, 2, 3, 4, 5, 6, 7), (("actor.decode.0", 0), ("actor.decode.1", 0))),
        BundlePlan(3, (0, 1, 2, 3, 4, 5, 6, 7), node3),
    ]  # fmt: skip
    assert engine_hosts(process_placements(plan)) == [
        HostPlan("node 1", 1, (("actor.prefill.0", 0), ("actor.prefill.1", 0))),
        HostPlan("node 2", 2, (("actor.decode.0", 0), ("actor.decode.1", 0))),
        HostPlan("node 3", 3, node3),
    ]  # fmt: skip


def test_own_placement_group_of_the_card_plan_one_actor_per_process() -> None:
    plan = plan_of(*CARD)
    assert own_bundles(plan, per_node=False) == [
        BundlePlan(1, (0, 1, 2, 3), (("actor.prefill.0", 0),)),
        BundlePlan(1, (4, 5, 6, 7), (("actor.prefill.1", 0),)),
        BundlePlan(2, (0, 1, 2, 3), (("actor.decode.0", 0),)),
        BundlePlan(2, (4, 5, 6, 7), (("actor.decode.1", 0),)),
        BundlePlan(3, (0, 1, 2, 3), (("actor.decode.2", 0),)),
        BundlePlan(3, (4,), (("ref.regular.0", 0),)),
        BundlePlan(3, (5,), (("ref.regular.1", 0),)),
        BundlePlan(3, (6,), (("ref.regular.2", 0),)),
        BundlePlan(3, (7,), (("ref.regular.3", 0),)),
    ]
    hosts = engine_hosts(process_placements(plan), per_node=False)
    assert [(h.name, h.node, h.processes) for h in hosts[:2]] == [
        ("actor.prefill.0", 1, (("actor.prefill.0", 0),)),
        ("actor.prefill.1", 1, (("actor.prefill.1", 0),)),
    ]
    assert len(hosts) == 9


def test_placeholder_gpus_keep_the_engines_local_ids() -> None:
    # Placeholder first: 2 GPUs at slots 0-1 (reserved, no engine), then regular 6 in TP 2 at slots 2-7. Per
    # process they get bundles of their own; per node the node's bundle holds them too.
    plan = plan_of("sglang=default", "hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=6",
                   "sglang.actor.num_gpus_per_engine=2", "sglang.actor.placeholder.num_gpus=2",
                   "sglang.actor.group_order=[placeholder,regular]")  # fmt: skip
    assert own_bundles(plan, per_node=False) == [
        BundlePlan(0, (0, 1), ()),
        BundlePlan(0, (2, 3), (("actor.regular.0", 0),)),
        BundlePlan(0, (4, 5), (("actor.regular.1", 0),)),
        BundlePlan(0, (6, 7), (("actor.regular.2", 0),)),
    ]
    keys = (("actor.regular.0", 0), ("actor.regular.1", 0), ("actor.regular.2", 0))
    assert own_bundles(plan) == [BundlePlan(0, (0, 1, 2, 3, 4, 5, 6, 7), keys)]


def test_a_node_of_placeholders_alone_has_a_bundle_and_no_actor() -> None:
    # regular 8 at slots 0-7 (node 0), then placeholder 8 at slots 8-15 (node 1): node 1 has no engine.
    plan = plan_of("sglang=default", "hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=8",
                   "sglang.actor.num_gpus_per_engine=8", "sglang.actor.placeholder.num_gpus=8")  # fmt: skip
    assert own_bundles(plan) == [
        BundlePlan(0, tuple(range(8)), (("actor.regular.0", 0),)),
        BundlePlan(1, tuple(range(8)), ()),
    ]
    assert [h.name for h in engine_hosts(process_placements(plan))] == ["node 0"]


def test_an_engine_wider_than_a_node_gets_one_bundle_per_node() -> None:
    plan = plan_of("hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=16",
                   "sglang.actor.num_gpus_per_engine=16")  # fmt: skip
    for per_node in (True, False):
        assert own_bundles(plan, per_node=per_node) == [
            BundlePlan(0, tuple(range(8)), (("actor.regular.0", 0),)),
            BundlePlan(1, tuple(range(8)), (("actor.regular.0", 1),)),
        ]
    assert [(p.name, p.node, p.local_gpu_ids) for p in process_placements(plan)] == [
        ("actor.regular.0.node0", 0, tuple(range(8))),
        ("actor.regular.0.node1", 1, tuple(range(8))),
    ]
    assert [h.name for h in engine_hosts(process_placements(plan))] == ["node 0", "node 1"]


def test_plan_nodes_of_one_kind_take_the_spread_bundles_in_address_order() -> None:
    # Bundle i was asked for plan node i; Ray put them on nodes in another order. Bundles of one kind (8 GPUs)
    # are interchangeable: plan nodes 0, 1, 3 take them by address; plan node 2's (4 GPUs) is its own.
    landed = [RayNodeInfo("c", "10.0.0.10"), RayNodeInfo("a", "10.0.0.9"), RayNodeInfo("d", "10.0.0.2"),
              RayNodeInfo("b", "10.0.1.1")]  # fmt: skip
    kinds = [8, 8, 4, 8]
    assert spread_order(kinds, landed) == [1, 0, 2, 3]  # 10.0.0.9, 10.0.0.10, (10.0.0.2), 10.0.1.1
    assert spread_order([8, 8], [RayNodeInfo("x", "10.0.0.1"), RayNodeInfo("y", "10.0.0.2")]) == [0, 1]


def test_a_process_gets_the_gpus_ray_gave_at_its_local_ids_positions_in_the_bundle() -> None:
    # A node's bundle holds local GPUs 4-7 (the trainer has 0-3): Ray's i-th GPU is local GPU 4 + i.
    assert bundle_gpu_ids((4, 5, 6, 7), ["4", "5", "6", "7"], (6, 7)) == ("6", "7")
    assert bundle_gpu_ids((4, 5, 6, 7), ["7", "6", "5", "4"], (4, 5)) == ("4", "5")  # Ray's order, sorted
    # Ray gave GPUs 0-3 where the plan says 4-7: the process gets what is at its positions (then reported).
    assert bundle_gpu_ids((4, 5, 6, 7), ["0", "1", "2", "3"], (6, 7)) == ("2", "3")
    assert bundle_gpu_ids((4, 5, 6, 7), ["0", "1"], (6, 7)) == ("0", "1")  # another number: all of them
    assert bundle_gpu_ids((0, 1), ["GPU-b", "GPU-a"], (1,)) == (
        "GPU-a",
    )  # ids that are not numbers: as given


def test_plan_nodes_map_to_the_chosen_ray_nodes_in_address_order() -> None:
    chosen = [RayNodeInfo("c", "10.0.0.10"), RayNodeInfo("a", "10.0.0.9"), RayNodeInfo("b", "10.0.1.1")]
    assert {n: i.node_id for n, i in assign_plan_nodes([1, 2, 3], chosen).items()} == {1: "a", 2: "c", 3: "b"}
    assert sorted(["10.0.0.10", "host-b", "10.0.0.9", "::1"], key=address_order) == [
        "10.0.0.9",
        "10.0.0.10",
        "::1",
        "host-b",
    ]


def test_grants_that_differ_from_the_plan_are_each_reported() -> None:
    plan = plan_of("hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=16",
                   "sglang.actor.num_gpus_per_engine=4")  # fmt: skip
    a, b = RayNodeInfo("aaaaaaaaaa", "10.0.0.1"), RayNodeInfo("bbbbbbbbbb", "10.0.0.2")
    grants = {
        ("actor.regular.0", 0): ProcessGrant(a, ("0", "1", "2", "3")),
        ("actor.regular.1", 0): ProcessGrant(b, ("4", "5", "6", "7")),  # node 0's, but elsewhere
        ("actor.regular.2", 0): ProcessGrant(b, ("0", "1", "2", "3")),
        ("actor.regular.3", 0): ProcessGrant(b, ("5", "4", "6", "7")),  # not the planned order
    }
    on_b = "10.0.0.2 (Ray node bbbbbbbb)"
    assert check_grants(process_placements(plan), grants) == [
        f"actor.regular.1: the plan puts it on node 0 with other engines, which run on 10.0.0.1 (Ray node "
        f"aaaaaaaa), but Ray placed it on {on_b}",
        f"actor.regular.2: plan nodes 0 and 1 both landed on {on_b}; each plan node needs a Ray node of its own",
        f"actor.regular.3: plan nodes 0 and 1 both landed on {on_b}; each plan node needs a Ray node of its own",
        f"actor.regular.3: the plan gives it local GPUs 4,5,6,7 of node 1, but Ray assigned GPUs 5,4,6,7 on {on_b}",
    ]
    good = {
        ("actor.regular.0", 0): ProcessGrant(a, ("0", "1", "2", "3")),
        ("actor.regular.1", 0): ProcessGrant(a, ("4", "5", "6", "7")),
        ("actor.regular.2", 0): ProcessGrant(b, ("0", "1", "2", "3")),
        ("actor.regular.3", 0): ProcessGrant(b, ("4", "5", "6", "7")),
    }
    assert check_grants(process_placements(plan), good) == []


def test_a_trainer_group_is_indexed_by_slot() -> None:
    assert slot_bundles(4, None, [2, 3]) == {2: 2, 3: 3}
    assert slot_bundles(4, [3, 2, 1, 0], [0, 3]) == {0: 3, 3: 0}
    with pytest.raises(PlacementError, match=r"GPU slots up to 11 .* has 8 bundle\(s\): hand over"):
        slot_bundles(8, None, [8, 11])
    with pytest.raises(
        PlacementError, match=r"must be distinct bundle indices .* \(0\.\.3\), got \[0, 0, 1, 2\]"
    ):
        slot_bundles(4, [0, 0, 1, 2], [0])


# ------------------------------------------------------------------------------------- ports per node
def test_engine_ports_are_found_per_node_by_the_finder() -> None:
    # actor prefill 4 GPUs in TP 2 (slots 0-3, node 0) and decode 12 in TP 4 (slots 4-15): decode.0 on node 0,
    # decode.1-2 on node 1. dp_size 1: a dist-init run is 31 ports.
    plan = plan_of(*PD_TP_2_4, "hf_checkpoint=/c", "debug_rollout_only=true")
    asked = {}

    def finder(requests):
        asked.update({n: [list(r) for r in runs] for n, runs in requests.items()})
        base = {0: 20000, 1: 30000}
        return {
            n: [[base[n] + 100 * i + j for j in range(len(r))] for i, r in enumerate(runs)]
            for n, runs in requests.items()
        }

    ports = assign_ports(plan, host_of_node=str, router_host="10.0.0.1", probe=False, find_node_ports=finder)
    assert asked == {
        0: [[1, 1, 31, 1, 1], [1, 1, 31, 1, 1], [1, 1, 31, 1]],  # prefill.0, prefill.1, decode.0
        1: [[1, 1, 31, 1], [1, 1, 31, 1]],  # decode.1, decode.2
    }
    assert ports.engines[("actor.prefill.1", 0)] == EnginePorts(20100, 20101, 20102, 20103, 20104)
    assert ports.engines[("actor.decode.0", 0)] == EnginePorts(20200, 20201, 20202, 20203, None)
    assert ports.engines[("actor.decode.2", 0)] == EnginePorts(30100, 30101, 30102, 30103, None)
    assert ports.routers["actor"].http == 15000  # routers: found on the driver, from port_base


def test_plan_commands_of_the_ray_backend_show_node_addresses_to_come(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from miles_sglang_plugin.cli import main

    assert main(["plan", "--commands", *CARD, "sglang_deploy.launch.backend=ray"]) == 0
    out = capsys.readouterr().out
    assert "actor.decode.2 on node 3 (<node 3 address>) CUDA_VISIBLE_DEVICES=0,1,2,3" in out
    assert "--host '<node 3 address>' --port 15000" in out  # ports counted per node
    assert "router actor http://<driver address>:15000" in out
    assert "127.0.0.1" not in out
    assert "addresses in <...> are decided at launch" in out


def test_plan_commands_of_an_engine_over_two_nodes() -> None:
    prepared = prepare_from_config(
        compose_config(["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=16",
                        "sglang.actor.num_gpus_per_engine=16", "sglang_deploy.launch.backend=ray"])
    )  # fmt: skip
    first, second = prepared.launch.engines
    assert (first.host, second.host) == ("<node 0 address>", "<node 1 address>")
    assert (
        first.server_args["dist_init_addr"]
        == second.server_args["dist_init_addr"]
        == "<node 0 address>:15002"
    )
    assert (first.server_args["node_rank"], second.server_args["node_rank"]) == (0, 1)


def test_local_backend_plans_keep_the_configured_host() -> None:
    # Stand-ins of a multi-node plan run side by side here, at launch.host: that is what it prints.
    prepared = prepare_from_config(compose_config([*CARD, "sglang_deploy=simulated"]))
    assert {e.host for e in prepared.launch.engines} == {"127.0.0.1"}
    real = prepare_from_config(compose_config(list(CARD)))  # real engines over 3 nodes: not one machine
    assert {e.host for e in real.launch.engines} == {
        "<node 1 address>",
        "<node 2 address>",
        "<node 3 address>",
    }


# ---------------------------------------------------------------------------- errors before anything starts
def _cli(
    *args: str, env: dict[str, str] | None = None, block_ray: bool = False
) -> subprocess.CompletedProcess[str]:
    code = "import sys\n"
    if block_ray:
        code += "sys.modules['ray'] = None  # as if Ray were not installed\n"
    code += "from miles_sglang_plugin.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_ray_backend_without_ray_exits_2_naming_the_extra(tmp_path: Path) -> None:
    proc = _cli(
        "launch",
        f"--log-dir={tmp_path}",
        *launch_overrides("sglang_deploy.launch.backend=ray"),
        block_ray=True,
    )
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())
    assert (
        "sglang_deploy.launch.backend: 'ray' needs Ray, which is not installed: pip install 'miles_sglang_plugin[ray]'"
        in text
    )
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def _need_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        skip_or_fail("Ray is not installed (pip install -e '.[test,ray]')")


def test_no_ray_cluster_is_a_clear_error_without_hanging(tmp_path: Path) -> None:
    _need_ray()
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    # Without hanging: a launch that waited for the cluster would not return (_cli's timeout ends it).
    proc = _cli("launch", f"--log-dir={tmp_path}", *launch_overrides("sglang_deploy.launch.backend=ray"),
                env={"RAY_ADDRESS": f"127.0.0.1:{free}"})  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    text = " ".join(proc.stderr.split())
    assert f"error: no Ray cluster found at 127.0.0.1:{free}. Start one (ray start --head" in text
    assert "sglang_deploy.launch.ray.start_local_cluster=true" in text and "Traceback" not in proc.stderr


def test_bad_ray_settings_are_all_reported_before_connecting() -> None:
    _need_ray()
    proc = _cli("launch", *launch_overrides("sglang_deploy.launch.backend=ray",
                "sglang_deploy.launch.ray.bundle_gpu_share=0", "sglang_deploy.launch.ray.placement_timeout_s=-1",
                "sglang_deploy.launch.ray.engine_num_cpus=-0.5"),
                env={"RAY_ADDRESS": "127.0.0.1:1"})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())
    assert "3 problems with the SGLang deployment in sglang_deploy:" in text
    assert (
        "sglang_deploy.launch.ray.placement_timeout_s: must be a number > 0 and <= 2592000 (at most 30 days), got -1.0"
        in text
    )
    assert "sglang_deploy.launch.ray.engine_num_cpus: must be a number >= 0, got -0.5" in text
    assert "sglang_deploy.launch.ray.bundle_gpu_share: must be a number > 0 and <= 1, got 0.0" in text


def test_a_placement_group_needs_the_ray_backend() -> None:
    cfg = compose_config(launch_overrides())
    only_ray = "only the ray backend uses, but the backend is 'local'"
    with (
        pytest.raises(DeploymentConfigError, match=only_ray),
        launch_from_config(cfg, placement_group=object()),
    ):
        pytest.fail("must not start")
    with pytest.raises(
        ValueError,
        match=r"the local backend takes no option placement_group \(it takes: claims, visible_devices\)",
    ):
        get_backend("local", placement_group=object())


# --------------------------------------------------------------------------------------------- restarts
def test_local_backend_restarts_a_process_with_the_same_command(
    tmp_path: Path,
    leak_check: LeakTracker,  # noqa: F811
) -> None:
    """A process stopped through the backend and started again with its launch: same command, GPUs and port.
    The new process is told by its pid in ``/server_info``: an answer on the port proves nothing by itself (it
    failed once on a loaded machine, a ``ConnectError`` right after ``/health`` answered, when the deployment's
    own supervision still restarted the engine and stopped the process in its row). Without supervision the
    deployment leaves the new process alone (no event, still serving) until it stops it at its end."""
    cfg = compose_config(launch_overrides("sglang_deploy.supervision.enabled=false"))  # no restart of its own
    with launch_from_config(cfg, log_dir=tmp_path) as deployment:
        backend: LocalBackend = deployment.backend  # type: ignore[assignment]
        row = deployment.fleet.engines()[0]
        first = row.processes[0]
        url = first.launch.url
        backend.stop([first], grace_s=3)
        assert first.exit_code() == 0
        assert not port_accepts(first.launch.port)  # its socket went with it
        again = backend.start(first.launch, log_path=tmp_path / "again.log")
        deployment.fleet.update(row.id, processes=(again,))  # the deployment stops it at the end
        assert again.pid != first.pid and list(again.argv) == list(first.argv)
        info = _server_info_of(again, url)
        assert info["cuda_visible_devices"] == first.launch.env["CUDA_VISIBLE_DEVICES"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert again.exit_code() is None and deployment.events() == ()  # left alone: nothing watched
    assert again.exit_code() == 0  # stopped by the deployment (SIGTERM) at its end


def _server_info_of(process: LocalEngineProcess, url: str, timeout_s: float = 60.0) -> dict:
    """``url``'s ``/server_info`` once ``process`` answers it, checked by its pid; fails at once if ``process``
    exits (with its log: a port another program took shows there) or another process answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.exit_code() is None, f"exited with {process.exit_code()}: {process.tail()}"
        with contextlib.suppress(httpx.TransportError):
            info = httpx.get(url + "/server_info", timeout=10).json()
            assert info["pid"] == process.pid, f"{url} is answered by pid {info['pid']}, not {process.pid}"
            return info
        assert time.monotonic() < deadline, f"no answer at {url} within {timeout_s} s: {process.tail()}"
        time.sleep(0.1)
