"""Resolution rules with concrete numbers worked out by hand from Miles' rules."""

from __future__ import annotations

import pytest

from miles_sglang_plugin.config.deployment_spec import WorkerType
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.planning.resolution import resolve_deployment
from tests.conftest import group, model, spec

HF = "/ckpt/actor"


def T(**kw) -> TrainerInputs:
    kw.setdefault("hf_checkpoint", HF)
    return TrainerInputs(**kw)


def R(**kw) -> TrainerInputs:
    """A rollout-only run (debug_rollout_only): rollout GPUs from slot 0, nothing trains, any size. (Colocated,
    Miles sizes the rollout as the actor, so colocate no longer stands for "from slot 0".)"""
    return T(debug_rollout_only=True, **kw)


def problems_of(exc: pytest.ExceptionInfo[DeploymentConfigError]) -> dict[str, str]:
    return {p.key: p.message for p in exc.value.problems}


# ---------------------------------------------------------------------------------------------- offsets
def test_gpu_offset_cursor_runs_over_models_and_groups_placeholders_included():
    s = spec(
        model("actor", group("placeholder", 2), group("regular", 4, gpe=2)),
        model("ref", group("regular", 2, gpe=1), path="/ref"),
    )
    plan = resolve_deployment(s, T(colocate=True))  # 8 GPUs: the actor's 1 x 8
    offsets = [(m.name, g.name, g.gpu_offset) for m, g in plan.groups()]
    assert offsets == [("actor", "placeholder", 0), ("actor", "regular", 2), ("ref", "regular", 6)]
    assert plan.total_gpus == 8 and plan.rollout_num_gpus == 8
    actor = plan.model("actor")
    assert actor.group("placeholder").engines == ()
    assert [e.gpu_slots for e in actor.group("regular").engines] == [(2, 3), (4, 5)]
    assert [e.gpu_slots for e in plan.model("ref").engines] == [(6,), (7,)]


def test_slots_nodes_and_local_ids_after_the_actor_gpus():
    # Not colocated: rollout starts after 1 node x 8 actor GPUs, so on node 1.
    s = spec(model("actor", group("regular", 12, gpe=4)))
    plan = resolve_deployment(s, T(num_gpus_per_node=8, actor_num_nodes=1, actor_num_gpus_per_node=8))
    assert plan.rollout_offset == 8
    engines = plan.model("actor").engines
    assert [e.gpu_slots for e in engines] == [(8, 9, 10, 11), (12, 13, 14, 15), (16, 17, 18, 19)]
    assert [e.node for e in engines] == [1, 1, 2]
    assert [e.local_gpu_ids for e in engines] == [(0, 1, 2, 3), (4, 5, 6, 7), (0, 1, 2, 3)]
    assert plan.nodes == (1, 2)


@pytest.mark.parametrize(
    ("kw", "rollout_offset", "megatron"),
    [
        ({}, 16, 16),
        ({"colocate": True}, 0, 16),
        ({"debug_rollout_only": True}, 0, 0),
        # Miles dec268f70 (Share Actor/Critic GPUs): the PPO critic trains on the actor's GPUs, adding none.
        ({"use_critic": True, "critic_num_nodes": 1, "critic_num_gpus_per_node": 4}, 16, 16),
        ({"use_critic": True}, 16, 16),
        ({"critic_train_only": True, "critic_num_nodes": 1, "critic_num_gpus_per_node": 4}, 4, 4),
        # Miles' own fixtures: 0 critic nodes / GPUs per node = no critic.
        ({"critic_num_nodes": 0, "critic_num_gpus_per_node": 0}, 16, 16),
    ],
)
def test_rollout_offset_and_megatron_gpus(kw, rollout_offset, megatron):
    t = T(actor_num_nodes=2, actor_num_gpus_per_node=8, **kw)
    plan = resolve_deployment(spec(model("actor", group("regular", 16, gpe=4))), t)
    assert (plan.rollout_offset, plan.megatron_num_gpus) == (rollout_offset, megatron)
    assert plan.model("actor").engines[0].gpu_slots[0] == rollout_offset


