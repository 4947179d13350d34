"""The sweep report's plot: output tokens/s and p99 latency against the swept parameter, one line per model
(and per combination of the other swept parameters). Needs matplotlib (the ``report`` extra), imported here
only, with its Agg backend (no display, no pyplot state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_sglang_plugin.sweeps.report import JobResult, _number, simulated, x_key

#: More lines than this get no legend (it would crowd the axes out).
MAX_LEGEND = 12


class PlotUnavailable(RuntimeError):
    pass


def plain(text: str) -> str:
    """``text`` as matplotlib shows it literally (a ``$`` would start mathtext, which can fail to parse)."""
    return text.replace("$", r"\$")


def _series(
    jobs: Sequence[JobResult], x: str | None, others: Sequence[str]
) -> dict[str, list[tuple[Any, Any]]]:
    """line label -> [(x, job metrics of that model)] for the jobs with metrics; x a number where every job's
    is one, else text (matplotlib cannot put numbers and text on one axis)."""
    reported = [job for job in jobs if job.status == "ok" and job.metrics]
    x_values = [
        (job.params.get(x) or "-") if x else str(job.num if job.num is not None else job.name)
        for job in reported
    ]
    numbers = [_number(value) for value in x_values]
    numeric = all(number is not None for number in numbers)
    lines: dict[str, list[tuple[Any, Any]]] = {}
    for job, x_value, number in zip(reported, x_values, numbers, strict=True):
        rest = ", ".join(f"{k.rsplit('.', 1)[-1]}={job.params.get(k, '-')}" for k in others)
        for model, metrics in (job.metrics or {}).get("models", {}).items():
            label = plain(model + (f" ({rest})" if rest else ""))
            lines.setdefault(label, []).append((number if numeric else plain(x_value), metrics))
    return lines


def _failed_note(jobs: Sequence[JobResult], x: str | None) -> str:
    failed = [j for j in jobs if j.status != "ok"]
    if not failed:
        return ""
    parts = [
        f"job {j.name}" + (f" ({x.rsplit('.', 1)[-1]}={j.params.get(x, '-')})" if x else "")
        for j in failed[:20]
    ]
    more = f" and {len(failed) - 20} more" if len(failed) > 20 else ""
    return plain("no metrics: " + ", ".join(parts) + more)


def plot_sweep(path: Path, title: str, jobs: Sequence[JobResult], keys: Sequence[str]) -> Path:
    """Write the plot to ``path`` (PNG)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(
            "matplotlib is not installed (pip install 'miles_sglang_plugin[report]')"
        ) from None
    x = x_key(jobs, keys)
    lines = _series(jobs, x, [k for k in keys if k != x])
    figure = Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
    throughput, latency = figure.subplots(1, 2)
    for label, points in sorted(lines.items()):
        points = (
            sorted(points, key=lambda p: p[0]) if all(isinstance(p[0], float) for p in points) else points
        )
        xs = [p[0] for p in points]
        throughput.plot(xs, [m["output_tokens_per_s"] for _, m in points], marker="o", label=label)
        p99 = [(m.get("latency_s") or {}).get("p99") for _, m in points]
        latency.plot(xs, [v if v is not None else float("nan") for v in p99], marker="o", label=label)
    x_label = plain(x or "job")
    throughput.set(xlabel=x_label, ylabel="output tokens/s", title="throughput")
    latency.set(xlabel=x_label, ylabel="p99 latency (s)", title="p99 request latency")
    ticks = sorted({p[0] for points in lines.values() for p in points if isinstance(p[0], float)})
    for axes in (throughput, latency):
        axes.grid(True, alpha=0.3)
        axes.set_ylim(bottom=0)
        if ticks and len(ticks) <= 12:
            axes.set_xticks(ticks, [f"{t:g}" for t in ticks])
        if 0 < len(lines) <= MAX_LEGEND:
            axes.legend(fontsize="small")
    suffix = " — simulated: stand-in engines (speed model)" if simulated(jobs) else ""
    figure.suptitle(plain(f"sweep {title}{suffix}"), fontsize="medium")
    note = _failed_note(jobs, x)
    if note:
        figure.supxlabel(note, fontsize="small", color="darkred")
    figure.savefig(path, format="png")
    return path
