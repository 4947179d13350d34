"""Bad input, as an attacker or a careless user gives it (issue 12): each one is one clear message naming the key or
the file's line, exit status 2, no traceback, nothing started; reading and planning stay bounded; secrets stay
hidden whatever their shape; the port lock directory cannot be hijacked.

The command runs in this process (``cli.main``): a traceback would be an exception escaping ``main`` and fail
the test. "Nothing started": :class:`~miles_sglang_plugin.serving.deployment.Deployment` never started
(``leak_check`` records every start).
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from miles_sglang_plugin import cli
from miles_sglang_plugin.app.hydra_edge import resolve_config
from miles_sglang_plugin.backends.processes import (
    LOG_TAIL_BYTES,
    LogNotWritableError,
    ManagedProcess,
    log_tail,
)
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.reading import deploy_settings_from_config
from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.masking import mask_argv, mask_env
from miles_sglang_plugin.miles.bounded_yaml import MAX_CONFIG_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES
from miles_sglang_plugin.planning import resolution
from miles_sglang_plugin.planning.resolution import MAX_DEPLOYMENT_GPUS, resolve_deployment
from miles_sglang_plugin.planning.views import print_plan
from miles_sglang_plugin.rendering.ports import PortClaims, default_lock_dir
from miles_sglang_plugin.rendering.prepared import prepare_deployment
from miles_sglang_plugin.rendering.server_arg_checks import (
    _problem_of,
    shipped_server_arg_types,
    value_problem,
)
from tests.conftest import group, model, spec
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import LeakTracker, launch_overrides

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "miles"
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Run:
    """``miles-sglang ARGS...`` in this process, in the test's own directory: (exit status, stdout, stderr)."""
    monkeypatch.chdir(
        tmp_path
    )  # whatever a launch writes by default (sglang_logs/) stays out of the checkout

    def run_cli(*argv: str) -> tuple[int, str, str]:
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run_cli


def _one_problem(err: str) -> str:
    """The single problem line of a user error (``  - key: message``), whitespace normalised."""
    lines = [line.strip() for line in err.splitlines() if line.strip().startswith("- ")]
    assert len(lines) == 1, err
    return " ".join(lines[0][2:].split())


def bytes_read() -> int:
    """The bytes this process has read so far (``rchar`` of ``/proc/self/io``: every ``read``, from a disk,
    the page cache or a device alike): how much reading is bounded is told by bytes, not by seconds."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.fixture
def no_engine_enumerated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if resolution enumerates engines (``_Resolver.run``): a bound checked before that is
    bounded work whatever the count, where enumerating 10**9 engines would never end."""

    def enumerate_engines(self: object) -> None:
        raise AssertionError("the engines were enumerated before the GPU count was checked")

    monkeypatch.setattr(resolution._Resolver, "run", enumerate_engines)


# -------------------------------------------------------------------------------------- (2) tracebacks
def test_a_model_path_that_is_not_a_string_is_refused_where_it_was_set(run: Run) -> None:
    code, out, err = run("plan", "hf_checkpoint=/c", "+sglang.actor.regular.overrides.model_path=5")
    assert (code, out) == (2, "")
    assert _one_problem(err) == (
        "sglang.actor.regular.overrides.model_path: must be a string (a checkpoint path or hub name), got 5"
    )


def test_the_plan_view_shows_any_value_as_plain_text() -> None:
    plan = resolve_deployment(
        spec(model("actor", group("regular", 2), path="[bold red]x[/] [/oops]")),
        TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True),
    )
    console = Console(record=True, width=200, color_system=None)
    print_plan(plan, console)
    assert "[bold red]x[/] [/oops]" in console.export_text()  # no markup applied, no MarkupError


def test_import_of_a_file_with_a_nul_byte(run: Run, tmp_path: Path) -> None:
    bad = tmp_path / "nul.yaml"
    bad.write_bytes(b"sglang:\n  - name: a\x00b\n")
    code, out, err = run("import", str(bad), "--print")
    assert (code, out) == (2, "")
    assert _one_problem(err) == (
        "nul.yaml: line 2, column 12: the character U+0000 is not allowed in YAML (a binary file?)"
    )


def test_import_of_deep_nesting_stops_at_the_depth_limit(run: Run, tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000)
    code, _, err = run("import", str(deep), "--print")
    assert code == 2  # where it stopped (column 65, not the 100,000th) tells how far the parser went
    assert _one_problem(err) == (
        f"deep.yaml: line 1, column {MAX_YAML_DEPTH + 1}: nested deeper than 64 levels, the most a "
        "--sglang-config file may nest"
    )


