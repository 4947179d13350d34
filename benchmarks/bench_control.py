"""What the control handle and supervision cost, measured with stand-in engines and the real sglang-router.

(1) fan-out: K stand-in engines of 1 GPU (K = 1, 8, 32), every group needing offload (colocate, offload on).
    Wall time of ``offload(["kv_cache"])`` + ``onload(["kv_cache"])`` (one cycle) and of ``update_weight_version``
    through ``deployment.control``, median over the repetitions, K = 32 against K = 1, and this process's CPU
    time (all its threads) per engine call. Measured twice: with each
    engine taking ``--latency`` seconds per control call (``sglang_deploy.standin.control_latency_s``, as a real
    engine's release/resume of tens of GB takes), which is the case the goal is about, and with 0 s (the stand-in
    answers at once), which shows the client's and the machine's own overhead per engine.
(2) healing: 4 engines, each taking ``--start-delay`` s to start (``sglang_deploy.standin.start_delay_s``); one is
    SIGKILLed; from the kill until the replacement serves again (registered and listed healthy by its router),
    minus the replacement's own start (process start to answering ``/health_generate``): detection, taking it
    out of the router, registration (the first restart has no backoff). Goal: at most 0.3 s with the default
    supervision settings; also with fast ones (polls every 0.2 s).
(3) requests under a loss: 2,000 ``POST /generate`` at concurrency 64 through the router (cache_aware, the
    router's default retries) of 8 engines; one engine is SIGKILLed after 500 answers. Requests failed, latency,
    the loss and the recovery reported by the deployment.
(4) chaos soak: 10 engines, 32 clients sending ``/generate`` without pause for ``--soak-s`` (300) seconds,
    default supervision settings; every 5-15 s a serving engine is SIGKILLed or SIGSTOPped (its hang is
    noticed, it is killed and replaced), and the router is SIGKILLed twice (at 1/3 and 2/3 of the run). A
    client whose connection is refused (no router at that moment: nothing was sent) tries again; every other
    error or non-200 answer is a failure. Reported: failures while only engines failed (goal 0), 503s (goal 0),
    and failures of requests that were in flight inside the router when it was killed (the only ones allowed).
    With ``--soak-applies`` (and in the smoke run) the same soak runs on a PD deployment (4 prefill + 6 decode
    engines) that also moves one GPU between prefill and decode every 30 s (``move_gpus``) and runs a trainer's
    control cycle every 25 s (pause, offload and onload of the KV cache, a new weight version, continue); after
    each move the deployment's plan must name exactly the engines of its fleet (state mismatches: goal 0).
    With ``--soak-client`` (and in the smoke run) every request goes through the rollout client, asking for at
    least the weight version of the last update that ended, and each control cycle ends with a rolling disk
    update to a new version: failed requests (goal 0, router kills included), samples with a token below their
    minimum version (goal 0), tokens sent again (the cost of carrying requests on).
(5) router kills: 2 engines, 4 clients sending ``/generate`` without pause, the router SIGKILLed ``--router-kills``
    (20) times, each time once it serves again. Per kill: detection (the kill to ``router_lost``), the router's own
    start (``router_lost`` to the new process first answering ``/readiness`` 200, polled by the benchmark every
    10 ms) and the rest (that answer to ``router_recovered``). Goal: the rest <= 1 s every time.

Everything binds 127.0.0.1 with ports from a random base; everything started is stopped (context managers).

    python benchmarks/bench_control.py [--reps 5] [--latency 0.5] [--requests 2000] [--soak-s 300] [--soak-applies]
                                       [--soak-client]
                                       [--router-kills 20] [--skip fan_out,healing,requests,chaos,router_kills] [--json]
    python benchmarks/bench_control.py --smoke    # one quick repetition at the smallest sizes (run by the tests)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_launch import quiet  # beside this script (benchmarks/ is on sys.path when it runs)

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.serving.deployment import Deployment

HOST = "127.0.0.1"
GEN_BODY = {"text": "the quick brown fox jumps over", "sampling_params": {"max_new_tokens": 4}}
FAST_SUPERVISION = [
    "sglang_deploy.supervision.health_interval_s=0.2",
    "sglang_deploy.supervision.health_timeout_s=0.5",
    "sglang_deploy.supervision.restart_backoff_s=0",
]


def overrides(k: int, *extra: str) -> list[str]:
    return [
        "sglang=default",
        "hf_checkpoint=/c",
        "colocate=true",
        "offload_rollout=true",
        f"actor_num_gpus_per_node={k}",  # colocate: rollout_num_gpus = the actor's k GPUs
        f"num_gpus_per_node={max(8, k)}",
        "sglang_deploy=simulated",
        f"sglang.actor.regular.num_gpus={k}",
        "sglang.actor.num_gpus_per_engine=1",
        f"sglang_deploy.launch.host={HOST}",
        f"sglang_deploy.launch.port_base={random.randrange(20000, 29000)}",
        "sglang_deploy.launch.live=never",
        *extra,
    ]


def launch(k: int, tmp: Path, verbose: bool, *extra: str) -> contextlib.AbstractContextManager[Deployment]:
    log_dir = Path(tempfile.mkdtemp(prefix=f"control_k{k}_", dir=tmp))
    return launch_from_config(compose_config(overrides(k, *extra)), log_dir=log_dir)


def _timed(operation: Callable[[], Any]) -> tuple[float, float]:
    """Wall time and this process's CPU time (every thread: the caller's, the serving loop's) of one call."""
    started, cpu = time.perf_counter(), time.process_time()
    operation()
    return time.perf_counter() - started, time.process_time() - cpu


