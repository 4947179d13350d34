"""The `sglang` config group through real Hydra composition: presets, overrides, interpolation, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from miles_sglang_plugin.app.hydra_edge import resolve_config
from miles_sglang_plugin.cli import main as cli_main
from miles_sglang_plugin.config.compose import CompositionError, compose_config
from miles_sglang_plugin.config.reading import deploy_settings_from_config, spec_from_config
from miles_sglang_plugin.config.schema import EngineKind
from miles_sglang_plugin.errors import DeploymentConfigError

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (REPO / "conf" / "sglang").glob("*.yaml"))


def plan_for(*overrides: str):
    return resolve_config(compose_config(list(overrides)))


def test_presets_are_all_there_and_resolve():
    assert PRESETS == [
        "actor_ref", "actor_ref_1node", "agentic_32gpu", "default", "multi_model", "pd", "pd_actor_ref",
        "pd_actor_ref_1node", "placeholder",
    ]  # fmt: skip
    for name in PRESETS:
        plan = plan_for(f"sglang={name}", "hf_checkpoint=/ckpt")
        assert plan.total_gpus > 0


def test_pd_actor_ref_with_twelve_decode_gpus():
    plan = plan_for(
        "sglang=pd_actor_ref",
        "sglang.actor.decode.num_gpus=12",
        "hf_checkpoint=/ckpt",
        "rollout_num_gpus_per_engine=4",
    )
    actor, ref = plan.models
    assert (actor.name, actor.is_pd, actor.update_weights, actor.model_path) == ("actor", True, True, "/ckpt")
    assert [
        (g.name, g.num_gpus, g.num_gpus_per_engine, g.gpu_offset, len(g.engines)) for g in actor.groups
    ] == [
        ("prefill", 8, 4, 0, 2),
        ("decode", 12, 4, 8, 3),
    ]
    # ref: 4 GPUs at offset 20; every TP from the trainer's rollout_num_gpus_per_engine (the preset pins none).
    assert [(g.num_gpus, g.num_gpus_per_engine, g.gpu_offset, len(g.engines)) for g in ref.groups] == [
        (4, 4, 20, 1)
    ]
    assert (ref.update_weights, ref.model_path) == (False, "/ckpt")
    assert plan.rollout_num_gpus == 24 and plan.rollout_offset == 8  # after 1 node x 8 actor GPUs
    assert plan.model("actor").group("decode").engines[2].gpu_slots == (24, 25, 26, 27)


def test_num_gpus_per_engine_interpolates_group_then_model_then_trainer():
    cfg = compose_config(["sglang=pd_actor_ref", "rollout_num_gpus_per_engine=2"])
    assert cfg.sglang.ref.num_gpus_per_engine == 2  # model <- trainer
    assert cfg.sglang.ref.regular.num_gpus_per_engine == 2  # group <- model
    assert (
        cfg.sglang.actor.decode.num_gpus_per_engine == 2
    )  # group <- model <- trainer (the preset pins none)
    cfg = compose_config(["sglang=pd_actor_ref", "sglang.ref.num_gpus_per_engine=4"])
    assert cfg.sglang.ref.regular.num_gpus_per_engine == 4
    cfg = compose_config(
        [
            "sglang=pd_actor_ref",
            "sglang.ref.num_gpus_per_engine=4",
            "sglang.ref.regular.num_gpus_per_engine=1",
            "hf_checkpoint=/c",
        ]
    )
    plan = resolve_config(cfg)
    assert [len(g.engines) for g in plan.model("ref").groups] == [4]


def test_model_path_interpolates_to_the_trainer_checkpoint():
    cfg = compose_config(["sglang=agentic_32gpu", "hf_checkpoint=/data/models/Qwen3-8B"])
    assert cfg.sglang.actor.model_path == "/data/models/Qwen3-8B"
    assert cfg.sglang.ref.model_path == "/data/models/Qwen3-32B"
    plan = resolve_config(cfg)
    assert [(m.name, m.update_weights) for m in plan.models] == [
        ("actor", True),
        ("ref", False),
        ("reward", False),
    ]
    assert plan.total_gpus == 32
    assert plan.model("actor").group("decode").overrides["mem_fraction_static"] == 0.88


def test_untouched_defaults_are_passed_as_inherit():
    cfg = compose_config(["sglang=default", "hf_checkpoint=/c"])
    spec = spec_from_config(cfg)
    (m,) = spec.models
    assert (m.model_path, m.num_gpus_per_engine, m.groups[0].num_gpus_per_engine) == (None, None, None)
    assert [g.name for g in m.groups] == ["regular"]  # num_gpus: 0 slots are off


def test_typo_and_wrong_type_fail_at_compose_time_with_the_full_key():
    with pytest.raises(CompositionError) as exc:
        compose_config(["sglang=pd", "sglang.actor.decode.num_gpu=12"])
    assert "Key 'num_gpu' not in 'ServerGroupConf'" in str(exc.value)
    assert "full_key: sglang.actor.decode.num_gpu" in str(exc.value)
    with pytest.raises(CompositionError) as exc:
        compose_config(["sglang=pd", "sglang.actor.decode.num_gpus=twelve"])
    assert "Value 'twelve' of type 'str' could not be converted to Integer" in str(exc.value)
    with pytest.raises(CompositionError) as exc:
        compose_config(["sglang=pdd"])
    assert "Could not find 'sglang/pdd'" in str(exc.value)
    assert "pd_actor_ref" in str(exc.value)  # Hydra lists the available options


def test_add_a_model_a_group_and_an_extra_group_from_the_command_line():
    plan = plan_for(
        "sglang=pd_actor_ref",
        "hf_checkpoint=/ckpt",
        "sglang.actor.num_gpus_per_engine=4",
        "+sglang_model@sglang.reward=base",
        "sglang.reward.model_path=/rm",
        "sglang.reward.update_weights=false",
        "sglang.reward.regular.num_gpus=2",
        "sglang.ref.placeholder.num_gpus=4",
        "+sglang_group@sglang.actor.extra_groups.decode_tp8=decode",
        "sglang.actor.extra_groups.decode_tp8.num_gpus=8",
        "sglang.actor.extra_groups.decode_tp8.num_gpus_per_engine=8",
        "+sglang.actor.decode.overrides.mem_fraction_static=0.8",
    )
    assert [m.name for m in plan.models] == ["actor", "ref", "reward"]
    assert [
        (g.name, g.worker_type.value, g.num_gpus_per_engine, g.gpu_offset) for g in plan.model("actor").groups
    ] == [
        ("prefill", "prefill", 4, 0),
        ("decode", "decode", 4, 8),
        ("decode_tp8", "decode", 8, 16),
    ]
    assert [(g.name, g.gpu_offset) for g in plan.model("ref").groups] == [
        ("regular", 24),
        ("placeholder", 28),
    ]
    assert plan.model("reward").groups[0].gpu_offset == 32 and plan.model("reward").model_path == "/rm"
    assert plan.model("actor").group("decode").overrides["mem_fraction_static"] == 0.8


def test_group_order_changes_the_layout_and_is_checked():
    plan = plan_for(
        "sglang=placeholder", "hf_checkpoint=/c", "sglang.actor.group_order=[placeholder,regular]"
    )
    assert [(g.name, g.gpu_offset) for g in plan.model("actor").groups] == [
        ("placeholder", 0),
        ("regular", 2),
    ]
    with pytest.raises(DeploymentConfigError) as exc:
        plan_for("sglang=placeholder", "hf_checkpoint=/c", "sglang.actor.group_order=[regular,decoder]")
    assert "sglang.actor.group_order: names groups that do not exist: ['decoder']" in str(exc.value)
    assert "missing: ['placeholder']" in str(exc.value)


def test_remove_a_model_and_pin_rollout_num_gpus():
    plan = plan_for("sglang=pd_actor_ref", "~sglang.ref", "hf_checkpoint=/c", "rollout_num_gpus=16")
    assert [m.name for m in plan.models] == ["actor"]
    with pytest.raises(DeploymentConfigError) as exc:
        plan_for("sglang=pd_actor_ref", "hf_checkpoint=/c", "rollout_num_gpus=16")
    assert "rollout_num_gpus: is 16 but the server groups hold 20 GPUs (actor=16, ref=4)" in str(exc.value)


def test_multi_model_paths():
    plan = plan_for("sglang=multi_model", "hf_checkpoint=/c", "sglang.reward.model_path=/rm")
    assert [(m.name, m.model_path, m.update_weights) for m in plan.models] == [
        ("actor", "/c", True),
        ("ref", "/c", False),
        ("reward", "/rm", False),
    ]


def test_deploy_settings_and_the_simulated_and_cpu_options():
    assert deploy_settings_from_config(compose_config(["sglang=pd"])).launch.engine is EngineKind.sglang
    settings = deploy_settings_from_config(compose_config(["sglang=pd", "sglang_deploy=simulated"]))
    assert settings.launch.engine is EngineKind.simulated
    settings = deploy_settings_from_config(compose_config(["sglang=pd", "sglang_deploy=cpu_sglang"]))
    assert settings.launch.engine is EngineKind.cpu_sglang
    settings = deploy_settings_from_config(
        compose_config(["sglang=pd", "sglang_deploy.router.policy=round_robin"])
    )
    assert settings.router.policy == "round_robin"


# ------------------------------------------------------------------------------------------------ CLI
def test_plan_runs_the_collector_rarely_and_gives_its_thresholds_back(capsys, monkeypatch):
    """``plan`` makes a plan with the cyclic collector's first threshold at 200,000 (mypy's), and leaves the
    process's thresholds as it found them, also when the plan is refused."""
    import gc

    import miles_sglang_plugin.app.hydra_edge as hydra_edge

    seen = []
    real = hydra_edge.prepare_from_config

    def recording(*args, **kwargs):
        seen.append(gc.get_threshold())
        return real(*args, **kwargs)

    monkeypatch.setattr(hydra_edge, "prepare_from_config", recording)
    before = gc.get_threshold()
    gc.set_threshold(700, 11, 12)  # not Python's defaults, so that a reset to them would show
    try:
        assert cli_main(["plan", "--json", "hf_checkpoint=/c", "debug_rollout_only=true"]) == 0
        assert gc.get_threshold() == (700, 11, 12)
        assert cli_main(["plan", "hf_checkpoint=/c", "sglang.actor.regular.num_gpus=-1"]) == 2
        assert gc.get_threshold() == (700, 11, 12)
    finally:
        gc.set_threshold(*before)
    assert seen == [(200_000, 30, 30), (200_000, 30, 30)]


