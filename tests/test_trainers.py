"""Issue 20: verl 0.9.1 and skyrl-train 0.3.1 adopt the group with their own, unchanged config trees and code.

Their YAML is read from the installed packages (``make .venv-trainers/.installed``: ``scripts/install-trainers.sh``
installs them with ``--no-deps`` and the few packages their config code imports), never copied here. These
tests run in that venv (``make test``: its trainers lane); elsewhere they skip, and fail with
``MSP_REQUIRE_TRAINER_TESTS=1`` (CI), as a skipped lane is no test.

Numbers are worked out by hand from the trainers' own rules: verl's hybrid engine puts rollout on every GPU
(``trainer.nnodes`` x ``trainer.n_gpus_per_node``; its defaults 1 x 8) in engines of TP x DP x PP GPUs
(``RolloutReplica.world_size``); SkyRL runs ``generator.num_inference_engines`` engines of TP x PP x DP GPUs, as
many GPUs as its policy (defaults 1 x 4) under ``colocate_all``.
"""

from __future__ import annotations

import importlib.resources
import os
import pickle
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from omegaconf import open_dict

from miles_sglang_plugin.app.hydra_edge import prepare_from_config, resolve_config
from miles_sglang_plugin.app.trainers import fill_skyrl_engine_urls, skyrl_engine_urls
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.errors import DeploymentConfigError
from tests.conftest_ray import ray_cluster  # noqa: F401 - fixture

REQUIRE_ENV = "MSP_REQUIRE_TRAINER_TESTS"
try:
    from skyrl_train.utils.utils import validate_cfg
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    MISSING = ""
except ImportError as exc:  # the main test venv: the trainers' lane runs in .venv-trainers
    MISSING = str(exc)


@pytest.fixture(autouse=True)
def _trainers_installed() -> None:
    if not MISSING:
        return
    reason = f"verl / skyrl-train are not installed here ({MISSING}); they are in .venv-trainers (make test-trainers)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"the trainers' tests must run here ({REQUIRE_ENV}=1), but: {reason}", pytrace=False)
    pytest.skip(reason)


def _package_dir(package: str, *parts: str) -> Path:
    try:
        return Path(str(importlib.resources.files(package).joinpath(*parts)))
    except ModuleNotFoundError:
        return Path("/nonexistent")


pytestmark = pytest.mark.trainers

REPO = Path(__file__).resolve().parent.parent
VERL_CONFIG = _package_dir("verl", "trainer", "config")
SKYRL_CONFIG = _package_dir("skyrl_train", "config")
ENGINES = "actor_rollout_ref.sglang"
R = "actor_rollout_ref.rollout"
VERL_BASE = [
    f"+sglang@{ENGINES}=default",
    "+sglang_trainer=verl",
    f"{R}.name=sglang",
    "actor_rollout_ref.model.path=/models/Qwen3-8B",
]
SKYRL_BASE = [
    "+sglang=default",
    "+sglang_trainer=skyrl",
    "generator.backend=sglang",
    "generator.run_engines_locally=false",
    "trainer.logger=console",
]


def verl_config(*overrides: str, base: list[str] = VERL_BASE):
    return compose_config(
        [*base, *overrides], "ppo_trainer", config_dir=VERL_CONFIG, return_hydra_config=True
    )


def skyrl_config(*overrides: str):
    return compose_config(
        [*SKYRL_BASE, *overrides], "ppo_base_config", config_dir=SKYRL_CONFIG, return_hydra_config=True
    )


def groups(plan) -> list[tuple[str, int, int, int, int]]:
    """(group, GPUs, GPUs per engine, first GPU slot, engines) of every group."""
    return [
        (g.name, g.num_gpus, g.num_gpus_per_engine, plan.rollout_offset + g.gpu_offset, len(g.engines))
        for _m, g in plan.groups()
    ]


def server_args(cfg, index: int = 0) -> dict:
    return dict(prepare_from_config(cfg).launch.engines[index].server_args)


