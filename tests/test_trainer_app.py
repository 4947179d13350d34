"""Issue 13: the group in a trainer's own Hydra app (``tests/trainer_app``), not the examples' config.

The app is verl-style: its own key names (``actor_rollout_ref.model.path``, ``trainer.nnodes``,
``actor_rollout_ref.rollout.tensor_model_parallel_size``) mapped to Miles' names by interpolations at the root of
its primary config; the engines nested under its rollout config (``sglang@actor_rollout_ref.rollout.engines``,
from ``config/rollout/sglang.yaml``); presets of its own (``config/sglang/pd_32gpu.yaml``, ``small.yaml``).
Numbers are worked out by hand from Miles' rules: 4 nodes x 8 GPUs, colocated (rollout from slot 0; Miles then
sets rollout_num_gpus to the actor's GPUs, so a deployment is as large as the trainer's nodes: tests of other
sizes set ``trainer.nnodes``).

In-process tests compose the app's config with Hydra's compose API (``compose_config(config_dir=...)``, the
``hydra`` node kept: it records where the defaults list placed the group); subprocess tests run ``train.py``
itself, in a copy of the app's directory (Hydra writes ``outputs/`` and ``multirun/`` into the working
directory).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from miles_sglang_plugin.app.hydra_edge import resolve_config
from miles_sglang_plugin.config.compose import CompositionError, compose_config
from miles_sglang_plugin.errors import DeploymentConfigError

REPO = Path(__file__).resolve().parent.parent
APP = Path(__file__).resolve().parent / "trainer_app"
ENGINES = "actor_rollout_ref.rollout.engines"
TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def app_config(*overrides: str):
    return compose_config(list(overrides), "ppo_trainer", config_dir=APP / "config", return_hydra_config=True)


def groups(plan) -> list[tuple[str, int, int, int, int]]:
    """(model.group, GPUs, GPUs per engine, gpu_offset, engines) of every group."""
    return [
        (f"{m.name}.{g.name}", g.num_gpus, g.num_gpus_per_engine, g.gpu_offset, len(g.engines))
        for m, g in plan.groups()
    ]


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    target = tmp_path / "trainer_app"
    shutil.copytree(APP, target, ignore=shutil.ignore_patterns("__pycache__", "outputs", "multirun"))
    return target


def run_app(app_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=app_dir, capture_output=True, text=True, timeout=timeout
    )


def plan_line(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("PLAN "))[len("PLAN ") :])


# ------------------------------------------------------------------------------ item 2: the nested group
def test_the_nested_group_is_found_where_the_defaults_list_put_it():
    cfg = app_config()
    assert OmegaConf.select(cfg, "sglang") is None  # nothing at the root key
    plan = resolve_config(cfg)
    # pd_32gpu (the app's preset): prefill 8 + decode 24 GPUs, TP 2 from the app's tensor_model_parallel_size.
    assert groups(plan) == [("actor.prefill", 8, 2, 0, 4), ("actor.decode", 24, 2, 8, 12)]
    assert (
        plan.model("actor").model_path == "/models/Qwen3-8B"
    )  # hf_checkpoint: ${actor_rollout_ref.model.path}
    # the preset's own interpolation into the trainer's rollout config, resolved in place
    assert plan.model("actor").group("decode").overrides["mem_fraction_static"] == 0.85


def test_resolve_config_can_be_pointed_at_the_group():
    cfg = compose_config([], "ppo_trainer", config_dir=APP / "config")  # no record of Hydra's choices
    assert resolve_config(cfg).total_gpus == 32  # found as the node that holds typed models
    assert resolve_config(cfg, sglang_key=ENGINES).total_gpus == 32
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_config(cfg, sglang_key="actor_rollout_ref.rollout.engine")
    assert "actor_rollout_ref.rollout.engine: no sglang group here" in str(exc.value)


def test_trainer_inputs_next_to_the_group_win_over_the_root():
    """Miles' names are looked up from the group outwards: next to the engines first, the root last."""
    cfg = app_config(
        "+actor_rollout_ref.rollout.rollout_num_gpus_per_engine=8",  # next to the group
        "+actor_rollout_ref.rollout.hf_checkpoint=/models/next-to-it",
    )
    plan = resolve_config(cfg)
    assert [g[2] for g in groups(plan)] == [8, 8]
    assert plan.model("actor").model_path == "/models/next-to-it"
    # the schema's defaults show the same values (msp.trainer resolves from the group outwards)
    assert cfg.actor_rollout_ref.rollout.engines.actor.model_path == "/models/next-to-it"
    assert cfg.actor_rollout_ref.rollout.engines.actor.decode.num_gpus_per_engine == 8


