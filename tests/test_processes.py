"""Child processes (``backends/processes.py``): stopping a process group that ignores SIGTERM, the
parent-death signal, and the log tail that goes into error messages.

``stop_processes`` sends SIGTERM to each process group, waits up to the grace period, then SIGKILLs what is
left. Here the child and its grandchild (one process group) both take SIGTERM and carry on (they say so in
their log): the SIGKILL that ends them comes after that, once the grace period is over. What is checked is the
order of these events and the exit codes, not how long any of it took (the machine may be loaded): the one
time bound is the grace period the code must wait, a lower bound.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from miles_sglang_plugin.backends import processes
from miles_sglang_plugin.backends.processes import ManagedProcess, log_tail, stop_processes
from tests.launch_helpers import LeakTracker, process_alive

#: Takes SIGTERM and carries on, and so does the grandchild it forks (same process group); prints both PIDs,
#: then, in each, "<pid> carries on after SIGTERM" once it got one (its handler records the signal and returns).
STUBBORN_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))

    def carry_on():
        said = False
        while True:
            if got and not said:
                print(f"{os.getpid()} carries on after SIGTERM", flush=True)
                said = True
            time.sleep(0.05)

    grandchild = os.fork()
    if grandchild == 0:
        carry_on()
    print(f"ready {os.getpid()} {grandchild}", flush=True)
    carry_on()
    """
)
MARKER = "msp-stubborn-child"


