"""Parity with Miles (radixark/miles main at 31f1ca961; its refactor at 727f91769, and its later state for
debug_train_only, where said), issue 11.

Every expected number below is worked out by hand from Miles' code, cited at each test, not taken from this
project's output.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from miles_sglang_plugin import cli
from miles_sglang_plugin.app.hydra_edge import prepare_from_config, resolve_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.miles.argparse_bridge import (
    lora_from_namespace,
    resolve_namespace,
    server_defaults_from_namespace,
)
from miles_sglang_plugin.miles.sglang_config import load_miles_config, spec_to_preset
from miles_sglang_plugin.planning.miles_rules import apply_miles_rules
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.rendering.lora import hf_target_modules, lora_server_args
from miles_sglang_plugin.rendering.prepared import prepare_deployment
from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields, shipped_server_arg_fields
from tests.conftest import group, model, spec

FIXTURES = Path(__file__).parent / "fixtures" / "miles"
#: SGLang 0.5.23's ServerArgs fields (it has no prefill_round_robin_balance).
FIELDS_0_5_23 = shipped_server_arg_fields()


def problems_of(exc: pytest.ExceptionInfo[DeploymentConfigError]) -> dict[str, str]:
    return {p.key: p.message for p in exc.value.problems}


def flag(argv: tuple[str, ...] | list[str], name: str) -> str:
    return argv[list(argv).index(name) + 1]


def seeds(plan, settings: SGLangDeployConf | None = None) -> dict[str, list[int]]:
    """engine id -> the --random-seed of each of its processes, from the rendered command lines."""
    launch = prepare_deployment(plan, settings or SGLangDeployConf(), server_arg_fields=FIELDS_0_5_23).launch
    out: dict[str, list[int]] = {}
    for process in launch.engines:
        out.setdefault(process.engine_id, []).append(int(flag(process.argv, "--random-seed")))
    return out


def miles_namespace(**kw: Any) -> argparse.Namespace:
    """A Miles namespace with Miles' defaults for what the deployment reads."""
    values: dict[str, Any] = dict(
        sglang_config=None,
        hf_checkpoint="/ckpt/actor",
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
        critic_num_nodes=None,
        critic_num_gpus_per_node=None,
        rollout_external=False,
        seed=1234,
        sglang_cuda_graph_backend_prefill=None,
        sglang_mem_fraction_static=None,
        sglang_router_ip=None,
        sglang_router_port=None,
    )
    values.update(kw)
    return argparse.Namespace(**values)


# ====================================================================================== 2. ranks and seeds
def test_placeholder_engines_count_in_the_rank_cursor():
    # rollout_server.py: engine_offset += num_gpus // min(gpus per engine, GPUs per node) for every group,
    # placeholders included; server_group.py: rank = rank_offset + i (i counts each node of an engine);
    # sglang_engine.py: random_seed = seed + rank. Seed 1000, 4 GPUs per node, rollout-only (slot 0 on):
    #   actor.regular 8/2      4 engines                  ranks 0..3  -> 1000..1003
    #   actor.placeholder 4/4  4 // min(4, 4) = 1 counted rank 4
    #   ref.regular 16/8       2 engines x 2 nodes        ranks 5,6 and 7,8 -> ref engine 0 gets 1005
    s = spec(
        model("actor", group("regular", 8, gpe=2), group("placeholder", 4, gpe=4)),
        model("ref", group("regular", 16, gpe=8), path="/ref"),
    )
    t = TrainerInputs(hf_checkpoint="/ckpt/actor", seed=1000, num_gpus_per_node=4, debug_rollout_only=True)
    plan = resolve_deployment(s, t)
    assert [e.rank for e in plan.engines] == [0, 1, 2, 3, 5, 7]
    assert seeds(plan) == {
        "actor.regular.0": [1000],
        "actor.regular.1": [1001],
        "actor.regular.2": [1002],
        "actor.regular.3": [1003],
        "ref.regular.0": [1005, 1006],
        "ref.regular.1": [1007, 1008],
    }


def test_each_node_of_a_multi_node_engine_counts_as_a_worker():
    # Seed 1000, 4 GPUs per node: [regular 16/8, regular 4/2] -> the first group's 2 engines span 2 nodes each
    # (ranks 0,1 and 2,3), so the second group starts at rank 4: seeds 1004, 1005.
    s = spec(model("actor", group("regular", 16, gpe=8), group("regular", 4, gpe=2, name="small")))
    t = TrainerInputs(hf_checkpoint="/ckpt/actor", seed=1000, num_gpus_per_node=4, debug_rollout_only=True)
    plan = resolve_deployment(s, t)
    assert seeds(plan) == {
        "actor.regular.0": [1000, 1001],
        "actor.regular.1": [1002, 1003],
        "actor.small.0": [1004],
        "actor.small.1": [1005],
    }
    # The node rank stays the process's place in its engine (Miles derives it as rank % nnodes, which agrees
    # here because every multi-node engine starts at an even rank).
    assert [p.node_rank for e in plan.model("actor").group("regular").engines for p in e.processes] == [
        0,
        1,
        0,
        1,
    ]


# ============================================================================== 3. gated_launch_port is the plan's
def test_gated_launch_port_is_refused_wherever_a_user_could_set_it():
    # Miles' refactor sets gated_launch_port per engine from its own port allocator (sglang_engine.py
    # _compute_server_args); here no gate is opened, so an engine given one would never finish starting.
    s = spec(model("actor", group("regular", 2, gated_launch_port=31300)), model("eval", group("regular", 2)))
    t = TrainerInputs(
        hf_checkpoint="/c",
        debug_rollout_only=True,
        eval_num_gpus=2,
        eval_sglang_overrides={"gated_launch_port": 1},
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, t)
    got = problems_of(exc)
    assert got["sglang.actor.regular.overrides.gated_launch_port"].startswith(
        "cannot be overridden (31300): the launcher opens no launch gate: an engine given one would block at "
        "start-up until POST /gate/activate, which nothing sends"
    )
    assert got["eval_sglang_overrides.gated_launch_port"].startswith("cannot be overridden (1): the launcher")
    plan = resolve_deployment(
        spec(model("actor", group("regular", 2))), TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True)
    )
    with pytest.raises(DeploymentConfigError) as exc:
        prepare_deployment(plan, SGLangDeployConf(server_defaults={"gated_launch_port": 31300}))
    assert problems_of(exc)["sglang_deploy.server_defaults.gated_launch_port"].startswith(
        "cannot be set deployment-wide: the launcher opens no launch gate"
    )


# ======================================================================================= 5. colocated defaults
def test_miles_post_processing_of_a_colocated_run():
    # arguments.py (miles_validate_args) under --colocate: offload_rollout None -> True, rollout_num_gpus ->
    # actor_num_gpus_per_node * actor_num_nodes, sglang_cuda_graph_backend_prefill None -> "disabled".
    d = apply_miles_rules(TrainerInputs(colocate=True, actor_num_nodes=2, rollout_num_gpus=24))
    assert (d.trainer.offload_rollout, d.trainer.rollout_num_gpus) == (True, 16)
    assert dict(d.derived) == {"offload_rollout": True, "rollout_num_gpus": 16}
    assert dict(d.server_defaults) == {"cuda_graph_backend_prefill": "disabled"}
    assert d.notes[1] == (
        "rollout_num_gpus=16 (given 24): colocate: the actor's GPUs (actor_num_nodes=2 x actor_num_gpus_per_node=8), "
        "as Miles sets it"
    )
    # Given values stay: --no-offload-rollout, and a --sglang-cuda-graph-backend-prefill (either spelling).
    d = apply_miles_rules(
        TrainerInputs(colocate=True, offload_rollout=False), {"cuda-graph-backend-prefill": "disabled"}
    )
    assert (d.trainer.offload_rollout, dict(d.server_defaults), d.notes) == (
        False,
        {},
        (
            "rollout_num_gpus=8: colocate: the actor's GPUs (actor_num_nodes=1 x actor_num_gpus_per_node=8), as Miles sets it",
        ),
    )
    # Not colocated: an unset offload_rollout is off; nothing is derived.
    d = apply_miles_rules(TrainerInputs())
    assert (d.trainer.offload_rollout, dict(d.derived), d.notes) == (False, {}, ())
    # debug_rollout_only (earlier in miles_validate_args): colocate and offload off, a colocated rollout sized
    # as the actor when rollout_num_gpus is unset; then no colocate defaults.
    d = apply_miles_rules(TrainerInputs(debug_rollout_only=True, colocate=True, offload_rollout=True))
    assert (d.trainer.colocate, d.trainer.offload_rollout, d.trainer.rollout_num_gpus) == (False, False, 8)
    assert dict(d.server_defaults) == {}
    # Idempotent: the result's own trainer arguments derive nothing more.
    once = apply_miles_rules(TrainerInputs(colocate=True, use_critic=True, critic_num_gpus_per_node=2))
    assert dict(apply_miles_rules(once.trainer).derived) == {}