# ------------------------------------------------------------------------------------------ (1) fan-out
def _fan_out_times(d: Deployment, k: int, reps: int) -> dict[str, list[float]]:
    control = d.control
    control.update_weight_version("warm-up")  # the stand-ins read SGLang's request classes once
    out: dict[str, list[float]] = {"cycle": [], "cycle_cpu": [], "version": [], "version_cpu": []}
    for rep in range(reps):
        wall, cpu = _timed(lambda: (control.offload(["kv_cache"]), control.onload(["kv_cache"])))
        out["cycle"].append(wall)
        out["cycle_cpu"].append(cpu)
        wall, cpu = _timed(lambda rep=rep: control.update_weight_version(str(rep)))
        out["version"].append(wall)
        out["version_cpu"].append(cpu)
    assert len(control.offload(["kv_cache"]).engines) == k
    control.onload(["kv_cache"])
    return out


def fan_out(ks: list[int], latency_s: float, reps: int, tmp: Path, verbose: bool) -> list[dict[str, Any]]:
    rows = []
    for k in ks:
        with (
            quiet(verbose),
            launch(k, tmp, verbose, f"sglang_deploy.standin.control_latency_s={latency_s}") as d,
        ):
            times = _fan_out_times(d, k, reps)
        rows.append(
            {
                "k": k,
                "latency_s": latency_s,
                "offload_onload_s": statistics.median(times["cycle"]),
                "weight_version_s": statistics.median(times["version"]),
                "offload_onload_all_s": [round(x, 4) for x in times["cycle"]],
                # client CPU per engine call: an offload + onload cycle is two calls to each of the k engines
                "offload_onload_cpu_ms_per_call": 1000 * statistics.median(times["cycle_cpu"]) / (2 * k),
                "weight_version_cpu_ms_per_call": 1000 * statistics.median(times["version_cpu"]) / k,
            }
        )
    base = rows[0]
    for row in rows:
        row["offload_onload_ratio"] = row["offload_onload_s"] / base["offload_onload_s"]
        row["weight_version_ratio"] = row["weight_version_s"] / base["weight_version_s"]
    return rows