def test_exactly_the_depth_limit_still_reads() -> None:
    from miles_sglang_plugin.errors import ProblemCollector
    from miles_sglang_plugin.miles.bounded_yaml import parse_yaml

    problems = ProblemCollector()
    ok, data = parse_yaml("[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH, "f", problems)
    assert ok and not problems.problems
    depth = 0
    while isinstance(data, list):
        data, depth = (data[0] if data else None), depth + 1
    assert depth == MAX_YAML_DEPTH


def test_launch_with_a_host_that_is_not_one_starts_nothing(run: Run, leak_check: LeakTracker) -> None:  # noqa: F811
    code, _, err = run("launch", *launch_overrides("sglang_deploy.launch.host='not a host'"))
    assert code == 2
    assert _one_problem(err) == (
        "sglang_deploy.launch.host: 'not a host' is neither an IP address nor a host name "
        "(e.g. 127.0.0.1, ::1, node-0)"
    )
    assert leak_check.launchers == []


def test_launch_with_a_host_that_does_not_resolve_starts_nothing(run: Run, leak_check: LeakTracker) -> None:  # noqa: F811
    code, _, err = run("launch", *launch_overrides("sglang_deploy.launch.host=no-such-host.invalid"))
    assert code == 2
    assert _one_problem(err).startswith(
        "sglang_deploy.launch.host: 'no-such-host.invalid' does not resolve to an address here"
    )
    assert leak_check.launchers == []


def test_launch_with_a_negative_poll_interval_starts_nothing(run: Run, leak_check: LeakTracker) -> None:  # noqa: F811
    code, _, err = run("launch", *launch_overrides("sglang_deploy.launch.poll_interval_s=-1"))
    assert code == 2
    assert _one_problem(err) == (
        "sglang_deploy.launch.poll_interval_s: must be a number > 0 and <= 60 "
        "(an engine that exits is noticed at the next poll), got -1.0"
    )
    assert leak_check.launchers == []


# ----------------------------------------------------------------------------------- (3) work without bound
def _billion_laughs(path: Path) -> Path:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    path.write_text("\n".join([*lines, "sglang: *a9", ""]))  # 10**10 values once expanded
    return path


def test_import_of_a_billion_laughs_stops_at_the_node_limit(run: Run, tmp_path: Path) -> None:
    code, _, err = run("import", str(_billion_laughs(tmp_path / "laughs.yaml")), "--print")
    assert code == 2  # 10**10 values expanded would never end: the node where it stopped is told below
    # Nodes so far: the root 1, then per line its key and list: a0 1+11, a1 1+111, a2 1+1,111, a3 1+11,111
    # (12,349 in all); line 5: key and list node (12,351), and its first alias *a3 adds 11,111: past 20,000.
    assert _one_problem(err) == (
        "laughs.yaml: line 5, column 10: more than 20,000 YAML nodes (aliases counted in full), the most a "
        "--sglang-config file may hold here"
    )


def test_the_node_limit_counts_exactly(tmp_path: Path) -> None:
    from miles_sglang_plugin.errors import ProblemCollector
    from miles_sglang_plugin.miles.bounded_yaml import parse_yaml

    def nodes_ok(items: int) -> bool:  # the root mapping, its key, the list and its items
        problems = ProblemCollector()
        return parse_yaml("k: [" + ", ".join(["1"] * items) + "]", "f", problems)[0]

    assert nodes_ok(MAX_YAML_NODES - 3) and not nodes_ok(MAX_YAML_NODES - 2)


def test_an_alias_inside_its_own_anchor_is_refused(run: Run, tmp_path: Path) -> None:
    loop = tmp_path / "loop.yaml"
    loop.write_text("sglang: &a [*a]\n")
    code, _, err = run("import", str(loop), "--print")
    assert code == 2
    assert _one_problem(err) == "loop.yaml: line 1, column 13: alias *a refers to a node that contains it"


def test_import_of_a_device_reads_nothing(run: Run) -> None:
    code, _, err = run("import", "/dev/zero", "--name", "z", "--print")
    assert code == 2
    assert _one_problem(err) == "zero: '/dev/zero' is a character device, not a YAML file"


def test_import_of_a_1_gb_file_is_refused_having_read_its_first_256_kb(run: Run, tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("sglang:\n" + "# padding\n" * 1_000_000)
    os.truncate(big, 2**30)  # 1 GiB, the rest a hole (nothing on the disk)
    before = bytes_read()
    code, _, err = run("import", str(big), "--print")
    assert code == 2
    assert bytes_read() - before < 16 * 2**20  # what a read of it all would be is 1 GiB
    assert _one_problem(err) == (
        f"big.yaml: '{big}' is larger than 256 KiB, the most a --sglang-config file may hold here (a Miles "
        "config is a few KB)"
    )


def test_an_inline_base64_config_is_bounded_too(run: Run) -> None:
    payload = base64.b64encode(b"#" * (MAX_CONFIG_BYTES + 3)).decode()
    code, _, err = run("import", "base64:" + payload, "--name", "x", "--print")
    assert code == 2
    assert "larger than 256 KiB" in _one_problem(err)


def test_a_config_read_from_a_pipe(run: Run) -> None:
    read_fd, write_fd = os.pipe()
    text = (FIXTURES / "sglang_pd.yaml").read_bytes()

    def write_slowly() -> None:
        for i in range(0, len(text), 64):
            os.write(write_fd, text[i : i + 64])
            time.sleep(0.001)
        os.close(write_fd)

    writer = threading.Thread(target=write_slowly)
    writer.start()
    try:
        code, out, err = run("import", f"/dev/fd/{read_fd}", "--name", "piped", "--print")
    finally:
        writer.join()
        os.close(read_fd)
    assert (code, err) == (0, "")
    assert "/sglang_model@actor: base" in out


def test_gpu_counts_are_bounded_before_engines_are_enumerated(run: Run, no_engine_enumerated: None) -> None:
    code, _, err = run("plan", "hf_checkpoint=/c", "sglang.actor.regular.num_gpus=1000000000")
    assert code == 2
    assert _one_problem(err) == (
        "sglang.actor.regular.num_gpus: 1000000000 GPUs: the deployment would hold 1,000,000,000 GPUs, more "
        "than the 65,536 a deployment may hold"
    )


def test_gpu_counts_against_the_cluster_when_its_size_is_known(no_engine_enumerated: None) -> None:
    with pytest.raises(DeploymentConfigError) as info:  # before its 60,000 engines are enumerated
        resolve_deployment(
            spec(model("actor", group("regular", 60_000))), TrainerInputs(hf_checkpoint="/c", num_nodes=4)
        )
    assert [str(p) for p in info.value.problems] == [
        "num_nodes: the deployment needs 60008 GPU slots (rollout_offset=8 + 60000 rollout GPUs) but the "
        "cluster has num_nodes=4 x num_gpus_per_node=8 = 32"
    ]


def test_the_gpu_limit_itself_still_plans() -> None:
    plan = resolve_deployment(
        spec(model("actor", group("regular", MAX_DEPLOYMENT_GPUS, gpe=8))),
        TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True),
    )
    assert plan.total_gpus == 65_536 and len(plan.engines) == 8_192
    with pytest.raises(DeploymentConfigError, match="more than the 65,536"):
        resolve_deployment(
            spec(model("actor", group("regular", MAX_DEPLOYMENT_GPUS, gpe=8), group("placeholder", 1))),
            TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True),
        )


