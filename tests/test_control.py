"""The control handle on a running deployment (stand-in engines, real sglang-routers): each operation reaches
exactly the engines the plan says and no other (checked in each engine's own record of the calls it got),
in parallel with one deadline, with one aggregated error naming every engine that failed.

The deployment, worked out by hand (colocate=true with a 4-GPU actor: Miles sets rollout_num_gpus to the actor's
4 GPUs and turns offload_rollout on; Megatron trains on slots 0-3, so a group needs offload iff its first slot
is below 4; the eval fleet, eval_num_gpus=1, comes after the rollout GPUs):

    actor (PD, update_weights: its path is hf_checkpoint)
        prefill  2 GPUs, 1 per engine  slots 0, 1   needs_offload   actor.prefill.0, actor.prefill.1
        decode   2 GPUs, 2 per engine  slots 2-3    needs_offload   actor.decode.0
    eval (the eval fleet: frozen)
        regular  1 GPU                 slot 4       no offload      eval.regular.0

Miles' weights update group over the actor's engines (``connect_rollout_engines_from_distributed``): the
trainer is rank 0, then each engine's GPUs in order: prefill.0 -> rank 1, prefill.1 -> rank 2, decode.0 ->
ranks 3-4; world_size = 1 + 1 + 2 + 1 = 5.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.backends.local import LocalBackend
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.serving.errors import ControlError, DeploymentStoppedError
from tests.launch_helpers import LeakTracker, compose, prepare_unprobed

OVERRIDES = [
    "debug_rollout_only=false",
    "colocate=true",
    "actor_num_gpus_per_node=4",
    "sglang.actor.regular.num_gpus=0",
    "sglang.actor.prefill.num_gpus=2",
    "sglang.actor.prefill.num_gpus_per_engine=1",
    "sglang.actor.decode.num_gpus=2",
    "sglang.actor.decode.num_gpus_per_engine=2",
    "eval_num_gpus=1",
    "+sglang_model@sglang.eval=base",
    "sglang.eval.regular.num_gpus=1",
    "sglang_deploy.lora.enabled=true",
    "sglang_deploy.lora.max_loras_per_batch=2",
    "sglang_deploy.standin.control_latency_s=0.3",
]
ALL = ["actor.prefill.0", "actor.prefill.1", "actor.decode.0", "eval.regular.0"]
ACTOR = ALL[:3]
PREFILL = ALL[:2]
OFFLOADED = ACTOR


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tracker = LeakTracker()
    with launch_from_config(compose(*OVERRIDES), log_dir=tmp_path_factory.mktemp("control") / "logs") as d:
        tracker.add_launcher(d)
        yield d
    tracker.assert_nothing_left()


def calls(d: Deployment, route: str) -> dict[str, list[dict]]:
    """engine id -> the bodies of ``route`` it received, from the engine's own record."""
    out = {}
    for engine in d.engines():
        record = httpx.get(engine.url + "/stand_in/stats", timeout=10).json()["control_calls"]
        out[engine.id] = [body for path, body in record if path == route]
    return out


def reached(d: Deployment, route: str, since: dict[str, int] | None = None) -> list[str]:
    got = calls(d, route)
    return [engine for engine, bodies in got.items() if len(bodies) > (since or {}).get(engine, 0)]


def counts(d: Deployment, route: str) -> dict[str, int]:
    return {engine: len(bodies) for engine, bodies in calls(d, route).items()}


def test_engines_with_the_plans_decisions(deployment: Deployment) -> None:
    infos = {e.id: e for e in deployment.control.engines()}
    assert list(infos) == ALL
    assert {e.id for e in deployment.control.engines(model="actor", group="prefill")} == set(PREFILL)
    assert [infos[e].needs_offload for e in ALL] == [True, True, True, False]
    assert [infos[e].update_weights for e in ALL] == [True, True, True, False]
    assert [infos[e].num_gpus for e in ALL] == [1, 1, 2, 1]
    assert [infos[e].gpus for e in ALL] == ["0", "1", "2,3", "4"]
    assert all(infos[e].serves_lora and infos[e].state == "serving" for e in ALL)
    with pytest.raises(ValueError, match=r"no model 'critic' in the deployment; models: actor, eval"):
        deployment.control.offload(model="critic")
    with pytest.raises(ValueError, match=r"no group 'regular' among actor; groups: decode, prefill"):
        deployment.control.offload(model="actor", group="regular")