# ------------------------------------------------------------------------------------------ (2) healing
def healing(k: int, start_delay_s: float, reps: int, fast: bool, tmp: Path, verbose: bool) -> dict[str, Any]:
    extra = [f"sglang_deploy.standin.start_delay_s={start_delay_s}", *(FAST_SUPERVISION if fast else [])]
    runs = []
    with quiet(verbose), launch(k, tmp, verbose, *extra) as d:
        for rep in range(reps):
            victim = d.engines()[rep % k].id
            (process,) = [p for p in d.processes() if p.name == victim]
            since = len(d.events())
            killed = time.monotonic()
            os.kill(process.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            lost = d.wait_for_event("engine_lost", subject=victim, since=since, timeout_s=60)
            back = d.wait_for_event("engine_recovered", subject=victim, since=since, timeout_s=120)
            total = back.monotonic - killed
            runs.append(
                {
                    "noticed_s": lost.monotonic - killed,
                    "death_to_serving_s": total,
                    "own_start_s": back.details["start_s"],
                    "overhead_s": total - back.details["start_s"],
                }
            )
        backoff = d.settings.supervision.restart_backoff_s
    row: dict[str, Any] = {
        "settings": "fast" if fast else "default",
        "start_delay_s": start_delay_s,
        "backoff_s": backoff,
    }
    for field in runs[0]:
        row[field] = statistics.median(run[field] for run in runs)
    row["overhead_minus_backoff_s"] = row["overhead_s"] - backoff
    row["reps"] = len(runs)
    return row


# ------------------------------------------------------------------------------------------ (3) requests
async def _load(
    url: str, total: int, concurrency: int, on_answers: int, kill: Callable[[], None]
) -> dict[str, Any]:
    latencies: list[float] = []
    failures: list[str] = []
    queue = iter(range(total))
    killed = False

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal killed
        for _ in queue:
            started = time.perf_counter()
            try:
                response = await client.post(url, json=GEN_BODY)
                if response.status_code != 200:
                    failures.append(f"HTTP {response.status_code}: {response.text[:120]}")
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            latencies.append(time.perf_counter() - started)
            if not killed and len(latencies) >= on_answers:
                killed = True
                kill()

    # One client (one keep-alive connection) per worker: one pool of 64 connections measures httpcore's pool
    # scan, not the router (see bench_launch.py).
    clients = [
        httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1)) for _ in range(concurrency)
    ]
    started = time.perf_counter()
    try:
        await asyncio.gather(*(worker(client) for client in clients))
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))
    latencies.sort()
    return {
        "requests": total,
        "failed": len(failures),
        "failures": sorted(set(failures))[:5],
        "wall_s": time.perf_counter() - started,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99) - 1],
        "max_ms": 1000 * latencies[-1],
    }


def requests_under_loss(k: int, total: int, concurrency: int, tmp: Path, verbose: bool) -> dict[str, Any]:
    with quiet(verbose), launch(k, tmp, verbose) as d:
        victim = d.engines()[-1].id
        (process,) = [p for p in d.processes() if p.name == victim]
        since = len(d.events())
        row = asyncio.run(
            _load(
                d.registry.get_model_url("actor"),
                total,
                concurrency,
                on_answers=total // 4,
                kill=lambda: os.kill(process.pid, signal.SIGKILL),  # type: ignore[attr-defined]
            )
        )
        lost = d.wait_for_event("engine_lost", subject=victim, since=since, timeout_s=60)
        back = d.wait_for_event("engine_recovered", subject=victim, since=since, timeout_s=120)
        row.update(engines=k, concurrency=concurrency, lost=lost.message, recovered=back.message)
    return row


# ------------------------------------------------------------------------------------------ (4) chaos
@dataclass
class _Request:
    started: float
    ended: float
    outcome: str  # "200", "HTTP 503", "ReadError", ...