def _wait_ready(proc: ManagedProcess, timeout_s: float = 20.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in proc.tail(5).splitlines():
            if line.startswith("ready "):
                _, child, grandchild = line.split()
                return int(child), int(grandchild)
        assert proc.running, f"the child exited early ({proc.exit_code()}):\n{proc.tail()}"
        time.sleep(0.05)
    raise AssertionError(f"the child never said ready:\n{proc.tail()}")


def _gone_soon(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether ``pid`` is gone within ``timeout_s``: a SIGKILLed process (a grandchild especially, which no
    ``wait`` of ours reaps) can still be seen for a moment on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while process_alive(pid, MARKER):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_group_that_ignores_sigterm_is_killed_when_the_grace_period_ends(tmp_path: Path) -> None:
    # Both must run their SIGTERM handler within the grace period: 3 s was too short once on a machine loaded
    # eight times over its two cores (the grandchild had not run before SIGKILL)
    grace_s = 10.0
    proc = ManagedProcess(
        name="stubborn",
        argv=[sys.executable, "-c", STUBBORN_CHILD, MARKER],
        env={},
        log_path=tmp_path / "stubborn.log",
    )
    tracker = LeakTracker()
    proc.start()
    try:
        assert proc.pid is not None
        tracker.add_process(proc.pid, "stubborn child", MARKER)
        child, grandchild = _wait_ready(proc)
        assert child == proc.pid
        tracker.add_process(grandchild, "stubborn grandchild", MARKER)

        t0 = time.monotonic()
        codes = stop_processes([proc], grace_s=grace_s)
        elapsed = time.monotonic() - t0
        # Both were sent SIGTERM and ran on after it; then SIGKILL ended them (the child's -9), not before the
        # grace period was over.
        said = proc.tail(50).splitlines()
        assert (
            f"{child} carries on after SIGTERM" in said and f"{grandchild} carries on after SIGTERM" in said
        )
        assert codes == {"stubborn": -9}  # killed by SIGKILL, reaped
        assert elapsed >= grace_s, (
            f"killed {elapsed:.2f} s after SIGTERM, within the {grace_s} s grace period"
        )
        assert _gone_soon(child) and _gone_soon(grandchild)
    finally:
        tracker.assert_nothing_left(wait_s=10.0)


SLEEPER = "import time\nwhile True: time.sleep(0.1)"
#: Says ready once its command runs, then sleeps.
READY_SLEEPER = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.1)"


def _wait_for_line(proc: ManagedProcess, line: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in proc.tail(5).splitlines():
        assert proc.running, f"the child exited early ({proc.exit_code()}):\n{proc.tail()}"
        assert time.monotonic() < deadline, f"the child never said {line!r}:\n{proc.tail()}"
        time.sleep(0.05)


needs_prctl = pytest.mark.skipif(processes._PRCTL is None, reason="parent-death signals need Linux's prctl")
#: setpriv is part of util-linux (Debian's base system): where it exists, the exec-time guard must work.
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux's setpriv is not here")


@pytest.fixture(params=["setpriv", "preexec_fn"])
def spawn_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of arming the parent-death signal: at exec time (setpriv + the shell guard) and from a
    ``preexec_fn`` (where setpriv is missing)."""
    if request.param == "setpriv":
        if processes.exec_time_guard() is None:
            pytest.skip("setpriv cannot arm the parent-death signal here")
    else:
        monkeypatch.setattr(processes, "exec_time_guard", lambda: None)
    return str(request.param)


@needs_prctl
def test_a_child_is_killed_when_the_thread_that_started_it_exits(tmp_path: Path, spawn_mode: str) -> None:
    # PR_SET_PDEATHSIG fires when the thread that forked the child ends (prctl(2)): the same signal that
    # takes engines down with a SIGKILLed launcher, observed here without killing the test process.
    # The thread ends once the child runs its command, when the signal is armed whichever way: a thread that
    # ended before setpriv armed it would leave a child no signal will ever reach (its parent process lives on,
    # so the guard lets it run), as it did on a loaded machine.
    proc = ManagedProcess(name="orphan", argv=[sys.executable, "-c", READY_SLEEPER, MARKER], env={},
                          log_path=tmp_path / "orphan.log")  # fmt: skip
    tracker = LeakTracker()

    def start_and_wait_until_it_runs() -> None:
        proc.start()
        _wait_for_line(proc, "ready")

    starter = threading.Thread(target=start_and_wait_until_it_runs)
    starter.start()
    starter.join()
    try:
        assert proc.popen is not None
        tracker.add_process(proc.popen.pid, "orphaned child", MARKER)
        assert proc.popen.wait(timeout=60) == -9  # SIGKILL, from the kernel
    finally:
        stop_processes([proc], grace_s=0.5)
        tracker.assert_nothing_left(wait_s=10.0)


def test_log_tail_is_the_last_lines_from_the_offset_joined_by_newlines(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"earlier run\n" + b"".join(b"line %d\n" % i for i in range(1, 6)))
    assert log_tail(log, lines=3, start=len(b"earlier run\n")) == "line 3\nline 4\nline 5"
    assert log_tail(log, lines=10, start=len(b"earlier run\n")).splitlines()[0] == "line 1"
    assert log_tail(tmp_path / "missing.log", lines=3) == ""


def test_log_tail_reads_a_bounded_end_of_the_file_and_survives_bytes_that_are_not_utf8(
    tmp_path: Path,
) -> None:
    log = tmp_path / "engine.log"
    content = b"x" * (200 * 1024) + b"\xff\xfe broken \xe2\x82 end"  # one 200 KiB line, then bad UTF-8
    log.write_bytes(content)
    tail = log_tail(log, lines=1)
    assert tail.endswith("\ufffd\ufffd broken \ufffd end")
    # At most the last 64 KiB are read (each byte decodes to at most one character), not the whole line.
    assert len(tail) <= 64 * 1024 < len(content)


#: The leader exits at SIGTERM; its grandchild (same process group) ignores SIGTERM and reports any SIGHUP.
LEADER_WITH_STUBBORN_GRANDCHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, lambda *_: print("grandchild got SIGHUP", flush=True))
        print(f"ready {os.getppid()} {os.getpid()}", flush=True)
        while True:
            time.sleep(0.1)
    while True:
        time.sleep(0.1)
    """
)


def test_a_group_whose_leader_is_gone_is_probed_without_signals_and_killed_at_the_end(tmp_path: Path) -> None:
    grace_s = 1.0
    proc = ManagedProcess(name="leader", argv=[sys.executable, "-c", LEADER_WITH_STUBBORN_GRANDCHILD, MARKER],
                          env={}, log_path=tmp_path / "leader.log")  # fmt: skip
    tracker = LeakTracker()
    proc.start()
    try:
        assert proc.pid is not None
        tracker.add_process(proc.pid, "leader", MARKER)
        leader, grandchild = _wait_ready(proc)
        assert leader == proc.pid
        tracker.add_process(grandchild, "stubborn grandchild", MARKER)
        t0 = time.monotonic()
        codes = stop_processes([proc], grace_s=grace_s)
        elapsed = time.monotonic() - t0
        assert codes == {"leader": -15}  # the leader went at SIGTERM ...
        # ... the grandchild, which ignores SIGTERM, only at the SIGKILL, once the grace period was over
        assert elapsed >= grace_s and _gone_soon(grandchild)
        assert "SIGHUP" not in proc.tail(50)  # checking that the group lives sends it no signal
    finally:
        tracker.assert_nothing_left(wait_s=10.0)


def test_a_process_never_started_has_no_pid_exit_code_or_running_state(tmp_path: Path) -> None:
    proc = ManagedProcess(
        name="idle", argv=[sys.executable, "-c", "pass"], env={}, log_path=tmp_path / "x.log"
    )
    assert (proc.pid, proc.exit_code(), proc.running) == (None, None, False)
    assert stop_processes([proc]) == {}


def test_a_process_tail_is_its_own_output_and_as_many_lines_as_asked(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"earlier run\n")
    proc = ManagedProcess(name="p", argv=[sys.executable, "-c", "print('a'); print('b'); print('c')"], env={},
                          log_path=log)  # fmt: skip
    proc.start()
    assert proc.popen is not None and proc.popen.wait(timeout=20) == 0
    # The launcher writes one line marking the run's start before the process starts (a full disk fails
    # there, with a word), then the run's output begins: 12 bytes of the earlier run + the marker's 51
    # ("[miles_sglang_plugin] " 22, the date and time 19, " starting\n" 10).
    content = log.read_bytes()
    assert proc.log_offset == len(b"earlier run\n") + 51
    assert re.fullmatch(
        rb"earlier run\n\[miles_sglang_plugin\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d starting\n",
        content[: proc.log_offset],
    )
    assert content[proc.log_offset :] == b"a\nb\nc\n"
    assert proc.tail(2) == "b\nc"
    assert proc.tail() == "a\nb\nc"


def test_a_process_tail_masks_the_secrets_it_was_given_but_not_the_packages_own_values(
    tmp_path: Path,
) -> None:
    # What it prints: its argv (the key after --api-key and in --admin-api-key=), and its environment's values.
    script = "import os, sys; print(sys.argv[1:]); print(os.environ['HF_TOKEN'], os.environ['FLAG'], os.environ['CUDA_VISIBLE_DEVICES'], os.environ['SGLANG_MEMORY_SAVER_CUDA_GRAPH'])"
    proc = ManagedProcess(
        name="p",
        argv=[sys.executable, "-c", script, "--api-key", "sk-TAIL-1", "--admin-api-key=adm-TAIL-2"],
        env={"HF_TOKEN": "hf_TAIL_token_3", "FLAG": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7",
             "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true"},
        log_path=tmp_path / "engine.log",
    )  # fmt: skip
    proc.start()
    assert proc.popen is not None and proc.popen.wait(timeout=20) == 0
    assert proc.tail() == "['--api-key', '***', '--admin-api-key=***']\n*** 1 4,5,6,7 true"
    assert "sk-TAIL-1" in (tmp_path / "engine.log").read_text()  # the file holds what the process wrote


def test_a_cooperative_group_is_stopped_without_waiting_out_the_grace_period(tmp_path: Path) -> None:
    proc = ManagedProcess(name="polite", argv=[sys.executable, "-c", SLEEPER, MARKER], env={},
                          log_path=tmp_path / "polite.log")  # fmt: skip
    proc.start()
    # SIGTERM was enough, and the stop returned at the exit: a stop that waited out this grace period would
    # outlast the test's timeout many times over.
    assert stop_processes([proc], grace_s=3600.0) == {"polite": -15}
    proc.signal_group(signal.SIGTERM)  # a group that is gone: nothing to signal, nothing raised


#: Reports where its stdin comes from and whether the fd given as argv[1] is open in it.
REPORT_FDS = """
import os, sys
try:
    os.fstat(int(sys.argv[1]))
    inherited = "open"
except OSError:
    inherited = "closed"
print(os.readlink("/proc/self/fd/0"), inherited, flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd")
def test_a_child_reads_no_terminal_and_inherits_no_descriptors_of_the_launcher(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    saved_stdin = os.dup(0)
    os.set_inheritable(write_end, True)  # a descriptor a library left inheritable
    os.dup2(read_end, 0)  # the launcher's stdin: a pipe (a terminal, in real use)
    try:
        proc = ManagedProcess(name="fds", argv=[sys.executable, "-c", REPORT_FDS, str(write_end)], env={},
                              log_path=tmp_path / "logs" / "nested" / "fds.log")  # fmt: skip
        proc.start()  # creates the log directory and its parents
    finally:
        os.dup2(saved_stdin, 0)
        for fd in (saved_stdin, read_end, write_end):
            os.close(fd)
    assert proc.popen is not None and proc.popen.wait(timeout=20) == 0
    assert proc.tail(1) == "/dev/null closed"


#: A launcher in a process of its own: starts a sleeper through ManagedProcess (with the exec-time guard, or
#: with the preexec_fn where argv[1] says so), prints its pid, and waits to be SIGKILLed.
LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from miles_sglang_plugin.backends import processes
    if sys.argv[1] == "preexec_fn":
        processes.exec_time_guard = lambda: None
    proc = processes.ManagedProcess(name="child", argv=[sys.executable, "-c", sys.argv[3], sys.argv[4]], env={},
                                    log_path=Path(sys.argv[2]))
    proc.start()
    print(proc.pid, flush=True)
    time.sleep(600)
    """
)


