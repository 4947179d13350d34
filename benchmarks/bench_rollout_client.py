"""What the rollout client costs and what it saves, with stand-in engines paced by their speed model and the
real router, side by side in one run.

(1) overhead: ``--requests`` (400) greedy generations of ``--tokens`` (32) tokens at concurrency
    ``--concurrency`` (16) through the router: plain httpx (one POST, the whole answer), plain httpx streaming
    (the same events the client reads), and the rollout client. Goal: client / plain <= 1.05.
(2) one migration: a 100-token request whose engine is SIGKILLed after 50 tokens, against the same request
    uninterrupted. Reported: both times, the broken try's end to the next try's start (detection), and what the
    migrated request took beyond the uninterrupted one.
(3) engines killed under load: ``--kill-requests`` (600) requests while an engine is SIGKILLed every
    ``--kill-every`` (2) s (the deployment restarts it), once with plain httpx through the router and once with
    the client. Goal for the client: 0 failed; reported: tokens pre-filled again, and plain httpx's failures.

    python benchmarks/bench_rollout_client.py [--requests 400] [--concurrency 16] [--tokens 32] [--json]
    python benchmarks/bench_rollout_client.py --smoke    # one quick run at the smallest sizes (run by the tests)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from bench_launch import quiet  # beside this script (benchmarks/ is on sys.path when it runs)

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.serving.deployment import Deployment

HOST = "127.0.0.1"
PROMPT = [17, 29, 31, 37, 41, 43, 47, 53]


def overrides(engines: int, port_base: int, decode_step_s: float) -> list[str]:
    return [
        "sglang=default",
        "hf_checkpoint=/c",
        "debug_rollout_only=true",
        "sglang_deploy=simulated",
        f"sglang.actor.regular.num_gpus={engines}",
        "sglang.actor.num_gpus_per_engine=1",
        f"num_gpus_per_node={max(8, engines)}",
        "sglang_deploy.standin.speed.enabled=true",
        f"sglang_deploy.standin.speed.decode_step_s={decode_step_s}",
        "sglang_deploy.standin.speed.decode_token_s=0.0002",
        "sglang_deploy.router.policy=round_robin",
        "sglang_deploy.supervision.health_interval_s=0.3",
        "sglang_deploy.supervision.health_timeout_s=0.5",
        "sglang_deploy.supervision.restart_backoff_s=0.1",
        "sglang_deploy.supervision.kill_grace_s=0.5",
        "sglang_deploy.supervision.max_restarts=1000",
        f"sglang_deploy.launch.host={HOST}",
        f"sglang_deploy.launch.port_base={port_base}",
        "sglang_deploy.launch.live=never",
    ]


def launch(engines: int, decode_step_s: float, tmp: Path, verbose: bool) -> Any:
    cfg = compose_config(overrides(engines, random.randrange(20000, 28000), decode_step_s))
    with quiet(verbose):
        return launch_from_config(cfg, log_dir=Path(tempfile.mkdtemp(dir=tmp)))


def body(tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0},
        "stream": stream,
    }


async def _run_all(send: Callable[[], Awaitable[None]], total: int, concurrency: int) -> float:
    left = iter(range(total))

    async def worker() -> None:
        for _ in left:
            await send()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


def overhead(d: Deployment, total: int, concurrency: int, tokens: int) -> dict[str, Any]:
    url = d.registry.get_model_url("actor")
    limits = httpx.Limits(max_connections=concurrency)

    async def plain(stream: bool) -> float:
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:

            async def one() -> None:
                if stream:
                    async with http.stream("POST", url, json=body(tokens, True)) as r:
                        async for _ in r.aiter_raw():
                            pass
                else:
                    (await http.post(url, json=body(tokens))).raise_for_status()

            return await _run_all(one, total, concurrency)

    async def client() -> float:
        async with d.async_client("actor") as c:

            async def one() -> None:
                await c.generate(PROMPT, sampling_params={"max_new_tokens": tokens, "temperature": 0})

            return await _run_all(one, total, concurrency)

    times = {"plain_s": asyncio.run(plain(False)), "plain_stream_s": asyncio.run(plain(True))}
    times["client_s"] = asyncio.run(client())
    return {**times, "ratio": times["client_s"] / times["plain_s"], "goal": 1.05}


def migration(d: Deployment, tokens: int = 100) -> dict[str, Any]:
    sampling = {"max_new_tokens": tokens, "temperature": 0}

    async def uninterrupted() -> float:
        async with d.async_client("actor") as c:
            started = time.perf_counter()
            await c.generate(PROMPT, sampling_params=sampling)
            return time.perf_counter() - started

    async def killed() -> tuple[float, Any]:
        done: list[str] = []

        def kill_half(target: str, count: int) -> None:
            if count >= tokens // 2 and not done:
                (busy,) = [e for e in d.engines() if _in_flight(e.url) > 0]
                done.append(busy.id)
                os.kill(d.fleet.engine(busy.id).processes[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]

        async with d.async_client("actor") as c:
            started = time.perf_counter()
            result = await c.generate(PROMPT, sampling_params=sampling, on_tokens=kill_half)
            return time.perf_counter() - started, result

    whole_s = asyncio.run(uninterrupted())
    migrated_s, result = asyncio.run(killed())
    return {
        "tokens": tokens,
        "uninterrupted_s": whole_s,
        "migrated_s": migrated_s,
        "extra_s": migrated_s - whole_s,
        "tries": len(result.attempts),
        "detection_s": sum(
            a.began_s - (before.began_s + before.took_s)
            for before, a in zip(result.attempts, result.attempts[1:], strict=False)
        ),
        "resubmitted_tokens": result.resubmitted_tokens,
    }


def _in_flight(url: str) -> int:
    return int(httpx.get(url + "/stand_in/stats", timeout=10).json()["in_flight"])


def _killer(d: Deployment, stop: threading.Event, every_s: float, kills: list[int]) -> None:
    """SIGKILL a serving engine every ``every_s`` (never the last one serving) until ``stop``."""
    while not stop.wait(every_s):
        serving = [e for e in d.engines() if e.state == "serving"]
        if len(serving) >= 2:
            victim = random.choice(serving)
            os.kill(d.fleet.engine(victim.id).processes[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]
            kills.append(1)


def _with_kills(d: Deployment, every_s: float, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    stop, kills = threading.Event(), []
    since = len(d.events())
    thread = threading.Thread(target=_killer, args=(d, stop, every_s, kills))
    thread.start()
    try:
        out = run()
    finally:
        stop.set()
        thread.join()
    deadline = time.monotonic() + 120
    while any(e.state != "serving" for e in d.engines()) and time.monotonic() < deadline:
        time.sleep(0.1)  # every engine back before the next run
    return {**out, "kills": len(kills), "events": len(d.events()) - since}


def _plain_under_kills(url: str, total: int, concurrency: int, tokens: int) -> dict[str, Any]:
    failed: list[str] = []

    async def go() -> None:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as http:

            async def one() -> None:
                try:
                    r = await http.post(url, json=body(tokens))
                    if r.status_code != 200:
                        failed.append(f"HTTP {r.status_code}")
                except httpx.HTTPError as exc:
                    failed.append(type(exc).__name__)

            await _run_all(one, total, concurrency)

    asyncio.run(go())
    return {"failed": len(failed), "failures": sorted(set(failed))[:5]}


def _client_under_kills(d: Deployment, total: int, concurrency: int, tokens: int) -> dict[str, Any]:
    failed: list[str] = []
    resubmitted = [0]

    async def go() -> None:
        async with d.async_client("actor", deadline_s=120) as c:

            async def one() -> None:
                try:
                    r = await c.generate(PROMPT, sampling_params={"max_new_tokens": tokens, "temperature": 0})
                    resubmitted[0] += r.resubmitted_tokens
                except Exception as exc:  # counted, not raised: the goal is how many
                    failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")

            await _run_all(one, total, concurrency)

    asyncio.run(go())
    return {"failed": len(failed), "failures": sorted(set(failed))[:5], "resubmitted_tokens": resubmitted[0]}


def under_kills(d: Deployment, total: int, concurrency: int, tokens: int, every_s: float) -> dict[str, Any]:
    url = d.registry.get_model_url("actor")
    return {
        "requests": total,
        "plain": _with_kills(d, every_s, lambda: _plain_under_kills(url, total, concurrency, tokens)),
        "client": _with_kills(d, every_s, lambda: _client_under_kills(d, total, concurrency, tokens)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--kill-requests", type=int, default=600)
    parser.add_argument("--kill-every", type=float, default=2.0)
    parser.add_argument("--smoke", action="store_true", help="one quick run at the smallest sizes")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.tokens, args.kill_requests, args.kill_every = 40, 4, 8, 60, 1.0
    with tempfile.TemporaryDirectory() as tmp, launch(4, 0.01, Path(tmp), args.verbose) as d:
        report = {
            "overhead": overhead(d, args.requests, args.concurrency, args.tokens),
            "migration": migration(d),
            "kills": under_kills(d, args.kill_requests, args.concurrency, args.tokens, args.kill_every),
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    o, m, k = report["overhead"], report["migration"], report["kills"]
    print(
        f"(1) {args.requests} requests x {args.tokens} tokens, concurrency {args.concurrency}, through the router:"
    )
    print(
        f"    plain httpx {o['plain_s']:.2f} s, plain streaming {o['plain_stream_s']:.2f} s, client {o['client_s']:.2f} s"
    )
    print(f"    client/plain: {o['ratio']:.3f} (goal <= {o['goal']})")
    print(
        f"(2) {m['tokens']} tokens, engine killed after half: uninterrupted {m['uninterrupted_s']:.2f} s, migrated"
    )
    print(
        f"    {m['migrated_s']:.2f} s ({m['extra_s']:+.2f} s; {m['tries']} tries, waited {m['detection_s']:.2f} s"
        f" between them, {m['resubmitted_tokens']} tokens pre-filled again)"
    )
    c, p = k["client"], k["plain"]
    print(
        f"(3) {k['requests']} requests while engines are killed: plain httpx failed {p['failed']} "
        f"({p['kills']} kills) {p['failures']}"
    )
    print(
        f"    client: failed {c['failed']} (goal 0; {c['kills']} kills), {c['resubmitted_tokens']} tokens pre-filled again"
        f" {c['failures']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