def test_the_colocated_prefill_cuda_graph_default_reaches_every_engine_below_the_users_values():
    # sglang_engine.py fills every unset ServerArgs field from args.sglang_<field>, lowest: a group override
    # and a deployment-wide value (Miles' --sglang-*) both win over the colocate default.
    s = spec(
        model(
            "actor",
            group("regular", 4, gpe=2),
            group("regular", 4, gpe=2, name="own", cuda_graph_backend_prefill="full"),
        )
    )
    plan = resolve_deployment(s, TrainerInputs(hf_checkpoint="/c", colocate=True))
    launch = prepare_deployment(plan, SGLangDeployConf(), server_arg_fields=FIELDS_0_5_23).launch
    assert flag(launch.for_engine("actor.regular.0")[0].argv, "--cuda-graph-backend-prefill") == "disabled"
    assert flag(launch.for_engine("actor.own.1")[0].argv, "--cuda-graph-backend-prefill") == "full"
    assert (
        "--enable-memory-saver" in launch.for_engine("actor.regular.0")[0].argv
    )  # offload_rollout derived on


def test_argparse_and_hydra_paths_read_the_same_colocate_inputs():
    # The namespace's --sglang-cuda-graph-backend-prefill is what sglang_deploy.server_defaults holds on the
    # Hydra path: set, it stops the colocate default on both.
    for backend, expected in ((None, {"cuda_graph_backend_prefill": "disabled"}), ("breakable", {})):
        ns = miles_namespace(
            colocate=True, rollout_num_gpus_per_engine=2, sglang_cuda_graph_backend_prefill=backend
        )
        overrides = [
            "sglang=default",
            "hf_checkpoint=/ckpt/actor",
            "colocate=true",
            "rollout_num_gpus_per_engine=2",
        ]
        if backend:
            overrides.append(f"+sglang_deploy.server_defaults.cuda_graph_backend_prefill={backend}")
        from_ns, from_hydra = resolve_namespace(ns), resolve_config(compose_config(overrides))
        assert dict(from_ns.derived_server_defaults) == dict(from_hydra.derived_server_defaults) == expected
        assert (from_ns.model("default").group("regular").num_gpus, from_ns.trainer.offload_rollout) == (
            8,
            True,
        )
        assert from_ns.notes == from_hydra.notes


# ================================================================================================ 6. eval fleet
def test_eval_parallel_reset_follows_the_arguments_tp_not_the_groups():
    # rollout_server.py ~113: the reset happens iff args.eval_num_gpus_per_engine != args.rollout_num_gpus_per_engine.
    resets = ("dp_size", "pp_size", "ep_size", "attn_cp_size")

    def eval_overrides(eval_gpe_arg: int, group_gpe: int) -> dict:
        s = spec(model("actor", group("regular", 8)), model("eval", group("regular", 4, gpe=group_gpe)))
        t = TrainerInputs(
            hf_checkpoint="/c",
            debug_rollout_only=True,
            rollout_num_gpus_per_engine=2,
            eval_num_gpus=4,
            eval_num_gpus_per_engine=eval_gpe_arg,
        )
        return dict(resolve_deployment(s, t).model("eval").groups[0].overrides)

    # The group's TP equals the rollout TP (2), the arguments' do not (1 != 2): reset.
    assert {k: eval_overrides(1, 2).get(k) for k in resets} == dict.fromkeys(resets, 1)
    # The arguments' TPs agree (2 == 2), the group's (4) does not: no reset.
    assert not set(resets) & set(eval_overrides(2, 4))


def test_eval_gpus_per_engine_defaults_to_one():
    # arguments.py: --eval-num-gpus-per-engine default=1, "independent of --rollout-num-gpus-per-engine".
    assert TrainerInputs().eval_num_gpus_per_engine == 1
    assert TrainerInputs.from_mapping({"eval_num_gpus_per_engine": None}).eval_num_gpus_per_engine == 1
    plan = resolve_deployment(
        None,
        TrainerInputs(hf_checkpoint="/c", rollout_num_gpus=8, rollout_num_gpus_per_engine=4, eval_num_gpus=2),
    )
    ev = plan.model("eval").groups[0]
    assert (ev.num_gpus_per_engine, [e.gpu_slots for e in ev.engines]) == (1, [(16,), (17,)])


# debug_train_only, after Miles' refactor in its later state (sglang_config.py at 058ccc1fb, arguments.py at
# 00e365d95; 727f91769 still started nothing): miles_validate_args sets rollout_num_gpus = 0 under
# --debug-train-only (after the colocate block) and starts_inference_engines = not debug_train_only or
# eval_num_gpus > 0; _compute_raw_sglang_config gives no models without engines, else no rollout model
# (rollout_num_gpus == 0) plus the eval model of eval_num_gpus; _compute_rollout_offset is 0 only when colocated,
# rollout-only or without engines, so the eval fleet comes after the actor. Its tests (TestRolloutOffset):
# actor 2 x 8 -> offset 0 without an eval fleet, 16 with eval_num_gpus=4.
def dto_namespace(**kw: Any) -> argparse.Namespace:
    """Miles' TestRolloutOffset run: --debug-train-only, the actor on 2 nodes x 8 GPUs, not colocated."""
    return miles_namespace(debug_train_only=True, actor_num_nodes=2, rollout_num_gpus=8, **kw)


def test_debug_train_only_without_an_eval_fleet_starts_nothing_at_offset_0():
    # test_debug_train_only_without_eval_fleet_has_zero_rollout_placement_offset: offset 0; no models.
    plan = resolve_namespace(dto_namespace())
    assert (plan.models, plan.rollout_offset, plan.megatron_num_gpus) == ((), 0, 16)
    assert plan.notes == (
        "rollout_num_gpus=0 (given 8): debug_train_only starts no rollout engines, so Miles sets it to 0 (an eval "
        "fleet still starts)",
        "debug_train_only: no rollout engines are started",
    )


def test_debug_train_only_starts_the_eval_fleet_alone_after_the_actor():
    # test_debug_train_only_places_the_eval_fleet_after_the_actor_bundles: offset 2 x 8 = 16. The eval model of
    # 4 GPUs, eval_num_gpus_per_engine Miles' default 1: 4 engines on slots 16..19 = node 2, GPUs 0..3; ranks
    # from 0 (no rollout engine before them); megatron 16, so 16 + 0 < 16 is false: no offload, and with
    # --offload-rollout enable_memory_saver false (offload_rollout and not needs_offload).
    plan = resolve_namespace(dto_namespace(eval_num_gpus=4, offload_rollout=True))
    assert [m.name for m in plan.models] == ["eval"]
    assert (plan.rollout_offset, plan.megatron_num_gpus, plan.rollout_num_gpus, plan.total_gpus) == (
        16,
        16,
        0,
        4,
    )
    ev = plan.model("eval").group("regular")
    assert (ev.num_gpus_per_engine, ev.gpu_offset, ev.needs_offload) == (1, 0, False)
    assert ev.overrides["enable_memory_saver"] is False
    assert [e.gpu_slots for e in ev.engines] == [(16,), (17,), (18,), (19,)]
    assert [(p.node, p.local_gpu_ids) for e in ev.engines for p in e.processes] == [
        (2, (0,)),
        (2, (1,)),
        (2, (2,)),
        (2, (3,)),
    ]
    assert [e.rank for e in ev.engines] == [0, 1, 2, 3]
    assert plan.model("eval").update_weights is False
    assert plan.notes[-1] == (
        "debug_train_only: only the eval fleet starts (eval_num_gpus=4, from GPU slot 16); no rollout engines "
        "(rollout_num_gpus=0), as in Miles"
    )
    assert dict(plan.derived) == {"rollout_num_gpus": 0}


