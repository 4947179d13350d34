"""Trainers on argparse: a Miles-style Namespace resolves to the same plan as the Hydra path; the legacy flags
(--prefill-num-servers, --eval-num-gpus) give Miles' deployment. Numbers worked out by hand."""

from __future__ import annotations

import argparse
import base64
from pathlib import Path
from typing import Any

import pytest

from miles_sglang_plugin.app.hydra_edge import resolve_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.deployment_spec import WorkerType
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.miles.argparse_bridge import resolve_namespace
from miles_sglang_plugin.miles.sglang_config import (
    load_miles_config,
    miles_trainer_args,
    spec_to_miles_yaml,
    spec_to_preset,
)
from miles_sglang_plugin.planning.plan import DeploymentPlan

FIXTURES = Path(__file__).parent / "fixtures" / "miles"


def miles_namespace(**kw: Any) -> argparse.Namespace:
    """What Miles' parser leaves in a Namespace: every flag present with Miles' defaults (unset optional ones
    None, --offload-rollout's None, --eval-num-gpus-per-engine's 1), plus arguments that have nothing to do
    with the deployment."""
    values: dict[str, Any] = dict(
        sglang_config=None,
        hf_checkpoint=None,
        rollout_num_gpus=None,
        rollout_num_gpus_per_engine=1,
        num_gpus_per_node=8,
        actor_num_nodes=1,
        actor_num_gpus_per_node=8,
        colocate=False,
        offload_rollout=None,
        eval_num_gpus=0,
        eval_num_gpus_per_engine=1,
        prefill_num_servers=None,
        debug_rollout_only=False,
        debug_train_only=False,
        use_critic=False,
        critic_train_only=False,
        critic_num_nodes=None,
        critic_num_gpus_per_node=None,
        rollout_external=False,
        seed=1234,
        lr=1e-6,
        advantage_estimator="grpo",
        n_samples_per_prompt=8,
        eval_sglang_mem_fraction_static=None,
        sglang_mem_fraction_static=None,
    )
    values.update(kw)
    return argparse.Namespace(**values)


def comparable(plan: DeploymentPlan) -> dict[str, Any]:
    d = plan.to_dict()
    d.pop("source")
    return d


def slots(plan: DeploymentPlan, model: str, group: str) -> list[tuple[int, ...]]:
    return [e.gpu_slots for e in plan.model(model).group(group).engines]


# ============================================================================== --sglang-config vs the Hydra path
def test_agentic_namespace_equals_the_hydra_preset():
    # The shipped preset agentic_32gpu is slime's 32-GPU example, the same as the fixture file.
    ns = miles_namespace(
        sglang_config=str(FIXTURES / "sglang_agent.yaml"),
        hf_checkpoint="/data/models/Qwen3-8B",
        rollout_num_gpus=32,
    )
    plan = resolve_namespace(ns)
    cfg = compose_config(
        ["sglang=agentic_32gpu", "rollout_num_gpus=32", "hf_checkpoint=/data/models/Qwen3-8B"]
    )
    assert comparable(plan) == comparable(resolve_config(cfg))
    assert plan.source == str(FIXTURES / "sglang_agent.yaml")
    assert [g.gpu_offset for _, g in plan.groups()] == [0, 4, 16, 24]
    assert slots(plan, "reward", "regular") == [(32, 33, 34, 35), (36, 37, 38, 39)]


def test_miles_guide_namespace_equals_its_imported_preset(tmp_path):
    # Seed 000's launch line (not colocated: rollout after Miles' default actor of 1 x 8 GPUs), offload on.
    path = FIXTURES / "miles_actor_pd_ref.yaml"
    ns = miles_namespace(
        sglang_config=str(path),
        rollout_num_gpus=20,
        rollout_num_gpus_per_engine=4,
        offload_rollout=True,
        use_rollout_routing_replay=True,
        lora_rollout_enabled=True,
    )
    plan = resolve_namespace(ns)
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "guide.yaml").write_text(spec_to_preset(load_miles_config(path)))
    cfg = compose_config(
        [
            "sglang=guide",
            f"hydra.searchpath=[file://{tmp_path}]",
            "rollout_num_gpus=20",
            "rollout_num_gpus_per_engine=4",
            "offload_rollout=true",
            "use_rollout_routing_replay=true",
        ]
    )
    assert comparable(plan) == comparable(resolve_config(cfg))
    # Megatron on slots 0..7, rollout from slot 8: no group offloads, each has the memory saver off.
    assert [g.needs_offload for _, g in plan.groups()] == [False, False, False]
    assert all(g.overrides["enable_memory_saver"] is False for _, g in plan.groups())