def test_offload_and_onload_reach_exactly_the_groups_that_need_offload(deployment: Deployment) -> None:
    before = counts(deployment, "/release_memory_occupation")
    result = deployment.control.offload(["kv_cache", "cuda_graph"])
    assert (result.engines, result.skipped, result.deferred) == (
        tuple(OFFLOADED),
        ("eval.regular.0",),
        (),
    )
    assert reached(deployment, "/release_memory_occupation", before) == OFFLOADED
    for engine in deployment.engines():
        stats = httpx.get(engine.url + "/stand_in/stats", timeout=10).json()
        assert stats["released_memory_tags"] == (["cuda_graph", "kv_cache"] if engine.id in OFFLOADED else [])
    # The three engines were called at once: their 0.3 s each overlap.
    assert result.overlapped()
    # Each engine is sent what it released (resuming memory that is not released kills SGLang's scheduler; the
    # stand-in exits the same way: tests/test_engine_contract.py).
    onload = deployment.control.onload()
    assert onload.engines == tuple(OFFLOADED)
    assert all(
        calls(deployment, "/resume_memory_occupation")[e] == [{"tags": ["kv_cache", "cuda_graph"]}]
        for e in OFFLOADED
    )


def test_weight_updates_reach_only_the_model_that_receives_them(deployment: Deployment) -> None:
    result = deployment.control.update_weights_from_disk("/ckpt/step1", weight_version="1")
    assert result.engines == tuple(ACTOR) and result.skipped == ("eval.regular.0",)
    assert calls(deployment, "/update_weights_from_disk")["eval.regular.0"] == []
    assert calls(deployment, "/update_weights_from_disk")["actor.decode.0"][-1] == {
        "model_path": "/ckpt/step1",
        "abort_all_requests": False,
        "flush_cache": True,
        "weight_version": "1",
    }
    assert deployment.control.weight_versions() == {**dict.fromkeys(ACTOR, "1"), "eval.regular.0": "default"}
    out = httpx.post(
        deployment.registry.get_model_url("actor"),
        json={"text": "a b c", "sampling_params": {"max_new_tokens": 2}},
        timeout=10,
    ).json()
    assert out["meta_info"]["weight_version"] == "1"
    assert deployment.control.update_weight_version("1.1").engines == tuple(ACTOR)
    assert deployment.control.weight_versions(model="actor") == dict.fromkeys(ACTOR, "1.1")


def test_weights_update_group_ranks_as_miles_computes_them(deployment: Deployment) -> None:
    group = deployment.control.weight_update_group("10.0.0.1", 29500, group_name="miles-pp_0")
    assert group.world_size == 5
    assert [(r.engine, r.rank_offset, r.num_gpus) for r in group.ranks] == [
        ("actor.prefill.0", 1, 1),
        ("actor.prefill.1", 2, 1),
        ("actor.decode.0", 3, 2),
    ]
    # Started in the background (real engines answer once the trainer, rank 0, has joined), then awaited.
    future = deployment.control.background.init_weights_update_group(
        "10.0.0.1", 29500, group_name="miles-pp_0"
    )
    result = future.result(timeout=30)
    assert result.group == group and result.engines == tuple(ACTOR)
    bodies = calls(deployment, "/init_weights_update_group")
    assert bodies["eval.regular.0"] == []
    assert [(bodies[e][-1]["rank_offset"], bodies[e][-1]["world_size"]) for e in ACTOR] == [
        (1, 5),
        (2, 5),
        (3, 5),
    ]
    assert bodies["actor.decode.0"][-1] == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 3,
        "world_size": 5,
        "group_name": "miles-pp_0",
        "backend": "nccl",
    }
    assert deployment.control.engines_outside_weight_group("miles-pp_0") == ()
    update = deployment.control.update_weights_from_distributed(
        ["lm_head.weight"], ["torch.bfloat16"], [[8, 4]], group_name="miles-pp_0", weight_version="2"
    )
    assert update.engines == tuple(ACTOR)
    assert deployment.control.weight_versions(model="actor") == dict.fromkeys(ACTOR, "2")
    assert deployment.control.destroy_weights_update_group("miles-pp_0").engines == tuple(ACTOR)


def test_pause_continue_flush_abort_reach_every_engine_or_the_ones_asked(deployment: Deployment) -> None:
    before = counts(deployment, "/pause_generation")
    assert deployment.control.pause_generation().engines == tuple(ALL)
    assert [calls(deployment, "/pause_generation")[e][-1] for e in ALL] == [{"mode": "retract"}] * 4
    assert deployment.control.continue_generation().engines == tuple(ALL)
    assert deployment.control.pause_generation("in_place", model="eval").engines == ("eval.regular.0",)
    assert reached(deployment, "/pause_generation", before) == ALL  # eval twice, the others once
    assert counts(deployment, "/pause_generation")["eval.regular.0"] == before["eval.regular.0"] + 2
    assert deployment.control.continue_generation(model="eval", group="regular").engines == (
        "eval.regular.0",
    )
    assert deployment.control.flush_cache().ok
    before = counts(deployment, "/abort_request")
    assert deployment.control.abort_all(model="actor").engines == tuple(ACTOR)
    assert reached(deployment, "/abort_request", before) == ACTOR