# --------------------------------------------------------------------------------- item 1: the trainer's TP
@pytest.mark.parametrize(("preset", "tp"), [("pd_32gpu", 4), ("pd", 4), ("pd", 1)])
def test_presets_follow_the_trainers_tp(preset: str, tp: int):
    nodes = {"pd_32gpu": 4, "pd": 2}[preset]  # colocated: the deployment is the trainer's 32 or 16 GPUs
    plan = resolve_config(app_config(f"sglang@{ENGINES}={preset}", f"{TP}={tp}", f"trainer.nnodes={nodes}"))
    sizes = {"pd_32gpu": (8, 24), "pd": (4, 12)}[preset]
    assert groups(plan) == [
        ("actor.prefill", sizes[0], tp, 0, sizes[0] // tp),
        ("actor.decode", sizes[1], tp, sizes[0], sizes[1] // tp),
    ]


def test_a_trainer_tp_the_preset_cannot_hold_is_an_error_not_ignored():
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_config(app_config(f"sglang@{ENGINES}=pd", f"{TP}=8", "trainer.nnodes=2"))
    text = " ".join(str(exc.value).split())
    assert (
        f"{ENGINES}.actor.prefill.num_gpus: 4 GPUs do not split into engines of num_gpus_per_engine=8" in text
    )


def test_a_pin_of_the_user_wins_over_the_trainers_tp():
    plan = resolve_config(app_config(f"{TP}=4", f"{ENGINES}.actor.prefill.num_gpus_per_engine=2"))
    assert [g[2] for g in groups(plan)] == [2, 4]


def test_a_preset_pins_tp_only_for_a_checkpoint_it_pins():
    """agentic_32gpu: the actor serves the trainer's checkpoint (TP from the trainer), ref and reward are other
    checkpoints, whose TP the preset pins (4) with their paths."""
    plan = resolve_config(app_config(f"sglang@{ENGINES}=agentic_32gpu", f"{TP}=2"))
    assert [(g[0], g[2]) for g in groups(plan)] == [
        ("actor.prefill", 2), ("actor.decode", 2), ("ref.regular", 4), ("reward.regular", 4),
    ]  # fmt: skip


# ----------------------------------------------------------------------- item 3: the full placement mapping
def test_the_mapping_places_rollout_on_the_trainers_gpus_and_checks_capacity():
    plan = resolve_config(app_config())
    assert (plan.rollout_offset, plan.megatron_num_gpus) == (0, 32)  # colocated, actor on all 4 x 8 GPUs
    with pytest.raises(DeploymentConfigError) as exc:  # 36 slots on 32 GPUs
        resolve_config(app_config(f"{ENGINES}.actor.decode.num_gpus=28"))
    text = " ".join(str(exc.value).split())
    assert "num_nodes: the deployment needs 36 GPU slots" in text
    assert "num_nodes=4 x num_gpus_per_node=8 = 32" in text


def test_plan_header_says_whether_capacity_was_checked(capsys):
    from miles_sglang_plugin.cli import main

    assert main(["plan", "-cp", str(APP / "config"), "-cn", "ppo_trainer"]) == 0
    assert "cluster: 4 node(s) x 8 GPUs = 32 GPU slots, 32 used" in capsys.readouterr().out
    assert main(["plan", "-cp", str(APP / "config"), "-cn", "ppo_trainer", "~num_nodes"]) == 0
    assert "cluster size unknown (num_nodes unset): capacity not checked" in capsys.readouterr().out


# -------------------------------------------------------------------------- item 4: the app's own dry run
def test_dry_run_prints_the_apps_plan_and_runs_nothing(app_dir: Path):
    proc = run_app(app_dir, "hydra/callbacks=sglang_plan")
    assert proc.returncode == 0, proc.stderr
    assert "32 GPUs in 1 model(s), 16 engine(s); rollout_offset=0, megatron GPUs=32" in proc.stdout
    assert "PLAN " not in proc.stdout  # the task did not run
    assert not (app_dir / "outputs").exists()  # no job, no run directory
    proc = run_app(app_dir, "hydra/callbacks=sglang_plan", f"{ENGINES}.actor.decode.num_gpus=28")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "num_nodes: the deployment needs 36 GPU slots" in " ".join(proc.stderr.split())


def test_dry_run_of_a_sweep_over_the_trainers_tp_gives_distinct_plans(app_dir: Path):
    proc = run_app(app_dir, "-m", "hydra/callbacks=sglang_plan", f"{TP}=1,2,16")
    assert proc.returncode == 2, proc.stderr
    out = proc.stdout
    assert "32 GPUs in 1 model(s), 32 engine(s)" in out  # TP 1
    assert "32 GPUs in 1 model(s), 16 engine(s)" in out  # TP 2
    err = " ".join(proc.stderr.split())
    # TP 16: the 8 prefill GPUs do not hold one engine; said, not planned as something else
    assert (
        f"{ENGINES}.actor.prefill.num_gpus: 8 GPUs do not split into engines of num_gpus_per_engine=16" in err
    )
    assert "the plans of job(s) #2 have problems" in err and "Traceback" not in err
    assert "PLAN " not in out


def test_plan_reads_the_apps_config_with_cp_cn(capsys):
    from miles_sglang_plugin.cli import main

    assert main(["plan", "--json", "-cp", str(APP / "config"), "-cn", "ppo_trainer", f"{TP}=4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["models"]["actor"]["groups"]["decode"]["num_gpus_per_engine"] == 4
    assert data["rollout_offset"] == 0 and data["total_gpus"] == 32
    # --config-dir: the app's presets on the search path of the command's own primary config
    assert (
        main(
            [
                "plan",
                "--json",
                "-cd",
                str(APP / "config"),
                "sglang=small",
                "hf_checkpoint=/c",
                "debug_rollout_only=true",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["total_gpus"] == 2
    assert main(["plan", "-cp", str(APP / "config")]) == 2
    assert "-cp/--config-path needs -cn/--config-name" in capsys.readouterr().err
    assert main(["plan", "-cp", str(APP / "config"), "-cn", "ppo_trainer", "--sglang-key", ENGINES]) == 0
    assert "32 GPUs in 1 model(s), 16 engine(s)" in capsys.readouterr().out
    assert main(["plan", "-cp", str(APP / "config"), "-cn", "ppo_trainer", "--sglang-key", "engines"]) == 2
    assert "engines: no sglang group here" in " ".join(capsys.readouterr().err.split())


# ------------------------------------------------------------------------------------ item 5: field docs
def test_fields_prints_the_documentation_of_a_node(capsys):
    from miles_sglang_plugin.cli import main

    assert main(["fields", "sglang.actor.decode"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("sglang.<model>.decode.num_gpus  int  default: 0")
    assert lines[start + 1 : start + 3] == ["    GPUs of the group, in GPUs; 0 turns the group off.", ""]
    assert main(["fields", "sglang_deploy.launch.port_bse"]) == 2
    assert "did you mean sglang_deploy.launch.port_base" in capsys.readouterr().err


def test_fields_fit_100_columns_and_never_cut_a_key(capsys):
    """Issue 25: every key whole at the start of its own line, the text wrapped at spaces within 100 columns
    (output that is not a terminal), whatever the terminal would be."""
    from miles_sglang_plugin.cli import main
    from miles_sglang_plugin.config.field_docs import schema_fields
    from miles_sglang_plugin.config.schema import MilesTrainerArgs

    assert main(["fields"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    starts = [line.split("  ")[0] for line in lines if line and not line.startswith(" ")]
    assert starts == [row.key for row in schema_fields(MilesTrainerArgs)]
    # Where a key with its type and default would pass 100 columns (46 + 2 + 40 + 2 + 16), they go under it.
    start = lines.index("sglang.<model>.extra_groups.<name>.worker_type")
    assert lines[start + 1] == "    regular | prefill | decode | placeholder  default: regular"
    # A description longer than a line is wrapped at spaces: rejoined, it is the docstring.
    start = lines.index("sglang_deploy.router.drain_settle_secs  int  default: 0")
    text = []
    for line in lines[start + 1 :]:
        if not line:
            break
        assert line.startswith("    ") and len(line) <= 100
        text.append(line.strip())
    assert len(text) == 4
    assert " ".join(text).startswith("SMG only: how long a removed worker stays draining (listed, a new")


# ------------------------------------------------------------------------- issue 25: --help at the package
def test_help_lists_the_group_where_the_app_placed_it(app_dir: Path):
    proc = run_app(app_dir, "--help")
    assert proc.returncode == 0, proc.stderr
    groups_listed = proc.stdout.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    lines = [line for line in groups_listed.splitlines() if line.startswith("sglang")]
    assert lines == [
        f"sglang@{ENGINES}: actor_ref, actor_ref_1node, agentic_32gpu, default, multi_model, pd, pd_32gpu, "
        "pd_actor_ref, pd_actor_ref_1node, "
        "placeholder, small",
        "sglang_bench: default, smoke",
        "sglang_deploy: cpu_sglang, default, simulated",
        f"sglang_group@{ENGINES}.<model>.extra_groups.<name>: decode, placeholder, prefill, regular",
        f"sglang_model@{ENGINES}.<model>: base",
        "sglang_trainer: skyrl, verl",
    ]
    # As listed, the choice works: the package's pd preset at the app's key.
    proc = run_app(app_dir, f"sglang@{ENGINES}=pd", "--cfg", "job", "-p", f"{ENGINES}.actor.prefill.num_gpus")
    assert (proc.returncode, proc.stdout.strip()) == (0, "4"), proc.stderr


def test_help_names_the_group_at_the_root_and_the_helpers_under_it():
    from miles_sglang_plugin.config.app_help import with_group_packages

    hydra_listing = "rollout: sglang\nsglang: a, b\nsglang_model: base\nsglang_group: decode\nother: x\n"
    assert with_group_packages(hydra_listing, {"sglang": "a", "hydra/help": "default"}) == (
        "rollout: sglang\nsglang: a, b\nsglang_model@sglang.<model>: base\n"
        "sglang_group@sglang.<model>.extra_groups.<name>: decode\nother: x\n"
    )
    # Placed twice: listed at both packages. The long form (options under the group) keeps its options.
    assert with_group_packages("sglang:\n  a\n  b\n", {"sglang@x": "a", "sglang@y.z": "b"}) == (
        "sglang@x:\n  a\n  b\nsglang@y.z:\n  a\n  b\n"
    )
    # An app that does not use the group: Hydra's listing as it is.
    assert with_group_packages(hydra_listing, {"rollout": "sglang"}) == hydra_listing


# --------------------------------------------------------------------- item 6: helper groups out of place
def test_helper_groups_are_refused_outside_their_packages():
    with pytest.raises(CompositionError, match=r"sglang_model is a helper group, used only at a package"):
        app_config("+sglang_model=base")
    cfg = app_config(
        f"+sglang_model@{ENGINES}.judge=base",
        f"{ENGINES}.judge.regular.num_gpus=8",
        f"{ENGINES}.judge.update_weights=false",
        "trainer.nnodes=5",  # colocated: 40 GPUs, the actor's 32 and the judge's 8
    )
    assert [m.name for m in resolve_config(cfg).models] == ["actor", "judge"]  # at its package: fine
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_config(app_config("+sglang_model@judge=base"))
    assert (
        f"sglang_model: is a helper group, used at judge; add a model with +sglang_model@{ENGINES}.<name>=base"
        in (str(exc.value))
    )


# ---------------------------------------------------------------------------- item 7: a plain extra group
def test_a_plain_mapping_is_accepted_as_an_extra_group():
    plan = resolve_config(
        app_config(
            f"+{ENGINES}.actor.extra_groups.d2={{worker_type: decode, num_gpus: 8}}", "trainer.nnodes=5"
        )
    )
    assert groups(plan)[-1] == ("actor.d2", 8, 2, 32, 4)  # TP from the model, i.e. the trainer
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_config(app_config(f"+{ENGINES}.actor.extra_groups.d2={{worker_type: decode, num_gpu: 8}}"))
    assert f"{ENGINES}.actor.extra_groups.d2: Key 'num_gpu' not in 'ExtraServerGroupConf'" in str(exc.value)


# -------------------------------------------------------------------------------------------- item 8: noise
def test_a_failing_job_of_a_sweep_ends_without_a_traceback(app_dir: Path):
    proc = run_app(app_dir, "-m", f"{ENGINES}.actor.decode.num_gpus=24,28")
    assert proc.returncode == 1  # Hydra's status for a failed job
    err = " ".join(proc.stderr.split())
    assert "Traceback" not in err
    assert (
        "Error executing job with overrides: ['actor_rollout_ref.rollout.engines.actor.decode.num_gpus=28']"
        in err
    )
    assert err.count("num_nodes: the deployment needs 36 GPU slots") == 2  # when the job ran, and at the end
    assert plan_line(proc.stdout)["total_gpus"] == 32  # job #0 ran


# ------------------------------------------------------------------------ item 9: default follows Miles
@pytest.mark.parametrize(
    ("colocate", "rollout_gpus", "expected"),
    [
        ("true", "16", 32),  # colocated: Miles sets rollout_num_gpus to the actor's 4 x 8 GPUs
        ("true", "null", 32),
        ("false", "16", 16),  # not colocated: the trainer's rollout_num_gpus ...
        ("false", "null", 8),  # ... and 8 while it is unset
    ],
)
def test_default_preset_follows_rollout_num_gpus(colocate: str, rollout_gpus: str, expected: int):
    plan = resolve_config(
        app_config(
            f"sglang@{ENGINES}=default",
            f"trainer.rollout_gpus={rollout_gpus}",
            f"colocate={colocate}",
            "~num_nodes",  # not colocated, rollout comes after the actor's 32 GPUs
        )
    )
    assert [(g[0], g[1], g[2], g[4]) for g in groups(plan)] == [("actor.regular", expected, 2, expected // 2)]


# ------------------------------------------------------- the trainer guide's commands (docs), as written
#: The guide these commands are in: docs/trainers/hydra-app.md ("Use it in your trainer").
GUIDE = REPO / "docs" / "trainers" / "hydra-app.md"


def guide_commands() -> list[str]:
    blocks = re.findall(r"```console\n(.*?)```", GUIDE.read_text(), flags=re.S)
    return [line[2:] for block in blocks for line in block.splitlines() if line.startswith("$ ")]


def _argv(command: str) -> list[str]:
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "miles-sglang":
        argv[:1] = [sys.executable, "-m", "miles_sglang_plugin"]
    return argv


def _launches(command: str) -> bool:
    return "trainer.rollout_steps=1" in command


def test_the_trainer_guide_commands_run_as_written(app_dir: Path):
    commands = [c for c in guide_commands() if not _launches(c)]
    assert len(commands) >= 5, commands
    for command in commands:
        proc = subprocess.run(_argv(command), cwd=app_dir, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert "Traceback" not in proc.stderr, command


def _processes_in(directory: Path) -> list[int]:
    """PIDs of the processes whose working directory is ``directory`` (the app's engines and routers)."""
    pids = []
    for proc_dir in Path("/proc").iterdir():
        if proc_dir.name.isdigit():
            try:
                if Path(os.readlink(proc_dir / "cwd")) == directory:
                    pids.append(int(proc_dir.name))
            except OSError:
                continue
    return pids


STATUS_LINE = re.compile(r"^\[\s*\d+\.\d+s\] (engine|router) ", re.M)


def test_readme_launch_command_runs_with_the_launchers_requests_out_of_the_apps_log(app_dir: Path):
    (command,) = [c for c in guide_commands() if _launches(c)]
    proc = subprocess.run(_argv(command), cwd=app_dir, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GENERATED " in proc.stdout
    assert STATUS_LINE.search(proc.stderr)  # auto, off a terminal: plain start-up lines
    (log,) = app_dir.glob("outputs/*/*/train.log")  # Hydra's job log of the app, at INFO
    text = log.read_text()
    assert re.search(r"HTTP Request: POST http://127\.0\.0\.1:\d+/generate", text), text  # the app's own
    assert "/health_generate" not in text and "/workers" not in text, text  # the launcher's: filtered
    assert _processes_in(app_dir.resolve()) == []


def test_live_never_prints_no_start_up_lines(app_dir: Path):
    proc = run_app(
        app_dir, "trainer.rollout_steps=1", "trainer.nnodes=1", "trainer.n_gpus_per_node=2", f"sglang@{ENGINES}=small", "sglang_deploy=simulated",
        "sglang_deploy.launch.live=never", timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GENERATED " in proc.stdout
    assert not STATUS_LINE.search(proc.stderr), proc.stderr
    assert "SGLang deployment ready in" in proc.stderr  # the summary stays
    assert _processes_in(app_dir.resolve()) == []


# ------------------------------------------------- SkyRL's keys, without SkyRL installed (issue 30)
#: The keys of skyrl-train 0.3.1's ppo_base_config that the skyrl mapping reads, at SkyRL's own defaults (1 policy
#: node x 4 GPUs, colocate_all, 1 engine of TP 4, vLLM started by SkyRL itself). SkyRL's own tree is read in the
#: trainers' lane (tests/test_trainers.py); these tests run wherever the package does.
SKYRL_KEYS = """\
trainer:
  seed: 42
  policy:
    model:
      path: Qwen/Qwen2.5-1.5B-Instruct
  placement:
    colocate_all: true
    policy_num_nodes: 1
    policy_num_gpus_per_node: 4
generator:
  backend: vllm
  run_engines_locally: true
  num_inference_engines: 1
  inference_engine_tensor_parallel_size: 4
  inference_engine_pipeline_parallel_size: 1
  inference_engine_data_parallel_size: 1
  inference_engine_expert_parallel_size: 1
  gpu_memory_utilization: 0.8
  engine_init_kwargs: {}
"""
SKYRL_ARGS = [
    "+sglang=default",
    "+sglang_trainer=skyrl",
    "generator.backend=sglang",
    "generator.run_engines_locally=false",
]
GEN = "generator."
POLICY = "(trainer.placement.policy_num_nodes=1 x policy_num_gpus_per_node=4)"


@pytest.fixture
def skyrl_keys(tmp_path: Path) -> Path:
    config_dir = tmp_path / "skyrl_config"
    config_dir.mkdir()
    (config_dir / "ppo_base_config.yaml").write_text(SKYRL_KEYS)
    return config_dir


def skyrl_problems(config_dir: Path, *overrides: str) -> list[str]:
    cfg = compose_config([*SKYRL_ARGS, *overrides], "ppo_base_config", config_dir=config_dir)
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_config(cfg)
    return [str(p) for p in exc.value.problems]


def test_skyrls_defaults_plan_one_engine_on_the_policys_four_gpus(skyrl_keys: Path, monkeypatch):
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    plan = resolve_config(compose_config(SKYRL_ARGS, "ppo_base_config", config_dir=skyrl_keys))
    assert groups(plan) == [("actor.regular", 4, 4, 0, 1)]


def test_a_skyrl_engine_size_that_misses_the_policys_gpus_names_the_parallel_keys_typed(
    skyrl_keys: Path, monkeypatch
):
    """Colocated, SkyRL's engines must fill its policy's 4 GPUs: TP 3 cannot (no count of 3-GPU engines makes
    4), 2 engines of TP 1 give 2 (4 would do), 2 engines of TP 2 x DP 2 give 8 (1 would do)."""
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    tp = f"{GEN}inference_engine_tensor_parallel_size"
    head = f"{GEN}num_inference_engines: "
    colocated = (
        f"but colocated (trainer.placement.colocate_all=true) rollout runs on the policy's 4 GPUs {POLICY}"
    )
    assert skyrl_problems(skyrl_keys, f"{tp}=3") == [
        f"{head}1 engine(s) x 3 GPUs each ({tp}=3) = 3 GPUs, {colocated}, as SkyRL requires: no engine count "
        f"fills 4 GPUs with 3 GPUs per engine: make the engine's GPUs ({tp}=3) divide 4"
    ]
    assert skyrl_problems(skyrl_keys, f"{tp}=1", f"{GEN}num_inference_engines=2") == [
        f"{head}2 engine(s) x 1 GPU each ({tp}=1) = 2 GPUs, {colocated}, as SkyRL requires: set "
        f"{GEN}num_inference_engines=4"
    ]
    dp = f"{GEN}inference_engine_data_parallel_size"
    assert skyrl_problems(
        skyrl_keys, f"{tp}=2", f"{dp}=2", f"{GEN}num_inference_engines=2",
        f"+{GEN}engine_init_kwargs.enable_dp_attention=true",
    ) == [
        f"{head}2 engine(s) x 4 GPUs each ({tp}=2 x {dp}=2) = 8 GPUs, {colocated}, as SkyRL requires: set "
        f"{GEN}num_inference_engines=1"
    ]  # fmt: skip


def test_an_api_key_with_skyrls_client_is_refused_naming_where_it_came_from(skyrl_keys: Path, monkeypatch):
    """skyrl-train's remote engine client sends no API key (and has no setting for one): engines started with
    one would answer each of its requests 401. The key itself is never printed."""
    monkeypatch.setenv("SGLANG_API_KEY", "sk-from-the-environment")
    (problem,) = skyrl_problems(skyrl_keys)
    assert problem.startswith(
        "SGLANG_API_KEY (environment variable): is set, but with sglang_trainer=skyrl SkyRL's own client sends "
        "the rollout requests, and it sends no API key"
    ), problem
    assert "401" in problem and "sk-from-the-environment" not in problem
    monkeypatch.delenv("SGLANG_API_KEY")
    (problem,) = skyrl_problems(skyrl_keys, "sglang_deploy.api_key=sk-in-the-config")
    assert problem.startswith("sglang_deploy.api_key: is set, but with sglang_trainer=skyrl"), problem
    assert "sk-in-the-config" not in problem
    # Without the SkyRL mapping the key is the deployment's business: the trainer app plans with it.
    monkeypatch.setenv("SGLANG_API_KEY", "sk-from-the-environment")
    assert groups(resolve_config(app_config())) == [
        ("actor.prefill", 8, 2, 0, 4),
        ("actor.decode", 24, 2, 8, 12),
    ]


def test_the_skyrl_refusals_from_the_command_line_exit_2_without_a_traceback(
    skyrl_keys: Path, tmp_path: Path
):
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_API_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "miles_sglang_plugin", "plan", "-cp", str(skyrl_keys), "-cn", "ppo_base_config",
         *SKYRL_ARGS, f"{GEN}inference_engine_tensor_parallel_size=3"],
        cwd=tmp_path, env={**env, "SGLANG_API_KEY": "sk-from-the-environment"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (
        f"{GEN}num_inference_engines: 1 engine(s) x 3 GPUs each ({GEN}inference_engine_tensor_parallel_size=3)"
        in proc.stderr
    )
    assert "SGLANG_API_KEY (environment variable): is set, but with sglang_trainer=skyrl" in proc.stderr
    assert "sk-from-the-environment" not in proc.stdout + proc.stderr
