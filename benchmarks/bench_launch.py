"""How fast the local launcher starts, stops, and what the router costs per request, side by side in one run.

Measured with the stand-in engines (``sglang_deploy=simulated``) and one real sglang-router per model (see
benchmarks/README.md):

(1) time to ready: K stand-in engines of 1 GPU (K = 1, 4, 16) behind one router, each engine waiting T seconds
    before it listens (``sglang_deploy.standin.start_delay_s``); wall time from entering ``launch_from_config``
    until it yields, divided by T (1.0 would be a perfectly parallel start with a free router). The same with
    T = 0 is the pure overhead (resolve + port claims, process spawn, Python import of the stand-in, router
    start, health polls, worker registration). Also split into phases from the launcher's own timestamps.
(2) teardown: ``miles-sglang launch`` (K = 4) in a subprocess (own session); once the router URL is printed,
    SIGINT to the launcher, then the time until every engine/router PID is gone (exited; a zombie not yet
    reaped counts as gone) and every port (router HTTP + metrics, engines) refuses connections.
(3) router overhead: 2 stand-in engines behind one router (policy round_robin): requests/s of ``POST /generate``
    (small prompt, max_new_tokens 4) at concurrency 1 and 64, through the router vs straight to the engines
    (round robin over the two engine URLs done by the client). httpx with keep-alive; async client for c > 1.

Ports come from a random base in 20000-30000; everything binds 127.0.0.1. Everything started is stopped at the
end (context managers; the subprocess's process group and its recorded children are SIGKILLed in a finally).

    python benchmarks/bench_launch.py [--reps 3] [--delay 3] [--teardown-reps 3] [--requests 400] [--json]
    python benchmarks/bench_launch.py --smoke    # one quick repetition at the smallest sizes (run by the tests)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import re
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.config.compose import compose_config

HOST = "127.0.0.1"
GEN_BODY = {
    "text": "the quick brown fox jumps over",
    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
}


def _port_base() -> int:
    # Each launch probes and flock-claims its ports upward from here, so clashes only cost a skip.
    return random.randrange(20000, 29000)


def overrides(k: int, delay_s: float, *, policy: str | None = None, poll_s: float | None = None) -> list[str]:
    out = [
        "sglang=default",
        "hf_checkpoint=/c",
        "debug_rollout_only=true",
        "sglang_deploy=simulated",
        f"sglang.actor.regular.num_gpus={k}",
        "sglang.actor.num_gpus_per_engine=1",
        f"num_gpus_per_node={max(8, k)}",
        f"sglang_deploy.standin.start_delay_s={delay_s}",
        f"sglang_deploy.launch.host={HOST}",
        f"sglang_deploy.launch.port_base={_port_base()}",
        "sglang_deploy.launch.live=never",
    ]
    if policy:
        out.append(f"sglang_deploy.router.policy={policy}")
    if poll_s:
        out.append(f"sglang_deploy.launch.poll_interval_s={poll_s}")
    return out


@contextlib.contextmanager
def quiet(verbose: bool):
    """The launcher's status lines go to stderr; keep them out of the table unless --verbose."""
    if verbose:
        yield
        return
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            yield
    except BaseException:
        sys.stderr.write(buf.getvalue())
        raise


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------- (1) ready
def time_to_ready(k: int, delay_s: float, poll_s: float | None, tmp: Path, verbose: bool) -> dict[str, float]:
    cfg = compose_config(overrides(k, delay_s, poll_s=poll_s))
    log_dir = Path(tempfile.mkdtemp(prefix=f"ready_k{k}_", dir=tmp))
    with quiet(verbose):
        t0 = time.monotonic()
        with launch_from_config(cfg, log_dir=log_dir) as d:
            t_ready = time.monotonic()
            starts = [p.started_at for p in d.processes()]
            router_start = min(p.started_at for p in d.processes() if p.name.startswith("router."))
            engines = d.engines()
            healthy = [e.healthy_at for e in engines]
            per_engine = [e.healthy_at - e.started_at for e in engines]  # type: ignore[operator]
            t_stop0 = time.monotonic()
        t_stopped = time.monotonic()
    return {
        "ready_s": t_ready - t0,
        "prepare_s": min(starts) - t0,  # resolve, port probe + claims, launcher set-up
        "spawn_s": max(starts) - min(starts),  # Popen of the router and every engine
        "router_first_s": router_start - min(starts),
        "last_healthy_s": max(healthy) - max(starts),  # type: ignore[type-var]
        "engine_start_to_healthy_med_s": _med(per_engine),
        "engine_start_to_healthy_max_s": max(per_engine),
        "register_s": t_ready - max(healthy),  # type: ignore[type-var]
        "stop_s": t_stopped - t_stop0,
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def standin_floor(k: int, tmp: Path) -> float:
    """Seconds from the first of ``k`` plain Popen calls of the stand-in until all ``k`` accept connections
    (polled every 10 ms): interpreter start + import + bind, with no launcher, router or health polls."""
    ports = [_free_port() for _ in range(k)]
    procs: list[subprocess.Popen[bytes]] = []
    log = (tmp / f"floor_{k}.log").open("ab")
    try:
        t0 = time.monotonic()
        for port in ports:
            argv = [sys.executable, "-m", "miles_sglang_plugin.standin", "--model-path", "/c"]
            argv += ["--host", HOST, "--port", str(port)]
            procs.append(subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True))
        waiting = set(ports)
        while waiting and time.monotonic() - t0 < 60:
            waiting = {p for p in waiting if not _accepts(p)}
            time.sleep(0.01)
        if waiting:
            raise RuntimeError(f"stand-ins on ports {sorted(waiting)} did not listen within 60 s")
        return time.monotonic() - t0
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def bench_ready(
    ks: list[int], delay_s: float, fast_poll_s: float, reps: int, tmp: Path, verbose: bool
) -> list[dict[str, Any]]:
    """Cells (K, T, poll interval): T = 0 and T = delay_s at the default poll interval, plus T = 0 at
    ``fast_poll_s`` (0: left out) to show how much of the overhead is the launcher's polling period."""
    keys: list[tuple[int, float, float | None]] = [(k, t, None) for k in ks for t in (0.0, delay_s)]
    if fast_poll_s:
        keys += [(k, 0.0, fast_poll_s) for k in ks]
    runs: dict[tuple[int, float, float | None], list[dict[str, float]]] = {key: [] for key in keys}
    floors: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(reps):  # round-robin over the cells so that load changes hit all of them
        for key in keys:
            runs[key].append(time_to_ready(*key, tmp=tmp, verbose=verbose))
        for k in ks:
            floors[k].append(standin_floor(k, tmp))
    rows = []
    for (k, t, poll), rs in runs.items():
        row: dict[str, Any] = {"k": k, "delay_s": t, "poll_interval_s": poll, "reps": len(rs)}
        for field in rs[0]:
            row[field] = _med([r[field] for r in rs])
        row["ready_all_s"] = [round(r["ready_s"], 3) for r in rs]
        # bare stand-ins (no launcher): all listening after floor + T (the delay starts after the import)
        row["standin_floor_s"] = _med(floors[k]) + t
        rows.append(row)
    by = {(r["k"], r["delay_s"], r["poll_interval_s"]): r for r in rows}
    for r in rows:
        if r["delay_s"] > 0:
            r["ratio"] = r["ready_s"] / r["delay_s"]
            base = by.get((r["k"], 0.0, None))
            if base is not None:
                r["ratio_minus_overhead"] = (r["ready_s"] - base["ready_s"]) / r["delay_s"]
    return rows


