"""Launch specs as data (``rendering/launch_specs.py``): the ``plan --json`` entries of an engine process and
a router field by field, and the stand-in's fault variables per engine. Values worked out by hand from the
defaults: ports from 15000 (the router's two first, then the engine's), host 127.0.0.1, policy cache_aware."""

from __future__ import annotations

from miles_sglang_plugin.app.hydra_edge import prepare_from_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.config.reading import deploy_settings_from_config
from miles_sglang_plugin.rendering.launch_specs import standin_fault_env


def test_plan_json_entries_of_an_engine_process_and_its_router():
    prep = prepare_from_config(
        compose_config(["hf_checkpoint=/c", "colocate=true", "sglang.actor.regular.num_gpus=1"])
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
        "policy": "cache_aware",
        "workers": [{"url": "http://127.0.0.1:15002", "worker_type": "regular", "bootstrap_port": None}],
    }


def test_only_node_rank_0_of_a_multi_node_engine_has_a_url():
    prep = prepare_from_config(
        compose_config(
            [
                "hf_checkpoint=/c",
                "colocate=true",
                "sglang.actor.regular.num_gpus=16",
                "sglang.actor.regular.num_gpus_per_engine=16",
            ]
        )
    )
    launches = prep.to_dict()["models"]["actor"]["groups"]["regular"]["engines"][0]["launch"]
    assert [(entry["name"], entry["node_rank"], entry["url"]) for entry in launches] == [
        ("actor.regular.0.node0", 0, f"http://127.0.0.1:{launches[0]['port']}"),
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
