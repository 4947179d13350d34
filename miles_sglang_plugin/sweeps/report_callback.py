"""``hydra/callbacks=sglang_sweep_report``: the sweep report at multirun end, failed jobs included.

At each job's end it records the job's status and error (``job_status.json`` in the job's output directory);
at multirun end it writes the report into the sweep directory and prints it. When a job failed, Hydra's
sweeper raises before the multirun-end event; the report is then written when the process exits (after
Hydra printed the error), so a sweep with failed jobs still leaves its report.
"""

from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from rich.console import Console


def error_text(exc: BaseException) -> str:
    """One line: the exception's type and message, lines joined (a config error lists its problems; it is named
    as such, whichever subclass carried it: a sweep job's is a compact Hydra error too)."""
    from miles_sglang_plugin.errors import DeploymentConfigError

    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    name = DeploymentConfigError.__name__ if isinstance(exc, DeploymentConfigError) else type(exc).__name__
    return f"{name}: {'; '.join(lines) or '(no message)'}"[:1000]


def write_job_status(output_dir: Path, status: str, error: str | None) -> None:
    from miles_sglang_plugin.sweeps.report import STATUS_FILE

    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / STATUS_FILE).write_text(json.dumps({"status": status, "error": error}, indent=2) + "\n")


def report_console() -> Console:
    """Wide enough off a terminal (a log, a pipe) that the table is not folded."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 220)


class SweepReportCallback(Callback):
    def __init__(self) -> None:
        self._sweep_dir: Path | None = None
        self._reported = False

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._sweep_dir = Path(str(config.hydra.sweep.dir))
        atexit.register(self._report_at_exit)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobStatus

        if not HydraConfig.initialized():
            return
        failed = job_return.status == JobStatus.FAILED
        error = error_text(job_return._return_value) if failed else None
        write_job_status(
            Path(HydraConfig.get().runtime.output_dir), "FAILED" if failed else "COMPLETED", error
        )

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._report()

    def _report_at_exit(self) -> None:
        if not self._reported:
            self._report(note="the sweep ended with failed jobs; the report of what it left:")

    def _report(self, note: str | None = None) -> None:
        from miles_sglang_plugin.sweeps.report import SweepReportError, build_report

        self._reported = True
        if self._sweep_dir is None:
            return
        console = report_console()
        if note:
            console.print(note, markup=False)
        try:
            build_report(self._sweep_dir, console=console)
        except SweepReportError as exc:
            console.print(f"no sweep report: {exc}", markup=False)
