"""The local launcher end to end: stand-in engines and real sglang-routers on 127.0.0.1.

Every launch here is checked to leave nothing behind (no process, no listening port); see
``tests/launch_helpers.py``. Faults and signals are in ``test_launcher_faults.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.serving.registry import ROUTING_KEY_HEADER, UnknownModelError
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import (
    REPO,
    LeakTracker,
    compose,
    generate_body,
    launch_ports,
    port_accepts,
    process_alive,
    random_port_base,
)
from tests.router_helpers import router_workers

# A PD actor and a regular reference model, worked out by hand (debug_rollout_only=true: rollout from slot 0,
# 8 GPUs per node, groups placed one after the other: actor prefill, actor decode, ref regular):
#   actor.prefill  4 GPUs, TP 4 (the actor's num_gpus_per_engine) -> slots 0-3  = node 0, GPUs 0-3
#   actor.decode   8 GPUs, TP 4                                   -> slots 4-7   = node 0, GPUs 4-7
#                                                                    slots 8-11  = node 1, GPUs 0-3
#   ref.regular    4 GPUs, TP 2 (rollout_num_gpus_per_engine)     -> slots 12-13 = node 1, GPUs 4,5
#                                                                    slots 14-15 = node 1, GPUs 6,7
PD_REF = [
    "sglang=pd_actor_ref",
    "rollout_num_gpus_per_engine=2",
    "sglang.actor.num_gpus_per_engine=4",
    "sglang.actor.prefill.num_gpus=4",
]
EXPECTED_GPUS = {
    "actor.prefill.0": (0, [0, 1, 2, 3]),
    "actor.decode.0": (0, [4, 5, 6, 7]),
    "actor.decode.1": (1, [0, 1, 2, 3]),
    "ref.regular.0": (1, [4, 5]),
    "ref.regular.1": (1, [6, 7]),
}
EXPECTED_MODE = {"prefill": "prefill", "decode": "decode", "regular": "null"}


@pytest.fixture(scope="module")
def pd_ref(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One PD + regular deployment shared by the read-only tests of this module."""
    tracker = LeakTracker()
    cfg = compose(*PD_REF)
    with launch_from_config(cfg, log_dir=tmp_path_factory.mktemp("pd_ref") / "logs") as launcher:
        tracker.add_launcher(launcher)
        yield launcher
    tracker.assert_nothing_left()


def _server_info(url: str) -> dict:
    resp = httpx.get(url + "/server_info", timeout=10)
    resp.raise_for_status()
    return resp.json()


def _stats(url: str) -> dict:
    resp = httpx.get(url + "/stand_in/stats", timeout=10)
    resp.raise_for_status()
    return resp.json()


# ------------------------------------------------------------------------------------------ 1. GPUs
def test_engines_see_the_planned_gpus(pd_ref: Deployment) -> None:
    plan = pd_ref.prepared.plan
    planned = {e.id: (e.processes[0].node, list(e.processes[0].local_gpu_ids)) for e in plan.engines}
    assert planned == EXPECTED_GPUS
    launches = {e.engine_id: e for e in pd_ref.prepared.launch.engines}
    assert set(launches) == set(EXPECTED_GPUS)
    for engine_id, (_node, gpus) in EXPECTED_GPUS.items():
        e = launches[engine_id]
        info = _server_info(e.url)
        assert info["stand_in"] is True
        assert info["cuda_visible_devices"] == ",".join(map(str, gpus)), engine_id
        assert info["tp_size"] == len(gpus), engine_id
        assert info["disaggregation_mode"] == EXPECTED_MODE[e.group], engine_id
        assert info["host"] == "127.0.0.1" and info["port"] == e.port
    # Each engine is a process of this launcher, and every process is running.
    names = {p.name for p in pd_ref.processes()}
    assert names == {*EXPECTED_GPUS, "router.actor", "router.ref"}
    assert all(p.running for p in pd_ref.processes())


def test_one_real_router_per_model_with_its_engines(pd_ref: Deployment) -> None:
    registry = pd_ref.registry
    assert registry.names() == ("actor", "ref")
    assert registry["actor"].pd_disaggregation and not registry["ref"].pd_disaggregation
    for model, engines in (
        ("actor", {"actor.prefill.0", "actor.decode.0", "actor.decode.1"}),
        ("ref", {"ref.regular.0", "ref.regular.1"}),
    ):
        urls = {e.url for e in pd_ref.prepared.launch.engines if e.engine_id in engines}
        listed = {w["url"].rstrip("/") for w in router_workers(registry[model].base_url)}
        assert listed == urls, model
    # The router processes are sglang-router (Python API), not a stand-in.
    routers = [p for p in pd_ref.processes() if p.name.startswith("router.")]
    assert [p.argv[2] for p in routers] == ["miles_sglang_plugin.serving.router_main"] * 2


