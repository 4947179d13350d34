"""The sweep report: every job of a Hydra sweep directory, its parameters, plan and rollout metrics, as a table
(``sweep_report.md``, ``sweep_report.csv``, printed with rich) and a plot (``sweep_report.png``: output
tokens/s and p99 latency against the swept parameter, one line per model and combination of the other swept
parameters). Failed jobs are rows with their error, never dropped.

A job is a directory under the sweep directory with Hydra's ``.hydra/overrides.yaml``; beside it the job may
have ``metrics.json`` and ``plan.json`` (:mod:`.bench`) and ``job_status.json`` (written at job end by the
``sglang_sweep_report`` callback or by the packed launcher: status and error).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from miles_sglang_plugin.masking import mask_overrides
from miles_sglang_plugin.printable import escape_controls
from miles_sglang_plugin.sweeps.bench import METRICS_FILE
from miles_sglang_plugin.sweeps.job_files import (
    MAX_ERROR_CHARS,
    MAX_METRICS_BYTES,
    MAX_STATUS_BYTES,
    JobFileError,
    load_json,
    load_yaml,
    metrics_problems,
    one_line,
    overrides_problem,
    printable,
    status_problems,
)

STATUS_FILE = "job_status.json"
OVERRIDES_FILE = ".hydra/overrides.yaml"
REPORT_MD, REPORT_CSV, REPORT_PNG = "sweep_report.md", "sweep_report.csv", "sweep_report.png"
#: Reading is bounded: jobs per sweep, directory depth of a job below the sweep directory; each file's size and
#: nesting in :mod:`.job_files`.
MAX_JOBS, MAX_DEPTH = 10_000, 4


class SweepReportError(ValueError):
    """The directory is not a sweep directory that can be reported on."""


@dataclass
class JobResult:
    #: The job's directory relative to the sweep directory (Hydra's subdir: the job number by default).
    name: str
    num: int | None
    overrides: list[str]
    status: str  # "ok", "failed", "unknown"
    error: str | None = None
    metrics: dict[str, Any] | None = None
    params: dict[str, str] = field(default_factory=dict)
    #: What the report could not use of the job without failing it (its overrides: no sweep parameters).
    notes: list[str] = field(default_factory=list)

    @property
    def sort_key(self) -> tuple[int, str]:
        return (self.num if self.num is not None else 1 << 30, self.name)


def _read_metrics(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """The job's metrics when they are there and what the report reads; else None, with the problem."""
    try:
        document = load_json(path, MAX_METRICS_BYTES)
    except JobFileError as exc:
        problems.append(f"{METRICS_FILE} {exc}")
        return None
    found = metrics_problems(document) if document is not None else []
    problems += [f"{METRICS_FILE}: {one_line(found)}"] if found else []
    return document if document is not None and not found else None