@needs_prctl
def test_a_child_dies_with_a_sigkilled_launcher(tmp_path: Path, spawn_mode: str) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, spawn_mode, str(tmp_path / "child.log"), SLEEPER, MARKER],
        stdout=subprocess.PIPE,
        text=True,
    )
    tracker = LeakTracker()
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        tracker.add_process(child, "child of the launcher", MARKER)
        deadline = time.monotonic() + 20
        while not process_alive(child, MARKER):  # the guard has exec'd the command
            assert time.monotonic() < deadline, "the child never ran its command"
            time.sleep(0.02)
        launcher.kill()
        launcher.wait(timeout=10)
        assert _gone_soon(child, timeout_s=10), "the child outlived its SIGKILLed launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
        tracker.assert_nothing_left(wait_s=10.0)


@needs_prctl
@needs_setpriv
def test_a_child_whose_launcher_died_before_the_signal_was_armed_never_runs_its_command(
    tmp_path: Path,
) -> None:
    # The launcher dying between fork and prctl: the child's parent is then another process (init, a subreaper),
    # so the signal would never come. The guard sees a parent that is not the launcher it was given and kills the
    # child before the command runs; here the "launcher" it is given is pid 1, which is not its parent.
    guard = processes.exec_time_guard()
    assert guard is not None
    marker = tmp_path / "ran"
    child = subprocess.run(
        [*guard, "1", sys.executable, "-c", f"open({str(marker)!r}, 'w')"], capture_output=True, timeout=30
    )
    assert child.returncode == -signal.SIGKILL
    assert not marker.exists()
    # Given its real parent, the same guard runs the command, in place of the shell (same pid).
    script = f"import os; open({str(marker)!r}, 'w').write(str(os.getpid()))"
    proc = subprocess.Popen([*guard, str(os.getpid()), sys.executable, "-c", script])
    assert proc.wait(timeout=30) == 0
    assert marker.read_text() == str(proc.pid)