def test_a_ppo_critic_shares_the_actors_gpus():
    # Miles (dec268f70): actor 1 x 8, critic 1 x 4, use_critic -> rollout_offset 8 and Megatron 8 (not 12 and
    # 12), the critic resized to the actor's 1 x 8; PPO with rollout 8 runs on slots 8..15.
    t = T(
        actor_num_nodes=1,
        actor_num_gpus_per_node=8,
        use_critic=True,
        critic_num_nodes=1,
        critic_num_gpus_per_node=4,
    )
    plan = resolve_deployment(spec(model("actor", group("regular", 8, gpe=8))), t)
    assert (plan.rollout_offset, plan.megatron_num_gpus) == (8, 8)
    assert plan.model("actor").engines[0].gpu_slots == tuple(range(8, 16))
    assert (plan.trainer.critic_num_nodes, plan.trainer.critic_num_gpus_per_node) == (1, 8)
    assert dict(plan.derived) == {"critic_num_gpus_per_node": 8}
    assert plan.notes == (
        "critic_num_gpus_per_node=8 (given 4): use_critic: the critic shares the actor's GPUs, so Miles gives it "
        "the actor's size",
    )


def test_critic_only_training_needs_critic_gpus():
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(None, T(rollout_num_gpus=8, critic_train_only=True, critic_num_nodes=0))
    assert problems_of(exc)["critic_train_only"] == (
        "trains only the critic, but it has no GPUs (critic_num_nodes=0 x critic_num_gpus_per_node=None); "
        "give the critic GPUs"
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(None, T(rollout_num_gpus=8, critic_num_nodes=-1))
    assert problems_of(exc)["critic_num_nodes"] == "must be >= 0, got -1"


# ---------------------------------------------------------------------------------------------- offload
def test_needs_offload_tests_the_groups_first_gpu_against_megatron():
    # colocate: rollout_offset 0; Megatron trains on 1 node x 8 GPUs = slots 0..7, which the 8 rollout GPUs
    # take (Miles sizes a colocated rollout as the actor); the eval fleet comes after them.
    s = spec(
        model("actor", group("regular", 6, gpe=2)),  # slots 0-5 -> inside
        model("ref", group("regular", 2, gpe=2), path="/ref"),  # slots 6-7 -> first GPU 6 < 8 -> offload
        model("eval", group("regular", 4, gpe=2)),  # slots 8-11 -> outside
    )
    plan = resolve_deployment(
        s, T(colocate=True, offload_rollout=True, eval_num_gpus=4, eval_num_gpus_per_engine=2)
    )
    assert [g.needs_offload for _, g in plan.groups()] == [True, True, False]
    assert "enable_memory_saver" not in plan.model("actor").groups[0].overrides
    assert "enable_memory_saver" not in plan.model("ref").groups[0].overrides
    assert plan.model("eval").groups[0].overrides["enable_memory_saver"] is False


def test_explicit_memory_saver_override_wins_but_does_not_change_needs_offload():
    s = spec(
        model("actor", group("regular", 8, gpe=8)),
        model("eval", group("regular", 8, gpe=8, enable_memory_saver=True)),
    )
    plan = resolve_deployment(
        s, T(colocate=True, offload_rollout=True, eval_num_gpus=8, eval_num_gpus_per_engine=8)
    )
    ev = plan.model("eval").groups[0]
    assert ev.needs_offload is False
    assert ev.overrides["enable_memory_saver"] is True


def test_no_offload_flag_means_no_group_needs_offload_and_nothing_injected():
    s = spec(model("actor", group("regular", 8, gpe=8)), model("ref", group("regular", 8, gpe=8), path="/r"))
    plan = resolve_deployment(s, T(colocate=True, offload_rollout=False, actor_num_nodes=2))
    assert [g.needs_offload for _, g in plan.groups()] == [False, False]
    assert all("enable_memory_saver" not in g.overrides for _, g in plan.groups())
    assert "offload_rollout" not in plan.derived  # given false: Miles keeps --no-offload-rollout


def test_not_colocated_nothing_overlaps_megatron():
    plan = resolve_deployment(spec(model("actor", group("regular", 8, gpe=8))), T(offload_rollout=True))
    g = plan.model("actor").groups[0]
    assert g.needs_offload is False and g.overrides["enable_memory_saver"] is False


# ----------------------------------------------------------------------------- gpe, model path, update_weights
def test_num_gpus_per_engine_falls_back_group_then_model_then_trainer():
    s = spec(
        model("a", group("regular", 8, gpe=8), gpe=2),
        model("b", group("regular", 8), gpe=2, path="/b"),
        model("c", group("regular", 8), path="/c"),
    )
    plan = resolve_deployment(s, R(rollout_num_gpus_per_engine=4))
    assert [g.num_gpus_per_engine for _, g in plan.groups()] == [8, 2, 4]
    assert [len(g.engines) for _, g in plan.groups()] == [1, 4, 2]


def test_model_path_and_update_weights_inference():
    s = spec(
        model("actor", group("regular", 2)),
        model("ref", group("regular", 2), path="/ref"),
        model("same_path_frozen", group("regular", 2), path=HF, update=False),
    )
    plan = resolve_deployment(s, R())
    assert [(m.name, m.model_path, m.update_weights) for m in plan.models] == [
        ("actor", HF, True),
        ("ref", "/ref", False),
        ("same_path_frozen", HF, False),
    ]
    assert plan.model("ref").groups[0].overrides["model_path"] == "/ref"


def test_group_override_of_model_path_counts_as_the_effective_path():
    s = spec(model("actor", group("regular", 2, model_path="/other")))
    plan = resolve_deployment(s, R())
    assert plan.model("actor").model_path == "/other"
    assert plan.model("actor").update_weights is False


def test_groups_of_one_model_must_share_the_model_path():
    s = spec(model("actor", group("prefill", 2, model_path="/x"), group("decode", 2)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, R())
    assert "one model path" in problems_of(exc)["sglang.actor"]
    assert "prefill='/x'" in problems_of(exc)["sglang.actor"]


def test_missing_model_path_everywhere():
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 2))), TrainerInputs(debug_rollout_only=True))
    assert "no model path" in problems_of(exc)["sglang.actor.model_path"]


