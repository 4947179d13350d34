"""Shared helpers of the launcher tests (``test_launcher.py``, ``test_launcher_faults.py``).

* :func:`launch_overrides` / :func:`compose`: a small stand-in deployment on 127.0.0.1 with a random
  ``port_base`` (20000-30000, so that sessions running tests at the same time rarely meet), a short shutdown
  grace and plain status lines.
* :class:`LeakTracker`: records every PID and port a launch used and asserts, with a short bounded wait, that
  no such process is left and no such port accepts a TCP connection. A leftover process is then killed (by
  its own process group, which the launcher created: never by name) so that one failing test does not leak
  into the next.
* :class:`ScriptRun`: a launch in a child Python process (:data:`LAUNCH_SCRIPT`), for signals sent to the
  launcher itself. The script prints JSON lines: ``ports`` before anything starts, ``spawned`` (every PID)
  right after the processes are started, ``ready`` once the deployment is up.

A process counts as gone when ``/proc/<pid>`` is missing, when it is a zombie (PID 1 of this container does
not reap orphans, so a process killed by ``PR_SET_PDEATHSIG`` stays a zombie; it holds no socket and no GPU),
or when the PID now belongs to another program (its command line no longer names our module).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from miles_sglang_plugin.app.hydra_edge import resolve_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.reading import deploy_settings_from_config
from miles_sglang_plugin.rendering.ports import PortClaims, default_lock_dir, port_is_free
from miles_sglang_plugin.rendering.prepared import PreparedDeployment, prepare_deployment

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
#: Modules our engine and router processes run (``python -m <module>``).
STANDIN_MODULE = "miles_sglang_plugin.standin"
ROUTER_MODULE = "miles_sglang_plugin.serving.router_main"


# ------------------------------------------------------------------------------------------------- config
def random_port_base() -> int:
    """A port base in 20000-30000; a launch of a few engines takes well under 400 ports above it."""
    return random.SystemRandom().randrange(20000, 29600)


def launch_overrides(
    *extra: str,
    port_base: int | None = None,
    startup_timeout_s: float = 60.0,
    shutdown_grace_s: float = 3.0,
) -> list[str]:
    """Overrides of a stand-in deployment (``debug_rollout_only=true``: rollout GPUs from slot 0, any size)."""
    return [
        "hf_checkpoint=/c",
        "sglang_deploy=simulated",
        "debug_rollout_only=true",
        f"sglang_deploy.launch.host={HOST}",
        f"sglang_deploy.launch.port_base={port_base if port_base is not None else random_port_base()}",
        f"sglang_deploy.launch.startup_timeout_s={startup_timeout_s}",
        f"sglang_deploy.launch.shutdown_grace_s={shutdown_grace_s}",
        "sglang_deploy.launch.poll_interval_s=0.2",
        "sglang_deploy.launch.live=never",
        *extra,
    ]


def compose(*extra: str, **kw: Any) -> DictConfig:
    return compose_config(launch_overrides(*extra, **kw))


def prepare_unprobed(*extra: str, attempts: int = 8, **kw: Any) -> tuple[PreparedDeployment, PortClaims]:
    """A deployment rendered without probing (the plain port sequence from ``port_base``, as a plan is
    printed), whose listening ports are then claimed (as a launch would claim them) so that a launch of
    another session keeps off them. Pass the claims to ``LocalBackend(claims=...)``: it releases them."""
    for _ in range(attempts):
        cfg = compose(*extra, **kw)
        prepared = prepare_deployment(resolve_config(cfg), deploy_settings_from_config(cfg), probe=False)
        claims = PortClaims(default_lock_dir())
        if all(claims.try_claim(p) and port_is_free(HOST, p) for p in sorted(launch_ports(prepared))):
            return prepared, claims
        claims.release()
    raise RuntimeError(f"no free port range found in {attempts} attempts")


def generate_body(text: str = "hello stand-in world", max_new_tokens: int = 4) -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}


# ------------------------------------------------------------------------------------- processes & ports
def launch_ports(prepared: PreparedDeployment) -> set[int]:
    """The ports a deployment's processes listen on: engine HTTP (+ PD bootstrap), router HTTP + metrics."""
    ports: set[int] = set()
    for e in prepared.launch.engines:
        ports.add(e.port)
        if e.bootstrap_port is not None:
            ports.add(e.bootstrap_port)
    for r in prepared.launch.routers:
        ports |= {r.spec.port, r.spec.prometheus_port}
    return ports


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def process_alive(pid: int, marker: str = "") -> bool:
    """True while ``pid`` runs and (if given) its command line contains ``marker``."""
    if not Path("/proc").is_dir():  # not Linux: fall back to kill(pid, 0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state = _proc_state(pid)
    if state is None or state in ("Z", "X", "x"):
        return False
    return not marker or marker in _cmdline(pid)


