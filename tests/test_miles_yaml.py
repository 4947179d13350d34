"""Miles/slime --sglang-config files: import (file → spec → preset), export (plan → Miles file + arguments),
error reporting, and the `import` / `export` commands.

Every expected number below is worked out by hand from Miles' rules (see the comment at each case): a group's
gpu_offset is the running GPU count of every earlier group of every model; a GPU slot is
rollout_offset + gpu_offset + i; rollout_offset is 0 when colocated and the actor's GPUs otherwise;
needs_offload = offload_rollout and (rollout_offset + gpu_offset) < megatron GPUs (the actor's).
"""

from __future__ import annotations

import argparse
import base64
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from miles_sglang_plugin import cli
from miles_sglang_plugin.app.hydra_edge import resolve_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.deployment_spec import WorkerType
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.miles import commands as miles_commands
from miles_sglang_plugin.miles.sglang_config import (
    load_miles_config,
    miles_trainer_args,
    spec_to_miles_yaml,
    spec_to_preset,
)
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.rendering.server_arg_fields import shipped_server_arg_fields

NEWER_SGLANG_FIELDS = shipped_server_arg_fields() | {"prefill_round_robin_balance"}

FIXTURES = Path(__file__).parent / "fixtures" / "miles"
REPO = Path(__file__).resolve().parent.parent


def fixture(name: str) -> Path:
    return FIXTURES / f"{name}.yaml"


def slots(plan: DeploymentPlan, model: str, group: str) -> list[tuple[int, ...]]:
    return [e.gpu_slots for e in plan.model(model).group(group).engines]


def comparable(plan: DeploymentPlan) -> dict[str, Any]:
    """plan.to_dict() without `source` (a file path on one side, "the Hydra config" on the other), and with the
    model path keys its notes name left out (spelled as the source spells them: ``sglang_full.yaml: sglang[1]
    (ref).model_path`` for a Miles file, ``sglang.ref.model_path`` for the Hydra config)."""
    d = plan.to_dict()
    d.pop("source")
    d["notes"] = [_keyless(note) for note in d["notes"]]
    return d


def _keyless(note: str) -> str:
    return re.sub(
        r"(?:\S+\.yaml: )?(?:sglang\[\d+\] \(\w+\)|sglang\.\w+)\.model_path", "<model>.model_path", note
    )


# Trainer arguments per fixture (the seed's launch arguments where it gives them; choices are commented).
TRAINER: dict[str, dict[str, Any]] = {
    # Seed 000's launch line: --rollout-num-gpus=20 --rollout-num-gpus-per-engine=4 --offload-rollout, not
    # colocated, Miles' default actor of 1 node x 8 GPUs: rollout_offset 8, megatron 8.
    "miles_actor_pd_ref": dict(rollout_num_gpus=20, rollout_num_gpus_per_engine=4, offload_rollout=True),
    # Seed 001 basic: --rollout-num-gpus 8 --rollout-num-gpus-per-engine 2; hf_checkpoint chosen (no model
    # path in the file); colocated (rollout_offset 0).
    "sglang_basic": dict(
        rollout_num_gpus=8, rollout_num_gpus_per_engine=2, hf_checkpoint="/ckpt/base", colocate=True
    ),
    # Seed 001 pd: --rollout-num-gpus 16; hf_checkpoint chosen; not colocated (rollout_offset 8).
    "sglang_pd": dict(rollout_num_gpus=16, hf_checkpoint="/ckpt/actor"),
    # Seed 001 multi_model: --rollout-num-gpus 16 --hf-checkpoint /path/to/actor_model; not colocated.
    "sglang_multi_model": dict(rollout_num_gpus=16, hf_checkpoint="/path/to/actor_model"),
    # Seed 001 full (no launch line given): 16 GPUs, colocated with a 2 x 8 GPU actor, with offload_rollout.
    # Colocated because with the default non-colocated actor of 8 GPUs every group starts at slot >= 8 and
    # nothing would need offloading; this is the offload case.
    "sglang_full": dict(
        rollout_num_gpus=16,
        hf_checkpoint="/ckpt/actor",
        colocate=True,
        actor_num_nodes=2,
        offload_rollout=True,
    ),
    # Seed 001 placeholder: 8 GPUs, colocated (the placeholder keeps 2 GPUs for training).
    "sglang_placeholder": dict(rollout_num_gpus=8, hf_checkpoint="/ckpt/actor", colocate=True),
    # Seed 001 overrides: 8 GPUs, colocated.
    "sglang_overrides": dict(rollout_num_gpus=8, hf_checkpoint="/ckpt/actor", colocate=True),
    # Seed 001 agentic: --hf-checkpoint /data/models/Qwen3-8B --rollout-num-gpus 32; not colocated.
    "sglang_agent": dict(rollout_num_gpus=32, hf_checkpoint="/data/models/Qwen3-8B"),
    # Not from a seed: `models` + `engine_groups` aliases and a second decode group; colocated with a 2 x 8 actor
    # (Miles sizes a colocated rollout as the actor).
    "miles_models_alias_extra_groups": dict(
        rollout_num_gpus=16, hf_checkpoint="/ckpt/actor", colocate=True, actor_num_nodes=2
    ),
}


def resolve_fixture(name: str, **extra: Any) -> DeploymentPlan:
    return resolve_deployment(load_miles_config(fixture(name)), TrainerInputs(**{**TRAINER[name], **extra}))