def _read_status(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """The job's recorded status and error, None where there is none or it is malformed (then a problem)."""
    try:
        document = load_json(path, MAX_STATUS_BYTES)
    except JobFileError as exc:
        problems.append(f"{STATUS_FILE} {exc}")
        return None
    found = status_problems(document) if document is not None else []
    problems += [f"{STATUS_FILE}: {one_line(found)}"] if found else []
    return document if document is not None and not found else None


def _read_overrides(path: Path, notes: list[str]) -> list[str]:
    """The job's overrides (secrets masked); none, with a note, where the file is not Hydra's list."""
    try:
        data = load_yaml(path)
        problem = overrides_problem(data)
    except JobFileError as exc:
        problem = str(exc)
    if problem is not None:
        notes.append(f"{OVERRIDES_FILE} {problem}: its sweep parameters are unknown")
        return []
    return mask_overrides(data)


def parse_override(override: str) -> tuple[str, str]:
    """``key=value`` (``+key=``, ``++key=``, ``~key`` too) -> (key, value)."""
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def _job_num(job_dir: Path) -> int | None:
    try:
        data = load_yaml(job_dir / ".hydra" / "hydra.yaml")
    except JobFileError:
        data = None
    job = ((data.get("hydra") or {}).get("job") or {}) if isinstance(data, dict) else {}
    num = job.get("num") if isinstance(job, dict) else None
    if isinstance(num, int) and not isinstance(num, bool):
        return num
    return int(job_dir.name) if job_dir.name.isdigit() and len(job_dir.name) < 10 else None


def _status(
    recorded: dict[str, Any] | None, metrics: dict[str, Any] | None, problems: list[str]
) -> tuple[str, str | None]:
    if recorded is not None and recorded.get("status") == "FAILED":
        error = recorded.get("error") or "failed (no message)"
        return "failed", one_line([error])
    if problems:  # a malformed file: the job cannot be reported as it ran
        return "failed", one_line(problems)
    if metrics is not None:
        return "ok", None
    if recorded is not None:
        return (
            "unknown",
            f"no {METRICS_FILE}: the job ended without running the rollout benchmark (sglang_bench)",
        )
    return "unknown", f"no {METRICS_FILE} and no {STATUS_FILE}: the job did not finish"


def load_job(sweep_dir: Path, job_dir: Path) -> JobResult:
    """One job's row data; a job whose files are malformed is failed, with what is wrong with them."""
    problems: list[str] = []
    notes: list[str] = []
    metrics = _read_metrics(job_dir / METRICS_FILE, problems)
    recorded = _read_status(job_dir / STATUS_FILE, problems)
    status, error = _status(recorded, metrics, problems)
    overrides = _read_overrides(job_dir / OVERRIDES_FILE, notes)
    return JobResult(
        name=printable(str(job_dir.relative_to(sweep_dir))),
        num=_job_num(job_dir),
        overrides=overrides,
        status=status,
        error=error,
        metrics=metrics,
        params=dict(parse_override(o) for o in overrides),
        notes=notes,
    )


def collect_sweep(sweep_dir: Path) -> list[JobResult]:
    """Every job of ``sweep_dir``, in job-number order."""
    if not sweep_dir.is_dir():
        raise SweepReportError(f"{sweep_dir} is not a directory")
    job_dirs = []
    for depth in range(1, MAX_DEPTH + 1):
        pattern = "/".join(["*"] * depth) + "/.hydra/overrides.yaml"
        job_dirs += [p.parent.parent for p in sweep_dir.glob(pattern)]
        if len(job_dirs) > MAX_JOBS:
            raise SweepReportError(f"{sweep_dir} holds more than {MAX_JOBS} jobs")
    if not job_dirs:
        raise SweepReportError(
            f"{sweep_dir} holds no Hydra jobs (no */.hydra/overrides.yaml): is it a multirun's sweep directory?"
        )
    return sorted((load_job(sweep_dir, d) for d in job_dirs), key=lambda j: j.sort_key)


def swept_keys(jobs: Sequence[JobResult]) -> list[str]:
    """Override keys whose values differ between jobs (or that only some jobs set), in first-seen order."""
    values: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for job in jobs:
        for key, value in job.params.items():
            values.setdefault(key, set()).add(value)
            counts[key] = counts.get(key, 0) + 1
    return [k for k in values if len(values[k]) > 1 or counts[k] < len(jobs)]


def _number(value: str | None) -> float | None:
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def x_key(jobs: Sequence[JobResult], keys: Sequence[str]) -> str | None:
    """The swept parameter the plot puts on its x axis: the first numeric one, else the first one."""
    for key in keys:
        if all(_number(job.params.get(key)) is not None for job in jobs):
            return key
    return keys[0] if keys else None


@dataclass(frozen=True)
class Row:
    job: JobResult
    model: str | None
    values: dict[str, Any]


def _groups_text(shape: dict[str, Any] | None) -> str:
    if not shape:
        return ""
    parts = [
        f"{name} {g['engines']}x TP{g['tp']}" for name, g in shape.get("groups", {}).items() if g["engines"]
    ]
    return ", ".join(parts)


def _stat(stats: dict[str, float] | None, key: str) -> float | None:
    return None if not stats else stats.get(key)


def _errors_text(errors: Sequence[dict[str, Any]]) -> str | None:
    text = "; ".join(f"{e['count']}x {e['sample']}" for e in errors[:20])
    return (text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…") or None


def _model_values(metrics: dict[str, Any], model: str) -> dict[str, Any]:
    m = metrics["models"][model]
    shape = (metrics.get("deployment") or {}).get("models", {}).get(model)
    return {
        "gpus": shape["gpus"] if shape else None,
        "engines": shape["engines"] if shape else None,
        "groups": _groups_text(shape),
        "requests": m["requests"],
        "succeeded": m["succeeded"],
        "failed": m["failed"],
        "requests_per_s": m["requests_per_s"],
        "output_tokens_per_s": m["output_tokens_per_s"],
        "ttft_p50_s": _stat(m.get("ttft_s"), "p50"),
        "ttft_p99_s": _stat(m.get("ttft_s"), "p99"),
        "latency_p50_s": _stat(m.get("latency_s"), "p50"),
        "latency_p99_s": _stat(m.get("latency_s"), "p99"),
        "ttft_source": m.get("ttft_source"),
        "latency_source": m.get("latency_source"),
        "error": _errors_text(m.get("errors") or []),
    }


def report_rows(jobs: Sequence[JobResult]) -> list[Row]:
    """One row per job and benchmarked model; one row (no model) for a job without metrics."""
    rows = []
    for job in jobs:
        models = list((job.metrics or {}).get("models", {})) if job.status == "ok" else []
        if not models:
            error = job.error if job.status != "ok" else "no model was benchmarked"  # an empty "models"
            rows.append(Row(job, None, {"error": error}))
        rows += [Row(job, model, _model_values(job.metrics or {}, model)) for model in models]
    return rows


def simulated(jobs: Sequence[JobResult]) -> bool:
    return any((job.metrics or {}).get("simulated") for job in jobs)


def speed_model(jobs: Sequence[JobResult]) -> dict[str, Any] | None:
    return next(
        ((j.metrics or {}).get("speed_model") for j in jobs if (j.metrics or {}).get("speed_model")), None
    )


#: (column title, row value key, format) of the table; the swept parameters come after "job".
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("model", "model", "s"),
    ("status", "status", "s"),
    ("GPUs", "gpus", "d"),
    ("engines", "groups", "s"),
    ("req/s", "requests_per_s", ".2f"),
    ("out tok/s", "output_tokens_per_s", ".1f"),
    ("TTFT p50 s", "ttft_p50_s", ".4f"),
    ("TTFT p99 s", "ttft_p99_s", ".4f"),
    ("lat p50 s", "latency_p50_s", ".4f"),
    ("lat p99 s", "latency_p99_s", ".4f"),
    ("errors", "errors", "s"),
)
CSV_FIELDS = (
    "model", "status", "gpus", "engines", "groups", "requests", "succeeded", "failed", "requests_per_s",
    "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "latency_p50_s", "latency_p99_s", "ttft_source",
    "latency_source", "simulated", "error",
)  # fmt: skip


def _cell(row: Row, key: str) -> Any:
    if key == "model":
        return row.model
    if key == "status":
        return row.job.status
    if key == "errors":
        if row.job.status != "ok" or row.model is None:
            return row.values.get("error")
        return f"{row.values['failed']}/{row.values['requests']}" + (
            f": {row.values['error']}" if row.values.get("error") else ""
        )
    if key == "simulated":
        return bool((row.job.metrics or {}).get("simulated"))
    return row.values.get(key)


def _text(value: Any, fmt: str) -> str:
    if value is None or value == "":
        return "-"
    if fmt != "s" and isinstance(value, int | float):
        return format(value, fmt)
    return str(value)


def table_lines(rows: Sequence[Row], keys: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the report's table (job, swept parameters, then :data:`COLUMNS`)."""
    header = ["job", *keys, *(title for title, _, _ in COLUMNS)]
    cells = []
    for row in rows:
        params = [row.job.params.get(k, "-") for k in keys]
        cells.append([row.job.name, *params, *(_text(_cell(row, key), fmt) for _, key, fmt in COLUMNS)])
    return header, cells


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def markdown(
    sweep_dir: Path, jobs: Sequence[JobResult], rows: Sequence[Row], keys: Sequence[str], png: Path | None
) -> str:
    header, cells = table_lines(rows, keys)
    failed = sum(job.status != "ok" for job in jobs)
    lines = [f"# Sweep report: {printable(sweep_dir.name)}", ""]
    lines.append(f"{len(jobs)} jobs, {failed} without metrics; swept: {', '.join(keys) or '(nothing)'}.")
    if simulated(jobs):
        lines += ["", f"> **Simulated numbers**: stand-in engines; {_speed_text(jobs)}."]
    lines += ["", "| " + " | ".join(_md_escape(c) for c in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in cells]
    notes = note_lines(jobs)
    if notes:
        lines += ["", *(f"- {_md_escape(note)}" for note in notes)]
    if png is not None:
        lines += ["", f"![throughput and p99 latency]({png.name})"]
    return "\n".join(lines) + "\n"


def note_lines(jobs: Sequence[JobResult]) -> list[str]:
    """What the report could not use of each job's files without failing the job."""
    return [f"job {job.name}: {note}" for job in jobs for note in job.notes]


def _speed_text(jobs: Sequence[JobResult]) -> str:
    speed = speed_model(jobs)
    if speed is None:
        return "their speed model was off, so times are the stand-ins' HTTP overhead only"
    return (
        "their speed follows the stand-in's model of each plan ("
        + ", ".join(f"{k}={v:g}" for k, v in speed.items())
        + ")"
    )


def write_csv(path: Path, rows: Sequence[Row], keys: Sequence[str]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["job", *keys, *CSV_FIELDS])
        for row in rows:
            values = [
                _cell(row, k) if k in ("model", "status", "simulated") else row.values.get(k)
                for k in CSV_FIELDS
            ]
            writer.writerow([row.job.name, *(row.job.params.get(k, "") for k in keys), *values])


def print_table(rows: Sequence[Row], keys: Sequence[str], console: Console, title: str) -> None:
    header, cells = table_lines(rows, keys)  # as Text: a value is never read as rich markup
    table = Table(title=Text(escape_controls(title)), title_justify="left")
    for name in header:
        table.add_column(Text(escape_controls(name)), overflow="fold")
    for row_cells, row in zip(cells, rows, strict=True):
        style = None if row.job.status == "ok" else "red"
        table.add_row(*(Text(escape_controls(cell)) for cell in row_cells), style=style)
    console.print(table)


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    csv: Path
    png: Path | None
    #: Why there is no plot, when there is none.
    no_plot: str | None = None


def build_report(sweep_dir: Path, *, console: Console | None = None, plot: bool = True) -> ReportFiles:
    """Collect the jobs of ``sweep_dir`` and write the report's files there (the plot needs matplotlib: the
    ``report`` extra)."""
    from miles_sglang_plugin.sweeps.report_plot import PlotUnavailable, plot_sweep

    jobs = collect_sweep(sweep_dir)
    keys = swept_keys(jobs)
    rows = report_rows(jobs)
    png, no_plot = None, None
    md = sweep_dir / REPORT_MD
    try:
        if plot:
            try:
                png = plot_sweep(sweep_dir / REPORT_PNG, printable(sweep_dir.name), jobs, keys)
            except PlotUnavailable as exc:
                no_plot = str(exc)
        md.write_text(markdown(sweep_dir, jobs, rows, keys, png), encoding="utf-8")
        write_csv(sweep_dir / REPORT_CSV, rows, keys)
    except OSError as exc:
        raise SweepReportError(f"cannot write the report in {printable(str(sweep_dir))}: {exc}") from None
    if console is not None:
        title = f"sweep {sweep_dir}" + (" — simulated (stand-in engines)" if simulated(jobs) else "")
        print_table(rows, keys, console, printable(title))
        for note in note_lines(jobs):
            console.print(f"note: {note}", markup=False)
        where = f"report: {md}, {sweep_dir / REPORT_CSV}" + (f", {png}" if png else "")
        console.print(printable(where), markup=False)
        if no_plot:
            console.print(f"no plot: {no_plot}", markup=False)
    return ReportFiles(md, sweep_dir / REPORT_CSV, png, no_plot)