#: The peak memory a plan at the cap may take: 65,536 engines of one GPU each (the most GPUs a deployment may
#: have, in the most engines), planned and printed in a process of its own. Measured: about 165 MB, tables or
#: JSON (it was 760 MB and 1.6 GB). Memory, not time: the machine's load does not move it.
CAP_PLAN_MAX_RSS_MB = 400
CAP_PLAN = ("sglang=default", "hf_checkpoint=/c", "debug_rollout_only=true",
            f"sglang.actor.regular.num_gpus={MAX_DEPLOYMENT_GPUS}", "sglang.actor.num_gpus_per_engine=1")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)  # bounded memory, not time: about 2 minutes each on two busy cores
@pytest.mark.parametrize("form", ["tables", "json"])
def test_a_plan_at_the_gpu_cap_stays_within_its_memory_bound(form: str, tmp_path: Path) -> None:
    """Issue 23, item 4: ``plan`` of the largest deployment allowed is bounded work: every engine planned,
    rendered, checked and printed (8,192 node tables, or 65,536 engine entries), within CAP_PLAN_MAX_RSS_MB of
    peak RSS (the child's own, from wait4)."""
    out, err = tmp_path / "plan.out", tmp_path / "plan.err"
    argv = [
        sys.executable,
        "-m",
        "miles_sglang_plugin",
        "plan",
        *(["--json"] if form == "json" else []),
        *CAP_PLAN,
    ]
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen(argv, stdout=stdout, stderr=stderr, cwd=tmp_path)
        _pid, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, err.read_text()
    peak_mb = usage.ru_maxrss / 1024  # kilobytes on Linux
    assert peak_mb <= CAP_PLAN_MAX_RSS_MB, f"peak RSS {peak_mb:.0f} MB"
    with out.open() as text:
        if form == "json":
            entries = sum(1 for line in text if line.lstrip().startswith('{"id": "actor.regular.'))
            assert entries == MAX_DEPLOYMENT_GPUS
        else:
            tables = sum(1 for line in text if line.startswith("Node "))
            assert tables == MAX_DEPLOYMENT_GPUS // 8


def test_log_tail_reads_a_bounded_amount(tmp_path: Path) -> None:
    before = bytes_read()
    assert log_tail(Path("/dev/zero")) == "" and log_tail(Path("/dev/full")) == ""  # never read at all
    assert bytes_read() - before < LOG_TAIL_BYTES  # not even the 64 KiB a regular file's tail may take
    log = tmp_path / "big.log"
    with log.open("w") as f:
        for i in range(400_000):  # ~5 MB
            f.write(f"line {i}\n")
    assert log_tail(log, lines=3) == "line 399997\nline 399998\nline 399999"
    assert len(log_tail(log, lines=10**9).encode()) <= LOG_TAIL_BYTES


def test_a_process_whose_log_cannot_be_written_is_not_started(tmp_path: Path) -> None:
    (tmp_path / "x.log").symlink_to("/dev/full")  # as on a full disk: every write fails
    process = ManagedProcess(name="x", argv=["true"], env={}, log_path=tmp_path / "x.log")
    with pytest.raises(LogNotWritableError) as info:
        process.start()
    assert process.popen is None
    assert (
        str(info.value)
        == f"[Errno 28] its log file {tmp_path / 'x.log'} cannot be written (No space left on device)"
    )


def test_a_router_on_a_full_disk_fails_the_launch_saying_so(
    run: Run,
    tmp_path: Path,
    leak_check: LeakTracker,  # noqa: F811
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "router.actor.log").symlink_to("/dev/full")
    code, _, err = run("launch", "--log-dir", str(logs), *launch_overrides("sglang.actor.regular.num_gpus=2"))
    assert code == 1
    text = " ".join(err.split())
    assert (
        f"router router.actor could not be started: [Errno 28] its log file {logs / 'router.actor.log'} cannot be written (No space left on device)"
        in text
    )