# ====================================================================================== seed examples → plan
def test_miles_guide_pd_actor_and_ref_not_colocated_with_offload():
    plan = resolve_fixture("miles_actor_pd_ref")
    assert plan.rollout_offset == 8 and plan.megatron_num_gpus == 8
    assert plan.total_gpus == 20 and plan.rollout_num_gpus == 20
    actor, ref = plan.model("actor"), plan.model("ref")
    assert [g.name for g in actor.groups] == ["prefill", "decode"]
    assert [g.gpu_offset for _, g in plan.groups()] == [0, 8, 16]
    # Model-level num_gpus_per_engine 4 for the actor; the ref model falls back to --rollout-num-gpus-per-engine 4.
    assert [g.num_gpus_per_engine for _, g in plan.groups()] == [4, 4, 4]
    assert [g.tp_size for _, g in plan.groups()] == [4, 4, 4]
    assert slots(plan, "actor", "prefill") == [(8, 9, 10, 11), (12, 13, 14, 15)]
    assert slots(plan, "actor", "decode") == [(16, 17, 18, 19), (20, 21, 22, 23)]
    assert slots(plan, "ref", "regular") == [(24, 25, 26, 27)]
    assert [e.node for e in plan.engines] == [1, 1, 2, 2, 3]
    assert actor.is_pd and not ref.is_pd
    assert (actor.model_path, actor.update_weights) == ("/mnt/checkpoints/actor", True)
    assert (ref.model_path, ref.update_weights) == ("/mnt/checkpoints/ref", False)
    # First GPUs 8, 16, 24 are all >= 8 Megatron GPUs: nothing offloads, all get enable_memory_saver False.
    assert [g.needs_offload for _, g in plan.groups()] == [False, False, False]
    assert dict(actor.group("prefill").overrides) == {
        "model_path": "/mnt/checkpoints/actor",
        "enable_memory_saver": False,
        "tp_size": 4,
        "load_balance_method": "round_robin",
    }
    assert dict(actor.group("decode").overrides) == {
        "model_path": "/mnt/checkpoints/actor",
        "enable_memory_saver": False,
        "tp_size": 4,
        "prefill_round_robin_balance": True,
    }
    assert dict(ref.group("regular").overrides) == {
        "model_path": "/mnt/checkpoints/ref",
        "enable_memory_saver": False,
    }


def test_miles_guide_colocated_needs_as_many_rollout_gpus_as_the_actor():
    # Miles with --colocate sets rollout_num_gpus to the actor's 2 x 8 = 16 (arguments.py) and then asserts the
    # file's 20 GPUs equal it: refused, saying where the 16 comes from.
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_fixture("miles_actor_pd_ref", colocate=True, actor_num_nodes=2)
    assert [(p.key, p.message) for p in exc.value.problems] == [
        (
            "rollout_num_gpus",
            "is 16 GPUs of the actor (colocate: Miles sets rollout_num_gpus to them) but the server groups hold 20 "
            "GPUs (actor=16, ref=4); size the groups to them",
        )
    ]
    # With a 5 x 4 actor (20 GPUs) it plans: rollout_offset 0, every group inside Megatron's 20 slots.
    plan = resolve_fixture("miles_actor_pd_ref", colocate=True, actor_num_nodes=5, actor_num_gpus_per_node=4)
    assert (plan.rollout_offset, plan.megatron_num_gpus) == (0, 20)
    assert [g.needs_offload for _, g in plan.groups()] == [True, True, True]
    assert slots(plan, "ref", "regular") == [(16, 17, 18, 19)]
    assert all("enable_memory_saver" not in g.overrides for _, g in plan.groups())


def test_slime_basic_four_tp2_engines():
    plan = resolve_fixture("sglang_basic")
    m = plan.model("default")
    assert [g.name for g in m.groups] == ["regular"]
    g = m.group("regular")
    assert (g.num_gpus, g.num_gpus_per_engine, g.tp_size, g.gpu_offset) == (8, 2, 2, 0)
    assert slots(plan, "default", "regular") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # No model_path: hf_checkpoint; update_weights inferred True (effective path == hf_checkpoint).
    assert (m.model_path, m.update_weights) == ("/ckpt/base", True)
    assert dict(g.overrides) == {"model_path": "/ckpt/base"}
    assert g.needs_offload is True  # colocated: Miles turns offload_rollout on, and slots 0..7 are Megatron's


def test_slime_pd_two_prefill_tp2_three_decode_tp4():
    plan = resolve_fixture("sglang_pd")
    assert plan.rollout_offset == 8
    actor = plan.model("actor")
    assert actor.is_pd and actor.update_weights and actor.model_path == "/ckpt/actor"
    pre, dec = actor.group("prefill"), actor.group("decode")
    assert (pre.gpu_offset, pre.num_gpus_per_engine, len(pre.engines)) == (0, 2, 2)
    assert (dec.gpu_offset, dec.num_gpus_per_engine, len(dec.engines)) == (4, 4, 3)
    assert slots(plan, "actor", "prefill") == [(8, 9), (10, 11)]
    assert slots(plan, "actor", "decode") == [(12, 13, 14, 15), (16, 17, 18, 19), (20, 21, 22, 23)]
    assert [e.node for e in dec.engines] == [1, 2, 2]
    assert [e.local_gpu_ids for e in dec.engines] == [(4, 5, 6, 7), (0, 1, 2, 3), (4, 5, 6, 7)]
    assert [e.worker_type for e in actor.engines] == [WorkerType.prefill] * 2 + [WorkerType.decode] * 3


def test_slime_multi_model_three_routers():
    plan = resolve_fixture("sglang_multi_model")
    assert [m.name for m in plan.models] == ["actor", "ref", "reward"]
    assert [g.gpu_offset for _, g in plan.groups()] == [0, 8, 12]
    assert slots(plan, "actor", "regular") == [(8, 9, 10, 11), (12, 13, 14, 15)]
    assert slots(plan, "ref", "regular") == [(16, 17), (18, 19)]
    assert slots(plan, "reward", "regular") == [(20, 21), (22, 23)]
    assert [(m.model_path, m.update_weights) for m in plan.models] == [
        ("/path/to/actor_model", True),
        ("/path/to/ref_model", False),
        ("/path/to/reward_model", False),
    ]
    assert [g.tp_size for _, g in plan.groups()] == [4, 2, 2]