def problems_of(cfg) -> str:
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_config(cfg)
    return "\n".join(str(p) for p in exc.value.problems)


def test_the_installed_trees_are_the_trainers_own():
    """Read from the installed packages: verl's rollout node is a typed RolloutConfig, SkyRL defaults to vLLM."""
    assert VERL_CONFIG.is_relative_to(Path(sys.prefix)) and SKYRL_CONFIG.is_relative_to(Path(sys.prefix))
    tracked = subprocess.run(
        ["git", "ls-files", "*.yaml"], cwd=REPO, capture_output=True, text=True, check=True
    )
    ours = {(REPO / name).read_text() for name in tracked.stdout.split()}
    for theirs in (VERL_CONFIG / "ppo_trainer.yaml", SKYRL_CONFIG / "ppo_base_config.yaml"):
        assert theirs.read_text() not in ours  # never copied into this repository
    cfg = compose_config([], "ppo_trainer", config_dir=VERL_CONFIG)
    assert cfg.actor_rollout_ref.rollout._target_ == "verl.workers.config.RolloutConfig"
    assert compose_config([], "ppo_base_config", config_dir=SKYRL_CONFIG).generator.backend == "vllm"


# ---------------------------------------------------------------------- item 2: a placement verl accepts
def test_verl_accepts_the_group_beside_its_rollout_node_not_inside_it():
    rollout = omega_conf_to_dataclass(verl_config().actor_rollout_ref.rollout)
    assert isinstance(rollout, RolloutConfig)
    assert (rollout.name, rollout.tensor_model_parallel_size) == ("sglang", 2)
    inside = verl_config(base=[f"+sglang@{R}.engines=default", *VERL_BASE[1:]])  # the old README's place
    with pytest.raises(Exception, match="unexpected keyword argument 'engines'"):
        omega_conf_to_dataclass(inside.actor_rollout_ref.rollout)


def _guide_commands(entry: str) -> list[list[str]]:
    """The commands of ``entry`` in the trainers' guides (docs/trainers/verl.md, skyrl.md), as written."""
    guides = "".join((REPO / "docs" / "trainers" / name).read_text() for name in ("verl.md", "skyrl.md"))
    lines = re.findall(rf"^python -m {re.escape(entry)} (.*?)$", guides, flags=re.M)
    return [[o for o in line.split() if not o.startswith("hydra/")] for line in lines]


def test_the_guides_commands_place_the_group_where_the_trainers_accept_it_and_plan_as_it_says():
    verl_commands = _guide_commands("verl.trainer.main_ppo")
    expected = [
        [("regular", 16, 4, 0, 4)],  # hybrid engine on 2 x 8 GPUs, TP 4
        [("prefill", 4, 2, 0, 2), ("decode", 12, 2, 4, 6)],  # 2 PD units of 1 x TP 2 + 3 x TP 2
    ]
    assert len(verl_commands) == len(expected)
    for overrides, groups_said in zip(verl_commands, expected, strict=True):
        cfg = compose_config(overrides, "ppo_trainer", config_dir=VERL_CONFIG, return_hydra_config=True)
        assert isinstance(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), RolloutConfig), overrides
        assert groups(resolve_config(cfg)) == groups_said, overrides
    (skyrl_command,) = _guide_commands("skyrl_train.entrypoints.main_base")
    cfg = compose_config(skyrl_command, "ppo_base_config", config_dir=SKYRL_CONFIG, return_hydra_config=True)
    assert groups(resolve_config(cfg)) == [
        ("regular", 4, 2, 0, 2)
    ]  # 2 engines of TP 2 on the policy's 4 GPUs


