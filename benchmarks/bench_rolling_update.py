"""A rolling weight update against an update of every engine at once, under continuous load, side by side in
one run: stand-in engines paced by their speed model, whose disk loads take ``--load-s`` (1.0) seconds (they
serve nothing meanwhile, as SGLang's scheduler), the real router, and rollout clients sending without pause.

(1) before: generated tokens per second over ``--window-s`` (3) seconds.
(2) rolling: ``update_weights_from_disk(..., rolling=True, min_serving_fraction=--fraction (0.75))``; tokens per
    second while it runs, against (1). Goal: >= 0.7 of (1), 0 failed requests.
(3) all at once: ``update_weights_from_disk(..., abort_all_requests=True)``; tokens per second while it runs
    (every engine loads at the same time: about 0).

    python benchmarks/bench_rolling_update.py [--engines 16] [--fraction 0.75] [--load-s 1.0] [--json]
    python benchmarks/bench_rolling_update.py --smoke    # one quick run at the smallest sizes (run by the tests)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_launch import quiet  # beside this script (benchmarks/ is on sys.path when it runs)

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.serving.deployment import Deployment

HOST = "127.0.0.1"
PROMPT = [17, 29, 31, 37, 41, 43, 47, 53]


def overrides(engines: int, port_base: int, load_s: float) -> list[str]:
    return [
        "sglang=default",
        "hf_checkpoint=/c",
        "debug_rollout_only=true",
        "sglang_deploy=simulated",
        f"sglang.actor.regular.num_gpus={engines}",
        "sglang.actor.num_gpus_per_engine=1",
        f"num_gpus_per_node={max(8, engines)}",
        "sglang_deploy.standin.speed.enabled=true",
        "sglang_deploy.standin.speed.decode_step_s=0.02",
        "sglang_deploy.standin.speed.decode_token_s=0.0005",
        f"sglang_deploy.standin.control_latency_s={load_s}",
        "sglang_deploy.router.policy=round_robin",
        f"sglang_deploy.launch.host={HOST}",
        f"sglang_deploy.launch.port_base={port_base}",
        "sglang_deploy.launch.live=never",
    ]


class Load:
    """Rollout clients sending without pause from a thread of their own; each token's arrival time is kept."""

    def __init__(self, d: Deployment, concurrency: int, tokens: int) -> None:
        self.d, self.concurrency, self.tokens = d, concurrency, tokens
        self.arrivals: list[tuple[float, int]] = []
        self.failed: list[str] = []
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load")

    async def _run(self) -> None:
        async with self.d.async_client("actor", deadline_s=120) as client:

            async def worker() -> None:
                while not self._stop.is_set():
                    seen = [0]

                    def on_tokens(_target: str, count: int, seen: list[int] = seen) -> None:
                        self.arrivals.append((time.perf_counter(), max(0, count - seen[0])))
                        seen[0] = max(seen[0], count)

                    sampling = {"max_new_tokens": self.tokens, "temperature": 0}
                    try:
                        await client.generate(PROMPT, sampling_params=sampling, on_tokens=on_tokens)
                        self.done += 1
                    except Exception as exc:  # counted, not raised: the goal is how many
                        self.failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def rate(self, start: float, end: float) -> float:
        """Tokens per second that arrived between ``start`` and ``end``."""
        tokens = sum(n for t, n in list(self.arrivals) if start <= t < end)
        return tokens / max(end - start, 1e-9)


def _serving_fraction(d: Deployment, stop: threading.Event, seen: list[float]) -> None:
    while not stop.wait(0.02):
        engines = d.state().engines
        seen.append(sum(e.state == "serving" for e in engines) / len(engines))


def timed(load: Load, d: Deployment, update: Any) -> dict[str, Any]:
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_serving_fraction, args=(d, stop, seen))
    watcher.start()
    started = time.perf_counter()
    try:
        result = update()
    finally:
        ended = time.perf_counter()
        stop.set()
        watcher.join()
    return {
        "seconds": ended - started,
        "tokens_per_s": load.rate(started, ended),
        "accepted": len(result.accepted),
        "least_serving": min(seen, default=1.0),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = compose_config(overrides(args.engines, random.randrange(20000, 28000), args.load_s))
    with tempfile.TemporaryDirectory() as tmp:
        with quiet(args.verbose):
            deployment = launch_from_config(cfg, log_dir=Path(tmp) / "logs")
        with deployment as d:
            with Load(d, args.engines * 2, args.tokens) as load:
                measured = _measure(args, d, load)
            # the clients have stopped: every request they sent is counted
            return {
                **measured,
                "requests": load.done,
                "failed": len(load.failed),
                "failures": load.failed[:5],
            }


def _measure(args: argparse.Namespace, d: Deployment, load: Load) -> dict[str, Any]:
    time.sleep(args.window_s)  # warm up
    now = time.perf_counter()
    time.sleep(args.window_s)
    before = load.rate(now, time.perf_counter())
    rolling = timed(
        load,
        d,
        lambda: d.control.update_weights_from_disk(
            "/ckpt/rolling",
            weight_version="2",
            rolling=True,
            min_serving_fraction=args.fraction,
            drain_timeout_s=args.drain_s,
        ),
    )
    time.sleep(args.window_s)
    at_once = timed(
        load,
        d,
        lambda: d.control.update_weights_from_disk("/ckpt/all", weight_version="3", abort_all_requests=True),
    )
    time.sleep(1.0)  # requests the update cut are carried on before the clients stop
    return {
        "engines": args.engines,
        "fraction": args.fraction,
        "load_s": args.load_s,
        "before_tokens_per_s": before,
        "rolling": {**rolling, "ratio": rolling["tokens_per_s"] / before, "goal": 0.7},
        "at_once": {**at_once, "ratio": at_once["tokens_per_s"] / before},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--fraction", type=float, default=0.75)
    parser.add_argument("--load-s", type=float, default=1.0)
    parser.add_argument("--drain-s", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--smoke", action="store_true", help="one quick run at the smallest sizes")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.engines, args.load_s, args.window_s, args.tokens = 4, 0.3, 1.0, 16
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    r, a = report["rolling"], report["at_once"]
    print(f"{report['engines']} engines, loads of {report['load_s']:g} s, clients sending without pause:")
    print(f"(1) before: {report['before_tokens_per_s']:.0f} tokens/s")
    print(
        f"(2) rolling (min_serving_fraction {report['fraction']:g}): {r['seconds']:.1f} s, "
        f"{r['tokens_per_s']:.0f} tokens/s = {r['ratio']:.2f} of before (goal >= {r['goal']}); "
        f"least serving {r['least_serving']:.2f}"
    )
    print(
        f"(3) all at once: {a['seconds']:.1f} s, {a['tokens_per_s']:.0f} tokens/s = {a['ratio']:.2f} of before; "
        f"least serving {a['least_serving']:.2f}"
    )
    print(f"requests {report['requests']}, failed {report['failed']} (goal 0) {report['failures']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