def test_multi_node_engine_runs_side_by_side(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    # One engine of 16 GPUs = 2 nodes of 8: a lead process (HTTP) and a follower, both on local GPUs 0-7.
    cfg = compose("sglang.actor.regular.num_gpus=16", "sglang.actor.num_gpus_per_engine=16")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as launcher:
        assert any("run side by side" in note for note in launcher.notes)
        engines = {p.name: p for p in launcher.processes() if not p.name.startswith("router.")}
        assert set(engines) == {"actor.regular.0.node0", "actor.regular.0.node1"}
        assert all(
            p.running and p.launch.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" for p in engines.values()
        )
        lead = launcher.prepared.launch.engines[0]
        assert _server_info(lead.url)["cuda_visible_devices"] == "0,1,2,3,4,5,6,7"
        resp = httpx.post(launcher.registry.get_model_url("actor"), json=generate_body(), timeout=30)
        assert resp.status_code == 200, resp.text


# ------------------------------------------------------------------------------------ 2. PD routing
def test_pd_generate_through_the_router_reaches_prefill_and_decode(pd_ref: Deployment) -> None:
    launches = {e.engine_id: e for e in pd_ref.prepared.launch.engines}
    prefill = launches["actor.prefill.0"]
    decodes = [launches["actor.decode.0"], launches["actor.decode.1"]]
    before = {
        e.engine_id: _stats(e.url)["requests_received"].get("/generate", 0) for e in [prefill, *decodes]
    }

    url = pd_ref.registry.get_model_url("actor")
    assert url == pd_ref.registry["actor"].base_url + "/generate"
    resp = httpx.post(url, json=generate_body(), timeout=30)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["text"] and body["meta_info"]["completion_tokens"] == 4

    p_stats = _stats(prefill.url)
    assert p_stats["requests_received"]["/generate"] == before["actor.prefill.0"] + 1
    hit = [d for d in decodes if _stats(d.url)["requests_received"].get("/generate", 0) > before[d.engine_id]]
    assert len(hit) == 1, "exactly one decode engine should have served the request"
    d_stats = _stats(hit[0].url)
    assert body["meta_info"]["stand_in"]["port"] == hit[0].port
    for stats in (p_stats, d_stats):
        boot = stats["last_bootstrap"]
        assert boot is not None, stats
        assert boot["bootstrap_host"] == "127.0.0.1"
        assert boot["bootstrap_port"] == prefill.bootstrap_port
        assert isinstance(boot["bootstrap_room"], int)
    assert p_stats["last_bootstrap"]["bootstrap_room"] == d_stats["last_bootstrap"]["bootstrap_room"]


def test_regular_model_generates_through_its_router(pd_ref: Deployment) -> None:
    resp = httpx.post(pd_ref.registry.get_model_url("ref"), json=generate_body(), timeout=30)
    assert resp.status_code == 200, resp.text
    ports = {e.port for e in pd_ref.prepared.launch.engines if e.model == "ref"}
    assert resp.json()["meta_info"]["stand_in"]["port"] in ports


# ---------------------------------------------------------------------------------------- 3. registry
def test_registry_unknown_model_lists_known_names(pd_ref: Deployment) -> None:
    with pytest.raises(UnknownModelError) as info:
        pd_ref.registry.get_model_url("critic")
    msg = str(info.value)
    assert "'critic'" in msg and "actor" in msg and "ref" in msg
    with pytest.raises(UnknownModelError, match="Did you mean 'actor'"):
        pd_ref.registry.get_model_url("actr")


def test_routing_key_pins_requests_to_one_engine(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    cfg = compose("sglang.actor.regular.num_gpus=2", "sglang_deploy.router.policy=consistent_hashing")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as launcher:
        registry = launcher.registry
        assert registry["actor"].policy == "consistent_hashing"
        with pytest.raises(ValueError, match="needs a routing key"):
            registry.routing_headers("actor", None)
        with pytest.raises(ValueError, match="needs a routing key"):
            registry.routing_headers("actor", "")
        engine_ports = {e.port for e in launcher.prepared.launch.engines}
        assert len(engine_ports) == 2
        url = registry.get_model_url("actor")
        with httpx.Client(timeout=30) as client:

            def port_for(key: str) -> int:
                headers = registry.routing_headers("actor", key)
                assert headers == {ROUTING_KEY_HEADER: key}
                resp = client.post(url, json=generate_body(f"prompt of {key}"), headers=headers)
                assert resp.status_code == 200, resp.text
                return resp.json()["meta_info"]["stand_in"]["port"]

            same = {port_for("session-42") for _ in range(10)}
            assert len(same) == 1 and same <= engine_ports
            # Other keys spread over both engines (the key, not chance, picks the engine).
            spread = {port_for(f"key-{i}") for i in range(24)}
            assert spread == engine_ports


# ---------------------------------------------------------------------------------------- 6. teardown
def test_nothing_left_after_normal_exit(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    cfg = compose("sglang.actor.regular.num_gpus=2")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as launcher:
        procs = launcher.processes()
        ports = launch_ports(launcher.prepared)
        assert len(procs) == 3 and all(p.running for p in procs)
        assert any(port_accepts(p) for p in ports)
        claims = launcher.backend.claims
        assert claims is not None and set(claims.fds) >= ports
    # Right after the block (no waiting): every process reaped, every claim released.
    assert all(p.exit_code() is not None for p in procs)
    assert not claims.fds
    assert not any(process_alive(p.pid) for p in procs)


def test_nothing_left_after_exception_in_block(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    cfg = compose("sglang.actor.regular.num_gpus=2")
    with (
        pytest.raises(RuntimeError, match="boom"),
        launch_from_config(cfg, log_dir=tmp_path / "logs") as launcher,
    ):
        procs = launcher.processes()
        raise RuntimeError("boom")
    assert all(p.exit_code() is not None for p in procs)
    assert not any(process_alive(p.pid) for p in procs)


def test_stop_twice_is_fine(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    cfg = compose("sglang.actor.regular.num_gpus=1")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as launcher:
        procs = launcher.processes()
        launcher.stop()
        assert all(p.exit_code() is not None for p in procs)
        launcher.stop()  # nothing left to stop: no error
        assert all(p.exit_code() is not None for p in procs)
    launcher.stop()  # and once more after the block


# -------------------------------------------------------------------------------- 5. multirun sweep
HYDRA_APP = textwrap.dedent(
    """
    import json, os
    from pathlib import Path

    import httpx
    import hydra
    from hydra.core.config_store import ConfigStore

    from miles_sglang_plugin.app.hydra_edge import launch_from_config

    ConfigStore.instance().store(
        name="app",
        node={
            "defaults": ["_self_", {"sglang": "default"}],
            "hf_checkpoint": "/c",
            "debug_rollout_only": True,  # rollout from slot 0, any size
        },
    )


    def alive(pid, marker):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X") and marker in cmd


    @hydra.main(version_base=None, config_name="app")
    def main(cfg):
        record = Path(os.environ["LAUNCH_RECORD"])
        earlier = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
        stale = [p["pid"] for job in earlier for p in job["processes"] if alive(p["pid"], p["marker"])]
        with launch_from_config(cfg) as launcher:
            url = launcher.registry.get_model_url("actor")
            resp = httpx.post(url, json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
            resp.raise_for_status()
            job = {
                "router": url,
                "stale_at_start": stale,
                "processes": [
                    {"pid": p.pid, "name": p.name, "marker": p.argv[2]} for p in launcher.processes()
                ],
                "engines": {e.engine_id: e.env["CUDA_VISIBLE_DEVICES"] for e in launcher.prepared.launch.engines},
                "log_dir": str(launcher.log_dir),
                "ports": [e.port for e in launcher.prepared.launch.engines]
                + [x for r in launcher.prepared.launch.routers for x in (r.spec.port, r.spec.prometheus_port)],
            }
        with record.open("a") as f:
            f.write(json.dumps(job) + "\\n")
        print(json.dumps(job), flush=True)


    if __name__ == "__main__":
        main()
    """
)


def test_multirun_sweep_starts_each_job_on_a_clean_slate(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(HYDRA_APP)
    record = tmp_path / "jobs.jsonl"
    env = {**os.environ, "LAUNCH_RECORD": str(record), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [
        sys.executable,
        str(app),
        "-m",
        "sglang_deploy=simulated",
        "sglang.actor.regular.num_gpus=2",
        "sglang.actor.num_gpus_per_engine=1,2",
        f"sglang_deploy.launch.port_base={random_port_base()}",
        "sglang_deploy.launch.shutdown_grace_s=3",
        "sglang_deploy.launch.live=never",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = [json.loads(line) for line in record.read_text().splitlines()]
    tracker = LeakTracker()
    for job in jobs:
        for p in job["processes"]:
            tracker.add_process(p["pid"], p["name"], p["marker"])
        tracker.add_ports(job["ports"])
    assert len(jobs) == 2
    # job 0: TP 1 -> two engines on GPUs 0 and 1; job 1: TP 2 -> one engine on GPUs 0,1.
    assert jobs[0]["engines"] == {"actor.regular.0": "0", "actor.regular.1": "1"}
    assert jobs[1]["engines"] == {"actor.regular.0": "0,1"}
    assert jobs[1]["stale_at_start"] == [], "processes of job 0 were still running when job 1 started"
    assert {p["pid"] for p in jobs[0]["processes"]}.isdisjoint(p["pid"] for p in jobs[1]["processes"])
    # Each job's logs are in its own Hydra output directory.
    assert jobs[0]["log_dir"] != jobs[1]["log_dir"]
    assert all(str(tmp_path / "sweep") in job["log_dir"] for job in jobs)
    tracker.assert_nothing_left()