@pytest.mark.parametrize(
    ("actor_num_nodes", "expected_offload"),
    [
        # Megatron 16 slots: first GPUs 0, 4, 12 are all inside. (A 1 x 8 actor would size the colocated
        # rollout at 8 GPUs, which the file's 16 do not match.)
        (2, [True, True, True]),
    ],
)
def test_slime_full_multi_model_pd_colocated_with_offload(actor_num_nodes, expected_offload):
    plan = resolve_fixture("sglang_full", actor_num_nodes=actor_num_nodes)
    assert plan.rollout_offset == 0
    assert [g.gpu_offset for _, g in plan.groups()] == [0, 4, 12]
    assert slots(plan, "actor", "prefill") == [(0, 1), (2, 3)]
    assert slots(plan, "actor", "decode") == [(4, 5, 6, 7), (8, 9, 10, 11)]
    assert slots(plan, "ref", "regular") == [(12, 13), (14, 15)]
    assert [g.needs_offload for _, g in plan.groups()] == expected_offload
    saver = [g.overrides.get("enable_memory_saver") for _, g in plan.groups()]
    assert saver == [None if off else False for off in expected_offload]
    assert [(m.model_path, m.update_weights) for m in plan.models] == [
        ("/ckpt/actor", True),
        ("/path/to/ref_model", False),
    ]


def test_slime_placeholder_reserves_two_gpus_without_engines():
    plan = resolve_fixture("sglang_placeholder")
    actor = plan.model("actor")
    assert [g.name for g in actor.groups] == ["regular", "placeholder"]
    assert slots(plan, "actor", "regular") == [(0, 1), (2, 3), (4, 5)]
    ph = actor.group("placeholder")
    assert (ph.gpu_offset, ph.num_gpus, ph.engines) == (6, 2, ())
    assert plan.total_gpus == 8 and len(plan.engines) == 3


def test_slime_per_group_overrides_are_kept_over_the_injected_model_path():
    plan = resolve_fixture("sglang_overrides")
    g = plan.model("actor").group("regular")
    assert slots(plan, "actor", "regular") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert dict(g.overrides) == {
        "model_path": "/ckpt/actor",
        "mem_fraction_static": 0.85,
        "context_length": 32768,
        "chunked_prefill_size": 4096,
        "enable_torch_compile": True,
    }


def test_slime_agentic_32_gpus():
    plan = resolve_fixture("sglang_agent")
    assert plan.rollout_offset == 8 and plan.total_gpus == 32
    assert [(m.name, g.name, g.gpu_offset) for m, g in plan.groups()] == [
        ("actor", "prefill", 0),
        ("actor", "decode", 4),
        ("ref", "regular", 16),
        ("reward", "regular", 24),
    ]
    assert slots(plan, "actor", "prefill") == [(8, 9), (10, 11)]
    assert slots(plan, "actor", "decode") == [(12, 13, 14, 15), (16, 17, 18, 19), (20, 21, 22, 23)]
    assert slots(plan, "ref", "regular") == [(24, 25, 26, 27), (28, 29, 30, 31)]
    assert slots(plan, "reward", "regular") == [(32, 33, 34, 35), (36, 37, 38, 39)]
    assert plan.nodes == (1, 2, 3, 4)
    assert [len(m.engines) for m in plan.models] == [5, 2, 2]
    assert [(m.model_path, m.update_weights) for m in plan.models] == [
        ("/data/models/Qwen3-8B", True),
        ("/data/models/Qwen3-32B", False),
        ("/data/models/reward-model", False),
    ]
    actor = plan.model("actor")
    assert actor.group("prefill").overrides["chunked_prefill_size"] == 8192
    assert actor.group("decode").overrides["mem_fraction_static"] == 0.88


def test_models_alias_engine_groups_and_a_second_decode_group():
    plan = resolve_fixture("miles_models_alias_extra_groups")
    actor = plan.model("actor")
    # Names: the worker type for the first group of a type, <type>_2 for the second.
    assert [(g.name, g.gpu_offset, g.num_gpus_per_engine) for g in actor.groups] == [
        ("decode", 0, 4),
        ("prefill", 8, 2),
        ("decode_2", 12, 2),
    ]
    assert slots(plan, "actor", "decode") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert slots(plan, "actor", "prefill") == [(8, 9), (10, 11)]
    assert slots(plan, "actor", "decode_2") == [(12, 13), (14, 15)]
    assert actor.group("decode_2").overrides["mem_fraction_static"] == 0.7


def test_spec_keys_point_into_the_file():
    spec = load_miles_config(fixture("sglang_agent"))
    assert spec.source == str(fixture("sglang_agent"))
    assert [m.key for m in spec.models] == [
        "sglang_agent.yaml: sglang[0] (actor)",
        "sglang_agent.yaml: sglang[1] (ref)",
        "sglang_agent.yaml: sglang[2] (reward)",
    ]
    assert spec.model("actor").groups[1].key == "sglang_agent.yaml: sglang[0] (actor).server_groups[1]"
    alias = load_miles_config(fixture("miles_models_alias_extra_groups"))
    assert alias.models[0].groups[2].key == (
        "miles_models_alias_extra_groups.yaml: models[0] (actor).engine_groups[2]"
    )


def test_resolution_errors_point_into_the_file():
    # Resolution is stricter than Miles: engines may not straddle nodes. With a non-colocated actor of
    # 1 node x 2 GPUs, rollout starts at slot 2; the decode group (gpu_offset 4) starts at slot 6, so its first engine
    # would take slots 6..9 across nodes 0 and 1. (This is why the fixtures above use other placements.)
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_fixture(
            "sglang_full", colocate=False, actor_num_nodes=1, actor_num_gpus_per_node=2, offload_rollout=False
        )
    keys = [p.key for p in exc.value.problems]
    assert keys == ["sglang_full.yaml: sglang[0] (actor).server_groups[1]"]
    assert "slots 6..9" in str(exc.value)
    # No model_path in the file and no hf_checkpoint.
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(load_miles_config(fixture("sglang_basic")), TrainerInputs(rollout_num_gpus=8))
    assert [p.key for p in exc.value.problems] == ["sglang_basic.yaml: sglang[0] (default).model_path"]


