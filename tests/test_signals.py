"""SIGINT and SIGTERM to a launcher: recorded by the handler, acted on by the deployment, handed on afterwards
(``miles_sglang_plugin/serving/signals.py``), so that a signal at any point of start-up ends the launch with
nothing left within the grace period, and never hangs it.

* The handlers themselves, in this process: recorded and not raised while watched; handed on once, to the
  handler the program had before; a signal the program ignores left alone.
* The hang of issue 12, reproduced exactly: a signal whose handler runs inside ``logging``'s after-fork hook
  (while logging's module lock is held) on the k-th process a launch spawns. With a handler that raised, the
  lock stayed held, the health-poll threads blocked on it and the launcher never ended.
* Many trials: one launcher process runs launch after launch, and a thread of it sends SIGINT or SIGTERM to
  it at a different delay each time, measured from the start of the launch (resolution, ports, spawning,
  health polls, registration, serving) and from the start of spawning (the first process, each following
  one). Every trial must end with none of its processes left, each stopped by its SIGTERM (none had to be
  killed once the grace period was over), in an outcome its signal and moment allow.

Nothing here bounds how long anything took (the machine may be loaded): events are checked in their order
(a wait woke after the signal was sent), and waiting out a grace period is seen in the exit codes it leaves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_sglang_plugin.serving import signals
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import REPO, LeakTracker, ScriptRun, launch_overrides

TWO_ENGINES = "sglang.actor.regular.num_gpus=2"
#: The shutdown grace period of these launches: generous, so that a loaded machine still stops every process by
#: its SIGTERM (a process SIGKILLed after the grace period fails the trials).
GRACE_S = 10.0


# ---------------------------------------------------------------------------------- the handlers themselves
class _Recorder:
    """A program's own handler: remembers what it was given."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        self.calls.append(signum)


@pytest.fixture
def own_handlers() -> Iterator[dict[int, _Recorder]]:
    """The program's handlers for SIGINT and SIGTERM during a test (the originals put back after it)."""
    before = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    handlers = {sig: _Recorder() for sig in signals.STOP_SIGNALS}
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    yield handlers
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_a_signal_while_watched_is_recorded_then_handed_on_once(own_handlers: dict[int, _Recorder]) -> None:
    watch = signals.watch()
    assert watch is not None
    signal.raise_signal(signal.SIGTERM)  # the handler runs here, synchronously: it must not raise
    signal.raise_signal(signal.SIGINT)
    assert watch.received == signal.SIGTERM  # the first one counts
    assert own_handlers[signal.SIGTERM].calls == [] and own_handlers[signal.SIGINT].calls == []
    with pytest.raises(signals.Interrupted) as info:
        watch.check()
    assert info.value.signum == signal.SIGTERM and str(info.value) == "SIGTERM"
    signals.unwatch(watch)
    signals.hand_on()
    signals.hand_on()  # once only
    assert own_handlers[signal.SIGTERM].calls == [signal.SIGTERM]
    assert own_handlers[signal.SIGINT].calls == []
    assert signal.getsignal(signal.SIGTERM) is own_handlers[signal.SIGTERM]  # the program's, back in place
    assert signal.getsignal(signal.SIGINT) is own_handlers[signal.SIGINT]