# ------------------------------------------------------------------------- item 3: verl's keys, mapped
def test_verl_tp4_on_two_nodes_of_eight_gives_four_colocated_engines():
    plan = resolve_config(verl_config("trainer.nnodes=2", f"{R}.tensor_model_parallel_size=4"))
    assert groups(plan) == [("regular", 16, 4, 0, 4)]  # hybrid engine: all 2 x 8 GPUs, from slot 0
    assert (plan.rollout_offset, plan.megatron_num_gpus, plan.trainer.num_nodes) == (0, 16, 2)
    assert plan.model("actor").model_path == "/models/Qwen3-8B"
    assert plan.trainer.offload_rollout is True  # colocated: Miles offloads


def test_verl_defaults_give_memory_fraction_seed_and_tp_of_verl():
    cfg = verl_config(f"{R}.gpu_memory_utilization=0.7", f"{R}.seed=7")
    plan = resolve_config(cfg)
    assert groups(plan) == [("regular", 8, 2, 0, 4)]  # verl's TP 2 on its 1 x 8 GPUs
    seeds = [dict(e.server_args)["random_seed"] for e in prepare_from_config(cfg).launch.engines]
    assert seeds == [7, 8, 9, 10]  # Miles: seed + the engine's rank
    args = server_args(cfg)
    assert (args["mem_fraction_static"], args["tp_size"]) == (0.7, 2)
    # the deployment-wide setting of the plugin wins over the trainer's
    assert (
        server_args(verl_config("+sglang_deploy.server_defaults.mem_fraction_static=0.6"))[
            "mem_fraction_static"
        ]
        == 0.6
    )


def test_verl_dp_with_dp_attention_is_an_engine_of_tp_times_dp_gpus():
    cfg = verl_config(f"{R}.data_parallel_size=2", f"+{R}.engine_kwargs.sglang.enable_dp_attention=true")
    plan = resolve_config(cfg)
    assert groups(plan) == [("regular", 8, 4, 0, 2)]  # verl: world_size = TP 2 x DP 2
    args = server_args(cfg)
    assert (args["tp_size"], args["dp_size"], args["enable_dp_attention"]) == (4, 2, True)  # verl's infer_tp


def test_verl_dp_without_dp_attention_is_refused_naming_the_key():
    text = problems_of(verl_config(f"{R}.data_parallel_size=2"))
    assert text.startswith(f"{R}.data_parallel_size: 2 needs SGLang's DP attention")
    assert "tensor_model_parallel_size=2 x data_parallel_size=2 = 4 GPUs (--tp-size 4 --dp-size 2)" in text
    assert f"set {R}.engine_kwargs.sglang.enable_dp_attention=true" in text


def test_verl_pp_and_ep_reach_the_engines():
    cfg = verl_config(f"{R}.pipeline_model_parallel_size=2", f"{R}.expert_parallel_size=2")
    assert groups(resolve_config(cfg)) == [("regular", 8, 4, 0, 2)]  # TP 2 x PP 2, not --tp-size 1
    args = server_args(cfg)
    assert (args["tp_size"], args["pp_size"], args["ep_size"]) == (2, 2, 2)
    text = problems_of(verl_config(f"{R}.expert_parallel_size=4"))
    assert f"{R}.expert_parallel_size: 4 must divide the engine's TP" in text


def test_verl_standalone_rollout_pool_comes_after_the_trainers_nodes():
    cfg = verl_config("actor_rollout_ref.hybrid_engine=false", "trainer.nnodes=2", f"{R}.nnodes=1")
    plan = resolve_config(cfg)
    assert groups(plan) == [("regular", 8, 2, 16, 4)]  # node 2: slots 16-23
    assert (plan.trainer.num_nodes, plan.trainer.colocate) == (3, False)
    assert {e.processes[0].node for e in plan.engines} == {2}
    assert f"{R}.nnodes: is 0" in problems_of(verl_config("actor_rollout_ref.hybrid_engine=false"))