def test_base64_sglang_config():
    text = (FIXTURES / "sglang_pd.yaml").read_text()
    ns_inline = miles_namespace(
        sglang_config="base64:" + base64.b64encode(text.encode()).decode(),
        hf_checkpoint="/ckpt/actor",
        rollout_num_gpus=16,
    )
    ns_file = miles_namespace(
        sglang_config=str(FIXTURES / "sglang_pd.yaml"), hf_checkpoint="/ckpt/actor", rollout_num_gpus=16
    )
    assert comparable(resolve_namespace(ns_inline)) == comparable(resolve_namespace(ns_file))


def test_sglang_config_with_an_eval_model():
    # rollout gpe 2; the eval model's group has no gpe: it takes --eval-num-gpus-per-engine 4 (not the model's 2,
    # which Miles ignores for eval), so its tp differs from the rollout tp and dp/pp/ep/attn_cp are reset to 1.
    text = (
        "sglang:\n"
        "  - name: actor\n"
        "    server_groups: [{worker_type: regular, num_gpus: 8}]\n"
        "  - name: eval\n"
        "    num_gpus_per_engine: 2\n"
        "    server_groups: [{worker_type: regular, num_gpus: 4}]\n"
    )
    ns = miles_namespace(
        sglang_config="base64:" + base64.b64encode(text.encode()).decode(),
        hf_checkpoint="/ckpt/actor",
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=2,
        eval_num_gpus=4,
        eval_num_gpus_per_engine=4,
        colocate=True,
    )
    plan = resolve_namespace(ns)
    assert (plan.rollout_num_gpus, plan.total_gpus) == (8, 12)
    assert slots(plan, "actor", "regular") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    ev = plan.model("eval")
    assert ev.is_eval and ev.update_weights is False
    assert slots(plan, "eval", "regular") == [(8, 9, 10, 11)]
    assert dict(ev.group("regular").overrides) == {
        "model_path": "/ckpt/actor",
        # colocate turns offload_rollout on; the eval fleet (slots 8..11) is past Megatron's 0..7
        "enable_memory_saver": False,
        "enable_return_routed_experts": False,
        "enable_return_indexer_topk": False,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "attn_cp_size": 1,
    }


# ========================================================================================= legacy flags
def test_legacy_prefill_num_servers_and_eval_fleet():
    # 2 prefill servers x 2 GPUs = 4 prefill GPUs, 16 - 4 = 12 decode GPUs; eval 4 GPUs at TP 4 after them.
    # Not colocated: rollout starts after the 8 actor GPUs.
    ns = miles_namespace(
        hf_checkpoint="/ckpt/actor",
        rollout_num_gpus=16,
        rollout_num_gpus_per_engine=2,
        prefill_num_servers=2,
        eval_num_gpus=4,
        eval_num_gpus_per_engine=4,
        eval_sglang_mem_fraction_static=0.6,
    )
    plan = resolve_namespace(ns)
    assert [m.name for m in plan.models] == ["default", "eval"]
    assert (plan.rollout_offset, plan.total_gpus, plan.rollout_num_gpus) == (8, 20, 16)
    d = plan.model("default")
    assert d.is_pd and d.update_weights and d.model_path == "/ckpt/actor"
    assert [(g.name, g.worker_type, g.num_gpus, g.gpu_offset) for g in d.groups] == [
        ("prefill", WorkerType.prefill, 4, 0),
        ("decode", WorkerType.decode, 12, 4),
    ]
    assert slots(plan, "default", "prefill") == [(8, 9), (10, 11)]
    assert slots(plan, "default", "decode") == [(12, 13), (14, 15), (16, 17), (18, 19), (20, 21), (22, 23)]
    assert [e.node for e in d.engines] == [1, 1, 1, 1, 2, 2, 2, 2]
    ev = plan.model("eval")
    g = ev.group("regular")
    assert (ev.is_eval, ev.update_weights, g.gpu_offset, g.num_gpus_per_engine) == (True, False, 16, 4)
    assert slots(plan, "eval", "regular") == [(24, 25, 26, 27)]
    assert dict(g.overrides) == {
        "model_path": "/ckpt/actor",
        "enable_return_routed_experts": False,
        "enable_return_indexer_topk": False,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "attn_cp_size": 1,
        "mem_fraction_static": 0.6,
    }


def test_legacy_single_group_and_eval_with_the_rollout_tp():
    # Colocated, offload off: one regular group of 8 GPUs (4 TP-2 engines) at slots 0..7, then eval 2 GPUs at
    # --eval-num-gpus-per-engine 2: the eval TP equals the rollout TP, so no parallel sizes are reset.
    ns = miles_namespace(
        hf_checkpoint="/ckpt/actor",
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=2,
        eval_num_gpus=2,
        eval_num_gpus_per_engine=2,
        colocate=True,
        offload_rollout=False,
    )
    plan = resolve_namespace(ns)
    assert slots(plan, "default", "regular") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert slots(plan, "eval", "regular") == [(8, 9)]
    assert dict(plan.model("eval").group("regular").overrides) == {
        "model_path": "/ckpt/actor",
        "enable_return_routed_experts": False,
        "enable_return_indexer_topk": False,
    }


