"""Tests of miles_sglang_plugin.rendering.sglang_server_args against the installed SGLang (CPU-only, triton not needed)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles_sglang_plugin.rendering import sglang_server_args as ssa
from miles_sglang_plugin.rendering.sglang_server_args import (
    SGLangArgvError,
    SGLangUnavailableError,
    load_sglang_server_args_module,
    parse_launch_argv,
    server_args_fields,
    sglang_version,
    suggest_field_names,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
FIELDS_0_5_23 = REPO_ROOT / "miles_sglang_plugin" / "data" / "sglang_server_args_fields.txt"

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="SGLang is not installed (on a CPU machine: `bash scripts/install-sglang-cpu.sh` in the venv)",
)

REALISTIC_ARGV = [
    "--model-path", "/nonexistent/x",
    "--tp-size", "2",
    "--port", "31000",
    "--host", "127.0.0.1",
    "--base-gpu-id", "0",
    "--nccl-port", "31001",
    "--disaggregation-mode", "prefill",
    "--disaggregation-bootstrap-port", "9001",
    "--enable-memory-saver",
    "--trust-remote-code",
    "--skip-server-warmup",
    "--random-seed", "7",
    "--nnodes", "2",
    "--node-rank", "1",
    "--dist-init-addr", "127.0.0.1:5000",
]  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Without SGLang
# --------------------------------------------------------------------------------------------------------------


def test_suggest_field_names_normalises_dashes() -> None:
    fields = ["mem_fraction_static", "max_running_requests", "tp_size", "pp_size", "port"]
    assert suggest_field_names("mem_fraction_statc", fields)[0] == "mem_fraction_static"
    assert suggest_field_names("mem-fraction-statc", fields)[0] == "mem_fraction_static"
    assert suggest_field_names("--mem-fraction-statc", fields)[0] == "mem_fraction_static"
    assert suggest_field_names("tp_sise", fields, n=1) == ["tp_size"]
    assert suggest_field_names("completely_unrelated_name", fields) == []
    assert len(suggest_field_names("p_size", fields, n=2)) <= 2


def test_parse_rejects_a_single_string() -> None:
    with pytest.raises(TypeError, match="sequence of strings"):
        parse_launch_argv("--model-path /x")
    with pytest.raises(TypeError, match="only strings"):
        parse_launch_argv(["--tp-size", 2])  # type: ignore[list-item]


def test_parse_without_sglang_raises_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssa, "load_sglang_server_args_module", lambda: None)
    with pytest.raises(SGLangUnavailableError, match="not installed"):
        parse_launch_argv(["--model-path", "/x"])


# --------------------------------------------------------------------------------------------------------------
# With SGLang
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.sglang
@needs_sglang
def test_fields_of_the_installed_sglang() -> None:
    fields = server_args_fields()
    assert fields is not None
    assert {
        "tp_size",
        "mem_fraction_static",
        "disaggregation_bootstrap_port",
        "enable_memory_saver",
    } <= fields
    if sglang_version() == "0.5.23":
        assert len(fields) == 546
        if FIELDS_0_5_23.is_file():
            expected = [line.strip() for line in FIELDS_0_5_23.read_text().splitlines() if line.strip()]
            assert fields == frozenset(expected)
            module = load_sglang_server_args_module()
            assert module is not None
            assert list(module.ServerArgs.__struct_fields__) == expected  # declaration order too


@pytest.mark.sglang
@needs_sglang
def test_version_is_reported() -> None:
    version = sglang_version()
    assert version is not None
    assert version[0].isdigit()


@pytest.mark.sglang
@needs_sglang
def test_parse_realistic_argv() -> None:
    parsed = parse_launch_argv(REALISTIC_ARGV)
    expected = {
        "model_path": "/nonexistent/x",
        "tp_size": 2,
        "port": 31000,
        "host": "127.0.0.1",
        "base_gpu_id": 0,
        "nccl_port": 31001,
        "disaggregation_mode": "prefill",
        "disaggregation_bootstrap_port": 9001,
        "enable_memory_saver": True,
        "trust_remote_code": True,
        "skip_server_warmup": True,
        "random_seed": 7,
        "nnodes": 2,
        "node_rank": 1,
        "dist_init_addr": "127.0.0.1:5000",
        # Not on the command line: SGLang's defaults.
        "pp_size": 1,
        "ep_size": 1,
        "device": None,
    }
    for field, value in expected.items():
        assert parsed[field] == value, field
        assert type(parsed[field]) is type(value), field
    assert set(parsed) == server_args_fields()
    assert next(iter(parsed)) == "model_path"


@pytest.mark.sglang
@needs_sglang
def test_parse_defaults_of_0_5_23() -> None:
    if sglang_version() != "0.5.23":
        pytest.skip("defaults recorded for sglang 0.5.23")
    parsed = parse_launch_argv(["--model-path", "/nonexistent/x"])
    assert parsed["disaggregation_transfer_backend"] == "mooncake"
    assert parsed["disaggregation_bootstrap_port"] == 8998
    assert parsed["disaggregation_mode"] == "null"
    assert parsed["enable_memory_saver"] is False
    assert parsed["enable_lora"] is None
    assert parsed["max_loras_per_batch"] == 8
    assert parsed["dist_init_addr"] is None


@pytest.mark.sglang
@needs_sglang
def test_invalid_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model-path", "/nonexistent/x", "--tp-size", "abc"]
    with pytest.raises(SGLangArgvError) as info:
        parse_launch_argv(argv)
    message = str(info.value)
    assert "--tp-size" in message
    assert "abc" in message
    assert info.value.exit_code == 2
    assert info.value.argv == tuple(argv)
    assert "invalid int value" in info.value.parser_output
    assert isinstance(info.value, ValueError)
    assert capsys.readouterr() == ("", "")  # argparse's usage/error text went into the exception only


@pytest.mark.sglang
@needs_sglang
def test_unknown_flag_names_the_flag_and_suggests() -> None:
    with pytest.raises(SGLangArgvError) as info:
        parse_launch_argv(["--model-path", "/nonexistent/x", "--mem-fraction-statc", "0.8"])
    message = str(info.value)
    assert "unrecognized arguments" in message
    assert "--mem-fraction-statc" in message
    assert "mem_fraction_static" in message  # the suggestion


@pytest.mark.sglang
@needs_sglang
def test_missing_model_path_and_help_are_argv_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SGLangArgvError, match="--model-path"):
        parse_launch_argv([])
    with pytest.raises(SGLangArgvError, match="help") as info:
        parse_launch_argv(["--help"])
    assert info.value.exit_code == 0
    assert "--tp-size" in info.value.parser_output
    assert capsys.readouterr() == ("", "")


@pytest.mark.sglang
@needs_sglang
def test_suggestions_from_the_real_fields() -> None:
    fields = server_args_fields()
    assert fields is not None
    assert suggest_field_names("mem_fraction_statc", fields)[0] == "mem_fraction_static"
    assert (
        suggest_field_names("--disaggregation-bootstrap-prot", fields)[0] == "disaggregation_bootstrap_port"
    )


@pytest.mark.sglang
@needs_sglang
def test_module_is_cached_across_parses() -> None:
    module = load_sglang_server_args_module()
    assert module is not None
    misses = load_sglang_server_args_module.cache_info().misses
    for i in range(20):
        parsed = parse_launch_argv(["--model-path", f"/nonexistent/m{i}", "--port", str(30000 + i)])
        assert parsed["port"] == 30000 + i
    assert load_sglang_server_args_module() is module
    assert sys.modules["sglang.srt.server_args"] is module
    assert load_sglang_server_args_module.cache_info().misses == misses


@pytest.mark.sglang
@needs_sglang
def test_parse_keeps_the_host_logging_configuration() -> None:
    class Recording(logging.Handler):
        closed = False

        def emit(self, record: logging.LogRecord) -> None:
            pass

        def close(self) -> None:
            self.closed = True
            super().close()

    root = logging.getLogger()
    handler = Recording()
    root.addHandler(handler)
    handlers, level = list(root.handlers), root.level
    try:
        parse_launch_argv(["--model-path", "/nonexistent/x", "--log-level", "debug"])
        with pytest.raises(SGLangArgvError, match="arguments are required: --model-path"):
            parse_launch_argv(["--bogus-flag"])
        assert root.handlers == handlers
        assert root.level == level
        assert not handler.closed
    finally:
        root.removeHandler(handler)


_FRESH_PROCESS_CHECK = textwrap.dedent(
    """
    import importlib.util, json, os, sys

    triton_before = importlib.util.find_spec("triton") is not None
    from miles_sglang_plugin.rendering import sglang_server_args as ssa
    imported_sglang_early = "sglang" in sys.modules
    module = ssa.load_sglang_server_args_module()
    parsed = ssa.parse_launch_argv(["--model-path", "/nonexistent/x", "--tp-size", "2"])

    import torch

    stub_leftovers = sorted(
        name for name, value in vars(torch.mps).items()
        if getattr(value, "__module__", None) == ssa._STUBS_MODULE_NAME
    )
    try:
        import triton  # noqa: F401
        triton_importable = True
    except ImportError:
        triton_importable = False
    print(json.dumps({
        "imported_sglang_early": imported_sglang_early,
        "tp_size": parsed["tp_size"],
        "tensor": (torch.zeros(2) + 1).tolist(),
        "cuda_initialized": torch.cuda.is_initialized(),
        "tensor_to_restored": torch.Tensor.to is torch._C.TensorBase.to,
        "tensor_copy_restored": torch.Tensor.copy_ is torch._C.TensorBase.copy_,
        "mps_stub_leftovers": stub_leftovers,
        "triton_before": triton_before,
        "triton_importable_after": triton_importable,
        "cache_env_leaked": sorted(k for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR") if k in os.environ),
    }))
    """
)


@pytest.mark.sglang
@needs_sglang
def test_fresh_process_torch_still_works_and_nothing_leaks() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_CHECK],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Importing, loading and parsing printed nothing to stdout: the JSON line is all there is.
    assert len(proc.stdout.splitlines()) == 1, proc.stdout
    result = json.loads(proc.stdout)
    assert result["imported_sglang_early"] is False
    assert result["tp_size"] == 2
    assert result["tensor"] == [1.0, 1.0]
    assert result["cuda_initialized"] is False
    assert result["tensor_to_restored"] is True
    assert result["tensor_copy_restored"] is True
    assert result["mps_stub_leftovers"] == []
    assert result["triton_importable_after"] is result["triton_before"]
    assert result["cache_env_leaked"] == []