def test_overrides_accept_both_spellings_but_not_both_at_once():
    plan = resolve_deployment(spec(model("actor", group("regular", 2, **{"mem-fraction-static": 0.7}))), R())
    assert plan.model("actor").groups[0].overrides["mem_fraction_static"] == 0.7
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(
            spec(
                model(
                    "actor", group("regular", 2, **{"mem-fraction-static": 0.7, "mem_fraction_static": 0.8})
                )
            ),
            R(),
        )
    assert "give it once" in str(exc.value)


# ------------------------------------------------------------------------------------------- rollout GPUs
def test_rollout_num_gpus_follows_the_groups_or_must_match():
    s = spec(model("actor", group("prefill", 4, gpe=2), group("decode", 12, gpe=4)))
    assert resolve_deployment(s, R()).rollout_num_gpus == 16
    assert resolve_deployment(s, R(rollout_num_gpus=16)).rollout_num_gpus == 16
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, R(rollout_num_gpus=20))
    assert problems_of(exc)["rollout_num_gpus"].startswith(
        "is 20 but the server groups hold 16 GPUs (actor=16)"
    )


# ------------------------------------------------------------------------------------------------- PD
def test_pd_model_and_router_mode():
    s = spec(
        model("actor", group("prefill", 4, gpe=2), group("decode", 8, gpe=4)),
        model("ref", group("regular", 4), path="/ref"),
    )
    plan = resolve_deployment(s, R(rollout_num_gpus_per_engine=2))
    assert plan.model("actor").is_pd and not plan.model("ref").is_pd
    assert [e.worker_type for e in plan.model("actor").engines] == [WorkerType.prefill] * 2 + [
        WorkerType.decode
    ] * 2


# ---------------------------------------------------------------------------------------- multi-node
def test_engine_wider_than_a_node_has_one_process_per_node():
    plan = resolve_deployment(spec(model("actor", group("regular", 32, gpe=16))), R())
    e0, e1 = plan.model("actor").engines
    assert [(p.node, p.node_rank, p.local_gpu_ids) for p in e0.processes] == [
        (0, 0, tuple(range(8))),
        (1, 1, tuple(range(8))),
    ]
    assert [(p.node, p.node_rank) for p in e1.processes] == [(2, 0), (3, 1)]
    assert e1.processes[1].gpu_slots == tuple(range(24, 32))