async def _soak_clients(url: str, clients: int, running: Callable[[], bool], log: list[_Request]) -> int:
    refused = 0

    async def client() -> None:
        nonlocal refused
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1)) as http:
            while running():
                started = time.monotonic()
                try:
                    response = await http.post(url, json=GEN_BODY)
                    outcome = (
                        str(response.status_code)
                        if response.status_code == 200
                        else f"HTTP {response.status_code}"
                    )
                except httpx.ConnectError:  # no router listening right now: nothing was sent, try again
                    refused += 1
                    await asyncio.sleep(0.01)
                    continue
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                log.append(_Request(started, time.monotonic(), outcome))

    await asyncio.gather(*(client() for _ in range(clients)))
    return refused


async def _soak_rollout_clients(
    d: Deployment, clients: int, running: Callable[[], bool], log: list[_Request], versions: dict[str, Any]
) -> int:
    """The soak's clients through the deployment's rollout client, each request asking for at least the
    version of the last weight update that ended (``versions["floor"]``); a sample with a token of an older
    version is counted in ``versions["below"]``, the prompt and tokens sent again in ``versions["resubmitted"]``."""
    async with d.async_client("actor", deadline_s=600, router_retry_s=120, version_wait_s=120) as rollout:

        async def client() -> None:
            while running():
                floor, started = versions["floor"], time.monotonic()
                try:
                    result = await rollout.generate(
                        [11, 22, 33], sampling_params={"max_new_tokens": 4}, min_version=floor or None
                    )
                    outcome = "200"
                    versions["resubmitted"] += result.resubmitted_tokens
                    seen = [s.weight_version for s in result.segments]
                    versions["below"] += bool(floor) and any(
                        not (v or "").isdigit() or int(v) < floor for v in seen
                    )
                except Exception as exc:  # counted: the goal is none
                    outcome = type(exc).__name__
                log.append(_Request(started, time.monotonic(), outcome))

        await asyncio.gather(*(client() for _ in range(clients)))
    return 0


def _chaos(
    d: Deployment, stop: float, router_kills: list[float], faults: list[tuple[float, str, str]]
) -> None:
    """Until ``stop``: an engine fault every 5-15 s, the router killed at each time of ``router_kills``."""
    rng = random.Random(7)
    next_fault = time.monotonic() + rng.uniform(5, 15)
    kills = sorted(router_kills)
    while time.monotonic() < stop:
        now = time.monotonic()
        if kills and now >= kills[0]:
            kills.pop(0)
            with contextlib.suppress(ProcessLookupError):  # the router may be away, being restarted
                os.kill(d.fleet.routers()[0].process.pid, signal.SIGKILL)  # type: ignore[arg-type]
                faults.append((time.monotonic(), "router", "SIGKILL"))
        if now >= next_fault:
            serving = [row for row in d.fleet.engines() if row.state.value == "serving" and row.processes]
            if serving:
                row = rng.choice(serving)
                how = rng.choice([signal.SIGKILL, signal.SIGSTOP])
                with contextlib.suppress(ProcessLookupError):  # it may have exited meanwhile
                    os.kill(row.processes[0].pid, how)  # type: ignore[attr-defined]
                    faults.append((time.monotonic(), row.id, how.name))
            next_fault = time.monotonic() + rng.uniform(5, 15)
        time.sleep(0.05)


