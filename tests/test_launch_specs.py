"""Launch specs as data (``rendering/launch_specs.py``): the ``plan --json`` entries of an engine process and
a router field by field, and the stand-in's fault variables per engine. Values worked out by hand from the
defaults: ports from 15000 (the router's two first, then the engine's), host 127.0.0.1, policy cache_aware.

Rollout starts at GPU slot 0 through ``debug_rollout_only`` where the test is not about colocation (Miles'
colocate rule sizes rollout to the actor's GPUs, 8 by default, and turns offload on); the tests of what
colocation changes keep ``colocate`` and size the actor to the deployment."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.app.hydra_edge import prepare_from_config, resolve_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.reading import deploy_settings_from_config
from miles_sglang_plugin.rendering.launch_specs import (
    check_deploy_settings,
    render_launch,
    server_args_to_argv,
    standin_fault_env,
)
from miles_sglang_plugin.rendering.ports import assign_ports
from miles_sglang_plugin.rendering.prepared import prepare_deployment

ONE_ENGINE = ["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=1"]


def test_the_whole_command_line_of_one_engine():
    # docs/render.md "The command line of an engine": seed 1234 + rank 0; ports: router 15000-15001, engine http 15002,
    # nccl 15003, a dist-init run of 31 from 15004, the engine-info bootstrap port after it (15035).
    (launch,) = prepare_from_config(compose_config(ONE_ENGINE)).launch.engines
    assert (launch.model, launch.group, launch.engine_id) == ("actor", "regular", "actor.regular.0")
    assert launch.argv == (
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/c", "--trust-remote-code",
        "--random-seed", "1234", "--host", "127.0.0.1", "--port", "15002", "--nccl-port", "15003",
        "--dist-init-addr", "127.0.0.1:15004", "--nnodes", "1", "--node-rank", "0", "--base-gpu-id", "0",
        "--gpu-id-step", "1", "--tp-size", "1", "--skip-server-warmup", "--enable-metrics",
        "--enable-draft-weights-cpu-backup", "--engine-info-bootstrap-port", "15035",
    )  # fmt: skip


def test_the_command_line_of_one_colocated_engine_adds_what_miles_derives():
    # Colocated with a 1-GPU actor (actor_num_nodes=1 x actor_num_gpus_per_node=1 = rollout_num_gpus=1):
    # offload_rollout turns on, and the engine's GPU (slot 0) is below Megatron's 1 GPU, so it needs offload:
    # --enable-memory-saver in the plan's place (after --tp-size). cuda_graph_backend_prefill=disabled is
    # Miles' colocate default, the lowest layer, so its flag comes first.
    cfg = compose_config(["hf_checkpoint=/c", "colocate=true", "actor_num_gpus_per_node=1",
                          "sglang.actor.regular.num_gpus=1"])  # fmt: skip
    (launch,) = prepare_from_config(cfg).launch.engines
    assert launch.argv == (
        sys.executable, "-m", "sglang.launch_server", "--cuda-graph-backend-prefill", "disabled",
        "--model-path", "/c", "--trust-remote-code", "--random-seed", "1234", "--host", "127.0.0.1",
        "--port", "15002", "--nccl-port", "15003", "--dist-init-addr", "127.0.0.1:15004", "--nnodes", "1",
        "--node-rank", "0", "--base-gpu-id", "0", "--gpu-id-step", "1", "--tp-size", "1",
        "--enable-memory-saver", "--skip-server-warmup", "--enable-metrics",
        "--enable-draft-weights-cpu-backup", "--engine-info-bootstrap-port", "15035",
    )  # fmt: skip


def test_server_args_become_flags_by_type():
    values = {"c": [1, 2], "a_b": {"x": [1]}, "d": True, "e": False, "f": None, "g": 3}
    assert server_args_to_argv(values) == ["--c", "1", "2", "--a-b", '{"x": [1]}', "--d", "--g", "3"]


def test_server_defaults_in_dash_spelling_are_the_same_fields_and_below_group_overrides():
    prep = prepare_from_config(compose_config([*ONE_ENGINE, "+sglang_deploy.server_defaults.mem-fraction-static=0.8",
                                               "+sglang.actor.regular.overrides.mem_fraction_static=0.7"]))  # fmt: skip
    (launch,) = prep.launch.engines
    assert launch.server_args["mem_fraction_static"] == 0.7
    assert [key for key in launch.server_args if "fraction" in key] == ["mem_fraction_static"]  # one field
    assert launch.argv.count("--mem-fraction-static") == 1
    settings = deploy_settings_from_config(compose_config(["+sglang_deploy.server_defaults.random-seed=1"]))
    assert [(p.key, p.message) for p in check_deploy_settings(settings, None)] == [
        ("sglang_deploy.server_defaults.random-seed", "cannot be set deployment-wide: each engine gets the trainer's seed + its rank")
    ]  # fmt: skip


def test_server_defaults_keys_and_port_base_bounds_are_checked():
    settings = deploy_settings_from_config(
        compose_config(["+sglang_deploy.server_defaults.mem_fraction_statc=1"])
    )
    assert [p.key for p in check_deploy_settings(settings, {"mem_fraction_static"})] == [
        "sglang_deploy.server_defaults.mem_fraction_statc"
    ]
    # Each bound is its own problem: both ports integers >= 1024 (port_base below the ephemeral range, 32768;
    # port_max a port), then port_base below port_max (checked only when both are in range).
    base, top = "sglang_deploy.launch.port_base", "sglang_deploy.launch.port_max"
    low = "must be an integer in 1024..32766 (ports are handed out below the ephemeral range, 32768), got"
    high = "must be an integer in 1024..65535 (above 32767 it means 32767), got"
    for port_base, port_max, expected in (
        (1024, 2000, []),
        (1023, 2000, [(base, f"{low} 1023")]),
        (2000, 2000, [(base, "2000 must be below port_max=2000")]),
        (80, 70, [(base, f"{low} 80"), (top, f"{high} 70")]),
        (32766, 65535, []),
        (32767, 65536, [(base, f"{low} 32767"), (top, f"{high} 65536")]),
    ):
        launch = replace(settings.launch, port_base=port_base, port_max=port_max)
        problems = check_deploy_settings(replace(settings, server_defaults={}, launch=launch), None)
        assert [(p.key, p.message) for p in problems] == expected, port_base


def test_router_settings_are_checked_and_reach_the_router_spec():
    settings = deploy_settings_from_config(compose_config(["sglang_deploy.router.policy=nope"]))
    ((key, message),) = [(p.key, p.message) for p in check_deploy_settings(settings, None)]
    assert key == "sglang_deploy.router" and "'nope'" in message
    prep = prepare_from_config(compose_config([*ONE_ENGINE, "sglang_deploy.router.policy=round_robin"]))
    assert prep.launch.routers[0].spec.settings.policy == "round_robin"


def test_miles_values_for_fields_sglang_may_lack_are_rendered_without_a_field_list():
    cfg = compose_config(
        ["sglang=pd", "hf_checkpoint=/c", "debug_rollout_only=true", "use_rollout_indexer_replay=true"]
    )
    prep = prepare_deployment(
        resolve_config(cfg), deploy_settings_from_config(cfg)
    )  # no field list: all kept
    decode = next(e for e in prep.launch.engines if e.worker_type.value == "decode")
    assert decode.server_args["prefill_round_robin_balance"] is True
    assert decode.server_args["enable_return_indexer_topk"] is True


def test_custom_all_reduce_is_off_only_for_colocated_multi_gpu_engines():
    # Miles: SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=0 when colocated with engines of more than one GPU. Colocated,
    # the actor is sized to the deployment's 2 GPUs (1 node x 2; Miles sets rollout_num_gpus to them);
    # debug_rollout_only turns colocate off (Miles' rule), so its engines keep the custom all-reduce.
    colocated = ["colocate=true", "actor_num_gpus_per_node=2"]
    cases = (
        (colocated, 2, "0"),
        (colocated, 1, "1"),
        ([], 2, "1"),
        ([*colocated, "debug_rollout_only=true"], 2, "1"),
    )
    for extra, gpe, expected in cases:
        cfg = compose_config(["hf_checkpoint=/c", "sglang.actor.regular.num_gpus=2",
                              f"sglang.actor.regular.num_gpus_per_engine={gpe}", *extra])  # fmt: skip
        prep = prepare_deployment(resolve_config(cfg), deploy_settings_from_config(cfg))
        assert prep.launch.engines[0].env["SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2"] == expected, (extra, gpe)


def test_each_process_of_a_multi_node_engine_binds_its_own_node_and_shares_the_first_nodes_address():
    cfg = compose_config(["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=16",
                          "sglang.actor.regular.num_gpus_per_engine=16"])  # fmt: skip
    plan, settings = resolve_config(cfg), deploy_settings_from_config(cfg)
    hosts = {0: "10.0.0.1", 1: "10.0.0.2"}
    ports = assign_ports(plan, host_of_node=hosts.__getitem__, router_host="10.0.0.9", port_base=15000)
    first, second = render_launch(
        plan, settings, ports, host_of_node=hosts.__getitem__, router_host="10.0.0.9"
    ).engines
    assert (first.host, second.host) == ("10.0.0.1", "10.0.0.2")
    assert first.server_args["dist_init_addr"] == second.server_args["dist_init_addr"] == "10.0.0.1:15002"


def test_plan_json_entries_of_an_engine_process_and_its_router(test_gateway):
    prep = prepare_from_config(
        compose_config(["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=1"])
    )
    actor = prep.to_dict()["models"]["actor"]
    (launch,) = actor["groups"]["regular"]["engines"][0]["launch"]
    assert {key: value for key, value in launch.items() if key not in ("argv", "env")} == {
        "name": "actor.regular.0",
        "node": 0,
        "node_rank": 0,
        "host": "127.0.0.1",
        "port": 15002,
        "url": "http://127.0.0.1:15002",
        "bootstrap_port": None,
    }
    assert launch["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert launch["argv"][launch["argv"].index("--port") + 1] == "15002"
    assert actor["router"] == {
        "url": "http://127.0.0.1:15000",
        "prometheus_port": 15001,
        "pd_disaggregation": False,
        "gateway": test_gateway,  # auto: the suite's gateway ($MSP_ROUTER_GATEWAY)
        "policy": "cache_aware",
        "dp_aware": False,  # no DP attention
        "workers": [
            {
                "url": "http://127.0.0.1:15002",
                "worker_type": "regular",
                "bootstrap_port": None,
                # debug_rollout_only: nothing trains, so nothing offloads; /c is hf_checkpoint: it gets weights
                "labels": {
                    "model": "actor",
                    "group": "regular",
                    "worker_type": "regular",
                    "engine_id": "actor.regular.0",
                    "needs_offload": "false",
                    "update_weights": "true",
                },
            }
        ],
    }


def test_only_node_rank_0_of_a_multi_node_engine_has_a_url():
    prep = prepare_from_config(
        compose_config(
            [
                "hf_checkpoint=/c",
                "debug_rollout_only=true",
                "sglang.actor.regular.num_gpus=16",
                "sglang.actor.regular.num_gpus_per_engine=16",
            ]
        )
    )
    launches = prep.to_dict()["models"]["actor"]["groups"]["regular"]["engines"][0]["launch"]
    # Real engines over two nodes: the plan writes each node's address as "<node N address>" (the launch
    # decides it) and counts ports per node, so node 0's engine has the first port, 15000 (the router's
    # ports are the driver's).
    assert [(entry["name"], entry["node_rank"], entry["url"]) for entry in launches] == [
        ("actor.regular.0.node0", 0, "http://<node 0 address>:15000"),
        ("actor.regular.0.node1", 1, None),
    ]


def test_standin_faults_reach_the_engines_their_patterns_match():
    settings = deploy_settings_from_config(
        compose_config(
            [
                "hf_checkpoint=/c",
                "sglang_deploy=simulated",
                "sglang_deploy.standin.start_delay_s=2.5",
                "sglang_deploy.standin.fail_at_start=[actor.prefill.*]",
                "sglang_deploy.standin.never_healthy=['*.decode.1']",
                "+sglang_deploy.standin.die_after_s={actor.*: 3.5}",
            ]
        )
    )
    assert standin_fault_env(settings, "actor.decode.1") == {
        "MSP_STANDIN_START_DELAY_S": "2.5",
        "MSP_STANDIN_NEVER_HEALTHY": "1",
        "MSP_STANDIN_DIE_AFTER_S": "3.5",
    }
    assert standin_fault_env(settings, "actor.prefill.0") == {
        "MSP_STANDIN_START_DELAY_S": "2.5",
        "MSP_STANDIN_FAIL_AT_START": "1",
        "MSP_STANDIN_DIE_AFTER_S": "3.5",
    }
    assert standin_fault_env(settings, "ref.regular.0") == {"MSP_STANDIN_START_DELAY_S": "2.5"}


@pytest.mark.parametrize(
    "overrides",
    [
        ["sglang=pd_actor_ref", "hf_checkpoint=/c", "sglang.actor.decode.num_gpus=12"],
        ["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=16",
         "sglang.actor.num_gpus_per_engine=16"],
        ["sglang=placeholder", "hf_checkpoint=/c"],
        ["hf_checkpoint=/c", "+sglang_model@sglang.judge=base", "sglang.judge.model_path=/j",
         "sglang.judge.update_weights=false", "sglang.judge.regular.num_gpus=0",
         'sglang.judge.external=["http://10.0.0.5:30000"]'],
        ["hf_checkpoint=/c", "debug_train_only=true"],
        ["sglang=pd_actor_ref", "hf_checkpoint=/c", "sglang_deploy=simulated", "sglang_deploy.api_key=--sk-SECRET",
         "+sglang_deploy.env.HF_TOKEN=hf-SECRET", "sglang_deploy.standin.fail_at_start=[actor.decode.1]",
         "+sglang.actor.decode.overrides.served_model_name='名前 \"q\"'"],
    ],
    ids=["pd_actor_ref", "an engine over two nodes", "placeholder", "an external engine", "no engines",
         "stand-ins, a secret, a fault, a name to escape"],
)  # fmt: skip
def test_the_streamed_plan_json_is_the_plans_dictionary(overrides: list[str]) -> None:
    """``plan --json`` writes the document as it makes it (an engine per line): the same JSON as the plan's
    dictionary, whatever the plan holds, and each engine's line exactly as ``json.dumps`` writes its entry
    (though made from parts its group's template encoded once)."""
    import io
    import json

    prepared = prepare_from_config(compose_config(overrides))
    out = io.StringIO()
    prepared.write_json(out, server_args_checked_against="the table")
    data = prepared.to_dict()
    assert json.loads(out.getvalue()) == {
        **json.loads(json.dumps(data)),
        "server_args_checked_against": "the table",
    }
    expected = [
        json.dumps(engine)
        for model in data["models"].values()
        for engine in [
            *(e for g in model["groups"].values() for e in g["engines"]),
            *model.get("external", []),
        ]
    ]
    lines = [line.strip().rstrip(",") for line in out.getvalue().splitlines()]
    assert sorted(line for line in lines if line.startswith('{"id": ')) == sorted(expected)  # one line each
    assert "SECRET" not in out.getvalue()


def test_a_plan_value_holding_nul_still_streams_exact_json():
    """Where a process's command line and environment go in its engine's line is found by a NUL placeholder; a
    plan value that holds a NUL itself (here a node's address) gets the line encoded whole instead."""
    import io
    import json

    from miles_sglang_plugin.rendering.server_arg_fields import shipped_server_arg_fields

    cfg = compose_config(["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=2"])
    prepared = prepare_deployment(
        resolve_config(cfg),
        deploy_settings_from_config(cfg),
        host_of_node=lambda _node: "h\0st",
        server_arg_fields=shipped_server_arg_fields(),
    )
    out = io.StringIO()
    prepared.write_json(out)
    lines = [line.strip().rstrip(",") for line in out.getvalue().splitlines() if '{"id": ' in line]
    engines = prepared.to_dict()["models"]["actor"]["groups"]["regular"]["engines"]
    assert lines == [json.dumps(engine) for engine in engines]
    assert json.loads(lines[0])["launch"][0]["host"] == "h\0st"


def test_worker_registrations_carry_the_plans_labels():
    # Colocated actor of 1 node x 2 GPUs, eval fleet of 2: rollout_offset 0, Megatron on slots 0-1. actor.regular
    # starts at slot 0 < 2 (needs offload), eval.regular at slot 2 (does not); eval gets no weights (Miles), the
    # actor does (its path is hf_checkpoint). The actor's external engine holds no GPU: never offloaded.
    from miles_sglang_plugin.config.deployment_spec import ExternalEngineSpec
    from miles_sglang_plugin.config.schema import SGLangDeployConf
    from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
    from miles_sglang_plugin.planning.resolution import resolve_deployment
    from miles_sglang_plugin.rendering.server_arg_fields import shipped_server_arg_fields
    from tests.conftest import group, model, spec

    actor = replace(
        model("actor", group("regular", 2)),
        external=(ExternalEngineSpec(url="http://10.0.0.5:30000", key="sglang.actor.external[0]"),),
    )
    trainer = TrainerInputs(hf_checkpoint="/c", actor_num_gpus_per_node=2, colocate=True, eval_num_gpus=2)
    plan = resolve_deployment(spec(actor, model("eval", group("regular", 2))), trainer)
    launch = prepare_deployment(
        plan, SGLangDeployConf(), server_arg_fields=shipped_server_arg_fields()
    ).launch
    labels = {router.model: [w.label_map for w in router.workers] for router in launch.routers}

    def expected(model: str, group: str, index: int, offload: str, weights: str) -> dict[str, str]:
        return {"model": model, "group": group, "worker_type": "regular", "engine_id": f"{model}.{group}.{index}",
                "needs_offload": offload, "update_weights": weights}  # fmt: skip

    assert labels == {
        "actor": [
            expected("actor", "regular", 0, "true", "true"),
            expected("actor", "regular", 1, "true", "true"),
            expected("actor", "external", 0, "false", "true"),
        ],
        "eval": [
            expected("eval", "regular", 0, "false", "false"),
            expected("eval", "regular", 1, "false", "false"),
        ],
    }
    router = launch.routers[0]
    assert router.registration("http://10.0.0.5:30000").label_map["engine_id"] == "actor.external.0"


@pytest.mark.parametrize("engine", ["sglang_deploy=default", "sglang_deploy=simulated"])
def test_a_printed_process_shows_its_command_line_and_environment_masked(engine: str) -> None:
    """Each process's printed argv and environment, made from its group's template masked once, are
    ``mask_argv`` and ``mask_env`` of its own: the API key and the values of ``sglang_deploy.env`` masked, its
    GPUs and the package's variables shown."""
    from miles_sglang_plugin.engine_env import PACKAGE_ENV_NAMES
    from miles_sglang_plugin.masking import mask_argv, mask_env

    cfg = compose_config(
        ["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=4", engine,
         "sglang_deploy.api_key=sk-SECRET", "+sglang_deploy.env.HF_TOKEN=hf-SECRET",
         "sglang_deploy.standin.fail_at_start=[actor.regular.1]"]
    )  # fmt: skip
    launches = prepare_from_config(cfg).launch.engines
    assert len(launches) == 4
    for launch in launches:
        shown = launch.to_dict()
        assert shown["argv"] == mask_argv(launch.argv) and "sk-SECRET" not in str(shown)
        assert shown["env"] == mask_env(launch.env, shown=PACKAGE_ENV_NAMES)
        assert (
            shown["env"]["HF_TOKEN"] == "***"
            and shown["env"]["CUDA_VISIBLE_DEVICES"] == launch.visible_devices
        )
    faulty = [launch.to_dict()["env"].get("MSP_STANDIN_FAIL_AT_START") for launch in launches]
    assert faulty == ([None, "1", None, None] if engine.endswith("simulated") else [None] * 4)


_OWN_VALUES = st.one_of(
    st.integers(), st.text(), st.booleans(), st.none(), st.lists(st.integers(), max_size=3), st.floats()
)


@settings(max_examples=200, deadline=None)
@given(
    own=st.tuples(_OWN_VALUES, _OWN_VALUES), prefix_key=st.sampled_from(["--api-key", "--api-key=x", "--a"])
)
def test_a_process_line_from_encoded_parts_is_json_dumps_of_it(own: tuple[Any, Any], prefix_key: str) -> None:
    """A process's command line and environment as JSON text, from its template's parts encoded once, are
    ``json.dumps`` of the masked ones, whatever its own values (negative numbers, text to escape, flags)."""
    import json

    from miles_sglang_plugin.rendering.launch_specs import ProcessTemplate

    values = {"model_path": "/m 名", "host": None, "served_model_name": 'a"b', "port": None, "api_key": "k"}
    template = ProcessTemplate.of(
        ("python", prefix_key, "v"), {**values, "host": own[0], "port": own[1]}, ("host", "port"),
        {"A": "1"}, {"HF_TOKEN": "secret \\ \"", "CUDA_VISIBLE_DEVICES": "ignored"}, None,
    )  # fmt: skip
    assert template.masked_argv_json(own) == json.dumps(template.masked_argv(own))
    assert "k" not in json.loads(template.masked_argv_json(own))
    assert template.masked_env_json("actor.regular.0", "3,4") == json.dumps(template.masked_env("e", "3,4"))


@pytest.mark.parametrize(
    ("setting", "pd_off", "regular_off"),
    [
        # not set: a PD router counts a pair's failure against both workers, so one dead engine would open
        # every circuit of the other kind: off there; a regular router keeps it
        ([], True, False),
        (["sglang_deploy.router.disable_circuit_breaker=false"], False, False),
        (["sglang_deploy.router.disable_circuit_breaker=true"], True, True),
    ],
)
def test_the_circuit_breaker_is_off_for_a_pd_router_unless_set(setting, pd_off, regular_off):
    overrides = [
        "hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=0",
        "sglang.actor.prefill.num_gpus=1", "sglang.actor.decode.num_gpus=1", "+sglang_model@sglang.ref=base",
        "sglang.ref.regular.num_gpus=1", "sglang.ref.update_weights=false", *setting,
    ]  # fmt: skip
    prep = prepare_from_config(compose_config(overrides))
    by_model = {r.model: r.spec for r in prep.launch.routers}
    assert by_model["actor"].pd_disaggregation and not by_model["ref"].pd_disaggregation
    assert by_model["actor"].settings.router_args_kwargs()["disable_circuit_breaker"] is pd_off
    assert by_model["ref"].settings.router_args_kwargs()["disable_circuit_breaker"] is regular_off