def test_query_every_engine(deployment: Deployment) -> None:
    result = deployment.control.query("/model_info", model="actor", group="prefill")
    assert result.engines == tuple(PREFILL)
    assert [reply.body["is_generation"] for reply in result.replies] == [True, True]
    metrics = deployment.control.query("/metrics")
    assert all("sglang:num_requests_total" in reply.body for reply in metrics.replies)
    with pytest.raises(ValueError, match="route must start with '/'"):
        deployment.control.query("metrics")


def test_lora_adapters_on_running_engines(deployment: Deployment) -> None:
    assert deployment.control.load_lora_adapter("math", "/lora/math").engines == tuple(ALL)
    for engine in deployment.engines():
        models = httpx.get(engine.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models[1:]] == ["math"]
    assert deployment.control.unload_lora_adapter("math", model="actor").engines == tuple(ACTOR)
    assert deployment.control.unload_lora_adapter("math", model="eval").ok


def wait_serving(d: Deployment, timeout_s: float = 30) -> None:
    """Until every engine serves with nothing under way (a heal of engines that disagreed is done)."""
    deadline = time.monotonic() + timeout_s
    while not all(r.state.value == "serving" and not r.pending for r in d.fleet.engines()):
        assert time.monotonic() < deadline, [
            (r.id, r.state.value, sorted(r.pending)) for r in d.fleet.engines()
        ]
        time.sleep(0.05)


def test_one_aggregated_error_names_each_failed_engine(deployment: Deployment) -> None:
    """The prefill engines, their weights released, refuse weights from disk; the decode engine takes them.
    The error names each prefill engine; since one engine took the weights, the prefill engines disagree with
    the ledger: each is reported and brought there by replay (weights resumed, loaded, released again), so
    the model's engines end with the same weights and the prefill engines' memory still released."""
    since = len(deployment.events())
    deployment.control.offload(
        ["weights"], group="prefill"
    )  # the prefill engines now refuse weights from disk
    with pytest.raises(ControlError) as exc:
        deployment.control.update_weights_from_disk("/ckpt/step3", weight_version="3")
    message = str(exc.value)
    assert message.startswith("update_weights_from_disk failed on 2 of 3 engine(s):")
    assert "actor.prefill.0" in message and "actor.prefill.1" in message and "actor.decode.0" not in message
    assert "weights are released" in message
    assert [r.engine for r in exc.value.result.failed] == PREFILL
    for engine in PREFILL:
        deployment.wait_for_event("engine_diverged", subject=engine, since=since, timeout_s=60)
    wait_serving(deployment)
    assert deployment.control.weight_versions(model="actor") == dict.fromkeys(ACTOR, "3")
    for engine in PREFILL:  # healed in the order SGLang needs, and released again afterwards
        record = httpx.get(deployment.fleet.engine(engine).url + "/stand_in/stats", timeout=10).json()
        routes = [route for route, _body in record["control_calls"]][-5:]
        assert routes == [
            "/release_memory_occupation",
            "/update_weights_from_disk",  # refused: its weights were released
            "/resume_memory_occupation",
            "/update_weights_from_disk",
            "/release_memory_occupation",
        ]
    result = deployment.control.update_weights_from_disk("/ckpt/step4", check=False)
    assert [r.ok for r in result.replies] == [False, False, True]
    wait_serving(deployment)
    deployment.control.onload(["weights"], group="prefill")


def test_one_deadline_for_all_engines(deployment: Deployment) -> None:
    result = deployment.control.pause_generation(timeout_s=0.1, check=False)
    assert [r.error for r in result.replies] == ["no answer within 0.1 s"] * 4
    deployment.control.continue_generation()


def test_the_async_handle(deployment: Deployment) -> None:
    async def trainer_step() -> tuple[tuple[str, ...], tuple[str, ...]]:
        control = deployment.async_control
        paused, offloaded = await asyncio.gather(
            control.pause_generation(model="eval"), control.offload(["kv_cache"])
        )
        await asyncio.gather(control.onload(["kv_cache"]), control.continue_generation(model="eval"))
        return paused.engines, offloaded.engines

    assert asyncio.run(trainer_step()) == (("eval.regular.0",), tuple(OFFLOADED))


def test_lora_without_lora_engines_is_refused_before_any_call(tmp_path) -> None:
    prepared, claims = prepare_unprobed("sglang.actor.regular.num_gpus=1")
    deployment = Deployment(
        prepared, LocalBackend(claims=claims), log_dir=tmp_path, install_signal_handlers=False
    )
    try:
        with pytest.raises(ValueError, match="no engine of the deployment serves LoRA adapters"):
            deployment.control.load_lora_adapter("math", "/lora/math")
        with pytest.raises(DeploymentStoppedError, match="the deployment is not started"):
            deployment.control.pause_generation()
    finally:
        deployment.stop()
