"""The test tiers (Makefile): ``make test`` runs each tier whatever became of the ones before
(``scripts/run-tiers.sh``), ends with a summary (tier / result / seconds) and fails when any tier failed; the
quick and slow tiers split the main venv's tests between them, and ``make test`` still runs every lane it ran
before (the SMG router lane, the Ray tests on the newest and the oldest Ray, the trainers' lane). A suite started
with SIGINT ignored (in the background) still stops the launchers its tests end with SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "scripts" / "run-tiers.sh"

#: Three tiers of a make file of the test's own: each appends its name to ran.txt; b fails.
FAKE_TIERS = """\
test-a:
\techo a >> ran.txt
test-b:
\techo b >> ran.txt; exit 3
test-c:
\techo c >> ran.txt
"""


def _env_outside_make() -> dict[str, str]:
    """The environment without what a make running this suite passes down: its flags, and the variables set
    on its command line (.ci/run's ``DISPOSABLE_VENVS=1``), which make exports to its recipes."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k != "DISPOSABLE_VENVS"}


def _run_tiers(tmp_path: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "Makefile").write_text(FAKE_TIERS)
    env = _env_outside_make()
    env["MAKE"] = "make"
    return subprocess.run(
        ["bash", str(RUNNER), *targets], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


def _summary(stdout: str) -> list[list[str]]:
    """The rows of the summary table: tier, result, seconds, GB free on disk after the tier."""
    table = stdout.split("=== tiers: summary\n", 1)[1].splitlines()
    assert table[0].split() == ["tier", "result", "seconds", "GB", "free"], stdout
    rows = []
    for line in table[1:]:
        match = re.fullmatch(r"(\S+)\s+(passed|FAILED \(exit \d+\))\s+(\d+)\s+(\d+\.\d)", line)
        if match:
            rows.append(list(match.groups()))
    return rows


def test_a_failed_tier_does_not_stop_the_next_ones_and_fails_the_run(tmp_path: Path) -> None:
    done = _run_tiers(tmp_path, "test-a", "test-b", "test-c")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (tmp_path / "ran.txt").read_text().split() == ["a", "b", "c"]  # c ran after b failed
    rows = _summary(done.stdout)
    assert [row[:2] for row in rows] == [["a", "passed"], ["b", "FAILED (exit 2)"], ["c", "passed"]]
    assert done.stdout.rstrip().endswith("1 of 3 tier(s) failed")


def test_tiers_that_all_pass_pass_the_run(tmp_path: Path) -> None:
    done = _run_tiers(tmp_path, "test-c", "test-a")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [row[:2] for row in _summary(done.stdout)] == [["c", "passed"], ["a", "passed"]]
    assert done.stdout.rstrip().endswith("all 2 tier(s) passed")


def test_no_tier_is_a_usage_error(tmp_path: Path) -> None:
    done = _run_tiers(tmp_path)
    assert done.returncode == 2 and "usage:" in done.stderr


def _dry_run(*args: str) -> str:
    """``make -n ARGS`` in the checkout: every command the tiers would run, none run (the runner itself does
    run, as a line naming $(MAKE) does under -n, and its makes inherit -n)."""
    env = _env_outside_make()
    done = subprocess.run(
        ["make", "-n", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _assert_in_order(out: str, commands: list[str]) -> None:
    """Each of ``commands`` is in ``out``, in this order."""
    positions = [out.find(command) for command in commands]
    assert -1 not in positions, [c for c, at in zip(commands, positions, strict=True) if at < 0]
    assert positions == sorted(positions)


def test_make_test_runs_every_tier_and_ci_adds_lint_docs_and_the_real_engine() -> None:
    out = _dry_run("test", "EXTRA_TIERS=lint docs test-real-engine")
    lanes = "not ray and not trainers and not real_engine"
    commands = [
        f'.venv/bin/python -m pytest -m "not slow and {lanes}" -p no:cacheprovider',  # quick
        f'.venv/bin/python -m pytest -m "slow and {lanes}" -p no:cacheprovider',  # slow
        '.venv/bin/python -m pytest --gateway smg -m "not ray" -p no:cacheprovider tests/test_routers.py',
        'in-loopback-netns.sh .venv/bin/python -m pytest -m "ray and not trainers" -p no:cacheprovider',
        'in-loopback-netns.sh .venv-ray-floor/bin/python -m pytest -m "ray and not trainers"',
        "in-loopback-netns.sh .venv-trainers/bin/python -m pytest -m trainers -p no:cacheprovider",
        ".venv/bin/ruff check .",
        "scripts/generate-docs.py --check",
        '.venv-real/bin/python -m pytest -m "real_engine or engine_contract"',
    ]
    _assert_in_order(out, commands)
    rows = _summary(out)
    assert [row[0] for row in rows] == [
        "quick", "slow", "smg", "ray", "ray-floor", "trainers", "lint", "docs", "real-engine",
    ]  # fmt: skip
    assert "rm -rf" not in out  # a developer's venvs stay
    assert (
        'make test EXTRA_TIERS="lint docs test-real-engine" DISPOSABLE_VENVS=1'
        in (REPO / ".ci" / "run").read_text()
    )


#: Venv paths that name nothing of this checkout's, for the dry runs that would remove them (``-n`` reaches the
#: runner's sub-makes; were it ever not to, nothing real goes).
SCRATCH_VENVS = ("VENV=/nonexistent/v", "TRAINERS_VENV=/nonexistent/t", "RAY_FLOOR_VENV=/nonexistent/f",
                 "REAL_VENV=/nonexistent/r")  # fmt: skip


def test_in_ci_each_lanes_venv_goes_once_its_tier_has_run_and_the_main_one_before_the_real_engines() -> None:
    out = _dry_run("test", "EXTRA_TIERS=lint docs test-real-engine", "DISPOSABLE_VENVS=1", *SCRATCH_VENVS)
    steps = [
        'in-loopback-netns.sh /nonexistent/f/bin/python -m pytest -m "ray and not trainers"',
        "rm -rf /nonexistent/f; exit $status",
        "in-loopback-netns.sh /nonexistent/t/bin/python -m pytest -m trainers",
        "rm -rf /nonexistent/t; exit $status",
        "scripts/generate-docs.py --check",  # docs: the main venv's last user
        "rm -rf /nonexistent/v /nonexistent/t /nonexistent/f\n",
        "bash scripts/install-sglang-real-cpu.sh",
        '/nonexistent/r/bin/python -m pytest -m "real_engine or engine_contract"',
        "rm -rf /nonexistent/r; exit $status",
    ]
    _assert_in_order(out, steps)


@pytest.mark.parametrize("value", ["0", "no", "yes", ""])
def test_only_disposable_venvs_1_removes_anything(value: str) -> None:
    out = _dry_run(
        "test", "EXTRA_TIERS=lint docs test-real-engine", f"DISPOSABLE_VENVS={value}", *SCRATCH_VENVS
    )
    assert "rm -rf" not in out


FAILING_THEN_DISPOSED = """\
include {makefile}
try:
\t$(call run_then_dispose,sh -c "touch ran; exit 3",gone)
"""


@pytest.mark.parametrize("disposable", ["1", ""])
def test_a_disposed_venv_goes_even_when_its_tier_fails_and_the_tier_still_fails(
    tmp_path: Path, disposable: str
) -> None:
    """The Makefile's own macro: the command's exit status is the recipe's, whether or not the venv goes."""
    (tmp_path / "gone").mkdir()
    (tmp_path / "Makefile").write_text(FAILING_THEN_DISPOSED.format(makefile=REPO / "Makefile"))
    env = _env_outside_make()
    done = subprocess.run(
        ["make", "--no-print-directory", "try", f"DISPOSABLE_VENVS={disposable}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "Error 3" in done.stderr, done.stdout + done.stderr
    assert (tmp_path / "ran").exists()
    assert (tmp_path / "gone").exists() == (disposable == "")


#: A test that reports whether a child process starts with SIGINT ignored.
CHILD_SIGINT_TEST = """
import subprocess, sys

def test_child():
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    print("child ignores SIGINT:", child.stdout.strip())
"""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("with_conftest", [True, False])
def test_a_suite_started_with_sigint_ignored_gives_its_children_sigints_default(
    tmp_path: Path, with_conftest: bool
) -> None:
    """As a background job of a non-interactive shell starts it: the launchers the tests stop with SIGINT must
    not inherit SIG_IGN (the suite's conftest puts a handler in its place; without it, they do)."""
    (tmp_path / "test_child.py").write_text(CHILD_SIGINT_TEST)
    plugin = ["-p", "tests.conftest"] if with_conftest else []
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *plugin, "-q", "-s", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_ignore_sigint,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"child ignores SIGINT: {not with_conftest}" in done.stdout