# ---------------------------------------------------------------------------------------- (2) teardown
def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie (dead, waiting for its parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        try:
            s.connect((HOST, port))
        except OSError:
            return False
        return True


def _refuses(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        try:
            s.connect((HOST, port))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False


def _ports_of(argv: list[str]) -> list[int]:
    ports = []
    if "--port" in argv:  # stand-in engine: sglang.launch_server argv
        ports.append(int(argv[argv.index("--port") + 1]))
    if "--spec-json" in argv:  # router_main: the RouterLaunchSpec as JSON
        spec = json.loads(argv[argv.index("--spec-json") + 1])
        ports += [int(spec["port"]), int(spec["prometheus_port"])]
    return ports


def _read_line_until(proc: subprocess.Popen[bytes], pattern: re.Pattern[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    buf = b""
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=0.1):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
                for line in buf.decode(errors="replace").splitlines():
                    if pattern.search(line):
                        return line
            if proc.poll() is not None:
                break
    finally:
        sel.close()
    raise RuntimeError(f"no line matching {pattern.pattern!r} within {timeout_s} s; stdout so far: {buf!r}")


def teardown_once(k: int, tmp: Path, launcher_cmd: list[str]) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="teardown_", dir=tmp))
    stderr_path = log_dir / "launcher.stderr"
    children: dict[int, list[int]] = {}
    with stderr_path.open("wb") as err:
        proc = subprocess.Popen(
            [*launcher_cmd, "launch", "--log-dir", str(log_dir), *overrides(k, 0.0)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    try:
        t_spawn = time.monotonic()
        line = _read_line_until(proc, re.compile(r"^actor http://"), timeout_s=120)
        t_ready = time.monotonic()
        router_port = int(line.rsplit(":", 1)[1].split("/")[0])
        children = {pid: _ports_of(_cmdline(pid)) for pid in _children(proc.pid)}
        ports = sorted({router_port, *(p for ps in children.values() for p in ps)})
        if len(children) != k + 1:
            raise RuntimeError(f"expected {k + 1} children of the launcher, found {sorted(children)}")
        assert not any(_refuses(p) for p in ports), "a port refused connections before SIGINT"

        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        pids_gone = ports_closed = exited = None
        deadline = t0 + 60
        while time.monotonic() < deadline and None in (pids_gone, ports_closed, exited):
            now = time.monotonic()
            if pids_gone is None and all(_gone(p) for p in children):
                pids_gone = now - t0
            if ports_closed is None and all(_refuses(p) for p in ports):
                ports_closed = now - t0
            if exited is None and proc.poll() is not None:
                exited = now - t0
            time.sleep(0.01)
        if None in (pids_gone, ports_closed, exited):
            raise RuntimeError(
                f"teardown not done after 60 s (pids {pids_gone}, ports {ports_closed}, exit {exited})"
            )
        return {
            "ready_s": t_ready - t_spawn,
            "pids_gone_s": pids_gone,
            "ports_closed_s": ports_closed,
            "teardown_s": max(pids_gone, ports_closed),  # type: ignore[type-var]
            "launcher_exit_s": exited,
            "launcher_rc": proc.returncode,
            "n_pids": len(children),
            "n_ports": len(ports),
        }
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()
        for pid, ports_ in children.items():  # each engine/router leads its own group; only if still ours
            if not _gone(pid) and _ports_of(_cmdline(pid)) == ports_:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


def bench_teardown(k: int, reps: int, tmp: Path) -> dict[str, Any]:
    exe = shutil.which("miles-sglang", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "miles_sglang_plugin"]
    runs = [teardown_once(k, tmp, cmd) for _ in range(reps)]
    out: dict[str, Any] = {"k": k, "reps": reps, "runs": runs}
    for f in ("ready_s", "pids_gone_s", "ports_closed_s", "teardown_s", "launcher_exit_s"):
        out[f] = _med([r[f] for r in runs])
        out[f + "_max"] = max(r[f] for r in runs)
    out["launcher_rc"] = sorted({r["launcher_rc"] for r in runs})
    return out


# ------------------------------------------------------------------------------------ (3) router overhead
def _check(resp: httpx.Response) -> None:
    if resp.status_code != 200 or "text" not in resp.json():
        raise RuntimeError(f"bad /generate answer {resp.status_code}: {resp.text[:200]}")


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pids: list[int]) -> float:
    """utime + stime of ``pids`` (and their reaped children), in seconds."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / _CLK_TCK


Cell = tuple[int, float, float, tuple[float, float]]  # done, wall, client CPU, (router CPU, engines CPU)
Probe = Callable[[], tuple[float, float]]


def _run_c1(urls: list[str], n: int, cap_s: float, probe: Probe) -> Cell:
    with httpx.Client(timeout=30) as client:
        for i in range(10):  # warm-up: connections open
            _check(client.post(urls[i % len(urls)], json=GEN_BODY))
        srv0, cpu0, t0, done = probe(), time.process_time(), time.monotonic(), 0
        while done < n and time.monotonic() - t0 < cap_s:
            _check(client.post(urls[done % len(urls)], json=GEN_BODY))
            done += 1
        wall, cpu, srv1 = time.monotonic() - t0, time.process_time() - cpu0, probe()
        return done, wall, cpu, (srv1[0] - srv0[0], srv1[1] - srv0[1])


async def _run_cn(urls: list[str], n: int, conc: int, cap_s: float, pooled: bool, probe: Probe) -> Cell:
    """``conc`` workers. By default each worker has its own AsyncClient with one keep-alive connection: httpcore
    1.0's pool scans every connection on each request (``_assign_requests_to_connections``), so one shared
    pool of 64 connections makes the client itself the bottleneck (``--pooled-client`` shows it)."""
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    many = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    if pooled:
        clients = [httpx.AsyncClient(timeout=30, limits=many)]
    else:
        clients = [httpx.AsyncClient(timeout=30, limits=one) for _ in range(conc)]
    try:
        # warm-up: every connection open
        warm = [clients[i % len(clients)].post(urls[i % len(urls)], json=GEN_BODY) for i in range(conc)]
        for resp in await asyncio.gather(*warm):
            _check(resp)
        counter = iter(range(n))
        srv0 = probe()
        t0 = time.monotonic()
        cpu0 = time.process_time()
        done = 0

        async def worker(client: httpx.AsyncClient) -> None:
            nonlocal done
            for i in counter:
                if time.monotonic() - t0 > cap_s:
                    return
                _check(await client.post(urls[i % len(urls)], json=GEN_BODY))
                done += 1

        await asyncio.gather(*(worker(clients[w % len(clients)]) for w in range(conc)))
        wall, cpu, srv1 = time.monotonic() - t0, time.process_time() - cpu0, probe()
        return done, wall, cpu, (srv1[0] - srv0[0], srv1[1] - srv0[1])
    finally:
        for client in clients:
            await client.aclose()


def bench_router(
    requests: int, rounds: int, cap_s: float, tmp: Path, verbose: bool, pooled: bool = False
) -> list[dict[str, Any]]:
    cfg = compose_config(overrides(2, 0.0, policy="round_robin"))
    log_dir = Path(tempfile.mkdtemp(prefix="router_", dir=tmp))
    cells: dict[tuple[int, str], list[Cell]] = {}
    with quiet(verbose), launch_from_config(cfg, log_dir=log_dir) as d:
        router = [d.registry.get_model_url("actor", "/generate")]
        direct = [e.url + "/generate" for e in d.engines()]
        router_pids = [p.pid or 0 for p in d.processes() if p.name.startswith("router.")]
        engine_pids = [p.pid or 0 for p in d.processes() if not p.name.startswith("router.")]

        def probe() -> tuple[float, float]:
            return _proc_cpu_s(router_pids), _proc_cpu_s(engine_pids)

        for _ in range(rounds):  # interleaved: router and direct alternate within each round
            for conc in (1, 64):
                for target, urls in (("router", router), ("direct", direct)):
                    if conc == 1:
                        res = _run_c1(urls, requests, cap_s, probe)
                    else:
                        res = asyncio.run(_run_cn(urls, requests, conc, cap_s, pooled, probe))
                    cells.setdefault((conc, target), []).append(res)
    rows = []
    for conc in (1, 64):
        row: dict[str, Any] = {"concurrency": conc}
        for target in ("router", "direct"):
            rs = cells[(conc, target)]
            rates = [n / wall for n, wall, _, _ in rs]
            row[f"{target}_rps"] = _med(rates)
            row[f"{target}_rps_all"] = [round(r, 1) for r in rates]
            row[f"{target}_requests"] = sum(n for n, _, _, _ in rs)
            row[f"{target}_client_cpu"] = _med([cpu / wall for _, wall, cpu, _ in rs])
            # CPU milliseconds per request spent in the router process and in the two engines
            row[f"{target}_router_cpu_ms"] = 1000 * sum(s[0] for *_, s in rs) / row[f"{target}_requests"]
            row[f"{target}_engines_cpu_ms"] = 1000 * sum(s[1] for *_, s in rs) / row[f"{target}_requests"]
        row["ratio"] = row["router_rps"] / row["direct_rps"]
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ output
def _print_ready(res: dict[str, Any]) -> None:
    print(
        f"(1) time to ready, median of {res['args']['reps']} (seconds; phases from the launcher's timestamps)"
    )
    print(
        "K | T | poll | ready | ready/T | (ready-ready[T=0])/T | bare stand-ins listening | prepare | spawn | "
        "last spawn->last healthy | engine start->healthy med/max | last healthy->ready | stop"
    )
    for r in res["ready"]:
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        ratio2 = f"{r['ratio_minus_overhead']:.2f}" if "ratio_minus_overhead" in r else "-"
        print(
            f"{r['k']} | {r['delay_s']:g} | {r['poll_interval_s'] or 'default'} | {r['ready_s']:.2f} | "
            f"{ratio} | {ratio2} | {r['standin_floor_s']:.2f} | "
            f"{r['prepare_s']:.2f} | "
            f"{r['spawn_s']:.3f} | {r['last_healthy_s']:.2f} | {r['engine_start_to_healthy_med_s']:.2f}/"
            f"{r['engine_start_to_healthy_max_s']:.2f} | {r['register_s']:.2f} | {r['stop_s']:.2f}"
        )


def _print_teardown(t: dict[str, Any]) -> None:
    print(f"\n(2) teardown after SIGINT, `miles-sglang launch`, K={t['k']}, {t['reps']} runs (seconds)")
    print("run | launch to URL line | pids gone | ports refuse | teardown | launcher exit (rc) | pids/ports")
    for i, r in enumerate(t["runs"], 1):
        print(
            f"{i} | {r['ready_s']:.2f} | {r['pids_gone_s']:.3f} | {r['ports_closed_s']:.3f} | "
            f"{r['teardown_s']:.3f} | {r['launcher_exit_s']:.3f} ({r['launcher_rc']}) | "
            f"{r['n_pids']}/{r['n_ports']}"
        )
    print(
        f"median | {t['ready_s']:.2f} | {t['pids_gone_s']:.3f} | {t['ports_closed_s']:.3f} | "
        f"{t['teardown_s']:.3f} | {t['launcher_exit_s']:.3f} |"
    )


def _print_router(res: dict[str, Any]) -> None:
    a = res["args"]
    print(f"\n(3) POST /generate req/s, {a['requests']} requests per cell x {a['rounds']} rounds (median)")
    print(
        "concurrency | via router | direct | router/direct | client CPU/wall (via router, direct) | "
        "router CPU ms/req | engines CPU ms/req (via router, direct)"
    )
    for r in res["router"]:
        print(
            f"{r['concurrency']} | {r['router_rps']:.0f} | {r['direct_rps']:.0f} | {r['ratio']:.2f} | "
            f"{r['router_client_cpu']:.0%}, {r['direct_client_cpu']:.0%} | {r['router_router_cpu_ms']:.2f} | "
            f"{r['router_engines_cpu_ms']:.2f}, {r['direct_engines_cpu_ms']:.2f}"
        )


def print_tables(res: dict[str, Any]) -> None:
    if res.get("ready"):
        _print_ready(res)
    if res.get("teardown"):
        _print_teardown(res["teardown"])
    if res.get("router"):
        _print_router(res)
    load = ", ".join(f"{x:.1f}" for x in (*res["loadavg_start"][:1], *res["loadavg_end"][:1]))
    print(f"\ntotal {res['total_s']:.0f} s on {res['cpus']} CPUs; 1-min load average at start, end: {load}")


def main() -> int:
    # The teardown runs end each launcher with SIGINT, a terminal's Ctrl-C: a launcher that inherited SIGINT
    # ignored (this script started in the background of a non-interactive shell, or under nohup) would keep
    # running. A handler, unlike SIG_IGN, is not inherited across exec: the launchers get SIGINT's default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each time-to-ready cell (median)")
    ap.add_argument("--delay", type=float, default=3.0, help="stand-in start delay T in seconds")
    ap.add_argument(
        "--fast-poll",
        type=float,
        default=0.05,
        help="extra T=0 cells at this sglang_deploy.launch.poll_interval_s (0: none)",
    )
    ap.add_argument("--ks", default="1,4,16", help="engine counts for time to ready")
    ap.add_argument("--teardown-reps", type=int, default=3)
    ap.add_argument("--teardown-k", type=int, default=4)
    ap.add_argument("--requests", type=int, default=400, help="requests per router-overhead cell")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the router-overhead cells (median)")
    ap.add_argument("--cap-s", type=float, default=20.0, help="time cap per router-overhead cell")
    ap.add_argument(
        "--pooled-client",
        action="store_true",
        help="c=64 through one shared AsyncClient pool instead of one client (one connection) per worker",
    )
    ap.add_argument("--skip", default="", help="comma list of parts to skip: ready,teardown,router")
    ap.add_argument("--json", action="store_true", help="print the results as JSON only")
    ap.add_argument("--verbose", action="store_true", help="show the launcher's status lines")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one quick repetition of every part at the smallest sizes (CI: proves the benchmark still runs; "
        "the numbers mean nothing)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.reps, args.delay, args.fast_poll, args.ks = 1, 0.2, 0.0, "1"
        args.teardown_reps, args.teardown_k, args.requests, args.rounds, args.cap_s = 1, 1, 20, 1, 10.0
    skip = set(filter(None, args.skip.split(",")))
    ks = [int(x) for x in args.ks.split(",")]
    from importlib.metadata import version

    from miles_sglang_plugin.rendering.router_specs import gateway_info, gateway_version, resolve_gateway

    gateway = resolve_gateway(
        "auto"
    )  # what the benchmark's routers run on ($MSP_ROUTER_GATEWAY, or installed)
    res: dict[str, Any] = {
        "args": vars(args),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "gateway": gateway,
        "versions": {
            gateway_info(gateway).distribution: gateway_version(gateway),
            **{p: version(p) for p in ("httpx", "httpcore", "aiohttp")},
        },
        "loadavg_start": os.getloadavg(),
    }
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as tmpname:
        tmp = Path(tmpname)
        if "ready" not in skip:
            res["ready"] = bench_ready(ks, args.delay, args.fast_poll, args.reps, tmp, args.verbose)
        if "teardown" not in skip:
            res["teardown"] = bench_teardown(args.teardown_k, args.teardown_reps, tmp)
        if "router" not in skip:
            res["router"] = bench_router(
                args.requests, args.rounds, args.cap_s, tmp, args.verbose, args.pooled_client
            )
    res["total_s"] = time.monotonic() - t0
    res["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_tables(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