# ------------------------------------------------------------------------------- (4) values checked before start
@pytest.mark.parametrize(
    ("override", "problem"),
    [
        (
            "mem_fraction_static=abc",
            "mem_fraction_static: must be a number, got 'abc' (SGLang's --mem-fraction-static)",
        ),
        (
            "mem_fraction_static={a:1}",
            "mem_fraction_static: must be a number, got '{\"a\": 1}' (SGLang's --mem-fraction-static)",
        ),
        (
            "mem_fraction_static=[1,2]",
            "mem_fraction_static: takes one value, got 2 ([1, 2]) (SGLang's --mem-fraction-static)",
        ),
        (
            "context_length=[1,2]",
            "context_length: takes one value, got 2 ([1, 2]) (SGLang's --context-length)",
        ),
        (
            "chunked_prefill_size=abc",
            "chunked_prefill_size: must be an integer, got 'abc' (SGLang's --chunked-prefill-size)",
        ),
        ("enable_memory_saver_x=1", None),  # not a field: the key check says so (below)
    ],
)
def test_server_args_values_are_checked_before_anything_starts(
    run: Run,
    leak_check: LeakTracker,  # noqa: F811
    override: str,
    problem: str | None,
) -> None:
    code, out, err = run("plan", "hf_checkpoint=/c", f"+sglang.actor.regular.overrides.{override}")
    assert (code, out) == (2, "")
    if problem is None:
        assert "is not a ServerArgs field" in _one_problem(err)
        return
    assert _one_problem(err) == f"sglang.actor.regular.overrides.{problem}"
    code, _, err = run("launch", *launch_overrides(f"+sglang.actor.regular.overrides.{override}"))
    assert code == 2 and _one_problem(err) == f"sglang.actor.regular.overrides.{problem}"
    assert leak_check.launchers == []


def test_server_defaults_are_checked_as_well(run: Run) -> None:
    code, _, err = run("plan", "hf_checkpoint=/c", "+sglang_deploy.server_defaults.enable_lora=maybe")
    assert code == 2
    assert _one_problem(err) == (
        "sglang_deploy.server_defaults.enable_lora: is a switch: true or false, got 'maybe' (SGLang's --enable-lora)"
    )


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        (
            "mem_fraction_static=1.5",
            "mem_fraction_static: must be a fraction: more than 0 and at most 1, got 1.5 (SGLang's --mem-fraction-static)",
        ),
        (
            "mem_fraction_static=0",
            "mem_fraction_static: must be a fraction: more than 0 and at most 1, got 0 (SGLang's --mem-fraction-static)",
        ),
        (
            "mem_fraction_static=-0.5",
            "mem_fraction_static: must be a fraction: more than 0 and at most 1, got -0.5 (SGLang's --mem-fraction-static)",
        ),
        (
            "mem_fraction_static=nan",
            "mem_fraction_static: must be a fraction: more than 0 and at most 1, got nan (SGLang's --mem-fraction-static)",
        ),
        (
            "hicache_host_memory_fraction=1.01",
            "hicache_host_memory_fraction: must be a fraction: more than 0 and at most 1, got 1.01 (SGLang's --hicache-host-memory-fraction)",
        ),
        (
            "swa_full_tokens_ratio=2",
            "swa_full_tokens_ratio: must be a fraction: more than 0 and at most 1, got 2 (SGLang's --swa-full-tokens-ratio)",
        ),
        ("page_size=0", "page_size: must be more than 0, got 0 (SGLang's --page-size)"),
        (
            "max_running_requests=0",
            "max_running_requests: must be more than 0, got 0 (SGLang's --max-running-requests)",
        ),
        ("max_total_tokens=0", "max_total_tokens: must be more than 0, got 0 (SGLang's --max-total-tokens)"),
        (
            "max_prefill_tokens=0",
            "max_prefill_tokens: must be more than 0, got 0 (SGLang's --max-prefill-tokens)",
        ),
        ("context_length=0", "context_length: must be more than 0, got 0 (SGLang's --context-length)"),
        (
            "chunked_prefill_size=0",
            "chunked_prefill_size: must be more than 0, or -1 (chunked prefill off), got 0 (SGLang's --chunked-prefill-size)",
        ),
        (
            "chunked_prefill_size=-2",
            "chunked_prefill_size: must be more than 0, or -1 (chunked prefill off), got -2 (SGLang's --chunked-prefill-size)",
        ),
    ],
)
def test_values_sglang_or_a_gpu_would_refuse_are_refused_at_plan_time(
    run: Run, override: str, problem: str
) -> None:
    code, out, err = run("plan", "hf_checkpoint=/c", f"+sglang.actor.regular.overrides.{override}")
    assert (code, out) == (2, "")
    assert "Traceback" not in err
    assert _one_problem(err) == f"sglang.actor.regular.overrides.{problem}"


@pytest.mark.parametrize(
    "override",
    [
        "mem_fraction_static=1",
        "mem_fraction_static=0.01",
        "chunked_prefill_size=-1",
        "chunked_prefill_size=1",
        "page_size=1",
        "max_total_tokens=32k",
        "swa_full_tokens_ratio=0.5",
    ],
)
def test_values_at_the_edges_of_their_ranges_plan(run: Run, override: str) -> None:
    code, _, err = run("plan", "hf_checkpoint=/c", f"+sglang.actor.regular.overrides.{override}")
    assert code == 0, err


def test_every_value_out_of_range_is_listed_with_the_key_as_typed_and_nothing_starts(
    run: Run,
    leak_check: LeakTracker,  # noqa: F811
) -> None:
    overrides = [
        "+sglang.actor.regular.overrides.mem_fraction_static=1.5",
        "+sglang.actor.regular.overrides.page_size=0",
        "+sglang_deploy.server_defaults.max-running-requests=0",
    ]
    code, out, err = run("plan", "hf_checkpoint=/c", *overrides)
    assert (code, out) == (2, "")
    text = " ".join(err.split())
    assert "3 problems" in text
    for line in (
        "sglang.actor.regular.overrides.mem_fraction_static: must be a fraction: more than 0 and at most 1, got 1.5",
        "sglang.actor.regular.overrides.page_size: must be more than 0, got 0",
        "sglang_deploy.server_defaults.max-running-requests: must be more than 0, got 0",
    ):
        assert f"- {line} (SGLang's --" in text
    code, _, err = run("launch", *launch_overrides(*overrides))
    assert code == 2 and "3 problems" in err and "Traceback" not in err
    assert leak_check.launchers == []