def test_verl_pd_replicas_size_the_pd_presets_groups():
    pd = [f"+sglang@{ENGINES}=pd", *VERL_BASE[1:], f"{R}.disaggregation.enabled=true"]
    # one PD unit = 1 prefill x TP 2 + 3 decode x TP 2 = 8 GPUs; 2 x 8 GPUs hold two units
    plan = resolve_config(verl_config("trainer.nnodes=2", f"{R}.disaggregation.decode_replicas=3", base=pd))
    assert groups(plan) == [("prefill", 4, 2, 0, 2), ("decode", 12, 2, 4, 6)]
    # decode TP 4: a unit of 2 + 4 = 6 GPUs on one node of 6
    plan = resolve_config(
        verl_config(
            "trainer.n_gpus_per_node=6", f"{R}.disaggregation.decode_tensor_model_parallel_size=4", base=pd
        )
    )
    assert groups(plan) == [("prefill", 2, 2, 0, 1), ("decode", 4, 4, 2, 1)]
    text = problems_of(verl_config(f"{R}.disaggregation.enabled=true"))
    assert f"{R}.disaggregation.enabled: is true, but the deployment at {ENGINES} has no prefill" in text


def test_verl_engine_name_other_than_sglang_is_refused_naming_the_key():
    text = problems_of(verl_config(f"{R}.name=vllm"))
    assert text == (
        f"{R}.name: is 'vllm', but the sglang group serves SGLang engines: set {R}.name=sglang, or leave "
        "sglang_trainer=verl (and the sglang group) out to let verl run vllm"
    )
    unset = verl_config(base=[VERL_BASE[0], VERL_BASE[1], VERL_BASE[3]])  # verl's name: ??? left as it is
    assert problems_of(unset).startswith(f"{R}.name: is unset; set {R}.name=sglang")


def test_errors_name_the_key_the_user_typed():
    assert problems_of(verl_config("trainer.n_gpus_per_node=abc")) == (
        "trainer.n_gpus_per_node: must be an integer >= 1, got 'abc'"
    )
    text = problems_of(verl_config(f"{R}.tensor_model_parallel_size=3"))
    assert (
        f"{ENGINES}.actor.regular.num_gpus: 8 GPUs do not split into engines of num_gpus_per_engine=3" in text
    )
    assert f"rollout_num_gpus_per_engine is {R}.tensor_model_parallel_size=3" in text
    text = problems_of(verl_config(f"{R}.tensor_model_parallel_size=0"))
    assert text == f"{R}.tensor_model_parallel_size: must be an integer >= 1, got 0"


def test_a_miles_name_in_the_tree_still_wins_over_the_mapping():
    plan = resolve_config(verl_config(f"+{R}.rollout_num_gpus_per_engine=8"))  # next to... the group's parent
    assert groups(plan) == [("regular", 8, 2, 0, 4)]  # actor_rollout_ref.rollout is not on the group's path
    plan = resolve_config(verl_config("+actor_rollout_ref.rollout_num_gpus_per_engine=8"))
    assert groups(plan) == [("regular", 8, 8, 0, 1)]


# ------------------------------------------------------------------------ item 3: SkyRL's keys, mapped
def test_skyrl_defaults_give_one_colocated_engine_on_the_policys_gpus():
    cfg = skyrl_config()
    plan = resolve_config(cfg)
    assert groups(plan) == [("regular", 4, 4, 0, 1)]  # 1 engine x TP 4 = the policy's 1 x 4 GPUs
    assert plan.model("actor").model_path == "Qwen/Qwen2.5-1.5B-Instruct"  # trainer.policy.model.path
    args = server_args(cfg)
    assert (args["mem_fraction_static"], args["random_seed"], args["tp_size"]) == (0.8, 42, 4)


