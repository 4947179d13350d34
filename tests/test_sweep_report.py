"""The rollout benchmark's arithmetic and settings, and the sweep report built from a sweep directory written
by hand (values worked out here, not taken from the code): rows, columns, failed jobs, CSV, Markdown, plot,
and the ``miles-sglang sweep-report`` command."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from miles_sglang_plugin.cli import main as cli_main
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.sweeps.bench import (
    BenchSettings,
    RequestRecord,
    percentile,
    prompt_ids,
    summarize_model,
)
from miles_sglang_plugin.sweeps.jobs import bench_settings_from_config
from miles_sglang_plugin.sweeps.report import (
    SweepReportError,
    build_report,
    collect_sweep,
    swept_keys,
    x_key,
)

# --------------------------------------------------------------------------------------------------------
# The benchmark's numbers


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)  # rank 2.97: 3 + 0.97
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)  # rank 3.6
    assert percentile([7.0], 99) == 7.0


def test_a_models_summary_takes_the_engines_times_where_reported_else_the_clients() -> None:
    records = [
        RequestRecord(
            ok=True,
            client_latency=1.0,
            client_ttft=0.3,
            engine={"ttft": 0.1, "latency": 0.9},
            output_tokens=10,
        ),
        RequestRecord(
            ok=True, client_latency=2.0, client_ttft=0.4, engine={"latency": 1.9}, output_tokens=10
        ),
        RequestRecord(ok=False, error="HTTP 503: busy", client_latency=0.1),
        RequestRecord(ok=False, error="ReadTimeout: timed out", client_latency=5.0),
    ]
    summary = summarize_model(records, wall_s=4.0)
    assert (summary["requests"], summary["succeeded"], summary["failed"]) == (4, 2, 2)
    assert summary["requests_per_s"] == 0.5 and summary["output_tokens_per_s"] == 5.0  # 20 tokens / 4 s
    assert summary["ttft_s"]["p50"] == pytest.approx(0.25)  # engine 0.1, client 0.4
    assert summary["ttft_source"] == "client+engine"
    assert summary["latency_s"]["p50"] == pytest.approx(1.4) and summary["latency_source"] == "engine"
    assert summary["client_latency_s"]["max"] == 2.0  # successful requests only
    assert {(e["kind"], e["count"]) for e in summary["errors"]} == {("HTTP 503", 1), ("ReadTimeout", 1)}


def test_prompts_have_exactly_the_input_length_and_are_seeded() -> None:
    settings = BenchSettings(num_prompts=3, input_len=5, seed=7)
    prompts = prompt_ids(settings)
    assert [len(p) for p in prompts] == [5, 5, 5] and prompts == prompt_ids(settings)
    assert all(1000 <= t < 20000 for p in prompts for t in p) and len({tuple(p) for p in prompts}) == 3


def test_bad_bench_settings_are_all_reported_at_once() -> None:
    with pytest.raises(DeploymentConfigError) as info:
        BenchSettings.from_mapping(
            {"num_prompts": 0, "concurrency": 5000, "output_len": "x", "timeout_s": -1}
        )
    message = str(info.value)
    assert "4 problems" in message
    assert "sglang_bench.num_prompts: 0 must be an integer in 1..100000" in message
    assert "sglang_bench.concurrency: 5000 must be an integer in 1..4096" in message
    assert "sglang_bench.output_len: 'x' must be an integer" in message
    assert "sglang_bench.timeout_s: -1 must be a number of seconds > 0" in message
    with pytest.raises(DeploymentConfigError, match=r"sglang_bench\.num_promts: is not a setting"):
        BenchSettings.from_mapping({"num_promts": 8})


def test_a_bench_key_that_is_not_a_string_is_an_unknown_setting_next_to_the_others() -> None:
    # An integer key of the node (YAML ``1: x``) besides a misspelt one: both reported, not a failed sort.
    cfg = OmegaConf.create({"sglang_bench": {1: "x", "num_promts": 8}})
    with pytest.raises(DeploymentConfigError) as info:
        bench_settings_from_config(cfg)
    message = str(info.value)
    assert "sglang_bench.1: is not a setting of the benchmark" in message
    assert "sglang_bench.num_promts: is not a setting of the benchmark" in message


# --------------------------------------------------------------------------------------------------------
# A sweep directory written by hand


def _model_metrics(rps: float, tps: float, p99: float, errors: int = 0) -> dict[str, Any]:
    return {
        "requests": 32,
        "succeeded": 32 - errors,
        "failed": errors,
        "errors": [{"kind": "HTTP 503", "count": errors, "sample": "HTTP 503: busy"}] if errors else [],
        "requests_per_s": rps,
        "output_tokens_per_s": tps,
        "ttft_s": {"p50": 0.01, "p90": 0.02, "p99": 0.03, "mean": 0.015, "max": 0.04},
        "latency_s": {"p50": p99 / 2, "p90": p99 * 0.9, "p99": p99, "mean": p99 / 2, "max": p99},
        "ttft_source": "engine",
        "latency_source": "engine",
    }


def _job(
    sweep: Path, num: int, overrides: list[str], metrics: dict[str, Any] | None, status: dict | None
) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"num": num}}}))
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))
    if status is not None:
        (job / "job_status.json").write_text(json.dumps(status))


def _metrics(tp: int, actor: dict[str, Any]) -> dict[str, Any]:
    shape = {
        "actor": {"gpus": 16, "engines": 2 + 8 // tp, "groups": {
            "prefill": {"worker_type": "prefill", "gpus": 8, "tp": 4, "engines": 2},
            "decode": {"worker_type": "decode", "gpus": 8, "tp": tp, "engines": 8 // tp}}},
        "ref": {"gpus": 4, "engines": 2, "groups": {"regular": {"worker_type": "regular", "gpus": 4, "tp": 2, "engines": 2}}},
    }  # fmt: skip
    return {
        "simulated": True,
        "speed_model": {"decode_step_s": 0.02},
        "deployment": {"total_gpus": 20, "models": shape},
        "models": {"actor": actor, "ref": _model_metrics(30.0, 480.0, 0.2)},
    }


KEY = "sglang.actor.decode.num_gpus_per_engine"


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "multirun" / "sweep"
    common = ["sglang=pd_actor_ref", "sglang_deploy=simulated"]
    _job(
        sweep,
        0,
        [*common, f"{KEY}=2"],
        _metrics(2, _model_metrics(31.5, 504.0, 0.25)),
        {"status": "COMPLETED"},
    )
    _job(
        sweep,
        1,
        [*common, f"{KEY}=3"],
        None,
        {"status": "FAILED", "error": "DeploymentConfigError: 8 GPUs do not split"},
    )
    _job(sweep, 2, [*common, f"{KEY}=4"], _metrics(4, _model_metrics(44.0, 704.0, 0.17, errors=2)), None)
    _job(sweep, 10, [*common, f"{KEY}=8"], None, None)  # never finished
    return sweep


def test_jobs_are_collected_in_job_order_with_their_status(sweep: Path) -> None:
    jobs = collect_sweep(sweep)
    assert [(j.name, j.status) for j in jobs] == [
        ("0", "ok"),
        ("1", "failed"),
        ("2", "ok"),
        ("10", "unknown"),
    ]
    assert jobs[1].error == "DeploymentConfigError: 8 GPUs do not split"
    assert "did not finish" in (jobs[3].error or "")
    assert swept_keys(jobs) == [KEY] and x_key(jobs, [KEY]) == KEY


def test_the_report_has_a_row_per_job_and_model_and_keeps_failed_jobs(sweep: Path) -> None:
    files = build_report(sweep)
    with files.csv.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r[KEY], r["model"], r["status"]) for r in rows] == [
        ("0", "2", "actor", "ok"),
        ("0", "2", "ref", "ok"),
        ("1", "3", "", "failed"),
        ("2", "4", "actor", "ok"),
        ("2", "4", "ref", "ok"),
        ("10", "8", "", "unknown"),
    ]
    first = rows[0]
    assert float(first["output_tokens_per_s"]) == 504.0 and float(first["latency_p99_s"]) == 0.25
    assert first["groups"] == "prefill 2x TP4, decode 4x TP2" and first["engines"] == "6"
    assert rows[3]["groups"] == "prefill 2x TP4, decode 2x TP4" and rows[3]["failed"] == "2"
    assert rows[2]["error"] == "DeploymentConfigError: 8 GPUs do not split"
    md = files.markdown.read_text()
    assert "**Simulated numbers**" in md and "decode_step_s=0.02" in md
    assert "| 1 | 3 | - | failed |" in md and "DeploymentConfigError: 8 GPUs do not split" in md
    assert "| 2 | 4 | actor | ok | 16 | prefill 2x TP4, decode 2x TP4 | 44.00 | 704.0 |" in md
    assert "2/32: 2x HTTP 503: busy" in md and "![throughput and p99 latency](sweep_report.png)" in md


def test_a_completed_job_that_benchmarked_no_model_is_a_row_saying_so(sweep: Path) -> None:
    # Found by the fuzzer: metrics whose "models" is empty (nothing was benchmarked) ended in a KeyError.
    _job(
        sweep,
        11,
        ["sglang=pd_actor_ref", "sglang_deploy=simulated", f"{KEY}=1"],
        {"simulated": False, "models": {}},
        {"status": "COMPLETED"},
    )
    files = build_report(sweep)
    with files.csv.open() as f:
        (row,) = [r for r in csv.DictReader(f) if r["job"] == "11"]
    assert (row["model"], row["status"], row["error"]) == ("", "ok", "no model was benchmarked")
    assert (
        "| 11 | 1 | - | ok | - | - | - | - | - | - | - | - | no model was benchmarked |"
        in files.markdown.read_text()
    )


def test_the_plot_is_a_png(sweep: Path) -> None:
    import matplotlib.image

    files = build_report(sweep)
    assert files.png is not None
    image = matplotlib.image.imread(files.png)
    assert image.shape[0] == 420 and image.shape[1] == 1100  # 11 x 4.2 inches at 100 dpi


def test_the_command_rebuilds_the_report(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sweep-report", str(sweep), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "504.0" in out and "failed" in out and (sweep / "sweep_report.csv").exists()
    assert not (sweep / "sweep_report.png").exists()


def test_a_directory_without_jobs_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SweepReportError, match="holds no Hydra jobs"):
        collect_sweep(tmp_path)
    assert cli_main(["sweep-report", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_job_whose_hydra_files_are_not_yaml_is_still_a_row(
    sweep: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("- a: [unclosed\n")
    (sweep / "2" / ".hydra" / "hydra.yaml").write_bytes(b"\xff\xfe: {")
    assert cli_main(["sweep-report", str(sweep), "--no-plot"]) == 0
    with (sweep / "sweep_report.csv").open() as f:
        rows = list(csv.DictReader(f))
    # job 2 keeps its place (by its directory's name) and its metrics, without its sweep parameters
    assert [(r["job"], r["model"], r["status"]) for r in rows][3:5] == [
        ("2", "actor", "ok"),
        ("2", "ref", "ok"),
    ]
    assert rows[3][KEY] == "" and "Traceback" not in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------
# Malformed job files (issue 23): a failed row with its reason, never a traceback; reading bounded

GOOD = _model_metrics(31.5, 504.0, 0.25)
MALFORMED_METRICS: list[tuple[str | bytes, str]] = [
    (
        '{"models": {"actor": {}}}',  # KeyError: 'requests' before
        "metrics.json: models.actor: missing requests, succeeded, failed, requests_per_s, output_tokens_per_s",
    ),
    ("[1, 2]", "metrics.json: must be a JSON object (a mapping), got [1, 2]"),
    ('{"models": ["actor"]}', "metrics.json: models: must be a mapping, got ['actor']"),  # TypeError before
    ("[" * 100_000, "metrics.json is nested deeper than 64 levels, the most the report reads"),  # RecursionError
    ("[" * 65 + "]" * 65, "metrics.json is nested deeper than 64 levels, the most the report reads"),
    ("[" * 64 + "]" * 64, "metrics.json: must be a JSON object (a mapping), got [[[...]]]"),  # 64: read
    ("{}", "metrics.json: models: missing (each benchmarked model's numbers)"),
    ('{"models": {"actor": 5}}', "metrics.json: models.actor: must be a mapping, got 5"),
    (
        json.dumps({"models": {"actor": {**GOOD, "requests": "32", "requests_per_s": float("nan")}}}),
        "metrics.json: models.actor.requests: must be an integer >= 0, got '32'; models.actor.requests_per_s: "
        "must be a finite number >= 0, got nan",
    ),
    (
        json.dumps({"models": {"actor": {**GOOD, "errors": [{"count": 1}], "latency_s": [0.1]}}}),
        "metrics.json: models.actor.latency_s: must be a mapping or null, got [0.1]; models.actor.errors[0]: "
        "missing sample",
    ),
    (
        json.dumps({"models": {"actor": GOOD}, "deployment": {"models": {"actor": {"gpus": 4, "groups": {"g": {}}}}}}),
        "metrics.json: deployment.models.actor: missing engines; deployment.models.actor.groups.g: missing "
        "engines, tp",
    ),
    (
        json.dumps({"models": {"actor": GOOD}, "simulated": "no", "speed_model": {"tp_comm_s": "fast"}}),
        "metrics.json: simulated: must be true or false, got 'no'; speed_model.tp_comm_s: must be a number, got "
        "'fast'",
    ),
    ("{", "metrics.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (b'{"models": "\xff"}', "metrics.json is not UTF-8 text (byte 12)"),
    ('{"models": {"\\ud800": {}}}', "metrics.json holds text that is not valid Unicode ('\\\\ud800')"),
]  # fmt: skip


@pytest.mark.parametrize(("content", "reason"), MALFORMED_METRICS)
def test_a_malformed_metrics_file_is_a_failed_row_with_its_reason(
    sweep: Path, content: str | bytes, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = sweep / "0" / "metrics.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert cli_main(["sweep-report", str(sweep), "--no-plot"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    rows = _csv_rows(sweep)
    assert [(r["job"], r["model"], r["status"], r["error"]) for r in rows if r["job"] == "0"] == [
        ("0", "", "failed", reason)
    ]
    assert [r["job"] for r in rows] == ["0", "1", "2", "2", "10"]  # the others as before


def _csv_rows(sweep: Path) -> list[dict[str, str]]:
    with (sweep / "sweep_report.csv").open() as f:
        return list(csv.DictReader(f))


def test_metrics_that_are_not_a_regular_file_of_bounded_size_are_refused_without_reading_them(
    sweep: Path,
) -> None:
    import os

    from miles_sglang_plugin.sweeps.job_files import MAX_METRICS_BYTES

    (sweep / "0" / "metrics.json").write_bytes(b" " * (MAX_METRICS_BYTES + 1))
    (sweep / "2" / "metrics.json").unlink()
    (sweep / "2" / "metrics.json").mkdir()
    os.mkfifo(sweep / "10" / "metrics.json")  # no writer: reading it would block for ever
    errors = {j.name: j.error for j in collect_sweep(sweep)}
    assert errors == {
        "0": "metrics.json is larger than 4 MiB, the most the report reads of it",
        "1": "DeploymentConfigError: 8 GPUs do not split",
        "2": "metrics.json is a directory, not a file",
        "10": "metrics.json is a pipe, not a file",
    }


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("[]", "job_status.json: must be a JSON object (a mapping), got []"),
        ('{"status": "DONE"}', "job_status.json: status: must be COMPLETED or FAILED, got 'DONE'"),
        ('{"status": "COMPLETED", "error": 5}', "job_status.json: error: must be null or a string, got 5"),
        ('{"status": "FAILED", "error": "' + "x" * 2000 + '"}', "x" * 999 + "…"),  # a long error, cut
    ],
)
def test_a_malformed_status_file_is_a_failed_row_with_its_reason(
    sweep: Path, content: str, reason: str
) -> None:
    (sweep / "0" / "job_status.json").write_text(content)
    job = collect_sweep(sweep)[0]
    assert (job.name, job.status, job.error) == ("0", "failed", reason)
    build_report(sweep, plot=False)
    assert [(r["model"], r["status"], r["error"]) for r in _csv_rows(sweep) if r["job"] == "0"] == [
        ("", "failed", reason)
    ]


@pytest.mark.parametrize(
    ("content", "note"),
    [
        ("[" * 100_000, "is nested deeper than 64 levels, the most the report reads"),  # RecursionError before
        ("- a=1\n- [b]\n", "item 2 must be an override (a string), got ['b']"),
        ("a: 1\n", "must be a list of overrides, got {'a': 1}"),
        ("- !!int abc\n", "is not valid YAML (invalid literal for int() with base 10: 'abc')"),
        ("- !!python/name:os.system\n", "is not valid YAML at line 1, column 3 (could not determine a constructor"),
        # aliases are never expanded: 9 levels of 9 would be 387,420,489 strings
        ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
         + "j: [*i]\n", "must be a list of overrides, got {'a': ['x', 'x', 'x', 'x', ...], 'b':"),
    ],
)  # fmt: skip
def test_malformed_overrides_keep_the_job_and_its_metrics_with_a_note(
    sweep: Path, content: str, note: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text(content)
    assert cli_main(["sweep-report", str(sweep), "--no-plot"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    job = next(j for j in collect_sweep(sweep) if j.name == "2")
    assert (job.status, job.params, len(job.notes)) == ("ok", {}, 1)
    assert job.notes[0].startswith(f".hydra/overrides.yaml {note}")
    assert job.notes[0].endswith(": its sweep parameters are unknown")
    assert f"job 2: .hydra/overrides.yaml {note}" in " ".join(out.split())
    assert f"- job 2: .hydra/overrides.yaml {note}" in (sweep / "sweep_report.md").read_text()


def test_text_of_any_kind_is_shown_as_it_is_in_table_markdown_and_plot(sweep: Path) -> None:
    """Rich markup (``[/x]`` raised MarkupError), matplotlib mathtext (``$\\frac$`` failed to parse), pipes and
    newlines in values, a job directory whose name is not UTF-8, a swept parameter of numbers and text (the plot
    cannot put both on one axis: all are text then)."""
    import os

    from rich.console import Console

    metrics = json.loads((sweep / "0" / "metrics.json").read_text())
    metrics["models"] = {"[red]$\\frac$": metrics["models"]["actor"]}
    odd = Path(os.fsdecode(bytes(sweep / "0") + b"-\xff"))
    odd.mkdir()
    (odd / ".hydra").mkdir()
    overrides = ["sglang=pd_actor_ref", "sglang_deploy=simulated", f"{KEY}=[/x] $\\frac$ a|b\nc"]
    (odd / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (odd / "metrics.json").write_text(json.dumps(metrics))
    console = Console(file=io.StringIO(), width=300)
    files = build_report(sweep, console=console)
    assert files.png is not None
    rows = _csv_rows(sweep)
    assert [(r["job"], r[KEY], r["model"]) for r in rows if r["job"].startswith("0-")] == [
        ("0-\\udcff", "[/x] $\\frac$ a|b\nc", "[red]$\\frac$")
    ]
    assert "| 0-\\udcff | [/x] $\\frac$ a\\|b c | [red]$\\frac$ | ok |" in files.markdown.read_text()
    assert "[red]$\\frac$" in console.file.getvalue()