@pytest.mark.parametrize(
    ("value", "spec_", "problem"),
    [
        (True, {"kind": "switch"}, None),
        ("yes", {"kind": "switch"}, "is a switch: true or false, got 'yes'"),
        ("32k", {"kind": "size", "nargs": None}, None),
        ("4Ki", {"kind": "size", "nargs": None}, None),
        (
            "2.5Ki",
            {"kind": "size", "nargs": None},
            "must be an integer (or with a suffix: 32k, 4Ki), got '2.5Ki'",
        ),
        (-0.5, {"kind": "float", "nargs": None}, None),  # rendered --flag=-0.5
        (True, {"kind": "int", "nargs": None}, "takes a value, got true"),
        (["a", "b"], {"kind": "str", "nargs": "+"}, None),
        ([], {"kind": "str", "nargs": "+"}, "takes one or more values, got none"),
        (
            ["a", "-b"],
            {"kind": "str", "nargs": "*"},
            "a list item cannot start with '-' (SGLang's parser would read it as a flag)",
        ),
        ("x", {"kind": "str", "nargs": None, "choices": ["a", "b"]}, "'x' is not one of a, b"),
        ({"a": 1}, {"kind": "json", "nargs": None}, None),
        ("{a", {"kind": "json", "nargs": None}, "must be JSON text (or a mapping), got '{a'"),
        (None, {"kind": "int", "nargs": None}, None),  # left out: SGLang's default
    ],
)
def test_values_against_the_type_table(value: object, spec_: dict, problem: str | None) -> None:
    assert value_problem(value, spec_) == problem


_TABLE_SPECS = sorted(
    {json.dumps(spec, sort_keys=True) for spec in shipped_server_arg_types()["fields"].values()}
)
_VALUES = st.one_of(
    st.integers(min_value=-(10**12), max_value=10**12),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["-1", "32k", "4Ki", "auto", "fa3", "1.5", "{}", "[1]", "-x"]),
    st.lists(st.one_of(st.integers(-5, 5), st.text(max_size=4)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
)


@settings(max_examples=400, deadline=None)
@given(value=_VALUES, spec_json=st.sampled_from(_TABLE_SPECS), again=st.booleans())
def test_the_checks_shortcuts_and_memo_answer_as_the_full_check(
    value: object, spec_json: str, again: bool
) -> None:
    """The check of every engine's values decides plain integers and texts without rendering them, and each
    other distinct value once: always what ``value_problem`` says, for every kind of flag of the shipped table."""
    spec_ = json.loads(spec_json)
    seen: dict = {}
    assert _problem_of("f", value, spec_, seen) == value_problem(value, spec_)
    if again:  # from the memo
        assert _problem_of("f", value, spec_, seen) == value_problem(value, spec_)


def test_the_shipped_type_table_is_sglang_0_5_23s() -> None:
    table = shipped_server_arg_types()
    assert table["sglang_version"] == "0.5.23"
    fields = table["fields"]
    assert fields["mem_fraction_static"] == {"kind": "float", "nargs": None}
    assert fields["tp_size"] == {"kind": "int", "nargs": None}
    assert fields["enable_memory_saver"] == {"kind": "switch"}
    assert fields["disaggregation_mode"] == {
        "kind": "str",
        "nargs": None,
        "choices": ["null", "prefill", "decode"],
    }
    # the flags every rendered command line uses are in it
    shipped = set(
        (REPO / "miles_sglang_plugin" / "data" / "sglang_server_args_fields.txt").read_text().split()
    )
    assert set(fields) <= shipped and len(fields) == 529


@pytest.mark.sglang
def test_the_shipped_type_table_is_what_the_generator_writes_from_the_installed_sglang() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "generate-server-args-types.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def _prepared(*overrides: str, probe: bool):
    cfg = compose_config(
        ["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=2", *overrides]
    )
    return prepare_deployment(resolve_config(cfg), deploy_settings_from_config(cfg), probe=probe)


@pytest.mark.sglang
def test_a_launch_of_real_engines_runs_every_argv_through_sglangs_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cuda_graph_config`` is text to the table but JSON to SGLang's own parser: only the parser refuses it."""
    from miles_sglang_plugin.rendering import sglang_server_args

    override = "+sglang.actor.regular.overrides.cuda_graph_config=bogus"
    _prepared(override, probe=False)  # a plan: the table only
    parsed: list[tuple[str, ...]] = []
    real_parse = sglang_server_args.parse_launch_argv
    monkeypatch.setattr(
        sglang_server_args, "parse_launch_argv", lambda argv: parsed.append(tuple(argv)) or real_parse(argv)
    )
    with pytest.raises(DeploymentConfigError) as info:
        _prepared(override, "sglang_deploy.launch.port_base=21000", probe=True)
    assert [str(p) for p in info.value.problems] == [
        "engine actor.regular.0 (and 1 more): SGLang rejected the launch_server arguments: argument "
        "--cuda-graph-config: --cuda-graph-config must be JSON: Expecting value: line 1 column 1 (char 0)"
    ]
    assert len(parsed) == 2  # both engines' command lines
    parsed.clear()
    _prepared("sglang_deploy.launch.port_base=21000", probe=True)
    assert len(parsed) == 2


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        (
            "sglang_deploy.launch.startup_timeout_s=-1",
            "sglang_deploy.launch.startup_timeout_s: must be a number > 0 and <= 2592000 (at most 30 days), got -1.0",
        ),
        (
            "sglang_deploy.launch.startup_timeout_s=nan",
            "sglang_deploy.launch.startup_timeout_s: must be a finite number > 0 and <= 2592000 (at most 30 days), got nan",
        ),
        (
            "sglang_deploy.launch.shutdown_grace_s=-5",
            "sglang_deploy.launch.shutdown_grace_s: must be a number in 0..2592000 (at most 30 days), got -5.0",
        ),
        (
            "sglang_deploy.launch.poll_interval_s=120",
            "sglang_deploy.launch.poll_interval_s: must be a number > 0 and <= 60 (an engine that exits is noticed at the next poll), got 120.0",
        ),
        (
            "sglang_deploy.launch.live=bogus",
            "sglang_deploy.launch.live: 'bogus' is not one of auto, always, never",
        ),
        (
            "sglang_deploy.launch.command=[]",
            "sglang_deploy.launch.command: must be a non-empty list of non-empty strings, e.g. [{python}, -m, sglang.launch_server]",
        ),
        (
            "sglang_deploy.lora.max_lora_rank=-1",
            "sglang_deploy.lora.max_lora_rank: must be an integer >= 1, got -1",
        ),
        (
            "sglang_deploy.lora.max_loras_per_batch=0",
            "sglang_deploy.lora.max_loras_per_batch: must be an integer >= 1, got 0",
        ),
        (
            "sglang_deploy.standin.start_delay_s=-1",
            "sglang_deploy.standin.start_delay_s: must be a number in 0..2592000 (at most 30 days), got -1.0",
        ),
        (
            "sglang_deploy.launch.port_base=40000",
            "sglang_deploy.launch.port_base: must be an integer in 1024..32766 (ports are handed out below the ephemeral range, 32768), got 40000",
        ),
        (  # 1e300 s passed once, and the supervisor's thread died of OverflowError in its first wait
            "sglang_deploy.supervision.health_interval_s=1e300",
            "sglang_deploy.supervision.health_interval_s: must be a number > 0 and <= 2592000 (at most 30 days), "
            "got 1e+300",
        ),
        (  # passed plan once; the router then exited: OverflowError: int too big to convert
            "sglang_deploy.router.request_timeout_secs=99999999999999999999",
            "sglang_deploy.router: request_timeout_secs: must be an integer in 1..2592000 (at most 30 days), got "
            "99999999999999999999",
        ),
        (
            "+sglang_deploy.env.BAD-NAME=x",
            "sglang_deploy.env.BAD-NAME: is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
        ),
    ],
)
def test_launch_settings_are_checked_on_every_path(
    run: Run,
    leak_check: LeakTracker,  # noqa: F811
    override: str,
    problem: str,
) -> None:
    code, _, err = run("plan", "hf_checkpoint=/c", override)
    assert code == 2 and _one_problem(err) == problem
    code, _, err = run("launch", *launch_overrides(override))
    assert code == 2 and _one_problem(err) == problem
    assert leak_check.launchers == []