def test_skyrl_engine_counts_size_the_group():
    plan = resolve_config(
        skyrl_config("generator.num_inference_engines=2", "generator.inference_engine_tensor_parallel_size=2")
    )
    assert groups(plan) == [("regular", 4, 2, 0, 2)]
    plan = resolve_config(
        skyrl_config("trainer.placement.colocate_all=false", "generator.num_inference_engines=3")
    )
    assert groups(plan) == [("regular", 12, 4, 4, 3)]  # after the policy's 4 GPUs
    text = problems_of(skyrl_config("generator.num_inference_engines=2"))
    assert text.startswith(
        "generator.num_inference_engines: 2 engine(s) x 4 GPUs each "
        "(generator.inference_engine_tensor_parallel_size=4) = 8 GPUs, but colocated "
        "(trainer.placement.colocate_all=true) rollout runs on the policy's 4 GPUs"
    )
    assert "as SkyRL requires: set generator.num_inference_engines=1" in text


def test_skyrl_backend_and_local_engines_are_refused_naming_the_keys():
    cfg = compose_config(
        ["+sglang=default", "+sglang_trainer=skyrl"], "ppo_base_config", config_dir=SKYRL_CONFIG
    )
    text = problems_of(cfg)
    assert "generator.backend: is 'vllm', but the sglang group serves SGLang engines" in text
    assert "generator.run_engines_locally: is true, so SkyRL would start engines of its own" in text


def test_skyrl_dp_needs_dp_attention_in_its_engine_kwargs():
    assert problems_of(skyrl_config("generator.inference_engine_data_parallel_size=2")).startswith(
        "generator.inference_engine_data_parallel_size: 2 needs SGLang's DP attention"
    )
    cfg = skyrl_config(
        "generator.inference_engine_tensor_parallel_size=2",
        "generator.inference_engine_data_parallel_size=2",
        "+generator.engine_init_kwargs.enable_dp_attention=true",
    )
    assert (server_args(cfg)["tp_size"], server_args(cfg)["dp_size"]) == (4, 2)


# ------------------------------------------------------------------------ item 4: SkyRL's remote engines
class _Deployment:
    """What the helper reads of a running deployment: ``engines()`` (EngineInfo-like records)."""

    def __init__(self, *engines: tuple[str, str, str]) -> None:
        from types import SimpleNamespace

        self._engines = [SimpleNamespace(model=m, worker_type=w, url=u) for m, w, u in engines]

    def engines(self):
        return tuple(self._engines)


def test_skyrl_urls_filled_from_the_deployment_pass_skyrl_validate_cfg():
    cfg = skyrl_config(
        "generator.num_inference_engines=2", "generator.inference_engine_tensor_parallel_size=2"
    )
    deployment = _Deployment(
        ("actor", "regular", "http://10.0.0.5:15000"), ("actor", "regular", "http://[::1]:15001"),
        ("judge", "regular", "http://10.0.0.6:15002"),
    )  # fmt: skip
    assert fill_skyrl_engine_urls(cfg, deployment) == ["10.0.0.5:15000", "[::1]:15001"]
    assert list(cfg.generator.remote_inference_engine_urls) == ["10.0.0.5:15000", "[::1]:15001"]
    validate_cfg(cfg)  # SkyRL's own check: one URL per engine, sglang remote engines
    with pytest.raises(ValueError, match=r"generator.num_inference_engines=2, but the deployment runs 1"):
        fill_skyrl_engine_urls(cfg, _Deployment(("actor", "regular", "http://h:1")))
    with pytest.raises(ValueError, match="decode, prefill engines, which SkyRL cannot use"):
        skyrl_engine_urls(_Deployment(("actor", "prefill", "http://h:1"), ("actor", "decode", "http://h:2")))


# --------------------------------------------------------------------- item 5: a sweep over the trainer's TP
def _sweep_app(tmp_path: Path, config_dir: Path, config_name: str) -> Path:
    app = tmp_path / "app.py"
    app.write_text(
        "import hydra\n"
        "from miles_sglang_plugin import resolve_config_or_exit\n"
        f"@hydra.main(version_base=None, config_path={str(config_dir)!r}, config_name={config_name!r})\n"
        "def main(cfg):\n"
        "    resolve_config_or_exit(cfg)\n"
        "main()\n"
    )
    return app


