"""Resolution at the edges of its rules: the smallest valid values, the first engine that breaks a rule after
one that keeps it, one problem per group rather than per engine, and the exact fields of the plans that have
no engines. Numbers worked out by hand from Miles' rules (``tests/test_resolution.py`` has the main cases).

Rollout starts at GPU slot 0 here through ``debug_rollout_only`` (rollout_offset 0, no Megatron GPUs, so no
group needs offload): ``colocate`` would also start it at slot 0, but Miles' rule then sizes rollout to the
actor's GPUs (8 by default), which these small deployments do not hold."""

from __future__ import annotations

import dataclasses

import pytest

from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.planning.resolution import resolve_deployment
from tests.conftest import group, model, spec

HF = "/ckpt/actor"


def T(**kw) -> TrainerInputs:
    kw.setdefault("hf_checkpoint", HF)
    return TrainerInputs(**kw)


def problem_keys(exc: pytest.ExceptionInfo[DeploymentConfigError]) -> list[str]:
    return [p.key for p in exc.value.problems]


# ------------------------------------------------------------------------------------------- legacy
def test_legacy_deployment_of_one_gpu_and_an_eval_fleet_of_one_gpu():
    plan = resolve_deployment(None, T(rollout_num_gpus=1, eval_num_gpus=1, debug_rollout_only=True))
    assert [
        (m.name, m.is_eval, [(g.key, g.num_gpus, len(g.engines)) for g in m.groups]) for m in plan.models
    ] == [
        ("default", False, [("sglang.default.regular", 1, 1)]),
        ("eval", True, [("sglang.eval.regular", 1, 1)]),
    ]
    assert plan.source == "trainer arguments"
    assert plan.model("eval").update_weights is False and plan.model("default").update_weights is True


def test_legacy_prefill_servers_may_leave_a_single_decode_gpu():
    # 3 GPUs, 2 prefill servers of 1 GPU: 1 GPU is left for decode, which is enough.
    plan = resolve_deployment(
        None,
        T(rollout_num_gpus=3, rollout_num_gpus_per_engine=1, prefill_num_servers=2, debug_rollout_only=True),
    )
    assert [(g.key, g.num_gpus, len(g.engines)) for g in plan.model("default").groups] == [
        ("sglang.default.prefill", 2, 2),
        ("sglang.default.decode", 1, 1),
    ]


def test_legacy_problems_name_the_legacy_models_keys():
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(None, TrainerInputs(rollout_num_gpus=2, eval_num_gpus=2))  # no hf_checkpoint
    assert problem_keys(exc) == ["sglang.default.model_path", "sglang.eval.model_path"]
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(
            None, TrainerInputs(rollout_num_gpus=2, prefill_num_servers=1)
        )  # PD, no checkpoint
    assert problem_keys(exc) == ["sglang.default.model_path"]
    # prefill 1 x 2 GPUs leaves 3 for decode, which do not split into engines of 2
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(None, T(rollout_num_gpus=5, rollout_num_gpus_per_engine=2, prefill_num_servers=1))
    assert problem_keys(exc) == ["sglang.default.decode.num_gpus"]


def test_legacy_without_rollout_num_gpus_is_one_clear_problem():
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(None, T())
    assert problem_keys(exc) == ["rollout_num_gpus"]
    # >= 0: rollout_num_gpus=0 without a deployment is a plan without engines (newer Miles: no models).
    assert exc.value.problems[0].message == (
        "must be >= 0 when no sglang deployment is given (got None); set it, or choose a preset with "
        "sglang=<preset>"
    )


# ------------------------------------------------------------------------------------- engine ranks
def test_engine_ranks_and_ids_count_over_models_and_groups_and_placeholder_engines():
    # Miles' rank cursor: one rank per engine process; a placeholder group takes
    # num_gpus // min(num_gpus_per_engine, num_gpus_per_node) = 2 // min(1, 8) = 2 ranks (its engine size is
    # rollout_num_gpus_per_engine=1), and has no engines of its own. So prefill 0, 1; decode 2, 3; the
    # placeholder 4, 5; ref 6, 7.
    s = spec(
        model("actor", group("prefill", 2, gpe=1), group("decode", 4, gpe=2), group("placeholder", 2)),
        model("ref", group("regular", 2, gpe=1), path="/ref"),
    )
    plan = resolve_deployment(s, T(debug_rollout_only=True))
    engines = [e for m in plan.models for e in m.engines]
    assert [(e.id, e.model, e.group, e.index, e.rank) for e in engines] == [
        ("actor.prefill.0", "actor", "prefill", 0, 0),
        ("actor.prefill.1", "actor", "prefill", 1, 1),
        ("actor.decode.0", "actor", "decode", 0, 2),
        ("actor.decode.1", "actor", "decode", 1, 3),
        ("ref.regular.0", "ref", "regular", 0, 6),
        ("ref.regular.1", "ref", "regular", 1, 7),
    ]