def test_debug_train_only_colocated_puts_the_eval_fleet_on_the_actors_gpus_offloaded():
    # Miles does not turn colocate off under --debug-train-only: the colocate block turns offload_rollout on,
    # then rollout_num_gpus = 0; _compute_rollout_offset is 0 (colocate), so the eval groups start at slot 0 <
    # megatron 16 and offload (needs_offload true, no enable_memory_saver injected).
    plan = resolve_namespace(dto_namespace(eval_num_gpus=4, colocate=True))
    ev = plan.model("eval").group("regular")
    assert (plan.rollout_offset, plan.trainer.rollout_num_gpus, plan.trainer.offload_rollout) == (0, 0, True)
    assert ([e.gpu_slots for e in ev.engines], ev.needs_offload) == ([(0,), (1,), (2,), (3,)], True)
    assert "enable_memory_saver" not in ev.overrides
    # Only critic training: the eval fleet comes after the critic's GPUs (1 x 4), megatron is the critic's.
    plan = resolve_namespace(
        dto_namespace(eval_num_gpus=4, critic_train_only=True, critic_num_nodes=1, critic_num_gpus_per_node=4)
    )
    assert (plan.rollout_offset, plan.megatron_num_gpus) == (4, 4)
    assert [e.gpu_slots for e in plan.engines] == [(4,), (5,), (6,), (7,)]


def test_debug_train_only_with_a_deployment_starts_only_its_eval_model(tmp_path):
    # Miles' refactor reads a --sglang-config under --debug-train-only with an eval fleet and asserts its total
    # equals rollout_num_gpus (0) + eval_num_gpus: a file holding only the eval model plans as without a file.
    # A file that also holds rollout models Miles refuses; here they do not start, with a note (the deployment
    # of the run being debugged need not be rewritten), and a deployment without an eval model is refused.
    eval_only = tmp_path / "eval_only.yaml"
    eval_only.write_text(
        yaml.safe_dump(
            {"sglang": [{"name": "eval", "server_groups": [{"worker_type": "regular", "num_gpus": 4}]}]}
        )
    )
    guide = FIXTURES / "miles_actor_pd_ref.yaml"  # actor (PD, 16 GPUs) and ref (4 GPUs), no eval model
    full = tmp_path / "full.yaml"
    with_eval = yaml.safe_load(guide.read_text())
    with_eval["sglang"].append(yaml.safe_load(eval_only.read_text())["sglang"][0])
    full.write_text(yaml.safe_dump(with_eval, sort_keys=False))
    without_file = resolve_namespace(dto_namespace(eval_num_gpus=4)).to_dict()
    with_eval_only = resolve_namespace(dto_namespace(eval_num_gpus=4, sglang_config=str(eval_only))).to_dict()
    for data in (without_file, with_eval_only):
        data.pop("source")
    assert with_eval_only == without_file
    plan = resolve_namespace(
        dto_namespace(eval_num_gpus=4, sglang_config=str(full)), server_arg_fields=FIELDS_0_5_23
    )
    assert [(m.name, m.num_gpus) for m in plan.models] == [("eval", 4)]
    assert [e.gpu_slots for e in plan.engines] == [(16,), (17,), (18,), (19,)]
    assert plan.notes[-1] == (
        "debug_train_only: the deployment's model(s) actor, ref do not start, only its eval model (Miles' refactor "
        "refuses a --sglang-config then unless its eval model holds all of its GPUs)"
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_namespace(dto_namespace(eval_num_gpus=2, sglang_config=str(guide)))
    assert problems_of(exc)["sglang"].startswith(
        "debug_train_only with eval_num_gpus=2 starts only the eval fleet, but the deployment has no model named "
        "'eval' (models: ['actor', 'ref'])"
    )


def test_debug_train_only_plans_the_same_on_the_hydra_path():
    # The default preset sizes its actor by ${msp.rollout_num_gpus:8}, Miles' rollout_num_gpus after its rules:
    # 0 under debug_train_only, so the actor has nothing to start; the eval model added on the command line
    # starts alone, as the namespace's eval fleet without a --sglang-config.
    hydra = [
        "sglang=default",
        "hf_checkpoint=/ckpt/actor",
        "debug_train_only=true",
        "actor_num_nodes=2",
        "rollout_num_gpus=8",
        "offload_rollout=true",
    ]
    for eval_gpus in (0, 4):
        ns = dto_namespace(eval_num_gpus=eval_gpus, offload_rollout=True)
        cfg = compose_config([*hydra, f"eval_num_gpus={eval_gpus}"] + (
            ["+sglang_model@sglang.eval=base", f"sglang.eval.regular.num_gpus={eval_gpus}"] if eval_gpus else []
        ))  # fmt: skip
        assert cfg.sglang.actor.regular.num_gpus == 0
        from_ns = resolve_namespace(ns, server_arg_fields=FIELDS_0_5_23).to_dict()
        from_hydra = resolve_config(cfg, server_arg_fields=FIELDS_0_5_23).to_dict()
        assert from_ns.pop("source") == "trainer arguments"
        from_hydra.pop("source")
        assert from_ns == from_hydra
        assert (from_ns["rollout_offset"], from_ns["total_gpus"]) == ((16, 4) if eval_gpus else (0, 0))


def test_miles_rules_under_debug_train_only():
    # arguments.py: the colocate block first (offload_rollout on; rollout_num_gpus = the actor's), then
    # rollout_num_gpus = 0. The colocate sizing is not noted here, since debug_train_only undoes it.
    d = apply_miles_rules(TrainerInputs(debug_train_only=True, colocate=True, actor_num_nodes=2))
    assert (d.trainer.rollout_num_gpus, d.trainer.offload_rollout, dict(d.derived)) == (
        0,
        True,
        {"offload_rollout": True, "rollout_num_gpus": 0},
    )
    assert not any(note.startswith("rollout_num_gpus") for note in d.notes)
    assert dict(apply_miles_rules(d.trainer).derived) == {}
    # Miles' starts_inference_engines: not debug_train_only or eval_num_gpus > 0.
    assert [
        TrainerInputs(debug_train_only=dto, eval_num_gpus=eval_gpus).starts_inference_engines
        for dto, eval_gpus in ((False, 0), (True, 0), (True, 4))
    ] == [True, False, True]


def test_the_rollout_size_the_composed_config_reads_is_the_one_the_rules_derive():
    # ${msp.rollout_num_gpus:...} is read while the config composes, before planning, so the composed config
    # reads Miles' rollout size from the inputs themselves (TrainerInputs.miles_rollout_num_gpus); the rules
    # (planning) derive it step by step. Miles' arguments.py, worked by hand: colocated, the actor's GPUs
    # (2 x 8 = 16, over a given 24); debug_rollout_only turns colocate off and keeps a given size (4), sizing
    # as the actor (1 x 8) only an unset one; debug_train_only: 0; otherwise as given.
    cases = {
        (("colocate", True), ("actor_num_nodes", 2), ("rollout_num_gpus", 24)): 16,
        (("colocate", True), ("debug_rollout_only", True), ("rollout_num_gpus", 4)): 4,
        (("colocate", True), ("debug_rollout_only", True)): 8,
        (("colocate", True), ("debug_train_only", True), ("rollout_num_gpus", 8)): 0,
        (("rollout_num_gpus", 12),): 12,
        (): None,
    }
    assert {case: TrainerInputs(**dict(case)).miles_rollout_num_gpus for case in cases} == cases
    # The two statements of the rule, held to each other over every combination of what they read.
    for colocate, rollout_only, train_only, rollout, (nodes, per_node) in itertools.product(
        (False, True), (False, True), (False, True), (None, 0, 4, 8, 16), ((1, 8), (2, 4), (2, 8))
    ):
        t = TrainerInputs(
            colocate=colocate,
            debug_rollout_only=rollout_only,
            debug_train_only=train_only,
            rollout_num_gpus=rollout,
            actor_num_nodes=nodes,
            actor_num_gpus_per_node=per_node,
        )
        assert t.miles_rollout_num_gpus == apply_miles_rules(t).trainer.rollout_num_gpus, t


def test_export_of_a_debug_train_only_eval_fleet_writes_the_eval_model_alone(tmp_path):
    # What Miles' refactor accepts then: a file of the eval model alone, with --debug-train-only and
    # --rollout-num-gpus 0 (total 4 = 0 + eval_num_gpus); read back, it plans the same.
    from miles_sglang_plugin.miles.sglang_config import miles_trainer_args, spec_to_miles_yaml

    s = spec(model("actor", group("regular", 8)), model("eval", group("regular", 4)))
    t = TrainerInputs(hf_checkpoint="/c", actor_num_nodes=2, eval_num_gpus=4, debug_train_only=True)
    plan = resolve_deployment(s, t)
    written = yaml.safe_load(spec_to_miles_yaml(s, plan))
    assert [(m["name"], [g["num_gpus"] for g in m["server_groups"]]) for m in written["sglang"]] == [
        ("eval", [4])
    ]
    args = miles_trainer_args(plan)
    assert "--debug-train-only" in args and flag(args, "--rollout-num-gpus") == "0"
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(written))
    again = resolve_deployment(load_miles_config(path), t)
    assert (
        [e.gpu_slots for e in again.engines]
        == [e.gpu_slots for e in plan.engines]
        == [(16,), (17,), (18,), (19,)]
    )