def test_engine_wider_than_a_node_must_use_whole_nodes():
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 24, gpe=12))), R())
    assert "whole nodes (a multiple of 8)" in problems_of(exc)["sglang.actor.regular.num_gpus_per_engine"]


def test_engine_may_not_straddle_a_node_boundary():
    s = spec(
        model("actor", group("regular", 6, gpe=2), group("placeholder", 1)),
        model("ref", group("regular", 4, gpe=4), path="/r"),
    )
    # actor: slots 0-5, placeholder: 6, ref: 7-10 -> crosses node 0 / node 1
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, R())
    msg = problems_of(exc)["sglang.ref.regular"]
    assert "slots 7..10" in msg and "node 0 and node 1" in msg and "gpu_offset=7" in msg


# ------------------------------------------------------------------------------------- strict errors
def test_every_problem_is_reported_at_once():
    s = spec(
        model(
            "actor",
            group("regular", 6, gpe=4),  # 6 GPUs do not split into TP-4 engines
            group("prefill", 2, gpe=2),  # regular mixed with prefill (the decode group d below counts too)
            group("bogus", 2, name="b"),  # not a worker type
            group("decode", -1, name="d"),  # negative GPUs
        ),
        model("ref", group("regular", 2, host="0.0.0.0", tp_size=2, pp_size=1), path=HF),  # 2nd updatable
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, R(rollout_num_gpus_per_engine=1))
    got = problems_of(exc)
    assert (
        "6 GPUs do not split into engines of num_gpus_per_engine=4: 1 engine(s) would leave 2 GPU(s) idle"
        in got["sglang.actor.regular.num_gpus"]
    )
    assert (
        "'bogus' is not a worker type; valid: regular, prefill, decode, placeholder"
        in got["sglang.actor.b.worker_type"]
    )
    assert got["sglang.actor.d.num_gpus"] == "must be an integer >= 1, got -1"
    assert "mixes regular groups with prefill/decode groups" in got["sglang.actor"]
    assert "cannot be overridden ('0.0.0.0')" in got["sglang.ref.regular.overrides.host"]
    assert "tp_size would be 1" in got["sglang.ref.regular.overrides.tp_size"]
    assert "2 models receive weight updates (actor, ref)" in got["sglang"]
    # Every problem, once, in the order they were found (group b's and d's faults do not cascade).
    assert [p.key for p in exc.value.problems] == [
        "sglang.actor",
        "sglang.actor.regular.num_gpus",
        "sglang.actor.b.worker_type",
        "sglang.actor.d.num_gpus",
        "sglang.ref.regular.overrides.host",
        "sglang.ref.regular.overrides.tp_size",
        "sglang",
    ]
    text = str(exc.value)
    assert text.startswith(f"{len(exc.value.problems)} problems with the SGLang deployment in test:")


def test_prefill_without_decode_and_decode_without_prefill():
    for wt, missing in (("prefill", "decode"), ("decode", "prefill")):
        with pytest.raises(DeploymentConfigError) as exc:
            resolve_deployment(spec(model("actor", group(wt, 2))), R())
        assert f"no {missing} group; PD disaggregation needs both" in problems_of(exc)["sglang.actor"]


def test_cluster_too_small():
    s = spec(model("actor", group("regular", 16, gpe=8)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, T(num_nodes=2))  # actor on node 0 + 16 rollout GPUs = 24 slots > 16
    assert (
        "needs 24 GPU slots (rollout_offset=8 + 16 rollout GPUs) but the cluster has num_nodes=2 x"
        in problems_of(exc)["num_nodes"]
    )
    assert resolve_deployment(s, T(num_nodes=3)).total_gpus == 16


def test_override_keys_checked_against_server_args_fields_when_given():
    fields = {"mem_fraction_static", "tp_size", "model_path", "enable_memory_saver"}
    s = spec(model("actor", group("regular", 2, mem_fraction_statc=0.8)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, R(), server_arg_fields=fields)
    assert (
        "did you mean mem_fraction_static?"
        in problems_of(exc)["sglang.actor.regular.overrides.mem_fraction_statc"]
    )
    assert resolve_deployment(s, R()).model("actor").groups[0].overrides["mem_fraction_statc"] == 0.8


def test_disaggregation_mode_override_must_agree_with_worker_type():
    s = spec(model("actor", group("prefill", 2, disaggregation_mode="decode"), group("decode", 2)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, R())
    assert (
        "contradicts worker_type 'prefill'"
        in problems_of(exc)["sglang.actor.prefill.overrides.disaggregation_mode"]
    )


def test_pp_size_splits_the_engine():
    plan = resolve_deployment(spec(model("actor", group("regular", 8, gpe=4, pp_size=2, tp_size=2))), R())
    assert plan.model("actor").groups[0].tp_size == 2
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 8, gpe=4, pp_size=3))), R())
    assert (
        "3 does not divide num_gpus_per_engine=4"
        in problems_of(exc)["sglang.actor.regular.overrides.pp_size"]
    )