def test_settings_given_in_code_are_checked_too() -> None:
    plan = resolve_deployment(spec(model("actor", group("regular", 1))), TrainerInputs(hf_checkpoint="/c"))
    settings = SGLangDeployConf()
    settings.launch.startup_timeout_s = "10"  # type: ignore[assignment]
    settings.launch.host = "::1"
    settings.env = {"OK": "1", "NUL": "a\0b"}
    with pytest.raises(DeploymentConfigError) as info:
        prepare_deployment(plan, settings)
    assert [str(p) for p in info.value.problems] == [
        "sglang_deploy.launch.startup_timeout_s: must be a number > 0 and <= 2592000 (at most 30 days), got '10'",
        "sglang_deploy.env.NUL: must be a string without NUL bytes, got a str",
    ]


# -------------------------------------------------------------------------------------------- (5) secrets
SECRET = "--s3cr3t-key"


def test_an_api_key_that_starts_with_dashes_is_passed_whole_and_never_shown(run: Run) -> None:
    overrides = ["hf_checkpoint=/c", f"sglang_deploy.api_key='{SECRET}'"]
    code, out, err = run("plan", "--commands", *overrides)
    assert code == 0 and SECRET not in out + err and "--api-key=***" in out
    code, out, err = run("plan", "--json", *overrides)
    assert code == 0 and SECRET not in out + err
    engine = json.loads(out)["models"]["actor"]["groups"]["regular"]["engines"][0]["launch"][0]
    assert "--api-key=***" in engine["argv"]
    prepared = _prepared(*overrides[1:], probe=False)
    assert f"--api-key={SECRET}" in prepared.launch.engines[0].argv  # one token: no parser reads it as a flag


PRINTABLE = "must be printable ASCII"
NOT_BLANK = "must be a non-empty string without surrounding blanks"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("sk-1\nX-Injected: 1", PRINTABLE),
        ("sk\t1", PRINTABLE),
        ("sk\x7f1", PRINTABLE),
        ("sk-\u00e9t\u00e9", PRINTABLE),
        ("sk-1\r\n", NOT_BLANK),
        ("  sk-1", NOT_BLANK),
        ("", NOT_BLANK),
    ],
    ids=["newline", "tab", "del", "non-ascii", "crlf", "blank", "empty"],
)
def test_an_api_key_that_cannot_travel_in_a_header_is_refused_without_showing_it(
    run: Run, monkeypatch: pytest.MonkeyPatch, key: str, expected: str
) -> None:
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    code, out, err = run("plan", "hf_checkpoint=/c", f"sglang_deploy.api_key='{key}'")
    problem = _one_problem(err)
    assert code == 2 and problem.startswith(f"sglang_deploy.api_key: {expected}"), problem
    assert "its value is not shown" in problem and "Traceback" not in err
    if key.strip():
        assert key.strip() not in out + err


