"""A fuzzer of ``miles-sglang plan`` over Hydra override sets (issue 12): whatever the overrides, the command
ends with status 0 or 2, prints no traceback, does not hang and does not grow without bound.

The strategy draws override sets of up to 6 overrides: keys from the schema (every key ``miles-sglang fields``
lists, model and group names filled in) and near misses of them (a letter dropped, doubled, swapped or changed),
the group choices (``sglang=``, ``sglang_deploy=``, the helper groups), with the prefixes ``+``, ``++`` and ``~``,
and values of every kind: the right type, wrong types, ``null``, lists, mappings, huge numbers (``10**30``,
``1e308``, ``nan``), long strings (300 characters), interpolations (to keys that exist, that do not, relative
ones, resolvers), and text that is not valid override syntax.

Bounds (also in the docs, docs/cli.md):

* in-process, through ``cli.main``: 200 override sets (derandomized: the same sets on every run), each one
  must return 0 or 2 within 20 s (it runs in a worker thread; a hang fails the test), no exception may
  escape ``main`` and no output may contain ``Traceback``; the test process's peak RSS may grow by at most
  512 MiB over the whole run.
* in a subprocess (``python -m miles_sglang_plugin plan``): 6 sets, each must exit 0 or 2 within 60 s, with no
  ``Traceback`` on stderr and a peak RSS of the child (``wait4``) under 1 GiB.

GPU counts in the random sets stay below 4,096, so that each set plans in well under its time bound (a plan of
that many engines renders every command line); counts far beyond any cluster are refused before any engine is
enumerated, which the cases after the random sets check (``num_gpus=1000000000``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.cli import main
from miles_sglang_plugin.config.field_docs import schema_fields
from miles_sglang_plugin.config.schema import MilesTrainerArgs

IN_PROCESS_EXAMPLES = 200
IN_PROCESS_TIMEOUT_S = 20.0
IN_PROCESS_RSS_GROWTH_MIB = 512
SUBPROCESS_EXAMPLES = 6
SUBPROCESS_TIMEOUT_S = 60.0
SUBPROCESS_RSS_MIB = 1024
#: GPU counts stay below this (see the module docstring).
GPU_COUNT_CAP = 4096

MODELS = ("actor", "ref", "reward")
#: Every key ``miles-sglang fields`` lists, names filled in -> its type as the schema declares it.
SCHEMA_TYPES = {
    row.key.replace("<model>", model).replace("<name>", "d2"): row.type
    for row in schema_fields(MilesTrainerArgs)
    for model in MODELS
}
SCHEMA_KEYS = sorted(SCHEMA_TYPES)
#: Keys whose integer values are GPU counts (capped in the random sets).
GPU_COUNT_KEY = re.compile(r"(^|\.)(num_gpus|rollout_num_gpus|eval_num_gpus|num_gpus_per_engine|num_gpus_per_node"
                           r"|actor_num_nodes|actor_num_gpus_per_node|critic_num_nodes|critic_num_gpus_per_node"
                           r"|num_nodes|prefill_num_servers|rollout_num_gpus_per_engine|eval_num_gpus_per_engine)$")  # fmt: skip
SERVER_ARG_KEYS = ("mem_fraction_static", "chunked_prefill_size", "context_length", "tp_size", "port",
                   "mem_fraction_statc", "model_path", "enable_memory_saver", "api_key")  # fmt: skip
PRESETS = ("default", "pd", "actor_ref", "pd_actor_ref", "multi_model", "placeholder", "agentic_32gpu")

LONG = "x" * 300
INTERPOLATIONS = ("${seed}", "${nonexistent}", "${..policy}", "${.policy}", "${oc.env:HOME}", "${hf_checkpoint}",
                  "${msp.trainer:hf_checkpoint,null}", "${msp.trainer:rollout_num_gpus,8}", "${sglang.actor}",
                  "${oc.select:missing,3}", "'${seed}'")  # fmt: skip
ODD_TEXT = ("", "'", "{", "[1,", "a=b=c", "${", "\\", "\x00", "é", "null", "~", "???", "1e", "0x10", "-0")


def _near_misses(key: str) -> st.SearchStrategy[str]:
    def mutate(data: tuple[int, str]) -> str:
        index, how = data
        parts = key.split(".")
        last = parts[-1]
        i = index % max(len(last), 1)
        edits = {
            "drop": last[:i] + last[i + 1 :],
            "double": last[:i] + last[i : i + 1] * 2 + last[i + 1 :],
            "swap": last[:i] + last[i + 1 : i + 2] + last[i : i + 1] + last[i + 2 :],
            "upper": last.upper(),
            "dash": last.replace("_", "-"),
        }
        return ".".join([*parts[:-1], edits[how] or "x"])

    return st.tuples(st.integers(0, 40), st.sampled_from(["drop", "double", "swap", "upper", "dash"])).map(
        mutate
    )


keys = st.one_of(
    st.sampled_from(SCHEMA_KEYS),
    st.sampled_from(SCHEMA_KEYS).flatmap(_near_misses),
    st.builds(
        lambda model, group, field: f"sglang.{model}.{group}.overrides.{field}",
        st.sampled_from(["actor", "actor", "ref"]),  # the default preset's model, mostly
        st.sampled_from(["regular", "regular", "prefill", "decode"]),
        st.sampled_from(SERVER_ARG_KEYS),
    ),
    st.builds(lambda field: f"sglang_deploy.server_defaults.{field}", st.sampled_from(SERVER_ARG_KEYS)),
    st.just(f"sglang.{LONG}.regular.num_gpus"),
    st.sampled_from(
        ["foo", "hydra.job.name", "sglang", "sglang_deploy", "sglang.actor", "sglang_deploy.launch"]
    ),
)
numbers = st.one_of(
    st.integers(-3, 64),
    st.sampled_from([10**30, -(10**30), 2**63, 1e308, -1e308, 0.5, 1e-300]),
    st.sampled_from(["nan", "inf", "-inf"]),
)
values = st.one_of(
    numbers.map(str),
    st.sampled_from(
        ["true", "false", "null", "abc", LONG, "[1,2]", "[]", "{a: 1}", "{}", "[a, [b]]", "/ckpt"]
    ),
    st.sampled_from(INTERPOLATIONS),
    st.sampled_from(ODD_TEXT),
    st.text(alphabet="abc_-.:/{}[]$,=' 0123456789", max_size=12),
)
prefixes = st.sampled_from(["", "", "", "+", "++", "~"])


def _well_typed(key: str) -> st.SearchStrategy[str]:
    """A value of the key's own type (so that sets get past composition and reach resolution and rendering)."""
    kind = SCHEMA_TYPES[key]
    if kind.startswith("int"):
        return st.integers(0, 16).map(str)
    if kind.startswith("float"):
        return st.sampled_from(["0.5", "2.0", "30"])
    if kind.startswith("bool"):
        return st.sampled_from(["true", "false"])
    if " | " in kind and "None" not in kind:  # an enum: its values
        return st.sampled_from(kind.split(" | "))
    if kind.startswith("str"):
        return st.sampled_from(["round_robin", "/ckpt/b", "127.0.0.1", "auto", "never"])
    return st.sampled_from(["[]", "{}"])