# ----------------------------------------------------------------------------------------- models
def test_a_model_named_eval_is_an_ordinary_model_without_an_eval_fleet():
    plan = resolve_deployment(spec(model("eval", group("regular", 2))), T(debug_rollout_only=True))
    assert plan.model("eval").is_eval is False
    assert plan.model("eval").update_weights is True  # serves hf_checkpoint, like any model


def test_a_model_level_num_gpus_per_engine_of_one_is_valid():
    plan = resolve_deployment(spec(model("actor", group("regular", 2), gpe=1)), T(debug_rollout_only=True))
    assert [e.gpu_slots for e in plan.model("actor").engines] == [(0,), (1,)]


def test_regular_mixed_with_only_prefill_or_only_decode_is_both_problems():
    for wt, missing in (("prefill", "decode"), ("decode", "prefill")):
        s = spec(model("actor", group("regular", 2), group(wt, 2)))
        with pytest.raises(DeploymentConfigError) as exc:
            resolve_deployment(s, T(debug_rollout_only=True))
        assert problem_keys(exc) == ["sglang.actor", "sglang.actor"]
        mixed, unpaired = (p.message for p in exc.value.problems)
        assert mixed.startswith("mixes regular groups with prefill/decode groups")
        assert unpaired == f"has {wt} groups but no {missing} group; PD disaggregation needs both"


def test_a_bad_num_gpus_per_engine_is_reported_once_at_the_level_that_set_it():
    # A group's value is reported at the group ...
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 2, gpe=0))), T(debug_rollout_only=True))
    assert [(p.key, p.message) for p in exc.value.problems] == [
        ("sglang.actor.regular.num_gpus_per_engine", "must be an integer >= 1, got 0")
    ]
    # ... a model's at the model only (the group then counts engines of 1 GPU: 3 GPUs are 3 whole engines).
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 3), gpe=0)), T(debug_rollout_only=True))
    assert problem_keys(exc) == ["sglang.actor.num_gpus_per_engine"]


def test_groups_without_engines_report_one_engine_wide_sizes():
    s = spec(model("actor", group("regular", 4, gpe=2), group("placeholder", 2, gpe=2)))
    plan = resolve_deployment(s, T(debug_rollout_only=True))
    assert [(g.name, g.tp_size, g.pp_size, g.dp_size) for g in plan.model("actor").groups] == [
        ("regular", 2, 1, 1),
        ("placeholder", 2, 1, 1),
    ]


def test_an_eval_fleet_with_the_rollout_tp_keeps_its_parallel_sizes():
    # The dp/pp/ep/attn_cp resets to 1 apply only when eval_num_gpus_per_engine differs from
    # rollout_num_gpus_per_engine; eval_num_gpus_per_engine defaults to 1 (Miles), so it is given as 2 here.
    s = spec(model("actor", group("regular", 4)), model("eval", group("regular", 2)))
    t = T(debug_rollout_only=True, rollout_num_gpus_per_engine=2, eval_num_gpus=2, eval_num_gpus_per_engine=2)
    overrides = resolve_deployment(s, t).model("eval").groups[0].overrides
    assert dict(overrides) == {
        "model_path": HF,
        "enable_return_routed_experts": False,
        "enable_return_indexer_topk": False,
    }


