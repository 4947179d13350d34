"""A fuzzer of ``miles-sglang sweep-report`` over sweep directories (issue 23), the plan fuzzer's companion
(``tests/test_fuzz_overrides.py``): whatever a sweep directory holds, the command ends with status 0 or 2,
prints no traceback, does not hang and does not grow without bound, and every job it finds is a row.

The strategy writes 1 to 4 jobs (directories named by digits or by odd text: blanks, ``[``, ``$``, ``|``, non-ASCII,
some one level deeper), each with any of Hydra's ``.hydra/overrides.yaml`` and ``.hydra/hydra.yaml`` and the
job's ``metrics.json`` and ``job_status.json``, each file one of: a good document (a metrics document of the
benchmark's shape, a status, Hydra's list of overrides); a good document mutated (a key dropped or a value
replaced, anywhere in it); any JSON value (NaN, huge integers, deep lists and mappings); text that is not what
the file should be (truncated JSON, deep nesting such as 100,000 ``[``, a lone surrogate, YAML aliases, tags
PyYAML cannot construct, control characters, bytes that are not UTF-8); or a directory or a FIFO in place of the
file, or no file. Override values hold rich markup and matplotlib mathtext, pipes and newlines.

Bounds (also in the docs, docs/cli.md): in-process, through ``cli.main``, 150 directories (derandomized: the same on
every run; one in eight also plots), each must return 0 or 2 within 20 s (in a worker thread), no exception
may escape ``main`` and no output may contain ``Traceback``; with status 0 the CSV has a row for every job
directory; the test process's peak RSS may grow by at most 512 MiB over the whole run. Plus 4 directories in a
subprocess (``python -m miles_sglang_plugin sweep-report``), each within 60 s and a peak RSS under 1 GiB.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.cli import main
from tests.test_fuzz_overrides import _wait_with_usage

EXAMPLES = 150
TIMEOUT_S = 20.0
RSS_GROWTH_MIB = 512
SUBPROCESS_EXAMPLES = 4
SUBPROCESS_TIMEOUT_S = 60.0
SUBPROCESS_RSS_MIB = 1024

KEY = "sglang.actor.decode.num_gpus_per_engine"
#: Text that is no file's proper content: broken JSON and YAML, deep nesting, escapes of lone surrogates,
#: aliases, tags PyYAML does not construct, control characters.
ODD_TEXT = (
    "",
    "{",
    "[1,",
    "[" * 100_000,
    "[" * 65 + "]" * 65,
    "{" * 50_000,
    '"\\ud800"',
    '{"models": {"\\udfff": {}}}',
    "NaN",
    "- !!int abc\n",
    "- !!python/name:os.system\n",
    "- !!binary ???\n",
    "a: &a [x, x, x, x]\nb: &b [*a, *a, *a, *a]\nc: [*b, *b, *b, *b]\n",
    "- &a [*a]\n",
    "\x00\x01",
    "- a=1\n- [b]\n",
    "---\n- a\n---\n- b\n",
    "1e999999",
    "9" * 5000,
)
#: One of :data:`ODD_TEXT`, drawn by index (its 100,000 ``[`` stay out of hypothesis' reprs).
odd_text = st.integers(0, len(ODD_TEXT) - 1).map(ODD_TEXT.__getitem__)
BYTES = st.binary(max_size=24).filter(lambda b: not _is_utf8(b)) | st.just(b"\xff\xfe{")
#: Values of overrides: numbers, words, rich markup, mathtext, a pipe, a newline, the empty string.
OVERRIDE_VALUES = st.one_of(
    st.integers(-3, 64).map(str),
    st.sampled_from(
        ["[/x]", "[bold]b[/bold]", "$\\frac$", "$x$", "a|b", "a\nb", "", "nan", "1e309", "é", "null"]
    ),
    st.text(alphabet="ab19.,[]$|\\/=+~ é", max_size=10),
)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=16,
)


def _stats(seed: float) -> dict[str, float]:
    return {"p50": seed, "p90": seed * 1.5, "p99": seed * 2, "mean": seed * 1.1, "max": seed * 3}


@st.composite
def good_metrics(draw: st.DrawFn) -> dict[str, Any]:
    """A metrics document of the benchmark's shape (:func:`miles_sglang_plugin.sweeps.bench.metrics_document`)."""
    names = draw(
        st.lists(
            st.sampled_from(["actor", "ref", "[red]m", "$m$", "a|b"]), min_size=1, max_size=3, unique=True
        )
    )
    models, shapes = {}, {}
    for name in names:
        requests = draw(st.integers(0, 64))
        failed = draw(st.integers(0, requests))
        models[name] = {
            "requests": requests, "succeeded": requests - failed, "failed": failed,
            "errors": [{"kind": "HTTP 503", "count": failed, "sample": "HTTP 503: busy [/x]"}] if failed else [],
            "requests_per_s": draw(st.floats(0, 1e6)), "output_tokens_per_s": draw(st.floats(0, 1e7)),
            "ttft_s": _stats(draw(st.floats(0, 10))) if requests > failed else None,
            "latency_s": _stats(draw(st.floats(0, 10))) if requests > failed else None,
            "ttft_source": "engine", "latency_source": "client",
        }  # fmt: skip
        tp = draw(st.sampled_from([1, 2, 4, 8]))
        shapes[name] = {"gpus": 8, "engines": 8 // tp, "groups": {"regular": {"worker_type": "regular", "gpus": 8,
                                                                              "tp": tp, "engines": 8 // tp}}}  # fmt: skip
    simulated = draw(st.booleans())
    return {
        "format": 1,
        "simulated": simulated,
        "speed_model": {"decode_step_s": 0.02, "tp_comm_s": 0.001} if simulated else None,
        "deployment": {"total_gpus": 8 * len(names), "models": shapes},
        "models": models,
    }


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of ``value`` (lists by index)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    found = []
    for key, item in items:
        found.append((*prefix, key))
        found += _paths(item, (*prefix, key))
    return found


@st.composite
def mutated(draw: st.DrawFn, document: st.SearchStrategy[Any]) -> Any:
    """``document`` with one to three changes: a key (or item) dropped, or a value replaced by any JSON value."""
    value = copy.deepcopy(draw(document))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(value)
        if not paths:
            return value
        path = draw(st.sampled_from(paths))
        parent = value
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return value


def _json(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


metrics_files = st.one_of(
    good_metrics().map(_json),
    mutated(good_metrics()).map(_json),
    mutated(good_metrics()).map(_json),
    json_values.map(_json),
    odd_text,
    BYTES,
)
good_status = st.builds(
    lambda status, error: {"status": status, "error": error},
    st.sampled_from(["COMPLETED", "FAILED"]),
    st.none() | st.text(max_size=30) | st.just("DeploymentConfigError: [/x] $\\frac$ | a\nb"),
)
status_files = st.one_of(
    good_status.map(_json), mutated(good_status).map(_json), json_values.map(_json), odd_text
)
override_lists = st.lists(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from([KEY, "sglang", "seed", "+extra", "~gone", "a.b|c", "[k]"]),
              OVERRIDE_VALUES),
    max_size=4,
)  # fmt: skip
overrides_files = st.one_of(
    override_lists.map(yaml.safe_dump),
    override_lists.map(yaml.safe_dump),
    override_lists.map(yaml.safe_dump),
    json_values.map(lambda v: yaml.safe_dump(v) if not isinstance(v, float) else str(v)),
    odd_text,
    BYTES,
)
hydra_files = st.one_of(
    st.builds(lambda num: yaml.safe_dump({"hydra": {"job": {"num": num}}}), st.integers(-5, 10**30) | st.text(max_size=5)),
    odd_text,
)  # fmt: skip
#: Where a file's content goes: as content, or as a directory or a FIFO in its place (FIFOs only for the
#: report's own files), or no file.
KINDS = ("content",) * 6 + ("missing", "directory", "fifo")


def _file(content: st.SearchStrategy[Any], fifo: bool = True) -> st.SearchStrategy[tuple[str, Any]]:
    kinds = [k for k in KINDS if fifo or k != "fifo"]
    return st.tuples(st.sampled_from(kinds), content)


@dataclass
class JobSpec:
    name: str
    files: dict[str, tuple[str, Any]]


job_names = st.one_of(
    st.integers(0, 30).map(str),
    st.integers(0, 30).map(str),
    st.text(alphabet="ab0 [$|é-", min_size=1, max_size=6).filter(lambda n: n.strip(".") != ""),
    st.integers(0, 3).map(lambda i: f"group/{i}"),
)
jobs = st.builds(
    JobSpec,
    job_names,
    st.fixed_dictionaries(
        {
            # kept a regular file mostly: without it the directory is no job
            ".hydra/overrides.yaml": st.tuples(
                st.sampled_from(("content",) * 8 + ("directory",)), overrides_files
            ),
            ".hydra/hydra.yaml": _file(hydra_files, fifo=False),
            "metrics.json": _file(metrics_files),
            "job_status.json": _file(status_files),
        }
    ),
)
sweeps = st.lists(jobs, min_size=1, max_size=4, unique_by=lambda j: j.name)


def _write(sweep: Path, spec: JobSpec) -> None:
    job = sweep / spec.name
    for relative, (kind, content) in spec.files.items():
        path = job / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "directory":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "content":
            path.write_bytes(
                content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass")
            )


def _report_in_process(args: list[str]) -> tuple[int | None, str, BaseException | None]:
    out, result = io.StringIO(), {}

    def run() -> None:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                result["rc"] = main(["sweep-report", *args])
        except BaseException as exc:  # anything escaping main counts, SystemExit included
            result["exc"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    return result.get("rc"), out.getvalue(), result.get("exc")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _csv_jobs(sweep: Path) -> set[str]:
    with (sweep / "sweep_report.csv").open(encoding="utf-8") as f:
        return {row["job"] for row in csv.DictReader(f)}


class _Budget:
    baseline_mib: float | None = None


@pytest.mark.slow
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(specs=sweeps, plot=st.sampled_from([False] * 7 + [True]))
def test_sweep_report_never_crashes_hangs_or_grows(specs: list[JobSpec], plot: bool) -> None:
    if _Budget.baseline_mib is None:
        _Budget.baseline_mib = _peak_rss_mib()
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(tmp) / "sweep"
        sweep.mkdir()
        for spec in specs:
            _write(sweep, spec)
        rc, output, escaped = _report_in_process([str(sweep)] + ([] if plot else ["--no-plot"]))
        event(f"status {rc}")
        shown = [(s.name, {k: (kind, str(v)[:80]) for k, (kind, v) in s.files.items()}) for s in specs]
        assert escaped is None, f"{shown}: {type(escaped).__name__}: {escaped}"
        assert rc is not None, f"{shown}: no answer within {TIMEOUT_S} s"
        assert rc == 0, f"{shown}: status {rc}\n{output[-2000:]}"  # every spec is a job: always a report
        assert "Traceback" not in output, f"{shown}\n{output[-3000:]}"
        assert _csv_jobs(sweep) == {spec.name for spec in specs}, shown
    growth = _peak_rss_mib() - _Budget.baseline_mib
    assert growth < RSS_GROWTH_MIB, f"peak RSS grew by {growth:.0f} MiB"


def test_a_directory_without_jobs_is_status_2_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "metrics.json").write_text("[" * 100_000)
    rc, output, escaped = _report_in_process([str(tmp_path)])
    assert (rc, escaped) == (2, None) and "holds no Hydra jobs" in output and "Traceback" not in output


@pytest.mark.slow
@settings(max_examples=SUBPROCESS_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(specs=sweeps)
def test_sweep_report_never_crashes_hangs_or_grows_in_a_subprocess(
    specs: list[JobSpec], tmp_path_factory
) -> None:
    base = tmp_path_factory.mktemp("fuzz-report")
    sweep = base / "sweep"
    sweep.mkdir()
    for spec in specs:
        _write(sweep, spec)
    with open(base / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "miles_sglang_plugin", "sweep-report", str(sweep)],
            cwd=base, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    waited = _wait_with_usage(proc, SUBPROCESS_TIMEOUT_S)
    assert waited is not None, f"no answer within {SUBPROCESS_TIMEOUT_S} s"
    rc, usage = waited
    stderr = (base / "stderr.txt").read_text()
    assert rc == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert usage.ru_maxrss / 1024 < SUBPROCESS_RSS_MIB, f"peak RSS {usage.ru_maxrss / 1024:.0f} MiB"