def children_of(ppid: int, markers: Sequence[str] = (STANDIN_MODULE, ROUTER_MODULE)) -> set[int]:
    """Live processes whose parent is ``ppid`` and whose command line names one of ``markers``."""
    out: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if (
            int(fields[1]) == ppid
            and fields[0] not in ("Z", "X")
            and any(m in _cmdline(pid) for m in markers)
        ):
            out.add(pid)
    return out


def port_accepts(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def held_socket(port: int, host: str = HOST) -> socket.socket:
    """A listening socket on ``port`` (as another program using it would hold it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, port))
    s.listen(8)
    return s


@contextlib.contextmanager
def refusing_port(host: str = HOST) -> Iterator[int]:
    """A port of this machine bound and not listening while the block runs: a connection to it is refused
    (as to a router that died), and no other program can take it meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        yield int(s.getsockname()[1])


@dataclass(frozen=True)
class Tracked:
    pid: int
    name: str
    marker: str  # a string its command line contains (guards against a reused PID)


def _marker(argv: Sequence[str]) -> str:
    return argv[2] if len(argv) > 2 and argv[1] == "-m" else (argv[0] if argv else "")


class LeakTracker:
    """Records launches (in-process launchers, or PIDs/ports reported by a child script) and checks that
    nothing of them is left."""

    def __init__(self) -> None:
        self.launchers: list[Any] = []
        self.processes: dict[int, Tracked] = {}
        self.ports: set[int] = set()

    def add_launcher(self, launcher: Any) -> None:
        if launcher not in self.launchers:
            self.launchers.append(launcher)

    def add_process(self, pid: int, name: str, marker: str) -> None:
        self.processes[pid] = Tracked(pid, name, marker)

    def add_ports(self, ports: Iterable[int]) -> None:
        self.ports |= set(ports)

    def _collect(self) -> None:
        for launcher in self.launchers:
            for p in launcher.processes():
                if p.pid is not None:
                    self.add_process(p.pid, p.name, _marker(p.argv))
            self.add_ports(launch_ports(launcher.prepared))

    @staticmethod
    def _port_open(port: int) -> bool:
        """Does ``port`` still accept connections? A port that another launch on this machine has claimed
        since ours ended (another session's tests) is not ours to judge: it is skipped."""
        claims = PortClaims(default_lock_dir())
        if not claims.try_claim(port):
            return False
        try:
            return port_accepts(port)
        finally:
            claims.release()

    def leftovers(self, wait_s: float = 5.0) -> tuple[list[Tracked], list[int]]:
        """Processes still alive and ports still open after waiting up to ``wait_s``."""
        self._collect()
        deadline = time.monotonic() + wait_s
        while True:
            alive = [t for t in self.processes.values() if process_alive(t.pid, t.marker)]
            open_ports = sorted(p for p in self.ports if self._port_open(p))
            if (not alive and not open_ports) or time.monotonic() > deadline:
                return alive, open_ports
            time.sleep(0.1)

    def kill(self, procs: Iterable[Tracked]) -> None:
        for t in procs:  # only processes this test started, by the process group the launcher created
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(t.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(t.pid, signal.SIGKILL)

    def assert_nothing_left(self, wait_s: float = 5.0) -> None:
        alive, open_ports = self.leftovers(wait_s)
        held = [
            sorted(claims.fds)
            for launcher in self.launchers
            if (claims := getattr(launcher.backend, "claims", None)) is not None and claims.fds
        ]
        if alive:
            self.kill(alive)
        problems = []
        if alive:
            problems.append("processes still running: " + ", ".join(f"{t.name} (pid {t.pid})" for t in alive))
        if open_ports:
            problems.append(f"ports still accepting connections on {HOST}: {open_ports}")
        if held:
            problems.append(f"port claims still held: {held}")
        assert not problems, "the launch left things behind: " + "; ".join(problems)


# ---------------------------------------------------------------------------------- launch in a child
#: A launch in its own Python process: argv[1] = JSON list of overrides, argv[2] = log dir. Prints JSON
#: lines on stdout (``ports``, ``spawned``, ``ready``) and then waits for a signal.
LAUNCH_SCRIPT = r"""
import json, signal, sys, threading, time
from pathlib import Path

# An interactive user's Ctrl-C: make sure SIGINT raises KeyboardInterrupt even if this process was started
# with SIGINT ignored (as background jobs of a non-interactive shell are).
signal.signal(signal.SIGINT, signal.default_int_handler)

from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.serving.deployment import Deployment


def emit(event, **kw):
    print(json.dumps({"event": event, **kw}), flush=True)


def marker(argv):
    return argv[2] if len(argv) > 2 and argv[1] == "-m" else argv[0]


_start_routers = Deployment._start_routers
_start = Deployment.start


def report_ports(self):
    ports = set()
    for e in self.prepared.launch.engines:
        ports.add(e.port)
        if e.bootstrap_port is not None:
            ports.add(e.bootstrap_port)
    for r in self.prepared.launch.routers:
        ports |= {r.spec.port, r.spec.prometheus_port}
    emit("ports", ports=sorted(ports))
    _start_routers(self)


def started(self):
    return [p for p in self.processes() if p.pid]


def start_and_report(self):
    # "spawned" once every router and engine process of the start-up runs (the reconcile loop starts the
    # engines), or once start-up ended before that (then with every process it had started).
    expected = len(self.prepared.launch.routers) + len(self.prepared.launch.engines)
    over, lock, sent = threading.Event(), threading.Lock(), []

    def send():
        with lock:
            if not sent:
                sent.append(True)
                emit("spawned", processes=[
                    {"pid": p.pid, "name": p.name, "marker": marker(list(p.argv))} for p in started(self)
                ])

    def report():
        while not over.is_set() and len(started(self)) < expected:
            time.sleep(0.005)
        if not over.is_set():
            send()

    def ended():
        over.set()
        reporter.join()
        send()

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    self.start_ended = ended  # an interrupted start-up stops everything, then hands the signal on: report first
    try:
        _start(self)
    finally:
        ended()


def abandon_and_report(self, note):
    _abandon_start(self, note)
    self.start_ended()


_abandon_start = Deployment._abandon_start
Deployment._start_routers = report_ports
Deployment.start = start_and_report
Deployment._abandon_start = abandon_and_report

cfg = compose_config(json.loads(sys.argv[1]))
with launch_from_config(cfg, log_dir=Path(sys.argv[2])) as launcher:
    emit("ready", url=launcher.registry.get_model_url("actor"))
    while True:
        time.sleep(0.1)
"""


class ScriptRun:
    """:data:`LAUNCH_SCRIPT` running in a child process; stdout/stderr go to files in ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        overrides: Sequence[str],
        tracker: LeakTracker | None = None,
        *,
        prelude: str = "",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """``prelude``: code run first, before the script imports anything; ``extra_env``: added variables."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        script = workdir / "launch_script.py"
        script.write_text(prelude + LAUNCH_SCRIPT)
        self.stdout_path = workdir / "script.out"
        self.stderr_path = workdir / "script.err"
        self.tracker = tracker
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, str(script), json.dumps(list(overrides)), str(workdir / "logs")],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=workdir,
                env=env,
                start_new_session=True,  # a signal from the test reaches this process only
            )
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stdout_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                data = json.loads(line)
                if isinstance(data, dict) and "event" in data:
                    out.append(data)
        return out

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def _record(self, event: dict[str, Any]) -> None:
        if self.tracker is None:
            return
        if event["event"] == "ports":
            self.tracker.add_ports(event["ports"])
        elif event["event"] == "spawned":
            for p in event["processes"]:
                self.tracker.add_process(p["pid"], p["name"], p["marker"])

    def wait_event(self, name: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self.events():
                self._record(event)
                if event["event"] == name:
                    return event
            if self.popen.poll() is not None:
                for event in self.events():  # lines written just before the exit
                    self._record(event)
                    if event["event"] == name:
                        return event
                raise AssertionError(
                    f"launch script exited ({self.popen.returncode}) before {name!r}; stderr:\n{self.stderr()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {name!r} from the launch script in {timeout_s} s; stderr:\n{self.stderr()}"
                )
            time.sleep(0.05)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"launch script still running after {timeout_s} s; stderr:\n{self.stderr()}"
            ) from None
        finally:
            for event in self.events():
                self._record(event)

    def close(self) -> None:
        """Kill the script (its own process group) if a failed test left it running."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=10)