def test_base64_form_is_the_same_as_the_file():
    text = fixture("sglang_agent").read_text()
    inline = "base64:" + base64.b64encode(text.encode()).decode()
    from_inline = resolve_deployment(load_miles_config(inline), TrainerInputs(**TRAINER["sglang_agent"]))
    assert comparable(from_inline) == comparable(resolve_fixture("sglang_agent"))
    assert load_miles_config(inline).models[1].key == "<base64 --sglang-config>: sglang[1] (ref)"


# =============================================================================================== round trips
def hydra_overrides(trainer: dict[str, Any]) -> list[str]:
    out = []
    for k, v in trainer.items():
        out.append(f"{k}={str(v).lower() if isinstance(v, bool) else v}")
    return out


@pytest.mark.parametrize("name", sorted(TRAINER))
def test_import_preset_compose_resolve_equals_direct(name, tmp_path):
    spec = load_miles_config(fixture(name))
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / f"imported_{name}.yaml").write_text(spec_to_preset(spec))
    cfg = compose_config(
        [f"sglang=imported_{name}", f"hydra.searchpath=[file://{tmp_path}]", *hydra_overrides(TRAINER[name])]
    )
    # resolve_config checks override keys as a launch does; the Miles guide's decode override
    # prefill_round_robin_balance is a field of SGLang releases newer than 0.5.23.
    via_hydra = resolve_config(cfg, server_arg_fields=NEWER_SGLANG_FIELDS)
    direct = resolve_deployment(spec, TrainerInputs(**TRAINER[name]))
    assert comparable(via_hydra) == comparable(direct)


