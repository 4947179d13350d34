"""Child processes (``backends/processes.py``): stopping a process group that ignores SIGTERM.

``stop_processes`` sends SIGTERM to each process group, waits up to the grace period, then SIGKILLs what is
left. Here the child and its grandchild (one process group) both ignore SIGTERM: they must still be running
just before the grace period ends, and be gone shortly after it.
"""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from pathlib import Path

from miles_sglang_plugin.backends.processes import ManagedProcess, stop_processes
from tests.launch_helpers import LeakTracker, process_alive

#: Ignores SIGTERM, forks a grandchild that ignores it too (same process group), prints both PIDs, sleeps.
STUBBORN_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = os.fork()
    if grandchild == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited already; said again for the reader
        while True:
            time.sleep(0.1)
    print(f"ready {os.getpid()} {grandchild}", flush=True)
    while True:
        time.sleep(0.1)
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


def test_a_group_that_ignores_sigterm_is_killed_when_the_grace_period_ends(tmp_path: Path) -> None:
    grace_s = 1.5
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

        codes: dict[str, int | None] = {}
        stopper = threading.Thread(target=lambda: codes.update(stop_processes([proc], grace_s=grace_s)))
        t0 = time.monotonic()
        stopper.start()
        time.sleep(grace_s - 0.4)
        # SIGTERM went out more than a second ago: both ignore it and are still there.
        assert process_alive(child, MARKER) and process_alive(grandchild, MARKER)
        assert stopper.is_alive()
        stopper.join(timeout=grace_s + 10)
        elapsed = time.monotonic() - t0
        assert not stopper.is_alive(), "stop_processes did not return"
        assert grace_s - 0.05 <= elapsed <= grace_s + 1.5, (
            f"stopped after {elapsed:.2f} s (grace {grace_s} s)"
        )
        assert codes == {"stubborn": -9}  # killed by SIGKILL, reaped
        assert not process_alive(child, MARKER) and not process_alive(grandchild, MARKER)
    finally:
        tracker.assert_nothing_left(wait_s=2.0)
