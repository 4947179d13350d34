"""What changing a running deployment in place costs (``Deployment.apply``), against stopping it and starting the
changed one, with stand-in engines that each take ``--start-delay`` s to start (a real engine loads its model
for minutes) and the real sglang-router.

(1) time: K engines of 1 GPU; the change adds c of them (from K to K + c, and back, removing c). Side by side
    in one run: the apply's wall time, and the full restart's (stop the deployment, start the changed one until
    ready). Goal: apply <= (c / (K + c) + 0.1) x the restart. Engines start in parallel, so both take about one
    engine's own start: the wall ratio cannot fall far below 1 - (stop + router start) / restart. Also reported:
    what the apply adds to its slowest added engine's own start (process start to healthy), and the
    engine-seconds without service, c x apply against (K + c) x restart (the kept engines serve throughout).
(2) requests under an apply: ``--requests`` (2,000) ``/generate`` at concurrency ``--concurrency`` (32) through
    the router while the deployment shrinks by c engines and grows back. Goal: 0 failed.
(3) churn: a weight update (version v1), then ``--applies`` (20) applies back and forth (K + c <-> K) while 6
    client threads send without pause. Goals: 0 failed requests, 0 samples with two live engine processes on
    one GPU (every engine process's CUDA_VISIBLE_DEVICES read from its own environment), every engine on v1
    after each apply, this process's descriptors after the last apply within 5 % of after the launch.

    python benchmarks/bench_elastic.py [--k 8] [--c 2] [--start-delay 2] [--requests 2000] [--applies 20] [--json]
    python benchmarks/bench_elastic.py --smoke    # one quick run at the smallest sizes (run by the tests)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from bench_launch import quiet  # beside this script (benchmarks/ is on sys.path when it runs)

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.config.compose import compose_config

HOST = "127.0.0.1"
GEN_BODY = {"text": "the quick brown fox jumps over", "sampling_params": {"max_new_tokens": 4}}


def overrides(engines: int, start_delay_s: float, port_base: int, node_gpus: int = 8) -> list[str]:
    """``node_gpus``: the node's size, the same before and after a change (a running deployment keeps it)."""
    return [
        "sglang=default",
        "hf_checkpoint=/c",
        "debug_rollout_only=true",
        "sglang_deploy=simulated",
        f"sglang.actor.regular.num_gpus={engines}",
        "sglang.actor.num_gpus_per_engine=1",
        f"num_gpus_per_node={max(node_gpus, engines)}",
        f"sglang_deploy.standin.start_delay_s={start_delay_s}",
        "sglang_deploy.router.policy=round_robin",
        f"sglang_deploy.launch.host={HOST}",
        f"sglang_deploy.launch.port_base={port_base}",
        "sglang_deploy.launch.live=never",
    ]


def timing(k: int, c: int, start_delay_s: float, tmp: Path, verbose: bool) -> dict[str, Any]:
    base = random.randrange(20000, 28000)
    small, large = (
        compose_config(overrides(k, start_delay_s, base, k + c)),
        compose_config(overrides(k + c, start_delay_s, base, k + c)),
    )
    with quiet(verbose), launch_from_config(small, log_dir=Path(tempfile.mkdtemp(dir=tmp))) as d:
        since = len(d.events())
        started = time.perf_counter()
        grown = d.apply(large)
        apply_s = time.perf_counter() - started
        added = [e for e in d.events()[since - len(d.events()) :] if e.kind == "engine_added"]
        own_start_s = max(e.details["start_s"] for e in added)
        assert len(grown.started) == c and len(grown.kept) == k, grown.lines()
        started = time.perf_counter()
        shrunk = d.apply(small)
        shrink_s = time.perf_counter() - started
        assert len(shrunk.stopped) == c
        started = time.perf_counter()
    stop_s = time.perf_counter() - started
    with quiet(verbose):
        started = time.perf_counter()
        with launch_from_config(large, log_dir=Path(tempfile.mkdtemp(dir=tmp))):
            start_s = time.perf_counter() - started
    restart_s = stop_s + start_s
    return {
        "k": k,
        "c": c,
        "start_delay_s": start_delay_s,
        "apply_add_s": apply_s,
        "apply_remove_s": shrink_s,
        "restart_s": restart_s,
        "ratio": apply_s / restart_s,
        "goal": c / (k + c) + 0.1,
        # what the apply adds to its slowest added engine's own start (process start to healthy)
        "added_own_start_s": own_start_s,
        "apply_overhead_s": apply_s - own_start_s,
        # engine-seconds without service: the apply's c new engines against the restart's k + c engines
        "capacity_lost_ratio": (c * apply_s) / ((k + c) * restart_s),
    }


def under_load(k: int, c: int, total: int, concurrency: int, tmp: Path, verbose: bool) -> dict[str, Any]:
    base = random.randrange(20000, 28000)
    full, less = compose_config(overrides(k, 0.0, base, k)), compose_config(overrides(k - c, 0.0, base, k))
    failures: list[str] = []
    answered = 0
    with quiet(verbose), launch_from_config(full, log_dir=Path(tempfile.mkdtemp(dir=tmp))) as d:
        url = d.registry.get_model_url("actor")
        remaining = iter(range(total))

        async def worker() -> None:
            nonlocal answered
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1)) as http:
                for _ in remaining:
                    try:
                        r = await http.post(url, json=GEN_BODY)
                        if r.status_code != 200:
                            failures.append(f"HTTP {r.status_code}: {r.text[:100]}")
                    except httpx.HTTPError as exc:
                        failures.append(type(exc).__name__)
                    answered += 1

        load = threading.Thread(target=lambda: asyncio.run(asyncio.wait_for(_all(worker, concurrency), 600)))
        load.start()
        while answered < total // 4:
            time.sleep(0.01)
        removed = d.apply(less)
        added = d.apply(full)
        load.join()
    return {
        "engines": k,
        "changed": c,
        "requests": total,
        "concurrency": concurrency,
        "failed": len(failures),
        "failures": sorted(set(failures))[:5],
        "removed": removed.stopped,
        "added": added.started,
    }


