"""The safety nets that stop a deployment its code left running, and ``miles-sglang launch`` stopped by Ctrl-C.

Each case runs in a child Python process with stand-in engines and real routers:

* the ``sglang_cleanup`` Hydra callback: a Hydra job that starts a deployment without a ``with`` block and
  returns; once Hydra has ended the job, still in the app's process, nothing of it may run;
* the ``atexit`` handler: a script that does the same and exits normally; an ``atexit`` probe registered before
  the package's handler (handlers run last in, first out) sees the processes while the interpreter still runs;
* Ctrl-C (SIGINT) to ``miles-sglang launch``: exit status 130, its message, every engine stopped by SIGTERM;
  SIGTERM to it: the same teardown, then SIGTERM's default action (status 143).

Without the safety nets the processes would still die when the launcher exits (``PR_SET_PDEATHSIG``), so each
case checks while the launcher is alive, or that the engines were stopped in order (their log says so). Every
PID and port a child reports is checked afterwards by :class:`~tests.launch_helpers.LeakTracker`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launch_helpers import REPO, LeakTracker, children_of, launch_overrides, process_alive

TWO_ENGINES = "sglang.actor.regular.num_gpus=2"

#: Shared by the child scripts: what a deployment started, and which of it still runs.
PROBE_HELPERS = textwrap.dedent(
    """
    import json
    from pathlib import Path


    def alive(pid, marker):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        return state not in ("Z", "X") and marker in cmdline


    def describe(deployment):
        launch = deployment.prepared.launch
        ports = {e.port for e in launch.engines} | {e.bootstrap_port for e in launch.engines if e.bootstrap_port}
        ports |= {p for r in launch.routers for p in (r.spec.port, r.spec.prometheus_port)}
        return {
            "processes": [{"pid": p.pid, "name": p.name, "marker": p.argv[2]} for p in deployment.processes()],
            "ports": sorted(ports),
        }


    def still_running(record):
        return [p["name"] for p in record["processes"] if alive(p["pid"], p["marker"])]
    """
)


@pytest.fixture
def tracker() -> Iterator[LeakTracker]:
    leaks = LeakTracker()
    yield leaks
    leaks.assert_nothing_left()


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _track(tracker: LeakTracker, record: dict[str, Any]) -> None:
    for p in record["processes"]:
        tracker.add_process(p["pid"], p["name"], p["marker"])
    tracker.add_ports(record["ports"])


def _events(stdout: str) -> dict[str, dict[str, Any]]:
    events = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            events[event.pop("event")] = event
    return events


# ------------------------------------------------------------------------------ the Hydra callback
HYDRA_APP = PROBE_HELPERS + textwrap.dedent(
    """
    import sys

    import hydra
    from hydra.core.config_store import ConfigStore

    from miles_sglang_plugin.backends import get_backend
    from miles_sglang_plugin.app.hydra_edge import resolve_config
    from miles_sglang_plugin.config.reading import deploy_settings_from_config
    from miles_sglang_plugin.serving.deployment import Deployment

    ConfigStore.instance().store(
        name="app", node={"defaults": ["_self_", {"sglang": "default"}], "hf_checkpoint": None, "debug_rollout_only": False}
    )
    record = {}


    @hydra.main(version_base=None, config_name="app")
    def job(cfg):
        backend = get_backend(cfg.sglang_deploy.launch.backend)
        prepared = backend.prepare(resolve_config(cfg), deploy_settings_from_config(cfg))
        deployment = Deployment(prepared, backend, log_dir=Path("logs"))
        deployment.start()  # and never stopped: the job returns, dropping its only reference
        record.update(describe(deployment))
        print(json.dumps({"event": "started", **record}), flush=True)


    if __name__ == "__main__":
        job()
        # Hydra has ended the job (its callbacks ran); this process, the launcher, still runs.
        print(json.dumps({"event": "after_job", "running": still_running(record)}), flush=True)
    """
)


def _run_hydra_app(tmp_path: Path, tracker: LeakTracker, *extra: str) -> dict[str, dict[str, Any]]:
    app = tmp_path / "app.py"
    app.write_text(HYDRA_APP)
    argv = [
        sys.executable,
        str(app),
        *launch_overrides(TWO_ENGINES),
        f"hydra.run.dir={tmp_path / 'run'}",
        *extra,
    ]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    events = _events(proc.stdout)
    if "started" in events:
        _track(tracker, events["started"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(events["started"]["processes"]) == 3, events  # two engines and a router
    return events


def test_hydra_callback_stops_what_a_job_left_running(tmp_path: Path, tracker: LeakTracker) -> None:
    events = _run_hydra_app(tmp_path, tracker, "hydra/callbacks=sglang_cleanup")
    assert events["after_job"]["running"] == []


def test_without_the_callback_the_deployment_outlives_the_job(tmp_path: Path, tracker: LeakTracker) -> None:
    """The counterpart: it is the callback that stops it (and ``atexit`` that stops it here, at exit)."""
    events = _run_hydra_app(tmp_path, tracker)
    assert sorted(events["after_job"]["running"]) == ["actor.regular.0", "actor.regular.1", "router.actor"]


# -------------------------------------------------------------------------------------------- atexit
ATEXIT_SCRIPT = PROBE_HELPERS + textwrap.dedent(
    """
    import atexit, sys

    record = {}


    def probe():
        print(json.dumps({"event": "at_exit", "running": still_running(record)}), flush=True)


    atexit.register(probe)  # before the package registers its handler, so it runs after it

    from miles_sglang_plugin.backends import get_backend
    from miles_sglang_plugin.app.hydra_edge import resolve_config
    from miles_sglang_plugin.config.compose import compose_config
    from miles_sglang_plugin.config.reading import deploy_settings_from_config
    from miles_sglang_plugin.serving.deployment import Deployment


    def start():
        cfg = compose_config(json.loads(sys.argv[1]))
        backend = get_backend("local")
        deployment = Deployment(
            backend.prepare(resolve_config(cfg), deploy_settings_from_config(cfg)), backend, log_dir=Path("logs")
        )
        deployment.start()  # no with block, never stopped, and no reference kept
        record.update(describe(deployment))
        print(json.dumps({"event": "started", **record}), flush=True)


    start()
    # and a normal exit
    """
)


def test_atexit_stops_a_deployment_left_running(tmp_path: Path, tracker: LeakTracker) -> None:
    script = tmp_path / "script.py"
    script.write_text(ATEXIT_SCRIPT)
    argv = [sys.executable, str(script), json.dumps(launch_overrides(TWO_ENGINES))]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    events = _events(proc.stdout)
    if "started" in events:
        _track(tracker, events["started"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(events["started"]["processes"]) == 3
    assert events["at_exit"]["running"] == []
    for name in ("actor.regular.0", "actor.regular.1"):  # stopped in order (SIGTERM), not by the kernel
        assert "stopping: signal received" in (tmp_path / "logs" / f"{name}.log").read_text()


# ---------------------------------------------------------------------------- Ctrl-C to the command
def _default_sigint() -> None:
    """A terminal's foreground command gets SIGINT with its default action (Python then raises
    KeyboardInterrupt); a test runner started in the background may have it ignored, which would be
    inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cmdline_port(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return int(argv[argv.index("--port") + 1])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_stops_miles_sglang_launch(
    tmp_path: Path, tracker: LeakTracker, sig: signal.Signals
) -> None:
    logs = tmp_path / "logs"
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    command = [str(Path(sys.executable).parent / "miles-sglang"), "launch", "--log-dir", str(logs)]
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [*command, *launch_overrides(TWO_ENGINES)],
            cwd=tmp_path,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # the test's SIGINT reaches this command only
            preexec_fn=_default_sigint,
        )
    try:
        deadline = time.monotonic() + 60
        while "Ctrl-C stops every engine and router" not in err.read_text():
            assert proc.poll() is None, out.read_text() + err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        router_url = out.read_text().splitlines()[0].split()[1]  # "actor http://127.0.0.1:PORT"
        children = children_of(proc.pid)
        assert len(children) == 3, children
        for pid in children:
            tracker.add_process(pid, f"child {pid}", "miles_sglang_plugin")
            tracker.add_ports(
                [_cmdline_port(pid)] if "standin" in Path(f"/proc/{pid}/cmdline").read_text() else []
            )
        tracker.add_ports([int(router_url.rsplit(":", 1)[1])])

        proc.send_signal(sig)
        code = proc.wait(timeout=120)
        message = err.read_text()
        assert f"{sig.name} received: stopping every engine and router" in message, message
        if sig == signal.SIGINT:
            assert code == 130, message
            assert "interrupted: every engine and router was stopped" in message
        else:  # SIGTERM's default action once everything is stopped: a shell reports status 143
            assert code == -signal.SIGTERM, message
        assert "Traceback" not in message
        assert not any(process_alive(pid) for pid in children)
        for name in ("actor.regular.0", "actor.regular.1"):  # stopped in order (SIGTERM), not by the kernel
            assert "stopping: signal received" in (logs / f"{name}.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