def test_an_unknown_key_without_close_fields_gets_no_suggestion():
    s = spec(model("actor", group("regular", 2, zzz=1)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(
            s, T(debug_rollout_only=True), server_arg_fields={"mem_fraction_static", "tp_size"}
        )
    assert [(p.key, p.message) for p in exc.value.problems] == [
        ("sglang.actor.regular.overrides.zzz", "is not a ServerArgs field of the installed SGLang")
    ]


# ----------------------------------------------------------------------------------------- overrides
def test_a_field_given_twice_does_not_hide_the_problems_of_the_keys_after_it():
    s = spec(
        model(
            "actor",
            group("regular", 2, **{"mem-fraction-static": 0.8, "mem_fraction_static": 0.7, "port": 1}),
        )
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, T(debug_rollout_only=True))
    assert problem_keys(exc) == [
        "sglang.actor.regular.overrides.mem_fraction_static",
        "sglang.actor.regular.overrides.port",
    ]
    assert "the same ServerArgs field as 'mem-fraction-static'" in exc.value.problems[0].message


def test_a_field_given_twice_in_server_defaults_or_eval_overrides_is_reported_at_its_own_key():
    # At the key of the mapping it was written in plus the second spelling, as a group override's is
    # (sglang.<model>.<group>.overrides.<field>, above); these two mappings have no ".overrides" level.
    s = spec(model("actor", group("regular", 2)), model("eval", group("regular", 2)))
    t = T(debug_rollout_only=True, eval_num_gpus=2, eval_sglang_overrides={"dp-size": 1, "dp_size": 1})
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, t, server_defaults={"chunked-prefill-size": 8, "chunked_prefill_size": 8})
    assert [(p.key, p.message) for p in exc.value.problems] == [
        (
            "sglang_deploy.server_defaults.chunked_prefill_size",
            "the same ServerArgs field as 'chunked-prefill-size'; give it once",
        ),
        ("eval_sglang_overrides.dp_size", "the same ServerArgs field as 'dp-size'; give it once"),
    ]


@pytest.mark.parametrize("pp_size", [0, "2", 3])
def test_a_bad_pp_size_is_its_only_problem(pp_size):
    # tp_size=4 agrees with num_gpus_per_engine=4 once the bad pp_size is set aside (taken as 1).
    s = spec(model("actor", group("regular", 4, gpe=4, pp_size=pp_size, tp_size=4)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, T(debug_rollout_only=True))
    assert problem_keys(exc) == ["sglang.actor.regular.overrides.pp_size"]


def test_disaggregation_mode_may_repeat_what_the_worker_type_implies():
    # SGLang's value for a regular engine is "null"; a prefill or decode group's is its own type.
    s = spec(
        model(
            "actor",
            group("prefill", 2, disaggregation_mode="prefill"),
            group("decode", 2, disaggregation_mode="decode"),
        ),
        model("ref", group("regular", 2, disaggregation_mode="null"), path="/ref"),
    )
    assert [g.worker_type.value for _, g in resolve_deployment(s, T(debug_rollout_only=True)).groups()] == [
        "prefill",
        "decode",
        "regular",
    ]
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(
            spec(model("actor", group("regular", 2, disaggregation_mode="prefill"))),
            T(debug_rollout_only=True),
        )
    assert problem_keys(exc) == ["sglang.actor.regular.overrides.disaggregation_mode"]
    assert "contradicts worker_type 'regular' (which implies 'null')" in exc.value.problems[0].message


def test_dp_and_ep_sizes_from_a_group_override_are_bounded_by_the_engine():
    s = spec(
        model("actor", group("regular", 8, gpe=4, pp_size=2, dp_size=2, ep_size=4, enable_dp_attention=True))
    )
    g = resolve_deployment(s, T(debug_rollout_only=True)).model("actor").groups[0]
    assert (g.tp_size, g.pp_size, g.dp_size) == (2, 2, 2)
    assert all(type(size) is int for size in (g.tp_size, g.pp_size, g.dp_size))  # printed as 2, not 2.0
    for bad in (
        {"dp_size": 5},
        {"dp_size": 0},
        {"dp_size": "2"},
        {"ep_size": 5},
        {"ep_size": 0},
        {"ep_size": "2"},
    ):
        with pytest.raises(DeploymentConfigError) as exc:
            resolve_deployment(
                spec(model("actor", group("regular", 4, gpe=4, **bad))), T(debug_rollout_only=True)
            )
        ((name, value),) = bad.items()
        assert [(p.key, p.message) for p in exc.value.problems] == [
            (
                f"sglang.actor.regular.overrides.{name}",
                f"must be an integer between 1 and num_gpus_per_engine=4, got {value!r}",
            )
        ]


def test_a_bad_eval_override_is_reported_at_eval_sglang_overrides():
    s = spec(model("actor", group("regular", 4)), model("eval", group("regular", 2)))
    t = T(
        debug_rollout_only=True,
        eval_num_gpus=2,
        eval_num_gpus_per_engine=2,
        eval_sglang_overrides={"dp_size": 5},
    )
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, t)
    assert problem_keys(exc) == ["eval_sglang_overrides.dp_size"]


# --------------------------------------------------------------------------------- engine placement
def test_a_node_wide_engine_may_not_straddle_two_nodes():
    # num_gpus_per_node=4: the placeholder takes slots 0-1, so the 4-GPU engine would take slots 2..5.
    s = spec(model("actor", group("placeholder", 2), group("regular", 4, gpe=4)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, T(debug_rollout_only=True, num_gpus_per_node=4))
    assert problem_keys(exc) == ["sglang.actor.regular"]
    assert "slots 2..5" in exc.value.problems[0].message


def test_an_engine_that_straddles_after_one_that_fits_is_reported():
    # num_gpus_per_node=3, engines of 2: slots 0-1 fit on node 0, slots 2-3 cross into node 1.
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(
            spec(model("actor", group("regular", 6, gpe=2))), T(debug_rollout_only=True, num_gpus_per_node=3)
        )
    assert problem_keys(exc) == ["sglang.actor.regular"]
    assert "engine 1 would take GPU slots 2..3" in exc.value.problems[0].message


def test_a_misplaced_group_is_reported_once_not_once_per_engine():
    # num_gpus_per_node=4, after a 1-GPU placeholder: engines at 1-2, 3-4 (crosses), 5-6, 7-8 (crosses).
    s = spec(model("actor", group("placeholder", 1), group("regular", 8, gpe=2)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, T(debug_rollout_only=True, num_gpus_per_node=4))
    assert problem_keys(exc) == ["sglang.actor.regular"]
    # Multi-node engines of 8 on nodes of 4, after a 2-GPU placeholder: both start mid-node (slots 2 and 10).
    s = spec(model("actor", group("placeholder", 2), group("regular", 16, gpe=8)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, T(debug_rollout_only=True, num_gpus_per_node=4))
    assert problem_keys(exc) == ["sglang.actor.regular"]
    assert "starts at GPU slot 2" in exc.value.problems[0].message


def test_gpus_that_do_not_split_into_engines_are_one_problem_not_also_a_misplaced_engine():
    # Nodes of 2 after a 1-GPU placeholder: 3 GPUs in engines of 2 do not split; no engine is placed at all
    # (the first would otherwise straddle slots 1..2).
    s = spec(model("actor", group("placeholder", 1), group("regular", 3, gpe=2)))
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(s, T(debug_rollout_only=True, num_gpus_per_node=2))
    assert problem_keys(exc) == ["sglang.actor.regular.num_gpus"]


def test_an_engine_of_partial_nodes_is_one_problem():
    # 12-GPU engines on 8-GPU nodes: refused for the width alone, not also for where the second would start.
    with pytest.raises(DeploymentConfigError) as exc:
        resolve_deployment(spec(model("actor", group("regular", 24, gpe=12))), T(debug_rollout_only=True))
    assert problem_keys(exc) == ["sglang.actor.regular.num_gpus_per_engine"]


# ------------------------------------------------------------------------------------- no engines
def test_the_debug_train_only_plan_keeps_the_trainers_placement():
    t = T(debug_train_only=True, actor_num_nodes=2, actor_num_gpus_per_node=4)
    plan = resolve_deployment(spec(model("actor", group("regular", 8))), t)
    # The plan holds the trainer's inputs after Miles' rules: without colocate an unset offload_rollout is off
    # (a plain default, not noted); debug_train_only sets rollout_num_gpus to 0 (Miles' later refactor);
    # nothing else changes. Megatron: the actor's 2 x 4 = 8 GPUs.
    assert plan.trainer == dataclasses.replace(t, offload_rollout=False, rollout_num_gpus=0)
    assert (plan.total_gpus, plan.rollout_num_gpus, plan.rollout_offset, plan.megatron_num_gpus) == (
        0,
        0,
        0,
        8,
    )
    assert plan.source == "test"
    assert len(plan.notes) == 1 and "debug_train_only" in plan.notes[0]
    assert resolve_deployment(None, t).source == "trainer arguments"
