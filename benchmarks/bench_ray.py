"""What the ray backend costs against the local backend, side by side in one run (see benchmarks/README.md).

On a Ray cluster of fake-GPU nodes on this machine (``ray.cluster_utils.Cluster``: a head and two workers of
8 GPUs each, at 127.0.0.1-3), with stand-in engines that wait T seconds before they listen
(``sglang_deploy.standin.start_delay_s``) and the real sglang-router:

(1) one node: K engines of 1 GPU (``debug_rollout_only=true``: slots from 0, all on node 0); time to ready (entering
    ``launch_from_config`` until it yields) with ``backend=local`` and with ``backend=ray``, and their ratio.
(2) three nodes: 24 GPUs in engines of 2 GPUs (12 engines, 4 per node); the local backend runs the three
    planned nodes side by side on this machine (stand-ins only), the ray backend on three Ray nodes.
(3) Ray's own overhead: the ray backend's ``prepare`` (placement group chosen and placed, the engine actors
    started and asked where they run, ports found on each node) against the local one's (ports probed
    here), and (ready_ray - ready_local) / engines, per engine; teardown time of both.

The ray backend runs twice in each cell: with one actor per node starting all engine processes of that node
(``sglang_deploy.launch.ray.engine_actors=per_node``, the default; row ``ray``) and with one actor per engine
process (``per_process``; row ``ray per process``), so that the two are compared in the same run.

The benchmark process connects to the cluster once, first (as a trainer already running on Ray is connected),
so connection time is shown apart. Repetitions run round-robin (local, ray, local, ray, ...) so that load on
the machine hits both alike; medians are printed. It must run in a network namespace that has only loopback
(Ray's traffic stays there): it re-executes itself under ``scripts/in-loopback-netns.sh`` when it is not in
one. Everything started is stopped (each launch is a ``with`` block; the cluster is shut down at the end).

    python benchmarks/bench_ray.py [--reps 3] [--delay 2] [--k 8] [--json]
    python benchmarks/bench_ray.py --smoke [--address HOST:PORT]   # one quick repetition (run by the tests)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NETNS_SCRIPT = REPO / "scripts" / "in-loopback-netns.sh"


def in_loopback_only_netns() -> bool:
    return [name for _index, name in socket.if_nameindex()] == ["lo"]


#: The launches compared in each cell: name -> (backend, extra overrides).
MODES: dict[str, tuple[str, tuple[str, ...]]] = {
    "local": ("local", ()),
    "ray": ("ray", ("sglang_deploy.launch.ray.engine_actors=per_node",)),
    "ray per process": ("ray", ("sglang_deploy.launch.ray.engine_actors=per_process",)),
}


def overrides(backend: str, gpus: int, gpe: int, delay_s: float) -> list[str]:
    return [
        "sglang=default",
        "hf_checkpoint=/c",
        "debug_rollout_only=true",
        "sglang_deploy=simulated",
        f"sglang.actor.regular.num_gpus={gpus}",
        f"sglang.actor.num_gpus_per_engine={gpe}",
        f"sglang_deploy.standin.start_delay_s={delay_s}",
        f"sglang_deploy.launch.backend={backend}",
        f"sglang_deploy.launch.port_base={random.randrange(20000, 28000)}",
        "sglang_deploy.launch.shutdown_grace_s=5",
        "sglang_deploy.launch.live=never",
    ]


def launch_once(mode: str, gpus: int, gpe: int, delay_s: float, log_dir: Path) -> dict[str, float]:
    from miles_sglang_plugin.app.hydra_edge import launch_from_config
    from miles_sglang_plugin.backends import get_backend
    from miles_sglang_plugin.config.compose import compose_config

    backend_name, extra = MODES[mode]
    cfg = compose_config([*overrides(backend_name, gpus, gpe, delay_s), *extra])
    backend = get_backend(backend_name)
    phases: dict[str, float] = {}
    original = backend.prepare

    def timed_prepare(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            phases["prepare_s"] = time.perf_counter() - t0

    backend.prepare = timed_prepare  # type: ignore[method-assign]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        t0 = time.perf_counter()
        with launch_from_config(cfg, log_dir=log_dir, backend=backend) as deployment:
            phases["ready_s"] = time.perf_counter() - t0
            engines = len(deployment.engines())
            actors = len(getattr(backend, "actors", ()))
            t1 = time.perf_counter()
        phases["teardown_s"] = time.perf_counter() - t1
    phases["engines"], phases["actors"] = engines, actors
    return phases


def bench_cell(gpus: int, gpe: int, delay_s: float, reps: int, tmp: Path, warm_up: bool) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    slug = {mode: mode.replace(" ", "-") for mode in MODES}
    if warm_up:  # first launches pay one-off imports and Ray's first worker processes: not counted
        for mode in MODES:
            launch_once(mode, gpus, gpe, 0.0, tmp / f"{slug[mode]}-{gpus}-warm-up")
    for rep in range(reps):
        for mode in MODES:
            runs[mode].append(launch_once(mode, gpus, gpe, delay_s, tmp / f"{slug[mode]}-{gpus}-{rep}"))
    out: dict[str, Any] = {"gpus": gpus, "gpus_per_engine": gpe, "delay_s": delay_s, "reps": reps}
    for mode, results in runs.items():
        out[mode] = {
            k: statistics.median(r[k] for r in results) for k in ("ready_s", "prepare_s", "teardown_s")
        }
        out[mode]["actors"] = int(results[0]["actors"])
        out["engines"] = int(results[0]["engines"])
    local = out["local"]
    for mode in ("ray", "ray per process"):
        out[mode]["over_local"] = out[mode]["ready_s"] / local["ready_s"]
        out[mode]["overhead_per_engine_ms"] = (
            1000 * (out[mode]["ready_s"] - local["ready_s"]) / out["engines"]
        )
        out[mode]["prepare_per_engine_ms"] = (
            1000 * (out[mode]["prepare_s"] - local["prepare_s"]) / out["engines"]
        )
    out["ray_over_local"] = out["ray"]["over_local"]
    out["ray_over_ray_per_process"] = out["ray"]["ready_s"] / out["ray per process"]["ready_s"]
    return out


def start_cluster() -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": 8,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    for node in (2, 3):
        cluster.add_node(num_cpus=1, num_gpus=8, node_ip_address=f"127.0.0.{node}")
    cluster.wait_for_nodes()
    return cluster


def print_cell(title: str, cell: dict[str, Any]) -> None:
    print(f"\n{title}: {cell['engines']} engines x {cell['gpus_per_engine']} GPU(s), stand-ins take T = "
          f"{cell['delay_s']:g} s, median of {cell['reps']}")  # fmt: skip
    print(
        f"  {'backend':<16} {'actors':>6} {'ready s':>8} {'ready/T':>8} {'prepare s':>10} {'teardown s':>11}"
    )
    for mode in MODES:
        r = cell[mode]
        per_t = f"{r['ready_s'] / cell['delay_s']:.2f}" if cell["delay_s"] else "-"
        actors = str(r["actors"]) if mode != "local" else "-"
        print(f"  {mode:<16} {actors:>6} {r['ready_s']:>8.2f} {per_t:>8} {r['prepare_s']:>10.2f} "
              f"{r['teardown_s']:>11.2f}")  # fmt: skip
    for mode, label in (("ray", "ray/local"), ("ray per process", "ray per process/local")):
        r = cell[mode]
        print(f"  {label} time to ready: {r['over_local']:.2f}; overhead per engine: "
              f"{r['overhead_per_engine_ms']:.0f} ms to ready, {r['prepare_per_engine_ms']:.0f} ms in prepare")  # fmt: skip
    print(
        f"  one actor per node against one per process: {cell['ray_over_ray_per_process']:.2f} of its time to ready"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions per backend and cell (median)")
    ap.add_argument("--delay", type=float, default=2.0, help="stand-in start delay T in seconds")
    ap.add_argument("--k", type=int, default=8, help="engines of the one-node plan (1 GPU each, at most 8)")
    ap.add_argument("--address", help="use this running Ray cluster (>= 3 nodes with 8 free GPUs) instead")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument(
        "--smoke", action="store_true", help="one quick repetition at small sizes (for the tests)"
    )
    args = ap.parse_args()
    if not in_loopback_only_netns():
        if os.environ.get("MSP_BENCH_REEXEC"):
            print(
                "error: not in a loopback-only network namespace (unshare -n not permitted?)", file=sys.stderr
            )
            return 2
        os.environ["MSP_BENCH_REEXEC"] = "1"
        os.execvp("bash", ["bash", str(NETNS_SCRIPT), sys.executable, *sys.argv])
    if args.smoke:
        args.reps, args.delay, args.k = 1, 0.0, 2
    import ray

    cluster = None if args.address else start_cluster()
    t0 = time.perf_counter()
    ray.init(address=args.address or cluster.address, logging_level=logging.WARNING)
    connect_s = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
            one = bench_cell(args.k, 1, args.delay, args.reps, Path(tmp), not args.smoke)
            three = bench_cell(24, 8 if args.smoke else 2, args.delay, args.reps, Path(tmp), not args.smoke)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    results = {"connect_s": connect_s, "one_node": one, "three_nodes": three, "ray": ray.__version__}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"Ray {ray.__version__}; connecting the benchmark process to the cluster: {connect_s:.2f} s (once)")
    print_cell("(1) one node", one)
    print_cell("(2) three nodes", three)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