def test_trainer_input_errors_come_first_and_together():
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(None, TrainerInputs(rollout_num_gpus_per_engine=0, num_gpus_per_node="8"))
    got = problems_of(exc)
    assert got["rollout_num_gpus_per_engine"] == "must be >= 1, got 0"
    assert got["num_gpus_per_node"] == "must be an integer, got '8'"


# -------------------------------------------------------------------------------------------- eval
def test_eval_fleet_overrides_layers_and_defaults():
    s = spec(
        model("actor", group("regular", 8, gpe=4)),
        model(
            "eval", group("regular", 4, enable_return_routed_experts=True), gpe=8
        ),  # model-level gpe ignored
    )
    t = T(
        colocate=True,
        rollout_num_gpus_per_engine=4,
        eval_num_gpus=4,
        eval_num_gpus_per_engine=2,
        # dp_size 2 needs DP attention (Miles' rule)
        eval_sglang_overrides={"mem_fraction_static": 0.5, "dp_size": 2, "enable_dp_attention": True},
    )
    plan = resolve_deployment(s, t)
    ev = plan.model("eval")
    assert ev.is_eval and ev.update_weights is False
    g = ev.groups[0]
    assert g.num_gpus_per_engine == 2 and len(g.engines) == 2
    assert dict(g.overrides) == {
        "model_path": HF,
        "enable_return_routed_experts": True,  # group override beats the eval default
        "enable_return_indexer_topk": False,
        "dp_size": 2,  # --eval-sglang-* beats the reset to 1
        "enable_dp_attention": True,
        "pp_size": 1,
        "ep_size": 1,
        "attn_cp_size": 1,
        "mem_fraction_static": 0.5,
        # colocate turns offload_rollout on; the eval fleet (slots 8..11) is past Megatron's 0..7
        "enable_memory_saver": False,
    }
    assert plan.rollout_num_gpus == 8 and plan.total_gpus == 12


def test_eval_fleet_checks():
    s = spec(model("actor", group("regular", 8, gpe=4)), model("eval", group("regular", 2)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, R(eval_num_gpus=4, eval_num_gpus_per_engine=3))
    got = problems_of(exc)
    assert "holds 2 GPUs but eval_num_gpus=4" in got["sglang.eval"]
    assert "eval_num_gpus=4 does not split into engines of 3 GPUs" in got["eval_num_gpus_per_engine"]
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 8))), R(eval_num_gpus=4))
    assert "needs exactly one model named 'eval', found 0" in problems_of(exc)["sglang"]


# ------------------------------------------------------------------------------------------- legacy
def test_no_deployment_means_one_regular_group_plus_eval():
    plan = resolve_deployment(
        None, T(rollout_num_gpus=8, rollout_num_gpus_per_engine=2, eval_num_gpus=2, debug_rollout_only=True)
    )
    assert [(m.name, [(g.name, g.num_gpus) for g in m.groups]) for m in plan.models] == [
        ("default", [("regular", 8)]),
        ("eval", [("regular", 2)]),
    ]
    assert plan.model("eval").groups[0].gpu_offset == 8


def test_prefill_num_servers_splits_prefill_and_decode():
    plan = resolve_deployment(
        None,
        T(rollout_num_gpus=8, rollout_num_gpus_per_engine=2, prefill_num_servers=1, debug_rollout_only=True),
    )
    assert [(g.name, g.num_gpus, len(g.engines)) for g in plan.model("default").groups] == [
        ("prefill", 2, 1),
        ("decode", 6, 3),
    ]
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(None, T(rollout_num_gpus=4, rollout_num_gpus_per_engine=2, prefill_num_servers=2))
    assert "leave 0 of rollout_num_gpus=4 for decode" in problems_of(exc)["prefill_num_servers"]
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 2))), T(prefill_num_servers=1))
    assert "cannot be combined with an sglang deployment" in problems_of(exc)["prefill_num_servers"]