def test_plan_json_fields(capsys):
    # Not colocated: rollout from slot 8 (after the 1 x 8 actor), Megatron on 0..7, so with offload on no group
    # needs it and each gets the memory saver off. prefill 8 (TP 4) at slots 8-15, decode 8 at 16-23, ref 4
    # (TP 1) at 24-27. Ranks: prefill 0, 1; decode 2, 3; ref 4..7.
    assert (
        cli_main(
            [
                "plan",
                "--json",
                "sglang=pd_actor_ref",
                "hf_checkpoint=/c",
                "sglang.actor.num_gpus_per_engine=4",
                "offload_rollout=true",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["rollout_offset"] == 8 and data["megatron_num_gpus"] == 8 and data["total_gpus"] == 20
    assert data["derived"] == {"trainer": {}, "server_defaults": {}}
    assert data["notes"] == [
        # offload asked for, but rollout starts after the trainer's slots 0-7: nothing to offload
        "offload_rollout=true, but no engine group sits on the trainer's GPUs (rollout starts at slot 8, the "
        "trainer trains on slots 0-7): nothing is offloaded (Miles offloads only groups that start below the "
        "trainer's GPUs; colocate=true puts them there)",
        "left out prefill_round_robin_balance: Miles sets it, but the installed SGLang has no such ServerArgs field",
    ]
    decode = data["models"]["actor"]["groups"]["decode"]
    assert (decode["gpu_offset"], decode["needs_offload"], decode["num_gpus_per_engine"]) == (8, False, 4)
    assert (decode["tp_size"], decode["pp_size"], decode["dp_size"]) == (4, 1, 1)
    assert [e["rank"] for e in decode["engines"]] == [2, 3]
    assert decode["overrides"] == {"model_path": "/c", "enable_memory_saver": False}
    prefill = data["models"]["actor"]["groups"]["prefill"]
    assert prefill["needs_offload"] is False and prefill["overrides"]["enable_memory_saver"] is False
    launch = prefill["engines"][1].pop("launch")
    assert [(p["node_rank"], p["url"] is not None) for p in launch] == [(0, True)]
    assert launch[0]["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert prefill["engines"][1] == {
        "id": "actor.prefill.1",
        "index": 1,
        "rank": 1,
        "gpu_slots": [12, 13, 14, 15],
        "node": 1,
        "local_gpu_ids": [4, 5, 6, 7],
        "nnodes": 1,
        "processes": [
            {
                "node": 1,
                "node_rank": 0,
                "rank": 1,
                "gpu_slots": [12, 13, 14, 15],
                "local_gpu_ids": [4, 5, 6, 7],
            }
        ],
    }
    ref = data["models"]["ref"]["groups"]["regular"]["engines"]
    assert [(e["node"], e["rank"]) for e in ref] == [(3, 4), (3, 5), (3, 6), (3, 7)]


def test_plan_shows_what_miles_derives_for_a_colocated_run(capsys):
    # Miles (arguments.py, --colocate): offload_rollout on unless given, rollout_num_gpus = the actor's 1 x 8,
    # and cuda_graph_backend_prefill=disabled on the engines unless --sglang-cuda-graph-backend-prefill is set.
    assert (
        cli_main(["plan", "--json", "--commands", "sglang=default", "hf_checkpoint=/c", "colocate=true"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["derived"] == {
        "trainer": {"offload_rollout": True, "rollout_num_gpus": 8},
        "server_defaults": {"cuda_graph_backend_prefill": "disabled"},
    }
    assert data["offload_rollout"] is True and data["rollout_num_gpus"] == 8
    assert [n.split(":")[0] for n in data["notes"]] == [
        "offload_rollout=true",
        "rollout_num_gpus=8",
        "cuda_graph_backend_prefill=disabled on every engine",
    ]
    group = data["models"]["actor"]["groups"]["regular"]
    assert group["needs_offload"] is True
    argv = group["engines"][0]["launch"][0]["argv"]
    assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert "--enable-memory-saver" in argv

    # Given values stay: an explicit --no-offload-rollout, and the user's prefill CUDA graph backend.
    assert cli_main(["plan", "--json", "sglang=default", "hf_checkpoint=/c", "colocate=true", "offload_rollout=false",
                     "+sglang_deploy.server_defaults.cuda_graph_backend_prefill=full"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["derived"] == {"trainer": {"rollout_num_gpus": 8}, "server_defaults": {}}
    assert data["offload_rollout"] is False
    assert data["notes"][-1] == (
        "colocate with cuda_graph_backend_prefill='full' may run out of memory (NVLS); Miles warns the same and "
        "defaults it to 'disabled'"
    )
    argv = data["models"]["actor"]["groups"]["regular"]["engines"][0]["launch"][0]["argv"]
    assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "full"

    # The table view prints the same notes.
    assert cli_main(["plan", "sglang=default", "hf_checkpoint=/c", "colocate=true"]) == 0
    out = capsys.readouterr().out
    assert "note: offload_rollout=true: colocate turns it on unless given (Miles)" in out
    assert (
        "note: rollout_num_gpus=8: colocate: the actor's GPUs (actor_num_nodes=1 x actor_num_gpus_per_node=8)"
        in out
    )


def test_plan_table_shows_nodes(capsys):
    assert cli_main(["plan", "sglang=placeholder", "hf_checkpoint=/c", "colocate=true"]) == 0
    out = capsys.readouterr().out
    assert "Node 0" in out and "actor.regular.2" in out and "placeholder" in out


def test_plan_user_errors_exit_2_without_traceback():
    cases = {
        (
            "sglang=pd",
            "sglang.actor.decode.num_gpus=10",
            "hf_checkpoint=/c",
            "rollout_num_gpus_per_engine=4",
        ): ("sglang.actor.decode.num_gpus: 10 GPUs do not split into engines of num_gpus_per_engine=4"),
        ("sglang=pd", "sglang.actor.decode.tp=2"): "Key 'tp' not in 'ServerGroupConf'",
    }
    for args, expected in cases.items():
        proc = subprocess.run(
            [sys.executable, "-m", "miles_sglang_plugin", "plan", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "error:" in proc.stderr
        assert expected in " ".join(proc.stderr.split())


def test_plan_error_message_lists_all_problems():
    proc = subprocess.run(
        [sys.executable, "-m", "miles_sglang_plugin", "plan", "sglang=pd", "sglang.actor.decode.num_gpus=10",
         "sglang.actor.decode.num_gpus_per_engine=4",
         "+sglang.actor.prefill.overrides.port=3000", "sglang.actor.regular.num_gpus=2", "hf_checkpoint=/c"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    err = " ".join(proc.stderr.split())
    assert "3 problems" in err
    assert "sglang.actor.decode.num_gpus: 10 GPUs do not split into engines of num_gpus_per_engine=4" in err
    assert "sglang.actor.prefill.overrides.port: cannot be overridden (3000)" in err
    assert "mixes regular groups with prefill/decode groups" in err


# ---------------------------------------------------------------------------------------- the example app
def run_example(*args: str, flags: tuple[str, ...] = (), tmp_path: Path) -> subprocess.CompletedProcess[str]:
    dirs = [f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"]
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "train.py"), *flags, *args, *dirs],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip


def test_example_app_first_command_plan(tmp_path):
    proc = run_example(
        "sglang=pd_actor_ref", "sglang.actor.decode.num_gpus=12", "plan_only=true", tmp_path=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    # TP 2 everywhere: the example app's rollout_num_gpus_per_engine (prefill 4, decode 6, ref 2 engines)
    assert "24 GPUs in 2 model(s), 12 engine(s)" in proc.stdout


def test_example_app_first_command_end_to_end_with_stand_ins(tmp_path):
    """The exact first command, plus the explicit choice of stand-in engines: up, one rollout step, down."""
    proc = run_example(
        "sglang=pd_actor_ref", "sglang.actor.decode.num_gpus=12", "sglang_deploy=simulated",
        f"sglang_deploy.launch.port_base={21000 + os.getpid() % 4000}", tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout 0: 4 samples" in proc.stdout
    assert "deployment stopped" in proc.stdout
    # 12 engines of TP 2 (the app's rollout_num_gpus_per_engine) over 3 planned nodes (rollout starts after
    # the actor's 8 GPUs): run side by side, said so.
    assert "they run side by side on this machine" in " ".join(proc.stderr.split())
    logs = sorted(p.name for p in (tmp_path / "run" / "sglang_logs").iterdir())
    assert logs == sorted(
        [f"actor.prefill.{i}.log" for i in range(4)] + [f"actor.decode.{i}.log" for i in range(6)]
        + [f"ref.regular.{i}.log" for i in range(2)] + ["router.actor.log", "router.ref.log"]
    )  # fmt: skip


def test_example_app_multirun_over_tp_sizes(tmp_path):
    proc = run_example(
        "-m",
        "sglang=pd_actor_ref",
        "sglang.actor.decode.num_gpus_per_engine=2,4,8",
        "plan_only=true",
        tmp_path=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    # prefill 4 engines + decode 8/gpe + ref 2 engines (TP 2 from the example's trainer config)
    for engines in (4 + 4 + 2, 4 + 2 + 2, 4 + 1 + 2):
        assert f"20 GPUs in 2 model(s), {engines} engine(s)" in proc.stdout


def test_example_app_cfg_job_resolve_shows_resolved_defaults(tmp_path):
    proc = run_example("sglang=pd_actor_ref", flags=("--cfg", "job", "--resolve"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.sglang.ref.regular.num_gpus_per_engine == 2  # from the app's rollout_num_gpus_per_engine
    assert cfg.sglang.ref.model_path == "/data/models/Qwen3-8B"  # from hf_checkpoint


def test_example_app_user_error_exits_2_cleanly(tmp_path):
    proc = run_example("sglang=pd", "sglang.actor.decode.num_gpus=11", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert (
        "sglang.actor.decode.num_gpus: 11 GPUs do not split into engines of num_gpus_per_engine=2"
        in " ".join(proc.stderr.split())
    )


# ------------------------------------------------------------------ the registration every Hydra app pays
def test_each_lazily_stored_node_loads_as_its_structured_schema() -> None:
    """The schemas are stored unbuilt (``LazyNode``) and built when Hydra first loads one: what
    ``ConfigStore.load`` hands out is the structured config ``ConfigStore.store`` would have stored."""
    from hydra.core.config_store import ConfigStore

    from miles_sglang_plugin.config.deployment_spec import WorkerType
    from miles_sglang_plugin.config.schema import (
        ExtraServerGroupConf,
        LaunchConf,
        MilesTrainerArgs,
        ModelConf,
        SGLangDeployConf,
        SGLangTrainerConf,
    )
    from miles_sglang_plugin.config.store import GROUP_OPTIONS, TRAINER_OPTIONS, register_configs
    from miles_sglang_plugin.config.trainer_mappings import TRAINER_MAPPING_KEY, TrainerKind

    register_configs()
    expected = {
        "sglang_model/base.yaml": ModelConf,
        "sglang_deploy/default.yaml": SGLangDeployConf,
        "sglang_deploy/simulated.yaml": SGLangDeployConf(launch=LaunchConf(engine=EngineKind.simulated)),
        "sglang_deploy/cpu_sglang.yaml": SGLangDeployConf(launch=LaunchConf(engine=EngineKind.cpu_sglang)),
        "miles_trainer_args.yaml": MilesTrainerArgs,
        **{f"sglang_group/{w}.yaml": ExtraServerGroupConf(worker_type=WorkerType(w)) for w in GROUP_OPTIONS},
        **{f"sglang_trainer/{t}.yaml": SGLangTrainerConf(trainer=TrainerKind(t)) for t in TRAINER_OPTIONS},
    }
    assert sorted(GROUP_OPTIONS) == sorted(w.value for w in WorkerType)
    assert (
        sorted(TRAINER_OPTIONS) == sorted(t.value for t in TrainerKind)
        and TRAINER_MAPPING_KEY == "sglang_trainer"
    )
    store = ConfigStore.instance()
    for path, schema in expected.items():
        loaded = store.load(path)
        assert loaded.provider == "miles_sglang_plugin", path
        assert OmegaConf.get_type(loaded.node) is OmegaConf.get_type(OmegaConf.structured(schema)), path
        assert OmegaConf.to_container(loaded.node) == OmegaConf.to_container(OmegaConf.structured(schema)), (
            path
        )
    first = store.load("sglang_deploy/default.yaml").node
    first.launch.port_base = 20001  # a copy: the stored node stays as it was
    assert store.load("sglang_deploy/default.yaml").node.launch.port_base == 15000


def _printed_list(code: str) -> list[str]:
    """The list of names that ``code`` prints last, run in a fresh interpreter (nothing imported or built)."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout.strip().splitlines()[-1].replace("'", '"')))


def test_a_compose_builds_only_the_schemas_it_loads() -> None:
    """Hydra deep-copies its whole config repository, the ConfigStore included, once per compose; the stored
    nodes must stay unbuilt there. ``miles-sglang``'s primary config loads ``miles_trainer_args``, and the
    ``pd`` preset ``sglang_model/base`` (for ``actor``) and ``sglang_deploy/default``: those three are built,
    the other eight (the four extra-group kinds, the simulated and cpu_sglang settings, the two trainer
    mappings) are not. In a fresh process, where nothing was built before."""
    code = (
        "from hydra.core.config_store import ConfigStore\n"
        "from miles_sglang_plugin.config.compose import compose_config\n"
        "from miles_sglang_plugin.config.store import LazyNode\n"
        "compose_config(['sglang=pd'])\n"
        "def walk(d, at=''):\n"
        "    for k, v in d.items():\n"
        "        if isinstance(v, dict): yield from walk(v, at + k + '/')\n"
        "        elif isinstance(v.node, LazyNode) and v.node._pickled is not None: yield at + k\n"
        "print(sorted(walk(ConfigStore.instance().repo)))\n"
    )
    assert _printed_list(code) == [
        "miles_trainer_args.yaml",
        "sglang_deploy/default.yaml",
        "sglang_model/base.yaml",
    ]


def test_hydras_plugin_scan_imports_no_schema_and_nothing_of_a_launch() -> None:
    """Every Hydra app imports the plugin modules at start-up, sglang group used or not: they store the
    nodes unbuilt and import neither the schemas nor anything a launch needs (HTTP clients, serving, backends)."""
    code = (
        "import sys\n"
        "from hydra.core.plugins import Plugins\n"
        "Plugins.instance()\n"
        "from hydra.core.config_store import ConfigStore\n"
        "assert 'base.yaml' in ConfigStore.instance().repo['sglang_model']\n"
        "print(sorted(m for m in sys.modules if m.startswith(('miles_sglang_plugin', 'httpx', 'rich', 'yaml'))))\n"
    )
    loaded = _printed_list(code)
    heavy = [m for m in loaded if m.startswith(("httpx", "rich", "miles_sglang_plugin.serving",
                                                 "miles_sglang_plugin.backends", "miles_sglang_plugin.config.schema",
                                                 "miles_sglang_plugin.rendering", "miles_sglang_plugin.planning"))]  # fmt: skip
    assert heavy == [], heavy


def test_plan_json_imports_nothing_of_a_launch() -> None:
    """``miles-sglang plan --json`` plans only: no HTTP client, serving, backend or table rendering loads, nor
    the gateways' ``RouterArgs`` when the router settings have no ``extra`` keys to check against them."""
    code = (
        "import sys\n"
        "from miles_sglang_plugin.cli import main\n"
        "code = main(['plan', '--json', 'sglang=pd_actor_ref', 'hf_checkpoint=/c'])\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('httpx', 'rich', 'anyio', 'miles_sglang_plugin.serving',"
        " 'miles_sglang_plugin.backends.processes', 'miles_sglang_plugin.backends.local', 'miles_sglang_plugin.miles.sglang_config',"
        " 'sglang_router.router_args', 'smg.router_args')))\n"
        "print(code, loaded, file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "0 []", result.stderr
