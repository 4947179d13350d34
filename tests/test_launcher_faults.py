"""The local launcher when things go wrong: engines that fail or never get healthy, ports in use, and signals
to the launcher (Ctrl-C during start-up, SIGTERM and SIGKILL once it runs).

Each case must end with a clear :class:`LaunchError` (or the expected exit status) and nothing left behind: no
process and no listening port of the launch (checked by ``leak_check``, see ``tests/launch_helpers.py``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.backends.base import LaunchError
from miles_sglang_plugin.backends.local import LocalBackend
from miles_sglang_plugin.serving.deployment import Deployment
from tests.conftest_launch import leak_check, script_run  # noqa: F401  (fixtures)
from tests.launch_helpers import (
    LeakTracker,
    ScriptRun,
    children_of,
    compose,
    generate_body,
    held_socket,
    launch_overrides,
    prepare_unprobed,
    process_alive,
)

TWO_ENGINES = "sglang.actor.regular.num_gpus=2"
ScriptFactory = Callable[[Sequence[str]], ScriptRun]


# ------------------------------------------------------------------------------- engines that fail
def test_engine_failing_at_start_fails_the_launch_at_once(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    # "At once": by the engine's exit, not by the start-up deadline, an hour away (the test's timeout comes first).
    cfg = compose(
        TWO_ENGINES, "sglang_deploy.standin.fail_at_start=[actor.regular.1]", startup_timeout_s=3600
    )
    with pytest.raises(LaunchError) as info, launch_from_config(cfg, log_dir=tmp_path / "logs"):
        pytest.fail("the launch should have failed")
    msg = str(info.value)
    assert msg.startswith("engine actor.regular.1 exited with code 3 during start-up"), msg
    assert "command: " in msg and "-m miles_sglang_plugin.standin" in msg and "--port" in msg
    assert str(tmp_path / "logs" / "actor.regular.1.log") in msg
    assert "failing at start as asked by MSP_STANDIN_FAIL_AT_START" in msg  # the log tail
    # The healthy engine and the router were stopped as well.
    (launcher,) = leak_check.launchers
    assert all(p.exit_code() is not None for p in launcher.processes())


def test_engine_never_healthy_times_out_naming_it(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    timeout = 10.0
    cfg = compose(
        TWO_ENGINES, "sglang_deploy.standin.never_healthy=[actor.regular.0]", startup_timeout_s=timeout
    )
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info, launch_from_config(cfg, log_dir=tmp_path / "logs"):
        pytest.fail("the launch should have failed")
    elapsed = time.monotonic() - t0
    assert elapsed >= timeout, elapsed  # the deadline was waited for (its end is no time to judge)
    msg = str(info.value)
    assert msg.startswith(
        "the deployment was not ready after 10 s (sglang_deploy.launch.startup_timeout_s)"
    ), msg
    assert "engine actor.regular.0 never answered /health_generate" in msg
    assert "actor.regular.1 never answered" not in msg  # the healthy one is not blamed
    assert "actor.regular.0.log" in msg and "listening on" in msg  # its log tail


def test_engine_command_that_cannot_run_is_a_launch_error(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    cfg = compose(
        "sglang.actor.regular.num_gpus=1",
        "sglang_deploy.launch.engine=sglang",
        "sglang_deploy.launch.command=[/nonexistent/sglang,serve]",
    )
    with pytest.raises(LaunchError) as info, launch_from_config(cfg, log_dir=tmp_path / "logs"):
        pytest.fail("the launch should have failed")
    msg = str(info.value)
    assert msg.startswith("engine actor.regular.0 could not be started: [Errno 2]"), msg
    assert "command: /nonexistent/sglang serve --model-path /c" in msg
    (launcher,) = leak_check.launchers
    (router,) = [p for p in launcher.processes() if p.name == "router.actor"]
    assert router.pid is not None and router.exit_code() is not None  # started, then stopped


def test_log_tail_shows_only_this_launch(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    """A log directory used twice: the second failure's message must not show the first run's lines."""
    logs = tmp_path / "logs"
    first = compose(TWO_ENGINES, "sglang_deploy.standin.fail_at_start=[actor.regular.1]")
    with (
        pytest.raises(LaunchError, match=r"engine actor\.regular\.1 exited with code 3"),
        launch_from_config(first, log_dir=logs),
    ):
        pass
    second = compose(
        TWO_ENGINES, "sglang_deploy.standin.never_healthy=[actor.regular.1]", startup_timeout_s=4
    )
    with pytest.raises(LaunchError) as info, launch_from_config(second, log_dir=logs):
        pass
    msg = str(info.value)
    assert "never answered" in msg and "MSP_STANDIN_FAIL_AT_START" not in msg, msg
    # The log file itself keeps both runs.
    assert "MSP_STANDIN_FAIL_AT_START" in (logs / "actor.regular.1.log").read_text()


def test_admin_api_key_stays_out_of_launch_errors_and_logs(
    tmp_path: Path,
    leak_check: LeakTracker,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An engine command (real engine kind) that carries ``--admin-api-key`` in its prefix and exits at once:
    the launch error shows its command with the key masked, in every spelling."""
    from miles_sglang_plugin.cli import main

    keys = ("adm1n-k1", "adm1n-k2", "adm1n-k3")
    command = (
        "sglang_deploy.launch.command=['{python}',-c,'import sys; sys.exit(3)',"
        f"--admin-api-key,{keys[0]},'--admin-api-key={keys[1]}',--admin_api_key,{keys[2]}]"
    )
    overrides = [
        o for o in launch_overrides("sglang.actor.regular.num_gpus=1") if o != "sglang_deploy=simulated"
    ]
    logs = tmp_path / "logs"
    assert main(["launch", "--log-dir", str(logs), *overrides, command]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "engine actor.regular.0 exited with code 3 during start-up" in err, err
    assert (
        "-c 'import sys; sys.exit(3)' --admin-api-key '***' '--admin-api-key=***' --admin_api_key '***'"
        in err
    )
    (launcher,) = leak_check.launchers
    assert launcher.prepared.launch.engine_kind.value == "sglang"
    texts = [err, *(f.read_text(errors="replace") for f in logs.iterdir())]
    assert len(texts) == 3  # the error, the engine's log, the router's log
    assert not any(key in text for key in keys for text in texts)


# ---------------------------------------------------------------------------------------------- ports
def test_ports_in_use_are_skipped(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    plain, claims = prepare_unprobed(TWO_ENGINES)
    router_port = plain.launch.routers[0].spec.port  # what the router and the first engine would get
    engine_port = plain.launch.engines[0].port
    cfg = compose(TWO_ENGINES, port_base=router_port)
    with held_socket(router_port), held_socket(engine_port):
        claims.release()  # the ports are "used by another program" now, not claimed by another launch
        with launch_from_config(cfg, log_dir=tmp_path / "logs") as launcher:
            launch = launcher.prepared.launch
            used = {launch.routers[0].spec.port, launch.routers[0].spec.prometheus_port}
            used |= {e.port for e in launch.engines}
            assert router_port not in used and engine_port not in used
            assert launch.routers[0].spec.port > router_port  # searched upward from port_base
            resp = httpx.post(launcher.registry.get_model_url("actor"), json=generate_body(), timeout=30)
            assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("what", ["engine", "router"])
def test_port_taken_after_render_fails_clearly(tmp_path: Path, leak_check: LeakTracker, what: str) -> None:  # noqa: F811
    # Failed by the process's exit, not by the start-up deadline an hour away.
    prepared, claims = prepare_unprobed(TWO_ENGINES, startup_timeout_s=3600)
    if what == "engine":
        port, name = prepared.launch.engines[1].port, "engine actor.regular.1"
    else:
        port, name = prepared.launch.routers[0].spec.port, "router router.actor"
    with (
        held_socket(port),
        pytest.raises(LaunchError) as info,
        Deployment(prepared, LocalBackend(claims=claims), log_dir=tmp_path / "logs"),
    ):
        pytest.fail("the launch should have failed")
    msg = str(info.value)
    assert msg.startswith(f"{name} exited with code 1 during start-up"), msg
    assert "ddress already in use" in msg and str(port) in msg, msg


# -------------------------------------------------------------------------------------------- signals
def _assert_children_match(run: ScriptRun, spawned: dict) -> set[int]:
    """The PIDs the script printed are exactly its engine and router children (read from /proc)."""
    pids = {p["pid"] for p in spawned["processes"]}
    assert children_of(run.pid) == pids
    return pids


def test_ctrl_c_during_startup_stops_everything(script_run: ScriptFactory) -> None:  # noqa: F811
    # The engines would take an hour to be ready, and the start-up deadline is an hour away: only the Ctrl-C can
    # end this launch before the test's timeout.
    run = script_run(
        launch_overrides(TWO_ENGINES, "sglang_deploy.standin.start_delay_s=3600", startup_timeout_s=3600)
    )
    spawned = run.wait_event("spawned", timeout_s=60)
    pids = _assert_children_match(run, spawned)
    assert len(pids) == 3
    assert all(process_alive(pid) for pid in pids)
    run.popen.send_signal(signal.SIGINT)
    code = run.wait_exit(timeout_s=120)
    assert code != 0
    assert not any(process_alive(pid) for pid in pids)
    err = run.stderr()
    assert "start-up interrupted by SIGINT: every engine and router was stopped" in err, err
    assert "KeyboardInterrupt" in err
    assert not any(e["event"] == "ready" for e in run.events())


def test_sigterm_to_running_launcher_stops_everything(script_run: ScriptFactory) -> None:  # noqa: F811
    run = script_run(launch_overrides(TWO_ENGINES))
    spawned = run.wait_event("spawned", timeout_s=60)
    ready = run.wait_event("ready", timeout_s=60)
    pids = _assert_children_match(run, spawned)
    assert httpx.post(ready["url"], json=generate_body(), timeout=30).status_code == 200
    run.popen.send_signal(signal.SIGTERM)
    # Stopped first, then SIGTERM's default action (the script set no handler): the status a shell reports as 143.
    assert run.wait_exit(timeout_s=20) == -signal.SIGTERM, run.stderr()
    assert not any(process_alive(pid) for pid in pids)  # stopped before the launcher exited
    assert "SIGTERM received: stopping every engine and router" in run.stderr()
    for name in ("actor.regular.0", "actor.regular.1"):  # stopped in order (SIGTERM), not by the kernel
        assert "stopping: signal received" in (run.workdir / "logs" / f"{name}.log").read_text()


def test_sigkill_of_launcher_kills_everything(script_run: ScriptFactory, leak_check: LeakTracker) -> None:  # noqa: F811
    run = script_run(launch_overrides(TWO_ENGINES))
    spawned = run.wait_event("spawned", timeout_s=60)
    run.wait_event("ready", timeout_s=60)
    _assert_children_match(run, spawned)
    run.popen.send_signal(signal.SIGKILL)
    assert run.wait_exit(timeout_s=60) == -signal.SIGKILL
    alive, open_ports = leak_check.leftovers(wait_s=60)  # the kernel's PR_SET_PDEATHSIG, nobody cleans up
    assert not alive and not open_ports, (alive, open_ports)
    for name in ("actor.regular.0", "actor.regular.1"):  # killed (SIGKILL), not stopped in order (SIGTERM)
        assert "stopping: signal received" not in (run.workdir / "logs" / f"{name}.log").read_text()