def test_a_tp_sweep_over_verls_own_key_plans_each_job(tmp_path: Path):
    app = _sweep_app(tmp_path, VERL_CONFIG, "ppo_trainer")
    proc = subprocess.run(
        [sys.executable, str(app), "-m", "hydra/callbacks=sglang_plan", *VERL_BASE, f"{R}.tensor_model_parallel_size=1,2,4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for engines in (8, 4, 2):
        assert f"8 GPUs in 1 model(s), {engines} engine(s)" in proc.stdout


def test_a_tp_sweep_over_skyrls_own_key_plans_each_job(tmp_path: Path):
    app = _sweep_app(tmp_path, SKYRL_CONFIG, "ppo_base_config")
    tp = "generator.inference_engine_tensor_parallel_size"
    proc = subprocess.run(
        [sys.executable, str(app), "-m", "hydra/callbacks=sglang_plan", *SKYRL_BASE,
         "trainer.placement.colocate_all=false", "generator.num_inference_engines=2", f"{tp}=1,2,4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for gpus in (2, 4, 8):
        assert f"{gpus} GPUs in 1 model(s), 2 engine(s)" in proc.stdout


# ------------------------------------------------------------- item 1: a composed config in a Ray worker
@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
def test_composed_verl_and_skyrl_configs_resolve_in_a_ray_task():
    import ray

    pd = [f"+sglang@{ENGINES}=pd", *VERL_BASE[1:], f"{R}.disaggregation.enabled=true"]
    verl = verl_config("trainer.nnodes=2", f"{R}.disaggregation.decode_replicas=3", base=pd)
    skyrl = skyrl_config(
        "generator.num_inference_engines=2", "generator.inference_engine_tensor_parallel_size=2"
    )
    for cfg in (verl, skyrl):
        with open_dict(cfg):
            del cfg["hydra"]  # as Hydra hands it to the task function (verl's main, SkyRL's main_base)

    def resolve_in_a_fresh_process(blob: bytes, key: str) -> dict:
        """What a trainer's Ray task does with the config it is handed (verl's TaskRunner.run:
        OmegaConf.resolve; SkyRL's tracker: to_container(resolve=True)): unpickle, resolve, to plain
        containers. Defined here, so that Ray ships it by value: the worker imports nothing of this package
        (nor this test module) before the config."""
        import pickle

        from omegaconf import OmegaConf

        before = OmegaConf.has_resolver("msp.trainer")
        config = OmegaConf.to_container(pickle.loads(blob), resolve=True)
        for part in key.split("."):
            config = config[part]
        return {"before": before, "engines": config}

    def in_a_worker_of_its_own(cfg, key: str) -> dict:
        task = ray.remote(num_cpus=0)(resolve_in_a_fresh_process).options(
            runtime_env={"env_vars": {"MSP_FRESH_WORKER": uuid.uuid4().hex}}  # a new worker process
        )
        return ray.get(task.remote(pickle.dumps(cfg), key), timeout=120)

    result = in_a_worker_of_its_own(verl, ENGINES)
    assert result["before"] is False
    actor = result["engines"]["actor"]
    assert actor["model_path"] == "/models/Qwen3-8B" and actor["num_gpus_per_engine"] == 2
    assert (actor["prefill"]["num_gpus"], actor["decode"]["num_gpus"]) == (4, 12)
    assert actor["decode"]["num_gpus_per_engine"] == 2
    assert "${" not in repr(result["engines"])
    result = in_a_worker_of_its_own(skyrl, "sglang")
    assert result["before"] is False
    actor = result["engines"]["actor"]
    assert (actor["model_path"], actor["num_gpus_per_engine"]) == ("Qwen/Qwen2.5-1.5B-Instruct", 2)
    assert (actor["regular"]["num_gpus"], actor["regular"]["num_gpus_per_engine"]) == (4, 2)