# ============================================================================ 8. what this SGLang version lacks
def guide_namespace() -> argparse.Namespace:
    """Seed 000's launch line with its own file: --rollout-num-gpus=20 --rollout-num-gpus-per-engine=4."""
    return miles_namespace(
        sglang_config=str(FIXTURES / "miles_actor_pd_ref.yaml"),
        rollout_num_gpus=20,
        rollout_num_gpus_per_engine=4,
    )


def test_an_unmodified_miles_file_plans_leaving_out_what_this_sglang_lacks():
    # sglang_engine.py drops the keys its SGLang lacks ("not supported in the current sglang"); the guide's
    # decode group sets prefill_round_robin_balance, which SGLang 0.5.23 does not have.
    plan = resolve_namespace(guide_namespace(), server_arg_fields=FIELDS_0_5_23)
    decode = plan.model("actor").group("decode")
    assert dict(decode.overrides) == {"model_path": "/mnt/checkpoints/actor", "tp_size": 4}
    assert plan.notes == (
        "left out miles_actor_pd_ref.yaml: sglang[0] (actor).server_groups[1].overrides.prefill_round_robin_balance"
        "=True: not a ServerArgs field of this SGLang version (Miles drops it too)",
    )
    # A key Miles does not drop stays refused in a Miles file: one the plan owns.
    text = (FIXTURES / "miles_actor_pd_ref.yaml").read_text().replace("tp_size: 4\n", "port: 30000\n", 1)
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_namespace(
            miles_namespace(sglang_config="base64:" + base64.b64encode(text.encode()).decode(),
                            rollout_num_gpus=20, rollout_num_gpus_per_engine=4),
            server_arg_fields=FIELDS_0_5_23,
        )  # fmt: skip
    assert [p.key for p in exc.value.problems] == [
        "<base64 --sglang-config>: sglang[0] (actor).server_groups[0].overrides.port"
    ]


def test_a_users_own_unknown_key_is_still_refused():
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_config(
            compose_config(["sglang=pd", "hf_checkpoint=/c", "+sglang.actor.decode.overrides.prefill_round_robin_balance=true"]),
            server_arg_fields=FIELDS_0_5_23,
        )  # fmt: skip
    assert problems_of(exc)["sglang.actor.decode.overrides.prefill_round_robin_balance"] == (
        "is not a ServerArgs field of the installed SGLang; did you mean prefill_attention_backend?"
    )


@pytest.fixture
def run_cli(capsys):
    def run(*argv: str) -> tuple[int, str, str]:
        rc = cli.main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def test_import_of_the_miles_guide_gives_a_preset_that_plans(run_cli, tmp_path):
    # The installed SGLang (or, without it, the shipped field list) is 0.5.23: no prefill_round_robin_balance.
    out_dir = tmp_path / "conf" / "sglang"
    rc, out, err = run_cli(
        "import", str(FIXTURES / "miles_actor_pd_ref.yaml"), "--name", "guide", "--output-dir", str(out_dir)
    )
    note = (
        "left out miles_actor_pd_ref.yaml: sglang[0] (actor).server_groups[1].overrides.prefill_round_robin_balance"
        f"=True: not a ServerArgs field of this SGLang version (Miles drops it too) (checked against "
        f"{known_server_arg_fields().source})"
    )
    assert (rc, err) == (0, "") and f"note: {note}" in out.splitlines()
    text = (out_dir / "guide.yaml").read_text()
    assert f"# {note}\n" in text
    assert yaml.safe_load(text)["actor"]["decode"] == {"num_gpus": 8, "overrides": {"tp_size": 4}}
    rc, out, err = run_cli(
        "plan", "sglang=guide", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "rollout_num_gpus=20",
        "rollout_num_gpus_per_engine=4", "hf_checkpoint=/c",
    )  # fmt: skip
    assert (rc, err) == (0, "")
    assert "actor.decode.1" in out


# ================================================================================================ 9. LoRA
def lora_server_args_of(*overrides: str) -> dict[str, Any]:
    """The LoRA ServerArgs of the first engine, as SGLang's parser (or the stand-in's) reads its argv."""
    from tests.test_rendering import parsed

    prepared = prepare_from_config(compose_config(["sglang=default", "hf_checkpoint=/c", *overrides]))
    values = parsed(prepared.launch.engines[0])
    keys = ("enable_lora", "max_loras_per_batch", "max_lora_rank", "lora_target_modules", "lora_paths")
    return {k: values[k] for k in keys}