def test_legacy_eval_fleet_defaults_to_one_gpu_per_engine():
    # Miles' --eval-num-gpus-per-engine defaults to 1 whatever the rollout TP (here 2): 2 eval engines of 1
    # GPU, and as 1 != 2 (the arguments' TPs, rollout_server.py) dp/pp/ep/attn_cp are reset to 1.
    ns = miles_namespace(
        hf_checkpoint="/ckpt/actor", rollout_num_gpus=8, rollout_num_gpus_per_engine=2, eval_num_gpus=2
    )
    del ns.eval_num_gpus_per_engine  # a namespace without the flag at all: Miles' default
    plan = resolve_namespace(ns)
    assert slots(plan, "eval", "regular") == [(16,), (17,)]  # after the actor's 8 and the 8 rollout GPUs
    overrides = dict(plan.model("eval").group("regular").overrides)
    assert {k: overrides[k] for k in ("dp_size", "pp_size", "ep_size", "attn_cp_size")} == dict.fromkeys(
        ("dp_size", "pp_size", "ep_size", "attn_cp_size"), 1
    )


def test_legacy_plan_exports_to_an_equivalent_miles_file(tmp_path):
    # The legacy deployment (prefill_num_servers + eval) written as a --sglang-config file: Miles refuses the
    # file together with --prefill-num-servers, so the arguments leave it out; the --eval-sglang-* value goes
    # into the eval group's overrides.
    ns = miles_namespace(
        hf_checkpoint="/ckpt/actor",
        rollout_num_gpus=16,
        rollout_num_gpus_per_engine=2,
        prefill_num_servers=2,
        eval_num_gpus=4,
        eval_num_gpus_per_engine=4,
        eval_sglang_mem_fraction_static=0.6,
    )
    plan = resolve_namespace(ns)
    out = tmp_path / "legacy.yaml"
    out.write_text(spec_to_miles_yaml(None, plan))
    args = miles_trainer_args(plan, sglang_config=str(out))
    assert "--prefill-num-servers" not in args
    assert args[-4:] == ["--eval-num-gpus", "4", "--eval-num-gpus-per-engine", "4"]
    eval_entry = load_miles_config(out).model("eval")
    assert dict(eval_entry.groups[0].overrides) == {"mem_fraction_static": 0.6}
    ns2 = miles_namespace(
        sglang_config=str(out),
        hf_checkpoint="/ckpt/actor",
        rollout_num_gpus=16,
        rollout_num_gpus_per_engine=2,
        eval_num_gpus=4,
        eval_num_gpus_per_engine=4,
    )
    assert comparable(resolve_namespace(ns2)) == comparable(plan)


# ============================================================================================== refusals
def test_sglang_config_with_prefill_num_servers_is_refused():
    ns = miles_namespace(
        sglang_config=str(FIXTURES / "sglang_pd.yaml"),
        hf_checkpoint="/ckpt/actor",
        rollout_num_gpus=16,
        prefill_num_servers=2,
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_namespace(ns)
    assert [p.key for p in exc.value.problems] == ["prefill_num_servers"]


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"sglang_config": str(FIXTURES / "sglang_pd.yaml")}, "sglang_config"),
        ({"prefill_num_servers": 2}, "prefill_num_servers"),
    ],
)
def test_rollout_external_with_a_deployment_is_refused(kw, key):
    ns = miles_namespace(rollout_external=True, rollout_num_gpus=16, hf_checkpoint="/ckpt", **kw)
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_namespace(ns)
    assert [p.key for p in exc.value.problems] == [key]


def test_bad_sglang_config_names_the_file_model_and_field(tmp_path):
    bad = tmp_path / "sglang_agent.yaml"
    bad.write_text((FIXTURES / "sglang_agent.yaml").read_text().replace("num_gpus: 8\n", "num_gpus: -8\n", 1))
    ns = miles_namespace(sglang_config=str(bad), hf_checkpoint="/ckpt", rollout_num_gpus=32)
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_namespace(ns)
    assert [p.key for p in exc.value.problems] == [
        "sglang_agent.yaml: sglang[1] (ref).server_groups[0].num_gpus"
    ]


def test_gpu_total_mismatch_is_reported_against_the_trainer_argument():
    ns = miles_namespace(
        sglang_config=str(FIXTURES / "sglang_agent.yaml"), hf_checkpoint="/ckpt", rollout_num_gpus=24
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_namespace(ns)
    assert [p.key for p in exc.value.problems] == ["rollout_num_gpus"]
    assert "32 GPUs" in str(exc.value)