def test_debug_train_only_starts_nothing():
    plan = resolve_deployment(spec(model("actor", group("regular", 8))), T(debug_train_only=True))
    assert plan.models == () and plan.engines == ()


def test_naming_and_type_errors_of_models_and_groups():
    s = spec(
        model("actor", group("regular", 2), gpe=0, update="yes"),
        model("actor", group("regular", 2), path="/x", update=False),
        model(
            "bad name", group("regular", 1, name="r"), group("regular", 1, name="r"), path="/y", update=False
        ),
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, R())
    got = problems_of(exc)
    assert got["sglang.actor"] == "model name 'actor' is used 2 times; names must be unique"
    assert got["sglang.actor.num_gpus_per_engine"] == "must be an integer >= 1, got 0"
    assert got["sglang.actor.update_weights"] == "must be true, false or null, got 'yes'"
    assert "must start with a letter or '_'" in got["sglang.bad name"]
    assert got["sglang.bad name.r"] == "group name 'r' is used 2 times in model 'bad name'"


def test_eval_overrides_without_eval_fleet_and_exclusive_debug_modes():
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 2))), R(eval_sglang_overrides={"dp_size": 2}))
    assert (
        "eval overrides ['dp_size'] are set but eval_num_gpus is 0"
        in problems_of(exc)["eval_sglang_overrides"]
    )
    # Also where no engine starts at all (Miles checks the arguments before anything else): debug_train_only
    # without an eval fleet, rollout_num_gpus=0 without a deployment.
    for trainer in (
        T(debug_train_only=True, eval_sglang_overrides={"mem_fraction_static": 0.5}),
        T(rollout_num_gpus=0, eval_sglang_overrides={"mem_fraction_static": 0.5}),
    ):
        with pytest.raises(DeploymentConfigError) as exc:
            resolve_deployment(None, trainer)
        assert list(problems_of(exc)) == ["eval_sglang_overrides"]
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(None, T(rollout_num_gpus=2, debug_rollout_only=True, debug_train_only=True))
    assert "exclude each other" in problems_of(exc)["debug_train_only"]


def test_placeholder_only_model_reserves_gpus_without_a_router():
    s = spec(model("actor", group("regular", 4, gpe=2)), model("reserved", group("placeholder", 4)))
    plan = resolve_deployment(s, R())
    reserved = plan.model("reserved")
    assert reserved.engines == () and plan.total_gpus == 8
    assert (reserved.model_path, reserved.update_weights) == ("", False)  # nothing served, nothing updated
    # GPUs 4..7 are the placeholder's (colocated: rollout_offset 0), 0..1 the actor's first engine.
    placeholder = reserved.group("placeholder")
    assert (plan.rollout_offset + placeholder.gpu_offset, placeholder.num_gpus) == (4, 4)
    assert plan.model("actor").group("regular").engines[0].gpu_slots == (0, 1)


def test_trainer_inputs_from_a_sparse_config_and_a_miles_namespace():
    import argparse

    from omegaconf import OmegaConf

    from miles_sglang_plugin.config.reading import trainer_from_config

    t = trainer_from_config(OmegaConf.create({"hf_checkpoint": "/c", "colocate": True}))
    assert (t.hf_checkpoint, t.colocate, t.eval_sglang_overrides, t.rollout_num_gpus_per_engine) == (
        "/c",
        True,
        {},
        1,
    )
    ns = argparse.Namespace(
        hf_checkpoint="/c", rollout_num_gpus=8, rollout_num_gpus_per_engine=None, eval_num_gpus=None,
        eval_sglang_mem_fraction_static=0.5, eval_sglang_dp_size=None, sglang_config=None, eval_sglang_overrides=None,
    )  # fmt: skip
    t = TrainerInputs.from_namespace(ns)
    assert (t.rollout_num_gpus, t.rollout_num_gpus_per_engine, t.eval_num_gpus) == (8, 1, 0)
    assert dict(t.eval_sglang_overrides) == {"mem_fraction_static": 0.5}