def test_python_default_sigint_handler_gets_it_as_keyboard_interrupt() -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with signals.recorded() as watch:
            signal.raise_signal(signal.SIGINT)
            assert watch is not None and watch.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            signals.hand_on()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_nothing_to_hand_on_puts_the_handlers_back_at_once(own_handlers: dict[int, _Recorder]) -> None:
    with signals.recorded():
        assert signal.getsignal(signal.SIGINT) is not own_handlers[signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is own_handlers[signal.SIGINT]
    signals.hand_on()
    assert own_handlers[signal.SIGINT].calls == []


def test_wait_wakes_for_a_signal_sent_from_elsewhere(own_handlers: dict[int, _Recorder]) -> None:
    with signals.recorded() as watch:
        assert watch is not None
        sent: list[float] = []

        def send() -> None:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

        sender = threading.Timer(0.2, send)
        sender.start()
        assert watch.wait(3600.0) == signal.SIGINT  # woken by the signal: its hour is far from over
        woke = time.monotonic()
        sender.join()
        assert sent and sent[0] <= woke  # not before the signal was sent
        assert watch.wait(0.0) == signal.SIGINT  # stays received
    assert own_handlers[signal.SIGINT].calls == []
    signals.hand_on()
    assert own_handlers[signal.SIGINT].calls == [signal.SIGINT]


def test_a_poke_wakes_one_wait_and_the_next_one_sleeps_again(own_handlers: dict[int, _Recorder]) -> None:
    """What woke a wait is read from its pipe: a poke left there made every later wait return at once (the
    deployment's signal watcher looped at 100% CPU for as long as it served)."""
    import select

    with signals.recorded() as watch:
        assert watch is not None
        watch.poke()
        watch.poke()
        assert watch.wait(10.0) is None  # woken by the pokes, no signal
        assert select.select([watch._read_fd], [], [], 0)[0] == []  # nothing left to wake the next wait
        waiter = threading.Thread(target=watch.wait, args=(30.0,))
        waiter.start()
        watch.poke()  # a later poke still wakes a waiting thread
        waiter.join(20.0)
        assert not waiter.is_alive()
    assert own_handlers[signal.SIGINT].calls == []


#: A watch whose pipe is numbered above 1024 (a launch of many engines holds thousands of descriptors: its
#: port claims): its wait must still sleep until poked. Prints the order of what happened.
HIGH_FD_WATCH = textwrap.dedent(
    """
    import os, resource, threading
    from miles_sglang_plugin.serving import signals
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    order = []
    with signals.recorded() as watch:
        assert watch._read_fd >= 1024, watch._read_fd
        def later():
            order.append("poked")
            watch.poke()
        threading.Timer(0.3, later).start()
        watch.wait(30.0)
        order.append("woke")
    print(" ".join(order))
    """
)


def test_a_wait_on_a_pipe_numbered_above_1024_still_sleeps() -> None:
    """``select`` refuses descriptors numbered 1024 and up; the watcher's wait returned at once there (and its
    thread spun) in a launch of 32 engines, whose port claims hold about 2,200 descriptors."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("this machine allows fewer than 1,200 open files")
    result = subprocess.run(
        [sys.executable, "-c", HIGH_FD_WATCH], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["poked", "woke"]


def test_a_signal_the_program_ignores_stays_ignored(own_handlers: dict[int, _Recorder]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with signals.recorded():
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not own_handlers[signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_no_watch_off_the_main_thread() -> None:
    found: list[object] = []
    thread = threading.Thread(target=lambda: found.append(signals.watch()))
    thread.start()
    thread.join()
    assert found == [None]


def test_handed_on_from_another_thread_it_reaches_the_main_thread(own_handlers: dict[int, _Recorder]) -> None:
    """As after start-up: the watcher thread stops the deployment, closes the watch and hands the signal on;
    the program's handler runs in the main thread."""
    watch = signals.watch()
    assert watch is not None
    signal.raise_signal(signal.SIGTERM)

    def watcher() -> None:
        signals.unwatch(watch)  # off the main thread: the handlers cannot be put back from here
        signals.hand_on()

    thread = threading.Thread(target=watcher)
    thread.start()
    thread.join()
    deadline = time.monotonic() + 5
    while not own_handlers[signal.SIGTERM].calls and time.monotonic() < deadline:
        time.sleep(0.01)  # the main thread runs the handler between two bytecodes
    assert own_handlers[signal.SIGTERM].calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is own_handlers[signal.SIGTERM]


def test_the_watcher_hands_the_signal_on_even_when_stopping_raised(
    own_handlers: dict[int, _Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a deployment whose teardown fails (a backend RPC error): the exception shows, and the program still
    gets its SIGTERM (before: it was never handed on, and the program ran on as if nothing had come)."""
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    watch = signals.watch()
    assert watch is not None

    def stop_that_fails(signum: int) -> None:
        signals.unwatch(watch)
        raise RuntimeError("the backend could not stop an engine")

    watcher = watch.serve_in_background(stop_that_fails, name="test watcher")
    signal.raise_signal(signal.SIGTERM)
    watcher.join(timeout=10)
    deadline = time.monotonic() + 5
    while not own_handlers[signal.SIGTERM].calls and time.monotonic() < deadline:
        time.sleep(0.01)  # the main thread runs the handler between two bytecodes
    assert own_handlers[signal.SIGTERM].calls == [signal.SIGTERM]
    assert [str(exc) for exc in raised] == ["the backend could not stop an engine"]


def test_a_signal_after_the_last_watch_closed_elsewhere_goes_to_the_program(
    own_handlers: dict[int, _Recorder],
) -> None:
    watch = signals.watch()
    thread = threading.Thread(target=signals.unwatch, args=(watch,))
    thread.start()
    thread.join()
    signal.raise_signal(signal.SIGINT)  # our handler is still installed; nobody watches: straight through
    assert own_handlers[signal.SIGINT].calls == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is own_handlers[signal.SIGINT]


# --------------------------------------------------------------------------- the hang of issue 12, exactly
#: Run before the launch script imports anything. A C-level at-fork hook (no Python bytecode runs in it),
#: registered before logging registers its own, leaves the signal pending on the k-th fork of this process;
#: Python then runs the handler on entering logging's after-fork hook, before it releases logging's lock.
AT_FORK_PRELUDE = textwrap.dedent(
    """
    import itertools as _it, os as _os, signal as _signal, sys as _sys
    assert "logging" not in _sys.modules
    _SIGNAL = _signal.Signals[_os.environ["MSP_TEST_SIGNAL"]]
    _FORK = int(_os.environ["MSP_TEST_FORK"])
    _SIGNALS = _it.chain(_it.repeat(0, _FORK - 1), [_SIGNAL], _it.repeat(0))  # 0: no signal, just a check
    # killpg, not kill: os.kill would run the handler itself, at once. The script leads its own process group.
    _os.register_at_fork(after_in_parent=map(_os.killpg, _it.repeat(_os.getpid()), _SIGNALS).__next__)
    """
)


@pytest.mark.parametrize("fork", [1, 2, 3])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_inside_loggings_fork_hook_while_spawning(
    tmp_path: Path,
    leak_check: LeakTracker,  # noqa: F811
    sig: signal.Signals,
    fork: int,
) -> None:
    """Forks 1, 2 and 3 of the launcher are the router and the two engines, in that order. Python's at-fork
    hooks run only where a child is forked with a ``preexec_fn`` (no setpriv): the launcher runs here with a
    PATH that has no setpriv (its children are started by absolute paths); with setpriv, ``Popen`` vforks
    and no Python code runs around a spawn at all (``test_a_spawn_runs_no_python_fork_hook``)."""
    run = ScriptRun(
        tmp_path,
        launch_overrides(TWO_ENGINES, shutdown_grace_s=GRACE_S),
        tracker=leak_check,
        prelude=AT_FORK_PRELUDE,
        extra_env={
            "MSP_TEST_SIGNAL": sig.name,
            "MSP_TEST_FORK": str(fork),
            "PATH": str(Path(sys.executable).parent),
        },
    )
    try:
        code = run.wait_exit(timeout_s=60)  # the old handler hung here for good
    finally:
        run.close()
    spawned = [event for event in run.events() if event["event"] == "spawned"]
    # The signal came with fork ``fork``; the engines are started by the reconcile loop's spawns, which may
    # start the next one before the main thread has taken the signal in (all three were started by then).
    assert len(spawned) == 1 and fork <= len(spawned[0]["processes"]) <= 3, run.stderr()
    assert not any(event["event"] == "ready" for event in run.events())
    err = run.stderr()
    assert f"start-up interrupted by {sig.name}: every engine and router was stopped" in err, err
    if sig == signal.SIGINT:  # the script's handler is Python's: KeyboardInterrupt, raised after the teardown
        assert code == -signal.SIGINT and err.rstrip().endswith("KeyboardInterrupt"), err
    else:  # no handler of its own: SIGTERM's default action, after the teardown
        assert code == -signal.SIGTERM, err
    leak_check.assert_nothing_left(wait_s=10.0)


# ------------------------------------------------------------------------------------------- many trials
#: argv[1]: JSON overrides; argv[2]: log dir; argv[3]: JSON list of trials [signal name, anchor, delay s].
#: Prints one JSON line per trial: when the signal was sent and when the launch had ended (monotonic), how it
#: ended, the processes it started and its ports, and which of its processes were still alive at its end.
TRIALS_SCRIPT = textwrap.dedent(
    r"""
    import json, os, signal, sys, threading, time
    from pathlib import Path

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: KeyboardInterrupt, as in a terminal
    terminated = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))  # a program's own handler

    from miles_sglang_plugin.app.hydra_edge import launch_from_config
    from miles_sglang_plugin.backends.base import LaunchError
    from miles_sglang_plugin.config.compose import compose_config
    from miles_sglang_plugin.serving.deployment import Deployment

    overrides, log_dir, trials = json.loads(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    cfg = compose_config(overrides)
    current = {}
    _start_routers = Deployment._start_routers


    def spawn(self):  # start-up's processes begin: the routers, then the engines (by the reconcile loop)
        current["deployment"] = self
        current["spawn_started"].set()
        _start_routers(self)


    Deployment._start_routers = spawn


    def alive(pid):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state not in ("Z", "X")


    def send_later(sig, anchor, delay, sent):
        if anchor == "spawn":
            current["spawn_started"].wait(30)
        elif anchor == "ready":
            current["ready"].wait(60)
        time.sleep(delay)
        sent.append(time.monotonic())
        deployment = current.get("deployment")
        sent.append(len(deployment.processes()) if deployment else 0)  # how far start-up had got
        os.kill(os.getpid(), sig)  # from this thread; the handler runs in the main thread, as for any signal


    def trial(name, anchor, delay):
        sig = signal.Signals[name]
        current.clear()
        current["spawn_started"] = threading.Event()
        current["ready"] = threading.Event()
        terminated.clear()
        sent = []
        sender = threading.Thread(target=send_later, args=(sig, anchor, delay, sent))
        outcome = "starting"
        try:
            sender.start()  # in the try: a signal sent at once may come while start() still waits
            with launch_from_config(cfg, log_dir=log_dir) as deployment:
                outcome = "ready"
                current["ready"].set()
                while not terminated:  # SIGINT raises KeyboardInterrupt in here instead
                    time.sleep(0.01)
        except KeyboardInterrupt:
            outcome += "+KeyboardInterrupt"
        except LaunchError as exc:
            outcome += "+" + type(exc).__name__
        ended = time.monotonic()
        sender.join()
        deployment = current.get("deployment")
        processes = [{"pid": p.pid, "name": p.name, "marker": p.argv[2], "code": p.exit_code()} for p in deployment.processes()] if deployment else []
        ports = []
        if deployment:
            launch = deployment.prepared.launch
            ports = [e.port for e in launch.engines] + [p for r in launch.routers for p in (r.spec.port, r.spec.prometheus_port)]
        print(json.dumps({
            "trial": [name, anchor, delay], "sent": sent[0], "started_when_sent": sent[1], "ended": ended,
            "outcome": outcome,
            "handled_by_program": bool(terminated), "processes": processes, "ports": ports,
            "alive": [p["name"] for p in processes if alive(p["pid"])],
        }), flush=True)


    for name, anchor, delay in trials:
        trial(name, anchor, delay)
    """
)

#: Delays from the start of a launch, across resolution, ports, spawning, polls, registration and serving (a
#: launch of two stand-ins is ready after about 0.6 s here, later on a loaded machine), from the start of
#: spawning (a process is started every few ms; the engines take far longer than these to be ready), and
#: from the moment the deployment is ready (the with block runs).
LAUNCH_DELAYS_S = [round(0.07 * i, 3) for i in range(16)]
SPAWN_DELAYS_S = [round(0.003 * i, 3) for i in range(12)]
READY_DELAYS_S = [0.0, 0.2]
TRIALS = [
    [sig, anchor, delay]
    for sig in ("SIGINT", "SIGTERM")
    for anchor, delays in (("launch", LAUNCH_DELAYS_S), ("spawn", SPAWN_DELAYS_S), ("ready", READY_DELAYS_S))
    for delay in delays
]
#: How a trial may end, by signal: SIGINT raises KeyboardInterrupt (Python's handler) during start-up or in the
#: with block; SIGTERM (a handler that returns) fails start-up with StartupInterrupted, or ends the with block
#: on the handler's flag. Whichever a launch-anchored trial hits depends on the machine's load; a
#: spawn-anchored one is always during start-up, a ready-anchored one always in the with block.
OUTCOMES = {
    "SIGINT": {"starting": "starting+KeyboardInterrupt", "ready": "ready+KeyboardInterrupt"},
    "SIGTERM": {"starting": "starting+StartupInterrupted", "ready": "ready"},
}


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _start_trials(tmp_path: Path) -> subprocess.Popen[bytes]:
    script = tmp_path / "trials.py"
    script.write_text(TRIALS_SCRIPT)
    argv = [
        sys.executable,
        str(script),
        json.dumps(launch_overrides(TWO_ENGINES, shutdown_grace_s=GRACE_S)),
        str(tmp_path / "logs"),
        json.dumps(TRIALS),
    ]
    with (tmp_path / "out.txt").open("wb") as out, (tmp_path / "err.txt").open("wb") as err:
        return subprocess.Popen(
            argv,
            cwd=tmp_path,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def _results(tmp_path: Path, tracker: LeakTracker) -> list[dict[str, Any]]:
    results = []
    for line in (tmp_path / "out.txt").read_text().splitlines():
        if line.startswith('{"trial"'):
            result = json.loads(line)
            results.append(result)
            for process in result["processes"]:
                tracker.add_process(process["pid"], process["name"], process["marker"])
            tracker.add_ports(result["ports"])
    return results


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_many_signals_at_every_point_of_start_up(tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    """60 trials (about 35 s here): each ends with nothing left, every process it started stopped by its
    SIGTERM (an engine still starting dies of it, one serving exits 0; none SIGKILLed after the grace period),
    in an outcome its signal allows (during start-up for a signal right after spawning began, in the with
    block for one after the deployment was ready: every outcome is hit, whatever the machine's load)."""
    proc = _start_trials(tmp_path)
    try:
        proc.wait(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    results = _results(tmp_path, leak_check)
    err = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 0, f"after {len(results)} trials: {err[-4000:]}"
    assert [result["trial"] for result in results] == TRIALS
    killed = [  # of the processes started (a router may not have been when the signal came: no pid)
        (r["trial"], p["name"], p["pid"], p["code"])
        for r in results
        for p in r["processes"]
        if p["pid"] is not None and p["code"] not in (0, -signal.SIGTERM)
    ]
    left = [(r["trial"], r["alive"]) for r in results if r["alive"]]
    assert not killed and not left, f"not stopped by SIGTERM: {killed}; left running: {left}"
    required = {"spawn": "starting", "ready": "ready"}  # launch-anchored: either
    wrong = [
        (r["trial"], r["outcome"])
        for r in results
        if r["outcome"] not in OUTCOMES[r["trial"][0]].values()
        or (r["trial"][1] in required and r["outcome"] != OUTCOMES[r["trial"][0]][required[r["trial"][1]]])
    ]
    assert not wrong, f"trials that ended otherwise than their signal and moment allow: {wrong}"
    assert {r["outcome"] for r in results} == {
        o for by_moment in OUTCOMES.values() for o in by_moment.values()
    }
    print("processes started when the signal was sent:", sorted(r["started_when_sent"] for r in results))
    print("signal to end, s: max", round(max(r["ended"] - r["sent"] for r in results), 2))
    for r in results:
        if r["trial"][0] == "SIGTERM":  # the program's own SIGTERM handler got it, always after the teardown
            assert r["handled_by_program"], r
