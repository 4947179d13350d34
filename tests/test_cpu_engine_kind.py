"""The ``cpu_sglang`` engine kind as rendered (``rendering/cpu_engine.py``): the command line of the ``sglang``
kind with the documented CPU substitutions, its environment and the plan's notes. No engine starts here (the
real-engine lane, ``tests/test_real_engine.py``, starts these command lines).

Values worked out by hand as in ``tests/test_launch_specs.py``: ports from 15000 (router 15000-15001, engine
http 15002, nccl 15003, dist-init 15004, engine-info bootstrap 15035), seed 1234."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles_sglang_plugin.app.hydra_edge import prepare_from_config
from miles_sglang_plugin.config.compose import CompositionError, compose_config
from miles_sglang_plugin.rendering import cpu_engine

ONE_ENGINE = ["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=1"]
COLOCATED = ["hf_checkpoint=/c", "colocate=true", "actor_num_gpus_per_node=1",
             "sglang.actor.regular.num_gpus=1"]  # fmt: skip
SHIM = Path(__file__).resolve().parent.parent / "miles_sglang_plugin" / "cpu_engine_shim"
SGLANG_ARGV = (
    sys.executable, "-m", "sglang.launch_server", "--model-path", "/c", "--trust-remote-code",
    "--random-seed", "1234", "--host", "127.0.0.1", "--port", "15002", "--nccl-port", "15003",
    "--dist-init-addr", "127.0.0.1:15004", "--nnodes", "1", "--node-rank", "0", "--base-gpu-id", "0",
    "--gpu-id-step", "1", "--tp-size", "1", "--skip-server-warmup", "--enable-metrics",
    "--enable-draft-weights-cpu-backup", "--engine-info-bootstrap-port", "15035",
)  # fmt: skip
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
             "--disable-cuda-graph")  # fmt: skip


def _engine(*overrides: str):
    (launch,) = prepare_from_config(compose_config(list(overrides))).launch.engines
    return launch


def test_the_cpu_command_line_is_the_sglang_one_with_the_cpu_flags():
    # The default KV cache size comes first (the lowest layer), the CPU flags last (over everything).
    assert _engine(*ONE_ENGINE).argv == SGLANG_ARGV
    cpu = _engine(*ONE_ENGINE, "sglang_deploy=cpu_sglang")
    assert cpu.argv == (*SGLANG_ARGV[:3], "--max-total-tokens", "8192", *SGLANG_ARGV[3:], *CPU_FLAGS)


def test_memory_saver_and_cuda_graph_settings_are_left_out_with_a_note():
    # Colocated: the sglang kind renders --cuda-graph-backend-prefill disabled (Miles) and --enable-memory-saver.
    sglang = _engine(*COLOCATED)
    assert "--enable-memory-saver" in sglang.argv and "--cuda-graph-backend-prefill" in sglang.argv
    prepared = prepare_from_config(compose_config([*COLOCATED, "sglang_deploy=cpu_sglang"]))
    (cpu,) = prepared.launch.engines
    left_out = ("--enable-memory-saver", "--cuda-graph-backend-prefill", "disabled")
    kept = [a for a in sglang.argv if a not in left_out]
    assert cpu.argv == (*kept[:3], "--max-total-tokens", "8192", *kept[3:], *CPU_FLAGS)
    assert prepared.launch.notes == (
        "cpu_sglang: real SGLang on the CPU: every engine gets --device cpu --attention-backend torch_native "
        "--disable-overlap-schedule --disable-cuda-graph (and --max-total-tokens 8192 unless set), "
        f"SGLANG_USE_CPU_ENGINE=1 and the CPU shim first on PYTHONPATH ({SHIM})",
        "cpu_sglang: left out cuda_graph_backend_prefill: CUDA graphs need a GPU (--disable-cuda-graph instead)",
        "cpu_sglang: left out enable_memory_saver: torch_memory_saver needs CUDA (libcuda.so.1); on a CPU "
        "offload releases nothing",
    )
    # The plan still decides offload: the control handle offloads the group (a CPU engine answers and keeps serving).
    assert prepared.plan.models[0].groups[0].needs_offload is True


def test_the_kv_cache_default_gives_way_to_server_defaults_and_overrides_but_the_cpu_flags_do_not():
    cpu = _engine(*ONE_ENGINE, "sglang_deploy=cpu_sglang", "+sglang_deploy.server_defaults.max_total_tokens=4096",
                  "+sglang.actor.regular.overrides.attention_backend=triton",
                  "+sglang.actor.regular.overrides.cuda_graph_max_bs_decode=8")  # fmt: skip
    assert cpu.server_args["max_total_tokens"] == 4096
    assert cpu.server_args["attention_backend"] == "torch_native"
    assert "cuda_graph_max_bs_decode" not in cpu.server_args
    assert cpu.argv.count("--max-total-tokens") == 1 and cpu.argv.count("--attention-backend") == 1


def test_the_environment_puts_the_shim_before_the_users_pythonpath():
    env = _engine(*ONE_ENGINE, "sglang_deploy=cpu_sglang").env
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"] == str(SHIM)
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    # Miles' engine environment, as for the sglang kind: /health answers without generating.
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    env = _engine(*ONE_ENGINE, "sglang_deploy=cpu_sglang", "+sglang_deploy.env.PYTHONPATH=/opt/mine").env
    assert env["PYTHONPATH"] == f"{SHIM}:/opt/mine"
    # The other kinds get neither.
    for kind in ("default", "simulated"):
        env = _engine(*ONE_ENGINE, f"sglang_deploy={kind}").env
        assert "SGLANG_USE_CPU_ENGINE" not in env and "PYTHONPATH" not in env


def test_the_shim_directory_holds_the_kernel_module_and_the_device_fix():
    assert cpu_engine.CPU_SHIM_DIR == SHIM
    assert sorted(p.name for p in SHIM.iterdir() if p.name != "__pycache__") == [
        "README.md", "sgl_kernel", "sitecustomize.py"
    ]  # fmt: skip
    assert (SHIM / "sgl_kernel" / "__init__.py").is_file()
    assert not (SHIM / "__init__.py").exists()  # a directory for PYTHONPATH, not a package of this project


def test_a_misspelt_kind_is_refused_listing_the_three():
    with pytest.raises(CompositionError) as info:
        compose_config([*ONE_ENGINE, "sglang_deploy.launch.engine=cpu-sglang"])
    assert "Invalid value 'cpu-sglang', expected one of [sglang, simulated, cpu_sglang]" in str(info.value)
    assert "full_key: sglang_deploy.launch.engine" in str(info.value)


def test_the_plan_json_names_the_kind():
    prepared = prepare_from_config(compose_config([*ONE_ENGINE, "sglang_deploy=cpu_sglang"]))
    data = prepared.to_dict()
    assert data["engine_kind"] == "cpu_sglang"
    (engine,) = data["models"]["actor"]["groups"]["regular"]["engines"]
    (process,) = engine["launch"]
    assert process["env"]["SGLANG_USE_CPU_ENGINE"] == "1"
    assert process["env"]["PYTHONPATH"] != str(SHIM)  # masked, as every variable the package does not own