def _pd_soak(k: int) -> list[str]:
    """k engines as prefill and decode: 4 + 6 of 10, 2 + 2 of 4."""
    prefill = max(2, k * 2 // 5)
    return [
        "sglang.actor.regular.num_gpus=0",
        f"sglang.actor.prefill.num_gpus={prefill}",
        f"sglang.actor.decode.num_gpus={k - prefill}",
    ]


def chaos_soak(
    k: int,
    clients: int,
    soak_s: float,
    tmp: Path,
    verbose: bool,
    applies: bool = False,
    rollout: bool = False,
) -> dict[str, Any]:
    log: list[_Request] = []
    faults: list[tuple[float, str, str]] = []
    driven: dict[str, Any] = {"moves": 0, "cycles": 0, "mismatches": 0, "errors": []}
    versions: dict[str, Any] = {"floor": 0, "below": 0, "resubmitted": 0, "rolling": rollout}
    # A fault every 5-15 s for the whole soak can hit one engine more often than its restart budget allows
    # within restart_budget_reset_s (3 in 600 s): the soak measures what clients see, not the budget.
    extra = ["sglang_deploy.router.policy=round_robin", "sglang_deploy.supervision.max_restarts=1000"]
    extra += _pd_soak(k) if applies else []
    with quiet(verbose), launch(k, tmp, verbose, *extra) as d:
        started = time.monotonic()
        stop = started + soak_s
        kills = [started + soak_s / 3, started + 2 * soak_s / 3]
        chaos = threading.Thread(target=_chaos, args=(d, stop, list(kills), faults), daemon=True)
        chaos.start()
        driver = threading.Thread(target=_drive, args=(d, stop, driven, versions), daemon=True)
        if applies:
            driver.start()
        url = d.registry.get_model_url("actor")
        running = lambda: time.monotonic() < stop  # noqa: E731
        refused = asyncio.run(
            _soak_rollout_clients(d, clients, running, log, versions)
            if rollout
            else _soak_clients(url, clients, running, log)
        )
        chaos.join(timeout=30)
        if applies:
            driver.join(timeout=600)
        events = [e.kind for e in d.events()]
        pids = [p.pid for p in d.processes()]
    states = [_state(pid) for pid in pids]
    left = [state for state in states if state not in (None, "Z", "X")]
    unreaped = [state for state in states if state == "Z"]
    router_kills = [t for t, what, _how in faults if what == "router"]
    failed = [r for r in log if r.outcome != "200"]
    in_router = [r for r in failed if any(_in_killed_router(r, t) for t in router_kills)]
    return {
        "engines": k,
        "clients": clients,
        "soak_s": soak_s,
        "applies": applies,
        "rollout_client": rollout,
        "below_min_version": versions["below"],
        "resubmitted_tokens": versions["resubmitted"],
        "requests": len(log),
        "refused_connections": refused,
        "engine_faults": sum(1 for _t, what, _how in faults if what != "router"),
        "router_kills": len(router_kills),
        "failed": len(failed),
        "failed_not_in_killed_router": len(failed) - len(in_router),
        "http_503": sum(1 for r in failed if r.outcome == "HTTP 503"),
        "failure_kinds": sorted({r.outcome for r in failed}),
        "events": {kind: events.count(kind) for kind in sorted(set(events))},
        "moves": driven["moves"],
        "control_cycles": driven["cycles"],
        "state_mismatches": driven["mismatches"],
        "driver_errors": driven["errors"][:5],
        "processes_left": len(left),
        "processes_unreaped": len(unreaped),
    }


def _state(pid: int | None) -> str | None:
    """The process's state letter (``R``, ``S``, ``Z`` for exited but not reaped, ...), None once it is gone."""
    if pid is None:
        return None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _drive(d: Deployment, stop: float, record: dict[str, Any], versions: dict[str, Any]) -> None:
    """Until ``stop``: one GPU moved between prefill and decode every 30 s (back and forth), a control cycle
    (generation paused, the KV cache offloaded and onloaded, a new weight version, generation continued) every
    25 s (both more often in a soak shorter than 150 s); after each move, does the plan name exactly the
    fleet's engines? With the rollout client (``versions["rolling"]``) the new version comes with a rolling
    disk update (half of each group serving) after the cycle, and is the clients' floor once it is done."""
    begun = time.monotonic()
    move_s, cycle_s = min(30.0, (stop - begun) / 5), min(25.0, (stop - begun) / 6)
    next_move, next_cycle, moves = begun + move_s, begun + cycle_s, 0
    while time.monotonic() < stop:
        now = time.monotonic()
        try:
            if now >= next_move:
                there, back = ("prefill", "decode") if moves % 2 == 0 else ("decode", "prefill")
                d.move_gpus("actor", there, back, 1)
                moves += 1
                planned = sorted(e.id for e in d.plan.engines)
                running = sorted(e.id for e in d.engines())
                record["mismatches"] += planned != running
                record["moves"] = moves
                next_move = time.monotonic() + move_s
            if (
                now >= next_cycle
            ):  # a trainer's step: generation paused, memory released and back, new weights
                d.control.pause_generation("retract")
                d.control.offload(["kv_cache"])
                d.control.onload(["kv_cache"])
                record["cycles"] += 1
                if versions["rolling"]:
                    d.control.continue_generation()
                    version = record["cycles"]
                    d.control.update_weights_from_disk(
                        f"/ckpt/{version}",
                        weight_version=str(version),
                        rolling=True,
                        min_serving_fraction=0.5,
                    )
                    versions["floor"] = version
                else:
                    d.control.update_weight_version(f"v{record['cycles']}")
                    d.control.continue_generation()
                next_cycle = time.monotonic() + cycle_s
        except Exception as exc:  # a benchmark reports what failed, and goes on
            record["errors"].append(f"{type(exc).__name__}: {str(exc)[:200]}")
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ (5) router kills
def _first_ready_after(url: str, stop: threading.Event, out: dict[str, float]) -> None:
    """The first ``/readiness`` 200 of the router at ``url`` after it was seen down (not the killed process's)."""
    seen_down = False
    with httpx.Client(timeout=0.5) as http:
        while not stop.is_set():
            try:
                ready = http.get(url + "/readiness").status_code == 200
            except httpx.HTTPError:
                ready = False
            if not ready:
                seen_down = True
            elif seen_down:
                out["ready"] = time.monotonic()
                return
            time.sleep(0.01)


def _kill_router_once(d: Deployment, url: str) -> dict[str, float]:
    since = len(d.events())
    first: dict[str, float] = {}
    stop = threading.Event()
    poller = threading.Thread(target=_first_ready_after, args=(url, stop, first), daemon=True)
    killed_at = time.monotonic()
    os.kill(d.fleet.routers()[0].process.pid, signal.SIGKILL)  # type: ignore[arg-type]
    poller.start()
    try:
        recovered = d.wait_for_event("router_recovered", subject="router.actor", since=since, timeout_s=120)
    finally:
        stop.set()
        poller.join(timeout=10)
    lost = next(e for e in d.events()[since - len(d.events()) :] if e.kind == "router_lost")
    ready = first.get("ready", recovered.monotonic)
    return {
        "killed_at": killed_at,
        "detection_s": lost.monotonic - killed_at,
        "own_start_s": ready - lost.monotonic,
        "rest_s": recovered.monotonic - ready,
        "total_s": recovered.monotonic - killed_at,
    }


#: A request sent this soon after the kill still reached the dying process (its socket outlives the signal).
KILL_SETTLE_S = 0.05


def _in_killed_router(request: _Request, killed_at: float) -> bool:
    """Whether ``request`` failed for being in the router when it was killed: in flight then (or sent within
    :data:`KILL_SETTLE_S` after), and its connection dropped."""
    dropped = request.outcome in ("ReadError", "RemoteProtocolError", "WriteError")
    return dropped and request.started <= killed_at + KILL_SETTLE_S and request.ended >= killed_at


def router_kills(kills: int, tmp: Path, verbose: bool) -> dict[str, Any]:
    log: list[_Request] = []
    rows: list[dict[str, float]] = []
    budget = f"sglang_deploy.supervision.router_max_restarts={kills + 1}"
    with quiet(verbose), launch(2, tmp, verbose, "sglang_deploy.router.policy=round_robin", budget) as d:
        url = d.registry.get_model_url("actor").rsplit("/", 1)[0]
        done = threading.Event()
        clients = threading.Thread(
            target=lambda: asyncio.run(_soak_clients(url + "/generate", 4, lambda: not done.is_set(), log)),
            daemon=True,
        )
        clients.start()
        try:
            time.sleep(1.0)
            for _ in range(kills):
                rows.append(_kill_router_once(d, url))
                time.sleep(1.0)  # serving again before the next kill
        finally:
            done.set()
            clients.join(timeout=60)
    failed = [r for r in log if r.outcome != "200"]
    killed = [r["killed_at"] for r in rows]
    other = [r for r in failed if not any(_in_killed_router(r, t) for t in killed)]
    return {
        "kills": kills,
        "rows": rows,
        "worst_rest_s": max(r["rest_s"] for r in rows),
        "requests": len(log),
        "failed": len(failed),
        "failed_not_in_killed_router": len(other),
        "http_503": sum(1 for r in failed if r.outcome == "HTTP 503"),
        "failure_kinds": sorted({r.outcome for r in failed}),
        "other_failures": [
            f"{outcome}: {sum(1 for r in other if r.outcome == outcome)}, the first "
            f"{min(r.started - t for r in other if r.outcome == outcome for t in killed if r.started >= t):.2f} s "
            "after a kill"
            for outcome in sorted({r.outcome for r in other})
        ],
    }


# ------------------------------------------------------------------------------------------ report
def print_report(results: dict[str, Any]) -> None:
    if "fan_out" in results:
        _print_fan_out(results["fan_out"])
    if "healing" in results:
        _print_healing(results["healing"])
    if "requests" in results:
        _print_requests(results["requests"])
    if "chaos" in results:
        _print_chaos(results["chaos"])
    if "router_kills" in results:
        _print_router_kills(results["router_kills"])


def _print_chaos(row: dict[str, Any]) -> None:
    print(
        f"(4) chaos soak: {row['soak_s']:g} s, {row['engines']} engines, {row['clients']} clients, "
        f"{row['engine_faults']} engine faults (SIGKILL/SIGSTOP), {row['router_kills']} router kills"
    )
    print(
        f"    {row['requests']} requests, failed {row['failed']} ({row['failed_not_in_killed_router']} not in flight "
        f"in a killed router; goal 0), 503s {row['http_503']} (goal 0); {row['refused_connections']} connections "
        f"refused while the router was down (tried again)"
    )
    if row["rollout_client"]:
        print(
            f"    through the rollout client: samples below their minimum version {row['below_min_version']} "
            f"(goal 0), tokens sent again {row['resubmitted_tokens']}"
        )
    print(
        f"    failures: {row['failure_kinds']}; events: {row['events']}; processes left {row['processes_left']} "
        f"(exited, not reaped: {row['processes_unreaped']})"
    )
    if row["applies"]:
        print(
            f"    {row['moves']} GPU moves, {row['control_cycles']} control cycles: state mismatches "
            f"{row['state_mismatches']} (goal 0); errors {row['driver_errors']}"
        )


def _print_router_kills(row: dict[str, Any]) -> None:
    print(f"(5) router SIGKILLed {row['kills']} times under 4 clients without pause")
    print(f"    {'kill':>4} {'detection':>10} {'own start':>10} {'rest':>8} {'total':>8}")
    for i, r in enumerate(row["rows"], 1):
        print(
            f"    {i:>4} {r['detection_s']:>8.2f} s {r['own_start_s']:>8.2f} s {r['rest_s']:>6.2f} s "
            f"{r['total_s']:>6.2f} s"
        )
    print(
        f"    worst rest {row['worst_rest_s']:.2f} s (goal <= 1 s); {row['requests']} requests, failed "
        f"{row['failed']} ({row['failed_not_in_killed_router']} not in flight in the killed router), 503s "
        f"{row['http_503']}; {row['failure_kinds']}"
    )
    for failure in row["other_failures"]:
        print(f"    not in the killed router: {failure}")


def _print_fan_out(rows: list[dict[str, Any]]) -> None:
    print("(1) control fan-out, median wall time per operation (ratio to K=1); client CPU per engine call")
    print(f"    {'K':>3} {'engine latency':>15} {'offload+onload':>24} {'weight version':>24}")
    for row in rows:
        print(
            f"    {row['k']:>3} {row['latency_s']:>13.2f} s {row['offload_onload_s'] * 1000:>9.1f} ms ({row['offload_onload_ratio']:.2f}x)"
            f" {row['offload_onload_cpu_ms_per_call']:>5.2f} ms CPU"
            f" {row['weight_version_s'] * 1000:>9.1f} ms ({row['weight_version_ratio']:.2f}x)"
            f" {row['weight_version_cpu_ms_per_call']:>5.2f} ms CPU"
        )


def _print_healing(rows: list[dict[str, Any]]) -> None:
    print("(2) an engine's death to its replacement serving again, minus the replacement's own start")
    for row in rows:
        print(
            f"    {row['settings']:>7} settings: noticed after {row['noticed_s']:.2f} s, serving after "
            f"{row['death_to_serving_s']:.2f} s, own start {row['own_start_s']:.2f} s -> overhead {row['overhead_s']:.2f} s "
            f"(restart backoff {row['backoff_s']:g} s; without it {row['overhead_minus_backoff_s']:.2f} s)"
        )


def _print_requests(row: dict[str, Any]) -> None:
    print(
        f"(3) {row['requests']} requests at concurrency {row['concurrency']} over {row['engines']} engines, one killed: "
        f"failed {row['failed']}, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, max {row['max_ms']:.0f} ms, "
        f"{row['requests'] / row['wall_s']:.0f} req/s"
    )
    print(f"    {row['lost']}\n    {row['recovered']}")
    for failure in row["failures"]:
        print(f"    failure: {failure}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--latency", type=float, default=0.5, help="seconds per control call on each stand-in"
    )
    parser.add_argument("--start-delay", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="one quick repetition at the smallest sizes")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--soak-s", type=float, default=300.0, help="length of the chaos soak")
    parser.add_argument(
        "--soak-applies", action="store_true", help="the soak on PD engines, moving GPUs and running control"
    )
    parser.add_argument(
        "--soak-client",
        action="store_true",
        help="the soak's requests through the rollout client, with rolling weight updates and version floors",
    )
    parser.add_argument("--router-kills", type=int, default=20)
    parser.add_argument(
        "--skip", default="", help="parts to leave out: fan_out,healing,requests,chaos,router_kills"
    )
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    ks = [1, 2] if args.smoke else [1, 8, 32]
    reps = 1 if args.smoke else args.reps
    with tempfile.TemporaryDirectory(prefix="bench_control_") as tmp_dir:
        tmp = Path(tmp_dir)
        results: dict[str, Any] = {}
        if "fan_out" not in skip:
            results["fan_out"] = fan_out(ks, args.latency, reps, tmp, args.verbose) + fan_out(
                ks, 0.0, reps, tmp, args.verbose
            )
        if "healing" not in skip:
            results["healing"] = [
                healing(
                    2 if args.smoke else 4,
                    0.2 if args.smoke else args.start_delay,
                    reps,
                    fast,
                    tmp,
                    args.verbose,
                )
                for fast in ((True,) if args.smoke else (False, True))
            ]
        if "requests" not in skip:
            results["requests"] = requests_under_loss(
                2 if args.smoke else 8,
                200 if args.smoke else args.requests,
                16 if args.smoke else args.concurrency,
                tmp,
                args.verbose,
            )
        if "chaos" not in skip:
            results["chaos"] = chaos_soak(
                4 if args.smoke else 10,
                8 if args.smoke else 32,
                20.0 if args.smoke else args.soak_s,
                tmp,
                args.verbose,
                applies=args.soak_applies or args.smoke,
                rollout=args.soak_client or args.smoke,
            )
        if "router_kills" not in skip:
            results["router_kills"] = router_kills(2 if args.smoke else args.router_kills, tmp, args.verbose)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