def test_a_bad_key_from_the_environment_is_named_as_the_environment_variable(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_API_KEY", "sk-env-7\nX-Injected: 1")
    code, out, err = run("plan", "hf_checkpoint=/c")
    assert code == 2 and "sk-env-7" not in out + err
    assert _one_problem(err) == (
        "SGLANG_API_KEY (environment variable): must be printable ASCII: it holds a control character (a "
        "newline, tab or NUL) or a non-ASCII one, which would break the HTTP header it travels in (its value "
        "is not shown)"
    )


@pytest.mark.parametrize(
    ("overrides", "secrets", "shown"),
    [
        (
            ["sglang_deploy.api_key=[sk-LIST-k3y]"],
            ["sk-LIST-k3y"],
            "Cannot convert 'list' to string: '['***']'",
        ),
        (
            ["+sglang_deploy.env.HF_TOKEN=hf_FIRST_1", "+sglang_deploy.env.HF_TOKEN=hf_SECOND_2"],
            ["hf_FIRST_1", "hf_SECOND_2"],
            "'++sglang_deploy.env.HF_TOKEN=***'",
        ),
        (["sglang_deploy.api_key='sk-UNCLOSED"], ["sk-UNCLOSED"], "sglang_deploy.api_key=***"),
    ],
    ids=["list", "given-twice", "unclosed-quote"],
)
def test_hydras_own_errors_about_a_secret_override_do_not_show_it(
    run: Run, overrides: list[str], secrets: list[str], shown: str
) -> None:
    code, out, err = run("plan", "hf_checkpoint=/c", *overrides)
    assert code == 2 and "Traceback" not in err and shown in err
    for secret in secrets:
        assert secret not in out + err


@pytest.mark.sglang
def test_sglangs_parser_takes_such_a_key_as_rendered() -> None:
    from miles_sglang_plugin.rendering.launch_specs import server_args_to_argv
    from miles_sglang_plugin.rendering.sglang_server_args import parse_launch_argv

    argv = server_args_to_argv({"model_path": "/c", "api_key": SECRET, "mem_fraction_static": -0.5})
    parsed = parse_launch_argv(argv)
    assert (parsed["api_key"], parsed["mem_fraction_static"]) == (SECRET, -0.5)


def test_such_a_key_stays_out_of_a_launch_error(run: Run, tmp_path: Path, leak_check: LeakTracker) -> None:  # noqa: F811
    code, out, err = run(
        "launch",
        "--log-dir",
        str(tmp_path / "logs"),
        *launch_overrides(
            f"sglang_deploy.api_key='{SECRET}'", "sglang_deploy.standin.fail_at_start=[actor.*]"
        ),
    )
    assert code == 1 and "exited with code" in err and "--api-key=***" in " ".join(err.split())
    assert SECRET not in out + err
    # The engine logged its server_args, key included (as SGLang does): the log tail shown masks it.
    assert "server_args={" in err and "'api_key': '***'" in err
    # The file is as written. Which engine's log holds it depends on which engine failed first: the others
    # are stopped as soon as one fails, perhaps before they logged anything.
    assert [p.name for p in (tmp_path / "logs").rglob("actor.*.log") if SECRET in p.read_text()] != []


def test_mask_argv_masks_by_position() -> None:
    argv = [
        "x",
        "--api-key",
        "--looks-like-a-flag",
        "--admin_api_key",
        "-",
        "--admin-api-key=--a=b",
        "--port",
        "1",
    ]
    assert mask_argv(argv) == [
        "x",
        "--api-key",
        "***",
        "--admin_api_key",
        "***",
        "--admin-api-key=***",
        "--port",
        "1",
    ]


def test_env_values_from_config_are_masked_unless_known_safe(run: Run) -> None:
    code, out, _ = run(
        "plan",
        "--json",
        "hf_checkpoint=/c",
        "+sglang_deploy.env.DATABASE_URL=postgres://u:pw@db/x",
        "+sglang_deploy.env.NCCL_DEBUG=INFO",
    )
    assert code == 0 and "pw@db" not in out
    env = json.loads(out)["models"]["actor"]["groups"]["regular"]["engines"][0]["launch"][0]["env"]
    assert env["DATABASE_URL"] == "***" and env["NCCL_DEBUG"] == "INFO"
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["SGLANG_DG_CACHE_DIR_PER_PROCESS"] == "1"
    assert mask_env({"HF_TOKEN": "t", "PATHS": "p"}, shown={"PATHS"}) == {"HF_TOKEN": "***", "PATHS": "p"}


# -------------------------------------------------------------------------------- (6) the port lock directory
def _claim(lock_dir: Path) -> tuple[bool, str]:
    claims = PortClaims(lock_dir)
    try:
        return claims.try_claim(20_001), str(claims.unusable or "")
    finally:
        claims.release()


def test_the_lock_directory_is_made_0700_and_a_shared_one_is_refused_not_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _claim(tmp_path / "new" / "locks") == (True, "")
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "locks").st_mode) == 0o700
    for mode in (0o1777, 0o777, 0o770):  # /tmp's mode among them: making it private would lock others out
        shared = tmp_path / f"shared-{mode:o}"
        shared.mkdir()
        shared.chmod(mode)
        reason = (
            f"others may write in it (mode {mode:o}); give a directory of this user's own, not a shared one"
        )
        assert _claim(shared) == (False, reason)
        assert stat.S_IMODE(os.stat(shared).st_mode) == mode and list(shared.iterdir()) == []
    readable = tmp_path / "readable"
    readable.mkdir()
    readable.chmod(0o755)  # others may look, not write: usable, and left as it is
    assert _claim(readable) == (True, "") and stat.S_IMODE(os.stat(readable).st_mode) == 0o755
    monkeypatch.setenv("MSP_PORT_LOCK_DIR", "")  # set but empty: the default, not the current directory
    assert default_lock_dir() == Path(tempfile.gettempdir()) / f"miles-sglang-ports-{os.getuid()}"