def _gpu_overlaps() -> int:
    """GPUs held by more than one live engine process started by this process (read from /proc)."""
    holders: dict[str, int] = {}
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] != me:
                continue
            if b"miles_sglang_plugin.standin" not in (entry / "cmdline").read_bytes():
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        for item in environ:
            if item.startswith(b"CUDA_VISIBLE_DEVICES="):
                for gpu in item.split(b"=", 1)[1].decode().split(","):
                    holders[gpu] = holders.get(gpu, 0) + 1
    return sum(1 for count in holders.values() if count > 1)


def churn(k: int, c: int, applies: int, tmp: Path, verbose: bool) -> dict[str, Any]:
    base = random.randrange(20000, 28000)
    full, less = (
        compose_config(overrides(k + c, 0.2, base, k + c)),
        compose_config(overrides(k, 0.2, base, k + c)),
    )
    failures: list[str] = []
    overlaps: list[int] = []
    off_version = 0
    stop = threading.Event()
    with quiet(verbose), launch_from_config(full, log_dir=tmp / "churn") as d:
        d.control.update_weights_from_disk("/ckpt/step1", weight_version="v1")
        fds_launch = len(os.listdir("/proc/self/fd"))
        url = d.registry.get_model_url("actor")

        def client() -> None:
            with httpx.Client(timeout=120) as http:
                while not stop.is_set():
                    try:
                        r = http.post(url, json=GEN_BODY)
                        if r.status_code != 200:
                            failures.append(f"HTTP {r.status_code}: {r.text[:100]}")
                    except httpx.HTTPError as exc:
                        failures.append(type(exc).__name__)

        def sampler() -> None:
            while not stop.is_set():
                overlaps.append(_gpu_overlaps())
                time.sleep(0.02)

        threads = [threading.Thread(target=client) for _ in range(6)] + [threading.Thread(target=sampler)]
        for thread in threads:
            thread.start()
        try:
            for i in range(applies):
                d.apply(less if i % 2 == 0 else full)
                versions = d.control.weight_versions()
                off_version += sum(1 for v in versions.values() if v != "v1")
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        fds_after = len(os.listdir("/proc/self/fd"))
    return {
        "applies": applies,
        "failed": len(failures),
        "failures": sorted(set(failures))[:5],
        "gpu_overlap_samples": sum(1 for n in overlaps if n),
        "samples": len(overlaps),
        "engines_off_version": off_version,
        "fds_after_launch": fds_launch,
        "fds_after_applies": fds_after,
    }


async def _all(worker: Any, n: int) -> None:
    await asyncio.gather(*(worker() for _ in range(n)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--c", type=int, default=2)
    parser.add_argument("--start-delay", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--applies", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="one quick run at the smallest sizes")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    k, c = (2, 1) if args.smoke else (args.k, args.c)
    with tempfile.TemporaryDirectory(prefix="bench_elastic_") as tmp_dir:
        tmp = Path(tmp_dir)
        results = {
            "timing": timing(k, c, 0.3 if args.smoke else args.start_delay, tmp, args.verbose),
            "load": under_load(
                k + c,
                c,
                100 if args.smoke else args.requests,
                8 if args.smoke else args.concurrency,
                tmp,
                args.verbose,
            ),
            "churn": churn(k, c, 4 if args.smoke else args.applies, tmp, args.verbose),
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    t, load, ch = results["timing"], results["load"], results["churn"]
    print(
        f"(1) apply adding {t['c']} engines to {t['k']} (start {t['start_delay_s']:g} s each): {t['apply_add_s']:.2f} s; "
        f"removing them: {t['apply_remove_s']:.2f} s; stopping and starting all {t['k'] + t['c']}: {t['restart_s']:.2f} s "
        f"-> ratio {t['ratio']:.2f} (goal <= {t['goal']:.2f})"
    )
    print(
        f"    the apply beyond its slowest added engine's own start ({t['added_own_start_s']:.2f} s): "
        f"{t['apply_overhead_s']:.2f} s; engine-seconds without service against the restart's: "
        f"{t['capacity_lost_ratio']:.2f}"
    )
    print(
        f"(2) {load['requests']} requests at concurrency {load['concurrency']} while {load['changed']} of "
        f"{load['engines']} engines are removed and added back: failed {load['failed']} (goal 0) {load['failures']}"
    )
    print(
        f"(3) {ch['applies']} applies back and forth under 6 clients after a weight update: failed requests "
        f"{ch['failed']} (goal 0) {ch['failures']}; samples with two engines on a GPU {ch['gpu_overlap_samples']} "
        f"of {ch['samples']} (goal 0); engines off v1 after an apply {ch['engines_off_version']} (goal 0); "
        f"descriptors {ch['fds_after_launch']} after the launch, {ch['fds_after_applies']} after the applies "
        "(goal within 5 %)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