well_typed = st.sampled_from(SCHEMA_KEYS).flatmap(
    lambda key: _well_typed(key).map(lambda value: f"{key}={value}")
)


def _override(prefix: str, key: str, value: str) -> str:
    if GPU_COUNT_KEY.search(key) and re.fullmatch(r"-?\d+", value) and abs(int(value)) >= GPU_COUNT_CAP:
        value = str(GPU_COUNT_CAP - 1)
    if prefix == "~":
        return f"~{key}" if value in ("", "null") else f"~{key}={value}"
    return f"{prefix}{key}={value}"


choices = st.one_of(
    st.builds(lambda p: f"sglang={p}", st.sampled_from([*PRESETS, "null", "nope", LONG, "[pd,default]", "pd,default"])),
    st.builds(lambda p: f"sglang_deploy={p}", st.sampled_from(["default", "simulated", "null", "1", "{}"])),
    st.sampled_from(["+sglang_model=base", "+sglang_model@sglang.judge=base", "+sglang_group=decode",
                     "+sglang_group@sglang.actor.extra_groups.d2=decode", "~sglang", "~sglang_deploy"]),
)  # fmt: skip
overrides = st.one_of(choices, well_typed, well_typed, st.builds(_override, prefixes, keys, values))
override_sets = st.lists(overrides, max_size=6).map(lambda extra: ["hf_checkpoint=/ckpt", *extra])


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _plan_in_process(args: list[str]) -> tuple[int | None, str, BaseException | None]:
    """(status, output, what escaped main) of ``miles-sglang plan ARGS`` in a worker thread; status None: it did
    not return within the bound."""
    out, result = io.StringIO(), {}

    def run() -> None:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                result["rc"] = main(["plan", *args])
        except BaseException as exc:  # anything escaping main counts, SystemExit included
            result["exc"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(IN_PROCESS_TIMEOUT_S)
    return result.get("rc"), out.getvalue(), result.get("exc")


class _Budget:
    baseline_mib: float | None = None


@pytest.mark.slow
@settings(
    max_examples=IN_PROCESS_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(args=override_sets, json_output=st.booleans())
def test_plan_never_crashes_hangs_or_grows_in_process(args: list[str], json_output: bool) -> None:
    if _Budget.baseline_mib is None:
        _Budget.baseline_mib = _peak_rss_mib()
    rc, output, escaped = _plan_in_process(["--json", *args] if json_output else args)
    event(f"status {rc}")
    assert escaped is None, f"{args}: {type(escaped).__name__}: {escaped}"
    assert rc is not None, f"{args}: no answer within {IN_PROCESS_TIMEOUT_S} s"
    assert rc in (0, 2), f"{args}: status {rc}\n{output[-2000:]}"
    assert "Traceback" not in output, f"{args}\n{output[-3000:]}"
    if rc == 2:
        assert "error:" in output, f"{args}\n{output[-2000:]}"
    growth = _peak_rss_mib() - _Budget.baseline_mib
    assert growth < IN_PROCESS_RSS_GROWTH_MIB, f"{args}: peak RSS grew by {growth:.0f} MiB"


def _wait_with_usage(proc: subprocess.Popen, timeout_s: float) -> tuple[int, resource.struct_rusage] | None:
    """(exit status, resource usage) of ``proc`` from ``wait4``; None (and the child killed) past the bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage
        if time.monotonic() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            proc.returncode = -9
            return None
        time.sleep(0.05)


@pytest.mark.slow
@settings(max_examples=SUBPROCESS_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(args=override_sets)
def test_plan_never_crashes_hangs_or_grows_in_a_subprocess(args: list[str], tmp_path_factory) -> None:
    cwd = tmp_path_factory.mktemp("fuzz")
    with open(cwd / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "miles_sglang_plugin", "plan", *args],
            cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    waited = _wait_with_usage(proc, SUBPROCESS_TIMEOUT_S)
    assert waited is not None, f"{args}: no answer within {SUBPROCESS_TIMEOUT_S} s"
    rc, usage = waited
    stderr = (cwd / "stderr.txt").read_text()
    assert rc in (0, 2), f"{args}: status {rc}\n{stderr[-2000:]}"
    assert "Traceback" not in stderr, f"{args}\n{stderr[-3000:]}"
    assert usage.ru_maxrss / 1024 < SUBPROCESS_RSS_MIB, f"{args}: peak RSS {usage.ru_maxrss / 1024:.0f} MiB"


# ------------------------------------------------------------------- cases for the rest of issue 12
def _plan_subprocess(args: list[str], tmp_path: Path, timeout: float) -> tuple[int | None, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "miles_sglang_plugin", "plan", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, ""
    return proc.returncode, proc.stderr


def test_a_huge_gpu_count_is_refused_quickly(tmp_path: Path) -> None:
    rc, stderr = _plan_subprocess(
        ["hf_checkpoint=/c", "sglang.actor.regular.num_gpus=1000000000"], tmp_path, 120
    )
    assert rc == 2 and "Traceback" not in stderr


def test_a_non_string_model_path_override_is_a_clean_error(capsys) -> None:
    rc = main(["plan", "hf_checkpoint=/c", "+sglang.actor.regular.overrides.model_path=5"])
    assert rc == 2 and "Traceback" not in capsys.readouterr().err
