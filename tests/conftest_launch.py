"""Fixtures of the launcher tests; import them into a test module (``from tests.conftest_launch import ...``).

``leak_check`` records every :class:`~miles_sglang_plugin.serving.deployment.Deployment` started during the test
(also one whose start fails) and, after the test, asserts that none of its processes runs and none of its
ports accepts a connection. ``script_run`` starts launches in child processes and kills a script a failed
test left running; every PID and port the scripts report is checked the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from miles_sglang_plugin.serving.deployment import Deployment
from tests.launch_helpers import LeakTracker, ScriptRun


@pytest.fixture
def leak_check(monkeypatch: pytest.MonkeyPatch) -> Iterator[LeakTracker]:
    tracker = LeakTracker()
    original_start = Deployment.start

    def tracking_start(self: Deployment) -> None:
        tracker.add_launcher(self)
        original_start(self)

    monkeypatch.setattr(Deployment, "start", tracking_start)
    yield tracker
    tracker.assert_nothing_left()


@pytest.fixture
def script_run(tmp_path: Path, leak_check: LeakTracker) -> Iterator[Callable[[Sequence[str]], ScriptRun]]:
    runs: list[ScriptRun] = []

    def start(overrides: Sequence[str]) -> ScriptRun:
        run = ScriptRun(tmp_path / f"script{len(runs)}", overrides, tracker=leak_check)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.close()