def miles_like_parser() -> argparse.ArgumentParser:
    """The subset of Miles' arguments that the deployment reads, with Miles' spellings and defaults."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang-config")
    ap.add_argument("--rollout-num-gpus", type=int)
    ap.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    ap.add_argument("--hf-checkpoint")
    ap.add_argument("--num-gpus-per-node", type=int, default=8)
    ap.add_argument("--actor-num-nodes", type=int, default=1)
    ap.add_argument("--actor-num-gpus-per-node", type=int, default=8)
    ap.add_argument("--colocate", action="store_true")
    ap.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction)
    ap.add_argument("--use-critic", action="store_true")
    ap.add_argument("--critic-num-nodes", type=int)
    ap.add_argument("--critic-num-gpus-per-node", type=int)
    ap.add_argument("--critic-train-only", action="store_true")
    ap.add_argument("--debug-rollout-only", action="store_true")
    ap.add_argument("--eval-num-gpus", type=int, default=0)
    ap.add_argument("--eval-num-gpus-per-engine", type=int, default=1)
    ap.add_argument("--prefill-num-servers", type=int)
    return ap


@pytest.mark.parametrize("name", sorted(TRAINER))
def test_export_to_miles_and_load_again_gives_the_same_plan(name, tmp_path):
    from miles_sglang_plugin.miles.argparse_bridge import resolve_namespace

    spec = load_miles_config(fixture(name))
    plan = resolve_deployment(spec, TrainerInputs(**TRAINER[name]))
    out = tmp_path / "exported.yaml"
    out.write_text(spec_to_miles_yaml(spec, plan))
    ns = miles_like_parser().parse_args(miles_trainer_args(plan, sglang_config=str(out)))
    assert comparable(resolve_namespace(ns)) == comparable(plan)


def test_exported_miles_yaml_is_explicit_and_keeps_only_the_users_overrides():
    spec = load_miles_config(fixture("miles_actor_pd_ref"))
    plan = resolve_deployment(spec, TrainerInputs(**TRAINER["miles_actor_pd_ref"], hf_checkpoint="/ckpt/x"))
    data = yaml.safe_load(spec_to_miles_yaml(spec, plan))
    assert data == {
        "sglang": [
            {
                "name": "actor",
                "model_path": "/mnt/checkpoints/actor",
                "update_weights": True,
                "server_groups": [
                    {
                        "worker_type": "prefill",
                        "num_gpus": 8,
                        "num_gpus_per_engine": 4,
                        "overrides": {"tp_size": 4, "load_balance_method": "round_robin"},
                    },
                    {
                        "worker_type": "decode",
                        "num_gpus": 8,
                        "num_gpus_per_engine": 4,
                        "overrides": {"tp_size": 4, "prefill_round_robin_balance": True},
                    },
                ],
            },
            {
                "name": "ref",
                "model_path": "/mnt/checkpoints/ref",
                "update_weights": False,
                "server_groups": [{"worker_type": "regular", "num_gpus": 4, "num_gpus_per_engine": 4}],
            },
        ]
    }
    assert miles_trainer_args(plan) == [
        "--rollout-num-gpus",
        "20",
        "--rollout-num-gpus-per-engine",
        "4",
        "--hf-checkpoint",
        "/ckpt/x",
        "--offload-rollout",
    ]


def test_exported_yaml_for_inherited_values_names_them():
    # sglang_basic inherits model_path (hf_checkpoint), update_weights (inferred) and TP (trainer's 2).
    spec = load_miles_config(fixture("sglang_basic"))
    plan = resolve_deployment(spec, TrainerInputs(**TRAINER["sglang_basic"]))
    assert yaml.safe_load(spec_to_miles_yaml(spec, plan)) == {
        "sglang": [
            {
                "name": "default",
                "model_path": "/ckpt/base",
                "update_weights": True,
                "server_groups": [{"worker_type": "regular", "num_gpus": 8, "num_gpus_per_engine": 2}],
            }
        ]
    }
    assert miles_trainer_args(plan, sglang_config="c.yaml") == [
        "--sglang-config",
        "c.yaml",
        "--rollout-num-gpus",
        "8",
        "--rollout-num-gpus-per-engine",
        "2",
        "--hf-checkpoint",
        "/ckpt/base",
        "--colocate",
    ]


def test_preset_shape_slots_extras_and_order():
    text = spec_to_preset(load_miles_config(fixture("miles_models_alias_extra_groups")))
    data = yaml.safe_load(text)
    assert data["defaults"] == [
        {"/sglang_model@actor": "base"},
        {"/sglang_deploy@_global_.sglang_deploy": "default"},
        "_self_",
    ]
    assert data["actor"] == {
        "num_gpus_per_engine": 4,
        "prefill": {"num_gpus": 4, "num_gpus_per_engine": 2},
        "decode": {"num_gpus": 8},
        "extra_groups": {
            "decode_2": {
                "worker_type": "decode",
                "num_gpus": 4,
                "num_gpus_per_engine": 2,
                "overrides": {"mem_fraction_static": 0.7},
            }
        },
        "group_order": ["decode", "prefill", "decode_2"],
    }
    # The canonical order needs no group_order; nothing given is written (so it keeps inheriting).
    agent = yaml.safe_load(spec_to_preset(load_miles_config(fixture("sglang_agent"))))
    assert list(agent) == ["defaults", "actor", "ref", "reward"]
    assert agent["actor"] == {
        "update_weights": True,
        "prefill": {"num_gpus": 4, "num_gpus_per_engine": 2, "overrides": {"chunked_prefill_size": 8192}},
        "decode": {"num_gpus": 12, "num_gpus_per_engine": 4, "overrides": {"mem_fraction_static": 0.88}},
    }
    assert "# " not in text.split("\n", 1)[1]  # the file's comments are not copied


def test_preset_keeps_strings_hydra_would_otherwise_reinterpret(tmp_path):
    src = tmp_path / "tricky.yaml"
    src.write_text(
        "sglang:\n"
        "  - name: actor\n"
        "    model_path: /ckpt/${USER}/actor\n"
        "    server_groups:\n"
        "      - worker_type: regular\n"
        "        num_gpus: 2\n"
        "        overrides:\n"
        "          served_model_name: 1e3\n"  # a string to PyYAML (Miles), a float to Hydra unless quoted
        '          chat_template: "${oc.env:HOME}"\n'
        "          json_model_override_args: '{\"a\": 1}'\n"
    )
    spec = load_miles_config(src)
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "tricky.yaml").write_text(spec_to_preset(spec))
    trainer = {"rollout_num_gpus": 2, "debug_rollout_only": True}
    cfg = compose_config(
        ["sglang=tricky", f"hydra.searchpath=[file://{tmp_path}]", *hydra_overrides(trainer)]
    )
    plan = resolve_config(cfg)
    g = plan.model("actor").group("regular")
    assert g.overrides["served_model_name"] == "1e3"
    assert g.overrides["chat_template"] == "${oc.env:HOME}"
    assert g.overrides["json_model_override_args"] == '{"a": 1}'
    assert plan.model("actor").model_path == "/ckpt/${USER}/actor"
    assert comparable(plan) == comparable(resolve_deployment(spec, TrainerInputs(**trainer)))


@pytest.mark.parametrize(
    ("model_name", "fragment"),
    [("my model", "cannot be a key"), ("sglang_deploy", "reserved"), ("defaults", "reserved")],
)
def test_preset_refuses_model_names_it_cannot_hold(tmp_path, model_name, fragment):
    src = tmp_path / "names.yaml"
    src.write_text(
        f"sglang:\n  - name: {model_name}\n    server_groups: [{{worker_type: regular, num_gpus: 1}}]\n"
    )
    spec = load_miles_config(src)
    with pytest.raises(DeploymentConfigError) as exc:
        spec_to_preset(spec)
    assert [p.key for p in exc.value.problems] == [f"names.yaml: sglang[0] ({model_name}).name"]
    assert fragment in str(exc.value)


def test_preset_refuses_values_hydra_cannot_hold(tmp_path):
    src = tmp_path / "dates.yaml"
    # An unquoted date is a datetime.date to PyYAML; Hydra would read a string: not silently changed.
    src.write_text(
        "sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 1\n"
        "        overrides: {release: 2024-01-01}\n"
    )
    with pytest.raises(DeploymentConfigError) as exc:
        spec_to_preset(load_miles_config(src))
    assert [p.key for p in exc.value.problems] == [
        "dates.yaml: sglang[0] (actor).server_groups[0].overrides.release"
    ]


def test_export_of_a_debug_train_only_plan_is_refused():
    plan = resolve_deployment(None, TrainerInputs(debug_train_only=True))
    with pytest.raises(DeploymentConfigError, match="nothing to write"):
        spec_to_miles_yaml(None, plan)


# ========================================================================================== malformed files
def load_bad(tmp_path: Path, text: str, name: str = "bad.yaml") -> DeploymentConfigError:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DeploymentConfigError) as exc:
        load_miles_config(path)
    assert str(path) in str(exc.value)  # the error's head names the file
    return exc.value


def problem_keys(err: DeploymentConfigError) -> list[str]:
    return [p.key for p in err.problems]


GOOD_REF = "  - name: ref\n    model_path: /ref\n    server_groups:\n      - worker_type: regular\n        num_gpus: 4\n"


def with_ref_group(group_lines: str) -> str:
    """A file whose second model (ref) has one group made of ``group_lines``."""
    return (
        "sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 4\n"
        "  - name: ref\n    server_groups:\n      - " + group_lines.replace("\n", "\n        ") + "\n"
    )


@pytest.mark.parametrize("value", ["0", "-4", "2.5", '"4"', "true", "null", "[4]"])
def test_num_gpus_must_be_a_positive_integer(tmp_path, value):
    err = load_bad(tmp_path, with_ref_group(f"worker_type: regular\nnum_gpus: {value}"), "sglang_agent.yaml")
    assert problem_keys(err) == ["sglang_agent.yaml: sglang[1] (ref).server_groups[0].num_gpus"]
    assert "integer > 0" in str(err)


def test_num_gpus_is_required(tmp_path):
    err = load_bad(tmp_path, with_ref_group("worker_type: regular"))
    assert problem_keys(err) == ["bad.yaml: sglang[1] (ref).server_groups[0].num_gpus"]
    assert "required" in str(err)


@pytest.mark.parametrize("value", ["0", "-1", "1.5"])
def test_num_gpus_per_engine_must_be_a_positive_integer(tmp_path, value):
    err = load_bad(
        tmp_path, with_ref_group(f"worker_type: regular\nnum_gpus: 4\nnum_gpus_per_engine: {value}")
    )
    assert problem_keys(err) == ["bad.yaml: sglang[1] (ref).server_groups[0].num_gpus_per_engine"]


def test_bad_worker_type_with_suggestion(tmp_path):
    err = load_bad(tmp_path, with_ref_group("worker_type: decod\nnum_gpus: 4"))
    assert problem_keys(err) == ["bad.yaml: sglang[1] (ref).server_groups[0].worker_type"]
    assert "did you mean 'decode'" in str(err)


def test_slimes_encoder_worker_type_is_not_supported(tmp_path):
    err = load_bad(tmp_path, with_ref_group("worker_type: encoder\nnum_gpus: 4"))
    assert problem_keys(err) == ["bad.yaml: sglang[1] (ref).server_groups[0].worker_type"]
    assert "'encoder'" in str(err) and "not supported" in str(err)


def test_unknown_keys_at_every_level_with_suggestions(tmp_path):
    err = load_bad(
        tmp_path,
        "sglang:\n"
        "  - name: actor\n"
        "    update_weight: true\n"
        "    server_groups:\n"
        "      - worker_type: regular\n"
        "        num_gpus: 4\n"
        "        overides: {mem_fraction_static: 0.8}\n"
        "router: {policy: round_robin}\n",
    )
    assert problem_keys(err) == [
        "bad.yaml: router",
        "bad.yaml: sglang[0] (actor).update_weight",
        "bad.yaml: sglang[0] (actor).server_groups[0].overides",
    ]
    text = str(err)
    assert "did you mean 'update_weights'" in text and "did you mean 'overrides'" in text


def test_missing_sglang_key(tmp_path):
    err = load_bad(tmp_path, "server_groups:\n  - worker_type: regular\n    num_gpus: 8\n")
    assert problem_keys(err) == ["bad.yaml: server_groups", "bad.yaml: sglang"]
    assert "wrap your server_groups inside a model entry under 'sglang'" in str(err)
    assert "is missing" in str(err)


def test_misspelled_top_level_key(tmp_path):
    err = load_bad(tmp_path, "sglnag:\n  - name: actor\n")
    assert problem_keys(err) == ["bad.yaml: sglnag", "bad.yaml: sglang"]
    assert "did you mean 'sglang'" in str(err)


def test_sglang_and_models_together(tmp_path):
    body = "  - name: actor\n    server_groups: [{worker_type: regular, num_gpus: 1}]\n"
    err = load_bad(tmp_path, f"sglang:\n{body}models:\n{body}")
    assert problem_keys(err) == ["bad.yaml: models"]
    assert "both 'sglang' and its alias 'models'" in str(err)


def test_server_groups_and_engine_groups_together(tmp_path):
    err = load_bad(
        tmp_path,
        "sglang:\n  - name: actor\n    server_groups: [{worker_type: regular, num_gpus: 1}]\n"
        "    engine_groups: [{worker_type: regular, num_gpus: 1}]\n",
    )
    assert problem_keys(err) == ["bad.yaml: sglang[0] (actor).engine_groups"]
    assert "server_groups" in str(err)


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        # a mapping of models instead of a list
        (
            "sglang:\n  actor:\n    server_groups: [{worker_type: regular, num_gpus: 1}]\n",
            "bad.yaml: sglang",
            "must be a list of models, got a mapping",
        ),
        # a model written as a list
        ("sglang:\n  - [actor, 8]\n", "bad.yaml: sglang[0]", "must be a mapping"),
        # server_groups as one mapping instead of a list
        (
            "sglang:\n  - name: actor\n    server_groups:\n      worker_type: regular\n      num_gpus: 8\n",
            "bad.yaml: sglang[0] (actor).server_groups",
            "must be a list of server groups, got a mapping",
        ),
        # a group written as a list
        (
            "sglang:\n  - name: actor\n    server_groups:\n      - [regular, 8]\n",
            "bad.yaml: sglang[0] (actor).server_groups[0]",
            "must be a mapping",
        ),
        # overrides as a list
        (
            "sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 8\n"
            "        overrides: [mem_fraction_static, 0.8]\n",
            "bad.yaml: sglang[0] (actor).server_groups[0].overrides",
            "must be a mapping",
        ),
        # a top-level list (the `sglang:` key forgotten)
        ("- name: actor\n  server_groups: []\n", "bad.yaml", "put the list of models under a top-level key"),
    ],
)
def test_lists_and_mappings_in_the_wrong_place(tmp_path, text, key, fragment):
    err = load_bad(tmp_path, text)
    assert problem_keys(err) == [key]
    assert fragment in str(err)


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    # Line 5 is `        num_gpus: 8: 4`: the second ':' is the 20th character.
    err = load_bad(
        tmp_path,
        "sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 8: 4\n",
    )
    assert problem_keys(err) == ["bad.yaml: line 5, column 20"]
    assert "YAML syntax error" in str(err)


def test_duplicate_yaml_key_is_reported_with_its_line(tmp_path):
    err = load_bad(
        tmp_path,
        "sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 8\n"
        "        num_gpus: 4\n",
    )
    assert problem_keys(err) == ["bad.yaml: line 6, column 9"]
    assert "duplicate key 'num_gpus'" in str(err)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_file(tmp_path, text):
    err = load_bad(tmp_path, text)
    assert problem_keys(err) == ["bad.yaml"]
    assert "is empty" in str(err)


def test_empty_model_list(tmp_path):
    assert problem_keys(load_bad(tmp_path, "sglang: []\n")) == ["bad.yaml: sglang"]


@pytest.mark.parametrize("groups", ["    server_groups: []\n", "    engine_groups: []\n", ""])
def test_a_model_without_server_groups_loads_as_in_slime_and_miles(tmp_path, groups):
    """slime's test_config_allows_model_with_no_server_groups; Miles' from_yaml reads
    ``m.get("server_groups") or m.get("engine_groups") or []`` (sglang_config.py:156 at 31f1ca961): a model
    whose router serves external engines. Resolving it without external engines is still refused."""
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "sglang:\n  - name: actor\n    server_groups: [{worker_type: regular, num_gpus: 2}]\n"
        f"  - name: judge\n{groups}"
    )
    spec = load_miles_config(str(path))
    assert [(m.name, len(m.groups)) for m in spec.models] == [("actor", 1), ("judge", 0)]
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec, TrainerInputs(hf_checkpoint="/c"))
    assert problem_keys(exc.value) == [f"{path.name}: sglang[1] (judge)"]
    assert "has no server groups and no external engines" in str(exc.value)


def test_duplicate_model_names(tmp_path):
    group = "    server_groups: [{worker_type: regular, num_gpus: 1}]\n"
    err = load_bad(
        tmp_path, f"sglang:\n  - name: actor\n{group}  - name: ref\n{group}  - name: actor\n{group}"
    )
    assert problem_keys(err) == ["bad.yaml: sglang[2] (actor).name"]
    assert "already used by sglang[0]" in str(err)


def test_model_field_types(tmp_path):
    err = load_bad(
        tmp_path,
        "sglang:\n"
        "  - model_path: /x\n"
        "    server_groups: [{worker_type: regular, num_gpus: 1}]\n"
        "  - name: ref\n"
        "    model_path: 7\n"
        '    update_weights: "yes"\n'
        "    num_gpus_per_engine: 0\n"
        "    server_groups: [{worker_type: regular, num_gpus: 1}]\n",
    )
    assert problem_keys(err) == [
        "bad.yaml: sglang[0].name",
        "bad.yaml: sglang[1] (ref).model_path",
        "bad.yaml: sglang[1] (ref).update_weights",
        "bad.yaml: sglang[1] (ref).num_gpus_per_engine",
    ]


def test_every_problem_of_a_file_in_one_error(tmp_path):
    text = fixture("sglang_agent").read_text()
    text = text.replace("        num_gpus: 8\n        num_gpus_per_engine: 4\n", "        num_gpus: 0\n", 1)
    text = text.replace("worker_type: decode", "worker_type: encoder")
    text = text.replace("  - name: reward\n", "  - name: reward\n    update_weigths: false\n")
    err = load_bad(tmp_path, text, "sglang_agent.yaml")
    assert problem_keys(err) == [
        "sglang_agent.yaml: sglang[0] (actor).server_groups[1].worker_type",
        "sglang_agent.yaml: sglang[1] (ref).server_groups[0].num_gpus",
        "sglang_agent.yaml: sglang[2] (reward).update_weigths",
    ]
    assert str(err).startswith(f"3 problems with the SGLang deployment in {tmp_path / 'sglang_agent.yaml'}:")


def test_unreadable_sources(tmp_path):
    with pytest.raises(DeploymentConfigError) as exc:
        load_miles_config(tmp_path / "nope.yaml")
    assert problem_keys(exc.value) == ["nope.yaml"] and "no such file" in str(exc.value)
    with pytest.raises(DeploymentConfigError) as exc:
        load_miles_config("base64:%%%not-base64")
    assert problem_keys(exc.value) == ["<base64 --sglang-config>"]
    inline = "base64:" + base64.b64encode(b"sglang:\n  - name: a\n    server_groups: 3\n").decode()
    with pytest.raises(DeploymentConfigError) as exc:
        load_miles_config(inline)
    assert problem_keys(exc.value) == ["<base64 --sglang-config>: sglang[0] (a).server_groups"]


# ======================================================================================================= CLI
def _build_parser_with_miles_commands() -> argparse.ArgumentParser:
    parser = _ORIGINAL_BUILD_PARSER()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "import" not in sub.choices:  # until cli.py registers them itself
        miles_commands.register(sub)
    return parser


_ORIGINAL_BUILD_PARSER = cli.build_parser


@pytest.fixture
def run_cli(monkeypatch, capsys):
    monkeypatch.setattr(cli, "build_parser", _build_parser_with_miles_commands)

    def run(*argv: str) -> tuple[int, str, str]:
        rc = cli.main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def test_cli_import_writes_a_preset_hydra_finds(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli("import", str(fixture("sglang_agent")))
    assert (rc, err) == (0, "")
    target = tmp_path / "conf" / "sglang" / "sglang_agent.yaml"
    assert target.is_file()
    assert "sglang=sglang_agent" in out and f"hydra.searchpath=[file://{tmp_path / 'conf'}]" in out
    trainer = TRAINER["sglang_agent"]
    cfg = compose_config(
        ["sglang=sglang_agent", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", *hydra_overrides(trainer)]
    )
    assert comparable(resolve_config(cfg)) == comparable(resolve_fixture("sglang_agent"))

    rc, _, err = run_cli("import", str(fixture("sglang_agent")))
    assert rc == 2 and "already exists" in err and "--force" in err
    rc, _, _ = run_cli("import", str(fixture("sglang_agent")), "--force")
    assert rc == 0


def test_cli_import_name_output_dir_and_print(run_cli, tmp_path):
    rc, _, _ = run_cli("import", str(fixture("sglang_pd")), "--name", "my_pd", "--output-dir", str(tmp_path))
    assert rc == 0 and (tmp_path / "sglang" / "my_pd.yaml").is_file()  # the group's folder in that directory
    rc, out, _ = run_cli("import", str(fixture("sglang_pd")), "--print")
    assert rc == 0 and out == (tmp_path / "sglang" / "my_pd.yaml").read_text()
    assert yaml.safe_load(out)["actor"]["decode"] == {"num_gpus": 12, "num_gpus_per_engine": 4}


def test_cli_import_refuses_names_it_cannot_use(run_cli, tmp_path):
    rc, _, err = run_cli("import", str(fixture("sglang_pd")), "--name", "pd", "--output-dir", str(tmp_path))
    assert rc == 2 and "shipped with miles_sglang_plugin" in err
    rc, _, err = run_cli("import", "base64:" + base64.b64encode(b"sglang: []").decode())
    assert rc == 2 and "--name" in err
    rc, _, err = run_cli("import", str(fixture("sglang_pd")), "--name", "a.b", "--print")
    assert rc == 2 and "cannot name a preset" in err


def test_a_shipped_preset_wins_over_a_searchpath_preset_of_the_same_name(tmp_path):
    # Why `import` refuses the names of shipped presets: on `miles-sglang`'s search path the package's own
    # conf comes first, in an app's the app's conf does; the same name would mean different files.
    (tmp_path / "sglang").mkdir()
    src = load_miles_config(fixture("sglang_basic"))
    (tmp_path / "sglang" / "pd.yaml").write_text(spec_to_preset(src))
    cfg = compose_config(["sglang=pd", f"hydra.searchpath=[file://{tmp_path}]"])
    assert list(cfg.sglang) == ["actor"]  # the shipped pd preset, not the file's model "default"


def test_searchpath_override_is_quoted_for_odd_directories(tmp_path):
    conf = tmp_path / "my confs" / "conf"
    (conf / "sglang").mkdir(parents=True)
    (conf / "sglang" / "spaced.yaml").write_text(spec_to_preset(load_miles_config(fixture("sglang_basic"))))
    override = miles_commands.hydra_searchpath_override(conf)
    assert override == f"hydra.searchpath=['file://{conf}']"
    assert list(compose_config(["sglang=spaced", override]).sglang) == ["default"]


def test_cli_import_of_a_bad_file_exits_2_with_every_problem(run_cli, tmp_path):
    bad = tmp_path / "sglang_agent.yaml"
    bad.write_text(with_ref_group("worker_type: regular\nnum_gpus: 0"))
    rc, out, err = run_cli("import", str(bad), "--output-dir", str(tmp_path / "out"))
    assert rc == 2 and out == ""
    assert "sglang_agent.yaml: sglang[1] (ref).server_groups[0].num_gpus" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_cli_export_to_stdout_is_valid_yaml_with_the_miles_args(run_cli):
    from miles_sglang_plugin.miles.argparse_bridge import resolve_namespace

    overrides = ["sglang=agentic_32gpu", "rollout_num_gpus=32", "hf_checkpoint=/data/models/Qwen3-8B"]
    rc, out, err = run_cli("export", *overrides)
    assert rc == 0
    first, _ = out.split("\n", 1)
    assert first.startswith("# miles args: --sglang-config FILE --rollout-num-gpus 32")
    assert "--rollout-num-gpus 32" in err
    data = yaml.safe_load(out)
    assert [m["name"] for m in data["sglang"]] == ["actor", "ref", "reward"]
    inline = "base64:" + base64.b64encode(out.encode()).decode()
    rest = first[len("# miles args: --sglang-config FILE ") :].split()
    ns = miles_like_parser().parse_args(["--sglang-config", inline, *rest])
    assert comparable(resolve_namespace(ns)) == comparable(resolve_config(compose_config(overrides)))


def test_cli_export_to_a_file(run_cli, tmp_path):
    target = tmp_path / "miles.yaml"
    rc, out, err = run_cli(
        "export", "--output", str(target), "sglang=pd", "hf_checkpoint=/ckpt",
        "sglang.actor.prefill.num_gpus_per_engine=2", "sglang.actor.decode.num_gpus_per_engine=4",
    )  # fmt: skip
    assert (rc, out) == (0, "")
    assert f"--sglang-config {target} --rollout-num-gpus 16 --rollout-num-gpus-per-engine 1" in err
    data = yaml.safe_load(target.read_text())
    assert data["sglang"][0]["server_groups"] == [
        {"worker_type": "prefill", "num_gpus": 4, "num_gpus_per_engine": 2},
        {"worker_type": "decode", "num_gpus": 12, "num_gpus_per_engine": 4},
    ]


def test_cli_export_says_what_the_miles_file_cannot_carry(run_cli):
    rc, out, err = run_cli(
        "export",
        "sglang=pd",
        "hf_checkpoint=/ckpt",
        "+sglang_deploy.server_defaults.mem_fraction_static=0.8",
        "+sglang_deploy.server_defaults.enable_metrics=false",
        "sglang_deploy.router.policy=round_robin",
    )
    assert rc == 0
    # Deployment-wide ServerArgs defaults are Miles' --sglang-* flags, in the header and on stderr.
    assert out.startswith("# miles args: ") and "--sglang-mem-fraction-static 0.8" in out.split("\n", 1)[0]
    assert "--sglang-mem-fraction-static 0.8" in err
    assert "server_defaults.enable_metrics=False has no Miles flag form" in err
    assert "--sglang-router-policy round_robin" in err
    assert "mem_fraction_static" not in yaml.safe_load(out)["sglang"][0]["server_groups"][0].get(
        "overrides", {}
    )


def test_cli_export_errors_exit_2(run_cli):
    rc, _, err = run_cli("export", "sglang=no_such_preset")
    assert rc == 2 and "no_such_preset" in err and "Traceback" not in err
    rc, _, err = run_cli("export", "sglang=pd", "hf_checkpoint=/ckpt", "rollout_num_gpus=3")
    assert rc == 2 and "rollout_num_gpus" in err and "Traceback" not in err


_SUBPROCESS_MAIN = """
import argparse, sys
from miles_sglang_plugin import cli
from miles_sglang_plugin.miles import commands as miles_commands
build = cli.build_parser
def build_with_miles_commands():
    parser = build()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "import" not in sub.choices:
        miles_commands.register(sub)
    return parser
cli.build_parser = build_with_miles_commands
raise SystemExit(cli.main(sys.argv[1:]))
"""


def test_cli_in_a_process_exits_2_without_a_traceback(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text(
        "sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: [\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_MAIN, "import", str(bad), "--print"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "broken.yaml: line" in proc.stderr and "YAML syntax error" in proc.stderr
    assert "Traceback" not in proc.stderr