def test_multi_lora_server_args_are_miles_numbers():
    # 727f91769 tests/fast/backends/sglang_utils/test_sglang_engine.py
    # test_a_multi_lora_inkling_launch_still_names_its_targets: lora_rank=16,
    # target_modules=["layers.*.self_attention.linear_qkv"], multi_lora_n_adapters=4 -> the targets are
    # k_proj, q_proj, v_proj; sglang_engine.py's multi-LoRA branch: enable_lora, max_loras_per_batch = 4
    # (the adapter count), max_lora_rank = max(16, 1), no lora_paths.
    lora = lora_from_namespace(
        argparse.Namespace(
            lora_rank=16,
            target_modules=["layers.*.self_attention.linear_qkv"],
            multi_lora=True,
            multi_lora_n_adapters=4,
            lora_adapter_path=None,
        )
    )
    assert lora_server_args(lora, colocate=False) == {
        "enable_lora": True,
        "max_loras_per_batch": 4,
        "max_lora_rank": 16,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj"],
    }
    # The same through the Hydra group, on a real command line.
    values = lora_server_args_of(
        "sglang_deploy.lora.multi_lora_n_adapters=4",
        "sglang_deploy.lora.max_lora_rank=16",
        "sglang_deploy.lora.target_modules=[layers.*.self_attention.linear_qkv]",
    )
    assert values["enable_lora"] is True and values["lora_paths"] is None
    assert (values["max_loras_per_batch"], values["max_lora_rank"]) == (4, 16)
    assert sorted(values["lora_target_modules"]) == ["k_proj", "q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        # test_sglang_engine.py: test_spellable_targets_are_named_one_by_one, test_gdn_attention_targets_...,
        # test_asking_for_every_module_is_still_honoured.
        (["layers.*.self_attention.linear_qkv"], ["q_proj", "k_proj", "v_proj"]),
        (["layers.*.self_attention.in_proj"], ["in_proj_qkvz", "in_proj_ba"]),
        (["all"], ["all"]),
        # lora_utils.py: merged fc1 -> gate/up, MLA names, HF names through, duplicates once.
        (["linear_fc1", "linear_fc2", "linear_proj"], ["gate_proj", "up_proj", "down_proj", "o_proj"]),
        (["linear_q_down_proj", "linear_kv_up_proj"], ["q_a_proj", "kv_b_proj"]),
        (["q_proj", "linear_qkv", "o_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ],
)
def test_target_modules_become_hf_names_as_in_miles(targets, expected):
    assert hf_target_modules(targets) == expected


def test_single_lora_server_args_are_miles_numbers():
    # sglang_engine.py's single-LoRA branch (lora_rollout_enabled): max_loras_per_batch 1, max_lora_rank =
    # max(lora_rank, 1), lora_paths {miles_lora: --lora-adapter-path}; enable_weights_cpu_backup for LoRA +
    # colocate + --lora-base-cpu-backup. test_compute_server_args.py: lora_rank=8 -> enable_lora True.
    ns = argparse.Namespace(
        lora_rank=0, lora_adapter_path="/adapters/a", target_modules=None, lora_base_cpu_backup=True
    )
    lora = lora_from_namespace(ns)
    assert lora_server_args(lora, colocate=True) == {
        "enable_lora": True,
        "max_loras_per_batch": 1,
        "max_lora_rank": 1,
        "lora_paths": ["miles_lora=/adapters/a"],
        "enable_weights_cpu_backup": True,
    }
    assert "enable_weights_cpu_backup" not in lora_server_args(lora, colocate=False)
    rank8 = lora_from_namespace(argparse.Namespace(lora_rank=8, target_modules="q_proj,v_proj"))
    assert lora_server_args(rank8, colocate=False) == {
        "enable_lora": True,
        "max_loras_per_batch": 1,
        "max_lora_rank": 8,
        "lora_target_modules": ["q_proj", "v_proj"],
    }
    # --lora-train-only: the engines serve the base model; no LoRA at all: nothing.
    train_only = argparse.Namespace(lora_rank=8, target_modules=["linear_qkv"], lora_train_only=True)
    assert lora_server_args(lora_from_namespace(train_only), colocate=False) == {}
    assert lora_server_args(lora_from_namespace(argparse.Namespace()), colocate=False) == {}


def test_a_group_override_wins_over_the_lora_defaults():
    # test_compute_server_args.py test_override_wins_over_lora_defaults: lora_rank=8, override enable_lora=False.
    s = spec(model("actor", group("regular", 2, enable_lora=False)))
    plan = resolve_deployment(s, TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True))
    settings = SGLangDeployConf(
        lora=lora_from_namespace(argparse.Namespace(lora_rank=8, target_modules=["linear_qkv"]))
    )
    process = prepare_deployment(plan, settings, server_arg_fields=FIELDS_0_5_23).launch.engines[0]
    assert process.server_args["enable_lora"] is False and "--enable-lora" not in process.argv
    assert process.server_args["max_lora_rank"] == 8


def test_what_miles_refuses_for_multi_lora_is_refused_before_anything_starts():
    # multi_lora.py validate_multi_lora_args: --target-modules must be set; not with --colocate. And what it
    # would ignore: adapter paths (its multi-LoRA engines start without any), another max_loras_per_batch.
    plan = resolve_deployment(
        spec(model("actor", group("regular", 8))), TrainerInputs(hf_checkpoint="/c", colocate=True)
    )
    settings = SGLangDeployConf()
    settings.lora.multi_lora_n_adapters = 4
    settings.lora.paths = {"a": "/a"}
    settings.lora.max_loras_per_batch = 2
    with pytest.raises(DeploymentConfigError) as exc:
        prepare_deployment(plan, settings)
    got = problems_of(exc)
    assert got["sglang_deploy.lora.target_modules"] == "multi-LoRA (4 adapter slots) needs the target modules"
    assert got["sglang_deploy.lora.multi_lora_n_adapters"].startswith(
        "4: multi-LoRA needs engines apart from training"
    )
    assert got["sglang_deploy.lora.paths"].startswith("['a']: multi-LoRA engines start without adapters")
    assert got["sglang_deploy.lora.max_loras_per_batch"] == (
        "2: with multi-LoRA it is the number of adapter slots, multi_lora_n_adapters=4; leave it null"
    )
    settings = SGLangDeployConf()
    settings.lora.multi_lora_n_adapters = -1
    with pytest.raises(DeploymentConfigError) as exc:
        prepare_deployment(plan, settings)
    assert problems_of(exc) == {"sglang_deploy.lora.multi_lora_n_adapters": "must be an integer >= 0, got -1"}


# ====================================================================== the argparse path == the Hydra path
@st.composite
def miles_runs(draw) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a Miles --sglang-config file as data, Miles' arguments): valid by construction, every group of whole
    nodes and any engine size dividing it, so that both paths plan; all of the trainer inputs vary."""
    gpn = draw(st.sampled_from([2, 4, 8]))
    gpes = [d for d in (1, 2, 4, 8) if gpn % d == 0] + [2 * gpn]
    models = []
    for i in range(draw(st.integers(1, 3))):
        types = ["prefill", "decode"] if draw(st.booleans()) else ["regular"]
        if draw(st.integers(0, 3)) == 0:
            types.insert(draw(st.integers(0, len(types))), "placeholder")
        groups = []
        for worker_type in types:
            g: dict[str, Any] = {"worker_type": worker_type, "num_gpus": 2 * gpn * draw(st.integers(1, 2))}
            if draw(st.booleans()):
                g["num_gpus_per_engine"] = draw(st.sampled_from(gpes))
            if draw(st.integers(0, 2)) == 0:
                g["overrides"] = {"mem_fraction_static": draw(st.sampled_from([0.7, 0.85]))}
            groups.append(g)
        entry: dict[str, Any] = {"name": f"m{i}", "server_groups": groups}
        if i:
            entry["model_path"] = f"/ckpt/m{i}"
        if draw(st.booleans()):
            entry["num_gpus_per_engine"] = draw(st.sampled_from(gpes))
        models.append(entry)
    rollout = sum(g["num_gpus"] for m in models for g in m["server_groups"])
    eval_gpus = 2 * gpn if draw(st.booleans()) else 0
    if eval_gpus:
        models.append({"name": "eval", "server_groups": [{"worker_type": "regular", "num_gpus": eval_gpus}]})
    colocate = draw(st.booleans())
    args: dict[str, Any] = dict(
        num_gpus_per_node=gpn,
        actor_num_nodes=rollout // gpn if colocate else draw(st.integers(1, 2)),
        actor_num_gpus_per_node=gpn,
        colocate=colocate,
        offload_rollout=draw(st.sampled_from([None, True, False])),
        rollout_num_gpus=draw(st.sampled_from([None, rollout])),
        rollout_num_gpus_per_engine=draw(st.sampled_from(gpes)),
        eval_num_gpus=eval_gpus,
        eval_num_gpus_per_engine=draw(st.sampled_from(gpes)),
        debug_rollout_only=draw(st.integers(0, 4)) == 0,
        debug_train_only=draw(st.integers(0, 9)) == 0,
        use_critic=draw(st.booleans()),
        critic_num_nodes=draw(st.sampled_from([None, 0, 1])),
        critic_num_gpus_per_node=draw(st.sampled_from([None, 0, gpn])),
        seed=draw(st.integers(0, 5000)),
        use_rollout_routing_replay=draw(st.booleans()),
        fp16=draw(st.booleans()),
        sglang_cuda_graph_backend_prefill=draw(st.sampled_from([None, "full"])),
        eval_sglang_mem_fraction_static=draw(st.sampled_from([None, 0.5])) if eval_gpus else None,
    )
    return {"sglang": models}, args


def hydra_overrides_of(args: dict[str, Any]) -> list[str]:
    """The same trainer inputs as Hydra overrides of the root (Miles' names), ``--sglang-*`` and
    ``--eval-sglang-*`` in their Hydra places."""
    out = []
    for name, value in args.items():
        if name == "sglang_cuda_graph_backend_prefill":
            if value is not None:
                out.append(f"+sglang_deploy.server_defaults.cuda_graph_backend_prefill={value}")
        elif name == "eval_sglang_mem_fraction_static":
            if value is not None:
                out.append(f"+eval_sglang_overrides.mem_fraction_static={value}")
        else:
            out.append(
                f"{name}={'null' if value is None else str(value).lower() if isinstance(value, bool) else value}"
            )
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=miles_runs())
def test_the_namespace_and_the_hydra_path_give_the_same_plan(run, tmp_path_factory):
    """A Miles run (its --sglang-config file and its arguments) resolved through ``resolve_namespace`` and,
    imported as a preset, through ``resolve_config`` of the composed config: the same plan, or both refused."""
    config, args = run
    where = tmp_path_factory.mktemp("run")
    path = where / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    (where / "sglang").mkdir()
    (where / "sglang" / "run.yaml").write_text(spec_to_preset(load_miles_config(path)))
    ns = miles_namespace(sglang_config=str(path), **args)
    cfg = compose_config(
        [
            "sglang=run",
            f"hydra.searchpath=[file://{where}]",
            "hf_checkpoint=/ckpt/actor",
            *hydra_overrides_of(args),
        ]
    )
    plans = []
    for resolve in (lambda: resolve_namespace(ns, server_arg_fields=FIELDS_0_5_23),
                    lambda: resolve_config(cfg, server_arg_fields=FIELDS_0_5_23)):  # fmt: skip
        try:
            plan = resolve()
        except DeploymentConfigError as exc:
            plans.append(sorted(p.key.rsplit(".", 1)[-1] for p in exc.problems))
        else:
            data = plan.to_dict()
            data.pop("source")
            plans.append(data)
    event("planned" if isinstance(plans[0], dict) else f"refused: {plans[0]}")
    assert plans[0] == plans[1]


# ============================================================================ 10. round 3 (issue 21): DP, external
def test_dp_attention_makes_the_router_dp_aware():
    # miles/backends/sglang_utils/arguments.py validate_args: `if args.sglang_enable_dp_attention:
    # args.router_dp_aware = True`; its tests/fast/backends/sglang_utils/test_router_dp_aware.py:
    # --sglang-enable-dp-attention --sglang-dp-size 4 with rollout_num_gpus_per_engine=4 -> dp-aware; no flags
    # -> untouched (False).
    ns = miles_namespace(
        rollout_num_gpus=8, rollout_num_gpus_per_engine=4, sglang_enable_dp_attention=True, sglang_dp_size=4
    )
    plan = resolve_namespace(ns, server_arg_fields=FIELDS_0_5_23)
    regular = plan.model("default").group("regular")
    assert (regular.tp_size, regular.dp_size, regular.dp_attention) == (4, 4, True)
    # the engines get the namespace's --sglang-* values as sglang_deploy.server_defaults
    settings = SGLangDeployConf(server_defaults=server_defaults_from_namespace(ns, FIELDS_0_5_23))
    prepared = prepare_deployment(plan, settings, server_arg_fields=FIELDS_0_5_23)
    (router,) = prepared.launch.routers
    assert router.spec.settings.extra["dp_aware"] is True and router.to_dict()["dp_aware"] is True
    engine = prepared.launch.for_engine("default.regular.0")[0]
    assert "--enable-dp-attention" in engine.argv and flag(engine.argv, "--dp-size") == "4"

    plain = resolve_namespace(miles_namespace(rollout_num_gpus=8, rollout_num_gpus_per_engine=4))
    (router,) = prepare_deployment(plain, SGLangDeployConf(), server_arg_fields=FIELDS_0_5_23).launch.routers
    assert "dp_aware" not in router.spec.settings.extra and router.to_dict()["dp_aware"] is False


def test_dp_attention_of_one_group_makes_only_its_models_router_dp_aware():
    # SGLang 0.5.23 turns --enable-dp-attention into attn_dp_size; attn_dp_size > 1 is DP attention too.
    s = spec(
        model("actor", group("regular", 4, gpe=4, enable_dp_attention=True, dp_size=2)),
        model("ref", group("regular", 4, gpe=4, attn_dp_size=4), path="/ref"),
        model("rm", group("regular", 4, gpe=4), path="/rm"),
    )
    plan = resolve_deployment(s, TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True))
    assert [m.dp_attention for m in plan.models] == [True, True, False]
    launch = prepare_deployment(plan, SGLangDeployConf(), server_arg_fields=FIELDS_0_5_23).launch
    assert [r.spec.settings.extra.get("dp_aware", False) for r in launch.routers] == [True, True, False]
    # noted, with what sglang-router 0.3.2 cannot do for a dp-aware router
    settings = SGLangDeployConf()
    settings.router.gateway = "sglang_router"
    notes = prepare_deployment(plan, settings, server_arg_fields=FIELDS_0_5_23).launch.notes
    assert [note for note in notes if "dp-aware" in note] == [
        f"router of model {name!r} is dp-aware (its engines run DP attention, as Miles sets it); sglang-router "
        "0.3.2 cannot take a dp-aware worker out (its removal job fails), so a lost engine stays listed: "
        "gateway=smg can"
        for name in ("actor", "ref")
    ]
    # the user's own router.extra.dp_aware wins
    settings = SGLangDeployConf()
    settings.router.extra = {"dp_aware": False}
    launch = prepare_deployment(plan, settings, server_arg_fields=FIELDS_0_5_23).launch
    assert [r.spec.settings.extra["dp_aware"] for r in launch.routers] == [False, False, False]


def test_dp_size_above_one_without_dp_attention_is_refused():
    # validate_args: `if args.sglang_dp_size > 1: assert args.sglang_enable_dp_attention` (slime likewise).
    # Without it SGLang runs dp_size replicas of the engine's TP: dp 2 x tp 4 = 8 GPUs in an engine of 4.
    ns = miles_namespace(rollout_num_gpus=8, rollout_num_gpus_per_engine=4, sglang_dp_size=2)
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_namespace(ns, server_arg_fields=FIELDS_0_5_23)
    assert problems_of(exc) == {
        "sglang_deploy.server_defaults.dp_size": "2 needs DP attention (enable_dp_attention: true), as Miles and "
        "slime require: without it SGLang runs 2 data-parallel replicas of tp_size=4, 8 GPUs, in an engine of "
        "num_gpus_per_engine=4"
    }
    # a group's own dp_size, with pipeline parallelism: dp 2 x tp 2 x pp 2 = 8 GPUs in an engine of 4
    s = spec(model("actor", group("regular", 8, gpe=4, pp_size=2, dp_size=2)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True))
    assert problems_of(exc) == {
        "sglang.actor.regular.overrides.dp_size": "2 needs DP attention (enable_dp_attention: true), as Miles and "
        "slime require: without it SGLang runs 2 data-parallel replicas of tp_size=2 x pp_size=2, 8 GPUs, in an "
        "engine of num_gpus_per_engine=4"
    }


EXTERNAL = ["10.0.0.1:30000", "10.0.0.2:30001"]


def test_external_engines_with_colocate_take_miles_layout():
    # miles/ray/placement_group.py _get_placement_group_layout: `if args.rollout_external: ... return
    # actor_num_gpus, actor_num_gpus`, colocated or not; tests/fast/ray/test_placement_group_shared_ppo.py's
    # arguments (actor 1 x 2, rollout_num_gpus 4) with --colocate: (2, 2): rollout after the actor's 2 GPUs,
    # Megatron on 2. The colocate rule's rollout_num_gpus (2) holds no engine: the engines run elsewhere.
    ns = miles_namespace(
        actor_num_gpus_per_node=2, rollout_num_gpus=4, colocate=True, rollout_external=True,
        rollout_external_engine_addrs=EXTERNAL,
    )  # fmt: skip
    plan = resolve_namespace(ns)
    assert (plan.rollout_offset, plan.megatron_num_gpus, plan.total_gpus) == (2, 2, 0)
    assert [e.url for e in plan.model("default").external] == [
        "http://10.0.0.1:30000",
        "http://10.0.0.2:30001",
    ]
    assert plan.notes[-1] == (
        "external engines only: the 2 GPUs that colocate gives rollout (rollout_num_gpus) hold no engine here; "
        "Miles' placement for external engines: rollout_offset=2, Megatron on 2 GPUs"
    )
    # not colocated: the same layout (actor_num_gpus, actor_num_gpus), nothing to note
    plan = resolve_namespace(dataclasses_replace_ns(ns, colocate=False))
    assert (plan.rollout_offset, plan.megatron_num_gpus, plan.total_gpus) == (2, 2, 0)
    assert not any("external engines only" in note for note in plan.notes)


def test_external_engines_with_debug_rollout_only_and_colocate_reserve_nothing():
    # _get_placement_group_layout: `if args.rollout_external: if args.debug_rollout_only: return 0, 0`
    # (test_external_rollout_only_reserves_no_local_bundles); miles_validate_args turns colocate off first.
    ns = miles_namespace(
        actor_num_gpus_per_node=2, rollout_num_gpus=4, colocate=True, debug_rollout_only=True,
        rollout_external=True, rollout_external_engine_addrs=EXTERNAL,
    )  # fmt: skip
    plan = resolve_namespace(ns)
    assert (plan.rollout_offset, plan.megatron_num_gpus, plan.total_gpus) == (0, 0, 0)
    assert plan.trainer.colocate is False
    assert len(plan.model("default").external) == 2


def test_external_engines_with_colocate_on_the_hydra_path():
    # A deployment whose only engines run elsewhere, colocated with an actor of 1 x 2 GPUs: (2, 2) as above.
    cfg = compose_config(
        ["hf_checkpoint=/c", "colocate=true", "actor_num_gpus_per_node=2", "sglang.actor.regular.num_gpus=0",
         "sglang.actor.external=[http://10.0.0.1:30000]"]
    )  # fmt: skip
    plan = resolve_config(cfg)
    assert (plan.rollout_offset, plan.megatron_num_gpus, plan.total_gpus) == (2, 2, 0)
    # with a local group as well, colocate still sizes the deployment: 0 GPUs for an actor of 2 is refused
    cfg = compose_config(
        ["hf_checkpoint=/c", "colocate=true", "actor_num_gpus_per_node=2", "sglang.actor.regular.num_gpus=4",
         "sglang.actor.external=[http://10.0.0.1:30000]"]
    )  # fmt: skip
    with pytest.raises(DeploymentConfigError, match="rollout_num_gpus: is 2 GPUs of the actor"):
        resolve_config(cfg)


def dataclasses_replace_ns(ns: argparse.Namespace, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), **kw})


def test_a_dashed_override_key_of_a_miles_file_is_read_as_its_field_with_a_note(tmp_path):
    # Miles (sglang_engine.py _compute_server_args) passes group overrides on as written and drops keys that are
    # not ServerArgs fields, so `pp-size: 2` is lost there; slime normalises '-' to '_' (pp_size=2), as here.
    path = tmp_path / "dashed.yaml"
    path.write_text(
        "sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 8\n"
        "        num_gpus_per_engine: 4\n        overrides: {pp-size: 2}\n"
    )
    ns = miles_namespace(sglang_config=str(path), rollout_num_gpus=8, debug_rollout_only=True)
    plan = resolve_namespace(ns, server_arg_fields=FIELDS_0_5_23)
    regular = plan.model("actor").group("regular")
    assert (regular.tp_size, regular.pp_size) == (2, 2)
    assert (
        "read dashed.yaml: sglang[0] (actor).server_groups[0].overrides.pp-size as pp_size, as slime does; Miles "
        "drops a key spelt with '-' (no ServerArgs field has that name): write pp_size for both to read it"
    ) in plan.notes


# ============================================================================= round 4 (issue 30): environment
#: Miles' engine defaults, copied by hand from radixark/miles ``miles/ray/rollout/server_group.py`` (31f1ca961,
#: lines 99-115) with its refactor's DeepGEMM cache switch and ``SGLANG_EXPOSE_OWN_ENV_VARS``
#: (``miles/ray/specs/inference.py`` at 727f91769, lines 364-381); the custom all-reduce one is tested apart.
MILES_DEFAULTS_BY_HAND = {
    "NVSHMEM_DISABLE_NCCL": "1",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_DG_CACHE_DIR_PER_PROCESS": "1",
    "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true",
    "SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_FALLBACK_VARIANT": "true",
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false",
    "SGLANG_EXPOSE_OWN_ENV_VARS": "1",
}


def colocated_tp2_plan():
    """One colocated group of 2 engines x 2 GPUs: Miles' custom all-reduce default there is "0"."""
    return resolve_deployment(
        spec(model("actor", group("regular", 4, gpe=2))),
        TrainerInputs(hf_checkpoint="/c", colocate=True, actor_num_gpus_per_node=4),
    )


def test_the_launchers_exported_engine_variables_win_over_miles_defaults(monkeypatch):
    # server_group.py:99-100 (31f1ca961): env_vars = {key: os.environ.get(key, default_val) for ...}: a value the
    # launcher's environment holds (even an empty one) is what the engine gets; a default only fills a gap.
    # Above both: sglang_deploy.env (the user's own config), and the plan's CUDA_VISIBLE_DEVICES.
    launcher = {
        "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "true",
        "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "false",
        "NVSHMEM_DISABLE_NCCL": "",
        "SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "1",  # Miles' default here would be "0" (colocated, TP 2)
        "HF_TOKEN": "hf_launcher_secret",  # not one of Miles' variables: inherited, never rendered
    }
    prepared = prepare_deployment(colocated_tp2_plan(), SGLangDeployConf(), launcher_env=launcher)
    env = prepared.launch.engines[0].env
    assert env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "true"
    assert env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "false"
    assert env["NVSHMEM_DISABLE_NCCL"] == ""
    assert env["SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2"] == "1"
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"  # not exported: Miles' default
    assert "HF_TOKEN" not in env
    # The printed plan records what runs: the launcher's values, shown (Miles' switches hold no secret).
    data = prepared.to_dict()
    shown = data["models"]["actor"]["groups"]["regular"]["engines"][0]["launch"][0]["env"]
    assert (
        shown["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "true"
        and shown["SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2"] == "1"
    )
    assert (
        "engine environment from the launcher's, over Miles' defaults (as Miles does): NVSHMEM_DISABLE_NCCL='' "
        "(Miles: 1), SGLANG_JIT_DEEPGEMM_PRECOMPILE=true (Miles: false), SGLANG_MEMORY_SAVER_CUDA_GRAPH=false "
        "(Miles: true), SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=1"
    ) in data["notes"]

    # sglang_deploy.env wins over the launcher's value, and then no note claims the launcher's.
    own = SGLangDeployConf(env={"SGLANG_JIT_DEEPGEMM_PRECOMPILE": "0"})
    prepared = prepare_deployment(
        colocated_tp2_plan(), own, launcher_env={"SGLANG_JIT_DEEPGEMM_PRECOMPILE": "true"}
    )
    assert prepared.launch.engines[0].env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "0"
    assert not any("from the launcher's" in note for note in prepared.launch.notes)

    # Without launcher_env, the launcher is this process: what the operator exported before `miles-sglang`.
    monkeypatch.setenv("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "true")
    cfg = compose_config(["sglang=default", "hf_checkpoint=/c", "sglang.actor.regular.num_gpus=2"])
    for process in prepare_from_config(cfg).launch.engines:
        assert process.env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "true"
        assert process.env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "true"


def test_without_exported_values_every_engine_gets_miles_defaults_and_exposes_its_environment():
    # inference.py:364-381 (727f91769): every engine's variables, SGLANG_EXPOSE_OWN_ENV_VARS=1 among them (SGLang
    # then lists its own variables in /server_info's internal_states[].env_vars); server_group.py:110-112:
    # SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2 is "0" when colocated with engines wider than one GPU, else "1".
    for kind in ("sglang", "simulated", "cpu_sglang"):
        settings = SGLangDeployConf()
        settings.launch.engine = kind
        prepared = prepare_deployment(colocated_tp2_plan(), settings, launcher_env={})
        for process in prepared.launch.engines:
            env = process.env
            assert {k: env[k] for k in MILES_DEFAULTS_BY_HAND} == MILES_DEFAULTS_BY_HAND, kind
            assert env["SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2"] == "0", kind
        assert not any("from the launcher's" in note for note in prepared.launch.notes)
    apart = resolve_deployment(
        spec(model("actor", group("regular", 4, gpe=2))), TrainerInputs(hf_checkpoint="/c", colocate=False)
    )
    env = prepare_deployment(apart, SGLangDeployConf(), launcher_env={}).launch.engines[0].env
    assert env["SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2"] == "1" and env["SGLANG_EXPOSE_OWN_ENV_VARS"] == "1"


def test_the_custom_all_reduce_default_follows_each_groups_own_engine_width():
    # server_group.py:110-112 (31f1ca961) decides it by args.rollout_num_gpus_per_engine, one width for every
    # group; this project keeps its own rule on purpose (docs: Miles and slime formats, deliberate differences):
    # each group by its own engines, so a colocated group of 1-GPU engines next to a TP-2 one gets "1".
    plan = resolve_deployment(
        spec(
            model("actor", group("regular", 2, gpe=2, name="wide"), group("regular", 2, gpe=1, name="narrow"))
        ),
        TrainerInputs(hf_checkpoint="/c", colocate=True, actor_num_gpus_per_node=4),
    )
    by_group = {
        p.group: p.env["SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2"]
        for p in prepare_deployment(plan, SGLangDeployConf(), launcher_env={}).launch.engines
    }
    assert by_group == {"wide": "0", "narrow": "1"}


# ====================================================================== round 4 (issue 30): LoRA preloading
def lora_settings(**paths: str) -> SGLangDeployConf:
    settings = SGLangDeployConf()
    settings.lora.enabled = True
    settings.lora.paths = dict(paths)
    return settings


def lora_plan(rollout_only: bool):
    return resolve_deployment(
        spec(model("actor", group("regular", 2, gpe=2))),  # one engine
        TrainerInputs(hf_checkpoint="/c", debug_rollout_only=rollout_only),
    )


def peft_dir(path: Path) -> Path:
    """An adapter as SGLang reads one (HF PEFT form): adapter_config.json with its weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def megatron_only_dir(path: Path) -> Path:
    """A resumed LoRA checkpoint with only Megatron-native shards (Miles' own test's file name)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_megatron_tp0_pp0_ep0.pt").write_bytes(b"")
    return path


def lora_paths_of(prepared) -> list[list[str] | None]:
    """Each engine's --lora-paths values, from its rendered command line (None: no such flag)."""
    out: list[list[str] | None] = []
    for process in prepared.launch.engines:
        argv = list(process.argv)
        if "--lora-paths" not in argv:
            out.append(None)
            continue
        start = argv.index("--lora-paths") + 1
        end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
        out.append(argv[start:end])
    return out


def test_a_training_run_leaves_miles_adapter_to_the_first_weight_sync(tmp_path):
    # radixark/miles PR #2708 (Part of #2705): "Normal train drivers start resumed rollout engines from the base
    # model and let the mandatory initial weight publish install the trainer's restored adapter"; only
    # --debug-rollout-only, which skips that publish, needs the preload. So no --lora-paths for a training run,
    # whatever the directory holds, and a note that says why.
    for adapter in (peft_dir(tmp_path / "peft"), megatron_only_dir(tmp_path / "native"), tmp_path / "absent"):
        prepared = prepare_deployment(lora_plan(False), lora_settings(miles_lora=str(adapter)))
        assert lora_paths_of(prepared) == [None]
        assert "--enable-lora" in prepared.launch.engines[0].argv  # LoRA itself is on
        (note,) = [n for n in prepared.launch.notes if n.startswith("LoRA adapter miles_lora")]
        assert note.startswith(
            f"LoRA adapter miles_lora ({adapter}) is not preloaded: as in Miles, the first weight sync installs the "
            "trainer's adapter before the first rollout (a preload is for debug_rollout_only runs)"
        )
    assert note.endswith("; it is no directory here")


def test_a_rollout_only_run_preloads_only_a_directory_sglang_can_read(tmp_path, run_cli):
    # sglang_engine.py:785-788 (b53603cff): peft_export_available = os.path.isfile(join(path,
    # "adapter_config.json")); lora_paths only then ("SGLang would abort at startup on the missing
    # adapter_config.json"). Miles' test_compute_server_args.py: test_preloads_a_directory_sglang_can_read,
    # test_skips_a_native_only_checkpoint. Rollout-only has no weight sync to bring it instead: refused here.
    adapter = peft_dir(tmp_path / "peft")
    prepared = prepare_deployment(lora_plan(True), lora_settings(miles_lora=str(adapter)))
    assert lora_paths_of(prepared) == [[f"miles_lora={adapter}"]]
    assert not any(n.startswith("LoRA adapter") for n in prepared.launch.notes)

    native = megatron_only_dir(tmp_path / "native")
    with pytest.raises(DeploymentConfigError) as exc:
        prepare_deployment(lora_plan(True), lora_settings(miles_lora=str(native)))
    assert problems_of(exc) == {
        "sglang_deploy.lora.paths.miles_lora": (
            f"{str(native)!r} holds no adapter_config.json: debug_rollout_only runs no weight sync, so the engines "
            "must load the adapter at start, and SGLang reads one only from a directory with adapter_config.json "
            "(HF PEFT form); export the adapter in that form, or remove the path"
        )
    }
    # The same through the command: one message naming the key, exit 2, no traceback.
    rc, _, err = run_cli(
        "plan", "sglang=default", "hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=2",
        "sglang_deploy.lora.enabled=true", f"+sglang_deploy.lora.paths.miles_lora={tmp_path / 'absent'}",
    )  # fmt: skip
    assert rc == 2 and "Traceback" not in err
    assert f"sglang_deploy.lora.paths.miles_lora: {str(tmp_path / 'absent')!r} is no directory here" in err


def test_the_adapter_check_reads_nothing_and_follows_only_a_files_own_links(tmp_path):
    # Miles checks with os.path.isfile (sglang_engine.py:785, b53603cff): a regular file, through symbolic links
    # (a Hugging Face cache's snapshot links each file into its blobs); a FIFO or a directory of that name is
    # none, and the check must not open it (a FIFO's open would wait for a writer).
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "cfg").write_text("{}")
    linked = tmp_path / "snapshot"
    linked.mkdir()
    (linked / "adapter_config.json").symlink_to(blobs / "cfg")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "adapter_config.json")
    dir_named = tmp_path / "dir_named"
    (dir_named / "adapter_config.json").mkdir(parents=True)
    prepared = prepare_deployment(lora_plan(True), lora_settings(miles_lora=str(linked)))
    assert lora_paths_of(prepared) == [[f"miles_lora={linked}"]]
    for odd in (fifo, dir_named):
        with pytest.raises(DeploymentConfigError) as exc:
            prepare_deployment(lora_plan(True), lora_settings(miles_lora=str(odd)))
        assert problems_of(exc)["sglang_deploy.lora.paths.miles_lora"].startswith(
            f"{str(odd)!r} holds no adapter_config.json"
        )
    # A path is taken as written: "~" is not the home directory (SGLang would not expand it either).
    with pytest.raises(DeploymentConfigError) as exc:
        prepare_deployment(lora_plan(True), lora_settings(miles_lora="~/adapters/a"))
    assert problems_of(exc)["sglang_deploy.lora.paths.miles_lora"].startswith(
        "'~/adapters/a' is no directory here"
    )


def test_an_adapter_no_weight_sync_brings_is_always_preloaded_but_never_from_a_directory_sglang_cannot_read(
    tmp_path,
):
    # Miles' weight sync loads only its own adapter (LORA_ADAPTER_NAME, miles_lora); another adapter of this
    # project's paths is loaded at start or never, so a training run preloads it too. The SGLang rule is the same
    # (sglang_engine.py:782-783, b53603cff: it aborts at start on a directory without adapter_config.json).
    sql = peft_dir(tmp_path / "sql")
    prepared = prepare_deployment(lora_plan(False), lora_settings(sql=str(sql)))
    assert lora_paths_of(prepared) == [[f"sql={sql}"]]
    native = megatron_only_dir(tmp_path / "native")
    with pytest.raises(DeploymentConfigError) as exc:
        prepare_deployment(lora_plan(False), lora_settings(sql=str(native)))
    assert problems_of(exc) == {
        "sglang_deploy.lora.paths.sql": (
            f"{str(native)!r} holds no adapter_config.json: SGLang would abort at start (it loads an adapter in HF "
            "PEFT form); point it at such a directory, or remove the path"
        )
    }
    # No directory here: passed as given (SGLang fetches a name that is no local directory from the Hub).
    prepared = prepare_deployment(lora_plan(False), lora_settings(sql="org/sql-adapter"))
    assert lora_paths_of(prepared) == [["sql=org/sql-adapter"]]
    assert (
        "LoRA adapter sql (org/sql-adapter) is no directory here: the engines get it as given (SGLang loads a path "
        "that is no directory on its machine as a Hugging Face repository id)"
    ) in prepared.launch.notes


def test_engines_loading_dummy_weights_preload_no_adapter(tmp_path):
    # sglang_engine.py:788 (b53603cff; the same condition at 31f1ca961:780): lora_paths only when
    # kwargs.get("load_format") != "dummy"; the weight sync brings adapter and weights together.
    adapter = peft_dir(tmp_path / "peft")
    settings = lora_settings(miles_lora=str(adapter))
    settings.server_defaults = {"load_format": "dummy"}
    prepared = prepare_deployment(lora_plan(True), settings, server_arg_fields=FIELDS_0_5_23)
    assert lora_paths_of(prepared) == [None]
    assert (
        "LoRA adapters not preloaded by actor/regular: their engines load dummy weights (load_format=dummy), and the "
        "first weight sync brings the adapter with the weights, as in Miles"
    ) in prepared.launch.notes


def test_a_target_sglangs_command_line_does_not_list_is_refused_not_widened_to_all(run_cli):
    # radixark/miles 7d7cc9b5c, sglang_engine.py:221-226 (_lora_target_modules_for_cli): a target outside
    # SGLang's --lora-target-modules choices turns the whole list into ["all"]. This project keeps its own rule
    # on purpose (docs: Miles and slime formats, deliberate differences): the plan refuses it, naming the target,
    # since "all" would put adapters on every module SGLang finds, not only the ones the trainer trains.
    # linear_qkv -> q_proj k_proj v_proj (listed); out_proj (GDN's output projection) is not in 0.5.23's list.
    rc, _, err = run_cli(
        "plan", "sglang=default", "hf_checkpoint=/c", "sglang_deploy.lora.enabled=true",
        "sglang_deploy.lora.target_modules=[layers.*.self_attention.linear_qkv,out_proj]",
    )  # fmt: skip
    assert rc == 2 and "Traceback" not in err
    assert "sglang_deploy.lora: 'out_proj' is not one of q_proj, k_proj, v_proj, o_proj, " in err
    assert "(SGLang's --lora-target-modules)" in err