@needs_setpriv
def test_a_child_is_started_without_python_between_fork_and_exec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where setpriv arms the signal, Popen gets no preexec_fn (so it may vfork) and runs the command under
    setpriv and the guard; the command itself is what runs, found on the child's PATH."""
    if processes.exec_time_guard() is None:
        pytest.skip("setpriv cannot arm the parent-death signal here")
    seen: dict[str, object] = {}
    real_popen = subprocess.Popen

    def recording_popen(argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        seen.update(argv=argv, **kwargs)
        return real_popen(argv, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(processes.subprocess, "Popen", recording_popen)
    proc = ManagedProcess(name="p", argv=["env"], env={"MSP_PROBE": "1"}, log_path=tmp_path / "p.log")
    proc.start()
    assert proc.popen is not None and proc.popen.wait(timeout=20) == 0
    assert "preexec_fn" not in seen
    argv = seen["argv"]
    assert isinstance(argv, list)
    assert argv[:4] == [shutil.which("setpriv"), "--pdeathsig", "KILL", "--"]
    assert argv[-2:] == [str(os.getpid()), shutil.which("env")]
    assert "MSP_PROBE=1" in proc.tail(200).splitlines()


def test_a_command_that_cannot_run_is_refused_as_popen_refuses_it(tmp_path: Path, spawn_mode: str) -> None:
    missing = ManagedProcess(name="m", argv=["msp-no-such-command"], env={}, log_path=tmp_path / "m.log")
    with pytest.raises(FileNotFoundError) as exc:
        missing.start()
    assert str(exc.value) == "[Errno 2] No such file or directory: 'msp-no-such-command'"
    assert missing.popen is None
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    refused = ManagedProcess(name="n", argv=[str(script)], env={}, log_path=tmp_path / "n.log")
    with pytest.raises(PermissionError) as denied:
        refused.start()
    assert str(denied.value) == f"[Errno 13] Permission denied: {str(script)!r}"


def test_without_a_working_setpriv_the_child_arms_the_signal_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No setpriv on PATH, or one that cannot arm the signal: no exec-time guard, the preexec_fn instead."""
    processes.exec_time_guard.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH directory: no setpriv there
    try:
        assert processes.exec_time_guard() is None
        broken = tmp_path / "setpriv"  # one that fails whatever it is asked (an old util-linux, a sandbox)
        broken.write_text("#!/bin/sh\necho 'setpriv: unrecognized option' >&2\nexit 1\n")
        broken.chmod(0o755)
        processes.exec_time_guard.cache_clear()
        assert processes.exec_time_guard() is None
        argv, options = processes.spawn_options([sys.executable, "-c", "pass"], {})
        assert argv == [sys.executable, "-c", "pass"] and "preexec_fn" in options
    finally:
        processes.exec_time_guard.cache_clear()


#: Counts Python's at-fork hooks around starts of a ManagedProcess (in a process of its own: hooks cannot be
#: unregistered). argv[1]: "setpriv" or "preexec_fn"; prints how many times the hooks ran for 3 starts.
FORK_HOOKS = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from miles_sglang_plugin.backends import processes
    if sys.argv[1] == "preexec_fn":
        processes.exec_time_guard = lambda: None
    ran = []
    os.register_at_fork(before=lambda: ran.append("before"), after_in_parent=lambda: ran.append("after"))
    for i in range(3):
        proc = processes.ManagedProcess(name=f"p{i}", argv=[sys.executable, "-c", "pass"], env={},
                                        log_path=Path(sys.argv[2]) / f"p{i}.log")
        proc.start()
        proc.popen.wait(30)
    print(len(ran))
    """
)


def test_a_spawn_runs_no_python_fork_hook(tmp_path: Path, spawn_mode: str) -> None:
    """With setpriv a child is vforked and execs at once: no Python code runs around the spawn (no at-fork
    hook, so no signal handler can run inside one, e.g. logging's, which takes locks); with a preexec_fn the
    child is forked and the hooks run, before and after each start."""
    result = subprocess.run(
        [sys.executable, "-c", FORK_HOOKS, spawn_mode, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == (0 if spawn_mode == "setpriv" else 6)