def test_a_symlinked_lock_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    assert _claim(tmp_path / "link") == (False, "it is a symlink; use a real directory")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_lock_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    (locks / "20001.lock").symlink_to(tmp_path / "victim")
    ok, reason = _claim(locks)
    assert not ok and "Too many levels of symbolic links" in reason
    assert not (tmp_path / "victim").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="making files owned by another user needs root")
def test_a_lock_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    assert _claim(theirs) == (False, "it is owned by uid 4242, not by this user (uid 0)")
    (tmp_path / "real").mkdir()
    (tmp_path / "hop").symlink_to(tmp_path / "real")
    os.lchown(tmp_path / "hop", 4242, 4242)
    assert _claim(tmp_path / "hop" / "locks") == (
        False,
        f"it is reached through {tmp_path / 'hop'}, a symlink owned by uid 4242",
    )


def test_a_refused_lock_directory_fails_the_launch_saying_why(
    run: Run,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    leak_check: LeakTracker,  # noqa: F811
) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("MSP_PORT_LOCK_DIR", str(tmp_path / "link"))
    code, _, err = run("launch", *launch_overrides())
    assert code == 2
    assert (
        f"the port lock directory {tmp_path / 'link'} is not usable (it is a symlink; use a real directory)"
        in _one_problem(err)
    )
    assert leak_check.launchers == []


# ------------------------------------------------------------------------------------------------- (7) smaller
def test_the_import_hint_works_when_run(run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(
        "import", str(FIXTURES / "sglang_basic.yaml"), "--name", "my_basic", "--output-dir", "out"
    )
    assert (code, err) == (0, "")
    assert (tmp_path / "out" / "sglang" / "my_basic.yaml").is_file()
    example = next(line for line in out.splitlines() if line.strip().startswith("miles-sglang plan"))
    argv = shlex.split(example)[1:]
    argv = [
        arg if not arg.endswith("=...") else f"{arg[:-4]}={'/c' if arg.startswith('hf_') else 'null'}"
        for arg in argv
    ]
    code, out, err = run(*argv)
    assert (code, err) == (0, ""), err
    assert "Models (one router each)" in out


def test_export_says_it_leaves_the_api_key_out(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_API_KEY", "k-123")
    code, out, err = run("export", "sglang=pd", "hf_checkpoint=/c")
    assert code == 0 and "k-123" not in out + err
    assert (
        "note: an API key is set (sglang_deploy.api_key or SGLANG_API_KEY); a secret is never written to the file "
        "or printed: give it to Miles' engines and router yourself"
    ) in err


def test_plans_options_and_overrides_come_in_any_order(run: Run) -> None:
    code, out, err = run(
        "plan", "hf_checkpoint=/c", "--json", "rollout_num_gpus=2", "rollout_num_gpus_per_engine=2"
    )
    assert code == 0, err
    data = json.loads(out)
    assert (data["rollout_num_gpus"], len(data["models"]["actor"]["groups"]["regular"]["engines"])) == (2, 1)
    with pytest.raises(SystemExit) as info:
        run("plan", "hf_checkpoint=/c", "--bogus", "x=1")
    assert info.value.code == 2


_OVERRIDE_KEYS = st.sampled_from(
    ["sglang", "sglang_deploy", "sglang_model", "sglang_group", "sglang.actor", "seed", "hydra/launcher",
     "sglang_model@sglang.x", "sglang@pkg", " sglang ", "x" * 201, "sglang_models"]
)  # fmt: skip
_OVERRIDE_VALUES = st.sampled_from(
    ["null", "pd", "", "[a,b]", "1", "default", "choice(a,null)", "y" * 250, "'x'"]
)


@settings(max_examples=300, deadline=None)
@given(prefix=st.sampled_from(["", "+", "++", "~"]), key=_OVERRIDE_KEYS, value=st.none() | _OVERRIDE_VALUES)
def test_overrides_left_unparsed_are_those_that_can_have_no_problem(
    prefix: str, key: str, value: str | None
) -> None:
    """The checks before composition parse only overrides of this package's groups and overrides longer than
    a name may be: what they find is what parsing every override finds."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from miles_sglang_plugin.config import overrides as checks

    text = prefix + key + ("" if value is None else f"={value}")
    try:
        (override,) = OverridesParser.create().parse_overrides([text])
    except (HydraException, ValueError):
        expected = []
    else:
        expected = [
            p for check in (checks._long_names, checks._bad_choice, checks._helper_without_package)
            for p in check(override, text)
        ]  # fmt: skip
    assert checks.override_problems([text]) == expected
