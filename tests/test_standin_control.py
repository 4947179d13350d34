"""The stand-in engine's control routes (state as a real engine keeps it; bodies checked against SGLang's own
request classes; answers as SGLang 0.5.23's server gives them, which tests/test_engine_contract.py checks against
the real server), and its answers in PD mode as SGLang's disaggregated servers give them, through the real
sglang-router 0.3.2."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import asyncio
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.test_standin import (  # noqa: F401  (the spawn fixture)
    Proc,
    spawn,
    start_router,
    start_standin,
    wait_http,
    wait_router_ready,
)

GENERATE = {
    "text": "one two three four",
    "sampling_params": {"max_new_tokens": 3},
    "return_logprob": True,
    "logprob_start_len": 0,  # the prompt's logprobs too (SGLang's default, -1: none)
}


def post(proc: Proc, route: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(proc.url + route, json=body if body is not None else {}, timeout=10.0)


def stats(proc: Proc) -> dict:
    return httpx.get(proc.url + "/stand_in/stats", timeout=10.0).json()


def test_released_memory_refuses_generation_until_resumed_with_the_memory_saver(
    spawn: Callable[..., Proc],
) -> None:
    engine = start_standin(spawn, "--enable-memory-saver")
    wait_http(engine)
    assert post(engine, "/generate", GENERATE).status_code == 200
    released = post(engine, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert (released.status_code, released.json()) == (200, None)  # SGLang answers null
    assert stats(engine)["released_memory_tags"] == ["kv_cache"]
    refused = post(engine, "/generate", GENERATE)
    assert refused.status_code == 503 and "memory released (kv_cache)" in refused.text
    assert (
        post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}).status_code
        == 503
    )
    assert httpx.get(engine.url + "/health").status_code == 200  # an offloaded engine is alive ...
    assert httpx.get(engine.url + "/health_generate").status_code == 503  # ... but cannot generate
    post(engine, "/release_memory_occupation")  # no tags: all of them
    assert stats(engine)["released_memory_tags"] == ["cuda_graph", "kv_cache", "weights"]
    post(engine, "/resume_memory_occupation", {"tags": ["weights", "cuda_graph"]})
    assert post(engine, "/generate", GENERATE).status_code == 503
    post(engine, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert post(engine, "/generate", GENERATE).status_code == 200


def test_a_request_held_by_a_pause_waits_out_an_offload_and_is_served(spawn: Callable[..., Proc]) -> None:
    """A trainer's cycle under load: pause, release and resume memory, continue. A request that came while
    paused is queued (as SGLang queues it) and served after continue, never refused for the released memory."""
    engine = start_standin(spawn, "--enable-memory-saver")
    wait_http(engine)
    post(engine, "/pause_generation", {"mode": "retract"})
    out: dict[str, httpx.Response] = {}
    held = threading.Thread(
        target=lambda: out.update(answer=post(engine, "/generate", GENERATE)), daemon=True
    )
    held.start()
    held.join(timeout=1.0)
    assert "answer" not in out
    post(engine, "/release_memory_occupation", {"tags": ["kv_cache"]})
    post(engine, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    post(engine, "/continue_generation")
    held.join(timeout=60)
    assert out["answer"].status_code == 200
    # while paused and released, then continued with the memory still released: refused once it may run
    post(engine, "/pause_generation", {"mode": "retract"})
    post(engine, "/release_memory_occupation", {"tags": ["kv_cache"]})
    held = threading.Thread(target=lambda: out.update(late=post(engine, "/generate", GENERATE)), daemon=True)
    held.start()
    held.join(timeout=1.0)
    assert "late" not in out
    post(engine, "/continue_generation")
    held.join(timeout=60)
    assert out["late"].status_code == 503 and "memory released (kv_cache)" in out["late"].text


def test_without_the_memory_saver_a_released_engine_keeps_serving(spawn: Callable[..., Proc]) -> None:
    """As SGLang without --enable-memory-saver (on a CPU, say): nothing is released, everything still works."""
    engine = start_standin(spawn)
    wait_http(engine)
    assert post(engine, "/release_memory_occupation", {}).json() is None
    assert stats(engine)["released_memory_tags"] == ["cuda_graph", "kv_cache", "weights"]
    assert post(engine, "/generate", GENERATE).status_code == 200
    assert httpx.get(engine.url + "/health_generate").status_code == 200
    loaded = post(engine, "/update_weights_from_disk", {"model_path": "/ckpt/step1"})
    assert loaded.json()["message"] == "Succeeded to update model weights."
    assert post(engine, "/resume_memory_occupation", {"tags": ["weights"]}).json() is None
    assert stats(engine)["released_memory_tags"] == ["cuda_graph", "kv_cache"]


def test_resuming_memory_that_was_not_released_ends_the_engine_as_sglangs(spawn: Callable[..., Proc]) -> None:
    """SGLang's scheduler removes each tag from its set of released ones: a KeyError, and the engine exits
    without answering. The stand-in does the same (exit code 5)."""
    engine = start_standin(spawn)
    wait_http(engine)
    post(engine, "/release_memory_occupation", {"tags": ["kv_cache"]})
    with pytest.raises(httpx.RemoteProtocolError):
        post(engine, "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert engine.wait(timeout=10) == 5
    assert "KeyError: 'weights' (resume_memory_occupation of memory that was not released: weights)" in (
        engine.stderr()
    )


def test_weight_version_is_reported_everywhere(spawn: Callable[..., Proc]) -> None:
    engine = start_standin(spawn, "--weight-version", "v0", "--enable-memory-saver")
    wait_http(engine)
    assert httpx.get(engine.url + "/model_info").json()["weight_version"] == "v0"
    post(engine, "/release_memory_occupation", {"tags": ["weights"]})
    refused = post(engine, "/update_weights_from_disk", {"model_path": "/ckpt/step1", "weight_version": "1"})
    assert refused.status_code == 400 and "weights are released" in refused.text
    post(engine, "/resume_memory_occupation", {"tags": ["weights"]})
    loaded = post(engine, "/update_weights_from_disk", {"model_path": "/ckpt/step1", "weight_version": "1"})
    assert loaded.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 1.",
        "num_paused_requests": 0,
    }
    assert post(engine, "/update_weight_version", {"new_version": "1b"}).json()["new_version"] == "1b"
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(engine.url + path).json()["weight_version"] == "1b", path
    for path in ("/server_info", "/get_server_info"):  # as SGLang's: the start-up --weight-version
        assert httpx.get(engine.url + path).json()["weight_version"] == "v0", path
    assert httpx.get(engine.url + "/get_weight_version").status_code == 404  # not in SGLang 0.5.23
    assert post(engine, "/generate", GENERATE).json()["meta_info"]["weight_version"] == "1b"
    state = stats(engine)
    assert (state["loaded_model_path"], state["weight_updates"]) == ("/ckpt/step1", 1)


def test_weights_update_group_ranks_are_checked(spawn: Callable[..., Proc]) -> None:
    engine = start_standin(spawn, "--tp-size", "4")
    wait_http(engine)
    group = {"master_address": "10.0.0.1", "master_port": 29500, "group_name": "g", "backend": "nccl"}
    # Ranks 1..4 of this TP-4 engine fit a group of 5 (the trainer is rank 0); 2..5 do not.
    assert (
        post(engine, "/init_weights_update_group", {**group, "rank_offset": 2, "world_size": 5}).status_code
        == 400
    )
    assert (
        post(engine, "/init_weights_update_group", {**group, "rank_offset": 0, "world_size": 9}).status_code
        == 400
    )
    assert (
        post(engine, "/init_weights_update_group", {**group, "rank_offset": 1, "world_size": 5}).status_code
        == 200
    )
    bucket = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 2]], "weight_version": "7"}
    assert (
        post(engine, "/update_weights_from_distributed", {**bucket, "group_name": "other"}).status_code == 400
    )
    assert post(engine, "/update_weights_from_distributed", {**bucket, "group_name": "g"}).status_code == 200
    assert stats(engine)["weight_update_groups"]["g"]["rank_offset"] == 1
    assert httpx.get(engine.url + "/model_info").json()["weight_version"] == "7"
    assert post(engine, "/destroy_weights_update_group", {"group_name": "g"}).status_code == 200
    assert stats(engine)["weight_update_groups"] == {}
    again = post(engine, "/destroy_weights_update_group", {"group_name": "g"})  # as SGLang: no such group
    assert (again.status_code, again.json()) == (
        400,
        {"success": False, "message": "The group to be destroyed does not exist."},
    )


def test_bodies_are_checked_against_sglangs_request_classes(spawn: Callable[..., Proc]) -> None:
    engine = start_standin(spawn)
    wait_http(engine)
    cases = {
        "/release_memory_occupation": (
            {"tag": ["kv_cache"]},
            "'tag' is not a field of ReleaseMemoryOccupationReqInput",
        ),
        "/update_weights_from_disk": (
            {"weight_version": "1"},
            "UpdateWeightFromDiskReqInput needs 'model_path'",
        ),
        "/pause_generation": ({"mode": "later"}, "PauseGenerationReqInput.mode must be Literal"),
        "/init_weights_update_group": (
            {"master_address": "h", "master_port": "29500", "rank_offset": 1, "world_size": 2},
            "InitWeightsUpdateGroupReqInput.master_port must be int, got '29500'",
        ),
        "/update_weight_version": (
            {"new_version": 3},
            "UpdateWeightVersionReqInput.new_version must be str, got 3",
        ),
    }
    for route, (body, message) in cases.items():
        answer = post(engine, route, body)
        assert answer.status_code == 400 and message in answer.json()["message"], (route, answer.text)
        assert {k: v for k, v in answer.json().items() if k != "message"} == {
            "object": "error", "type": "Bad Request", "param": None, "code": 400
        }  # fmt: skip
    # No body at all (SGLang: the body is required, also on GET): 400 as well.
    for method, route in (("POST", "/pause_generation"), ("POST", "/continue_generation"),
                          ("GET", "/release_memory_occupation"), ("POST", "/abort_request")):  # fmt: skip
        answer = httpx.request(method, engine.url + route, timeout=10.0)
        assert answer.status_code == 400 and "Field required" in answer.json()["message"], (
            route,
            answer.text,
        )
    assert stats(engine)["control_calls"] == []  # none of them was acted on


def test_pause_holds_generation_until_continue_and_an_abort_does_not_reach_it(
    spawn: Callable[..., Proc],
) -> None:
    """As SGLang's tokenizer manager: a request that arrives while paused waits before it reaches the
    scheduler, so an abort of all requests (which the scheduler carries out) does not end it."""
    engine = start_standin(spawn)
    wait_http(engine)

    async def scenario() -> tuple[list[dict], list[dict]]:
        async with httpx.AsyncClient(base_url=engine.url, timeout=20.0) as client:
            await client.post("/pause_generation", json={"mode": "retract"})
            waiting = [asyncio.ensure_future(client.post("/generate", json=GENERATE)) for _ in range(2)]
            await asyncio.sleep(0.5)
            assert not any(task.done() for task in waiting)  # held while paused
            await client.post("/continue_generation", json={})
            resumed = [(await task).json() for task in waiting]
            await client.post("/pause_generation", json={"mode": "in_place"})
            held = asyncio.ensure_future(client.post("/generate", json=GENERATE))
            await asyncio.sleep(0.3)
            await client.post("/abort_request", json={"abort_all": True})
            await asyncio.sleep(0.3)
            still_held = not held.done()
            await client.post("/continue_generation", json={})
            return resumed, [still_held, (await held).json()]

    resumed, (still_held, after) = asyncio.run(scenario())
    assert [r["meta_info"]["finish_reason"]["type"] for r in resumed] == ["length", "length"]
    assert still_held
    assert after["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_lora_adapters_load_unload_and_are_listed(spawn: Callable[..., Proc]) -> None:
    plain = start_standin(spawn)
    lora = start_standin(spawn, "--enable-lora", "--max-loras-per-batch", "2")
    wait_http(plain)
    wait_http(lora)
    refused = post(plain, "/load_lora_adapter", {"lora_name": "a", "lora_path": "/lora/a"})
    assert refused.status_code == 400 and "LoRA is not enabled" in refused.text
    assert post(lora, "/load_lora_adapter", {"lora_name": "a", "lora_path": "/lora/a"}).json()[
        "loaded_adapters"
    ] == {"a": "/lora/a"}
    assert post(lora, "/load_lora_adapter", {"lora_name": "a", "lora_path": "/lora/b"}).status_code == 400
    models = httpx.get(lora.url + "/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models[1:]] == [("a", "/lora/a")]
    assert post(lora, "/unload_lora_adapter", {"lora_name": "a"}).status_code == 200
    assert post(lora, "/unload_lora_adapter", {"lora_name": "a"}).status_code == 400
    assert len(httpx.get(lora.url + "/v1/models").json()["data"]) == 1


def test_control_latency(spawn: Callable[..., Proc]) -> None:
    engine = start_standin(spawn, env={"MSP_STANDIN_CONTROL_LATENCY_S": "0.4"})
    wait_http(engine)
    started = time.monotonic()
    post(engine, "/flush_cache")  # not a control call of the list: no latency
    post(engine, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert time.monotonic() - started >= 0.4  # a lower bound: the wait the stand-in must make


def test_a_stop_tells_the_control_calls_it_left_unanswered(spawn: Callable[..., Proc]) -> None:
    """SIGTERM while a control call waits out its latency: the log says which calls were never answered (how
    a test sees that a launcher stopped the engine without waiting for them)."""
    engine = start_standin(spawn, env={"MSP_STANDIN_CONTROL_LATENCY_S": "3600"})
    wait_http(engine)

    async def one_call_out_then_stop() -> None:
        async with httpx.AsyncClient(timeout=3600) as client:
            call = asyncio.ensure_future(
                client.post(engine.url + "/pause_generation", json={"mode": "abort"})
            )
            while not any(path == "/pause_generation" for path, _ in stats(engine)["control_calls"]):
                assert not call.done(), call
                await asyncio.sleep(0.05)
            engine.popen.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.HTTPError):
                await call  # the connection ends with the engine: no answer

    asyncio.run(one_call_out_then_stop())
    assert engine.wait(timeout=60) == 0
    lines = [line for line in engine.stdout().splitlines() if "stopping: signal received" in line]
    assert [line.split("] ", 1)[-1] for line in lines] == [
        "stopping: signal received; control calls unanswered: /pause_generation"
    ]


def test_pd_logprobs_as_sglangs_disaggregated_servers_through_the_real_router(
    spawn: Callable[..., Proc],
) -> None:
    """SGLang's prefill server computes the prompt's logprobs and generates the first token only
    (prefill.py: ``max_new_tokens = 1``); the decode server sends no input logprobs (output_streamer.py); the
    PD router puts the prefill's input logprobs in front of the decode's. A 4-token prompt therefore comes
    back with 4 input logprobs (the first None, as SGLang's), and 3 generated tokens with 3 output logprobs."""
    prefill = start_standin(
        spawn, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001"
    )
    decode = start_standin(spawn, "--disaggregation-mode", "decode")
    wait_http(prefill)
    wait_http(decode)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9001, "bootstrap_room": 7}
    own_prefill = post(prefill, "/generate", {**GENERATE, **boot}).json()["meta_info"]
    own_decode = post(decode, "/generate", {**GENERATE, **boot}).json()["meta_info"]
    assert (len(own_prefill["input_token_logprobs"]), len(own_prefill["output_token_logprobs"])) == (4, 1)
    assert (len(own_decode["input_token_logprobs"]), len(own_decode["output_token_logprobs"])) == (0, 3)
    router = start_router(
        spawn,
        "--pd-disaggregation",
        "--prefill",
        prefill.url,
        "9001",
        "--decode",
        decode.url,
        "--disable-circuit-breaker",
    )
    wait_router_ready(router)
    for text, tokens in (("one two three four", 4), ("a b c d e f", 6)):
        body = {**GENERATE, "text": text}
        merged = httpx.post(router.url + "/generate", json=body, timeout=10.0).json()["meta_info"]
        inputs = merged["input_token_logprobs"]
        assert len(inputs) == tokens and inputs[0][0] is None and all(lp < 0 for lp, *_ in inputs[1:])
        assert len(merged["output_token_logprobs"]) == 3 and merged["completion_tokens"] == 3


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_paused_engine_refuses_nothing_it_holds(spawn: Callable[..., Proc], route: str) -> None:
    """A pause holds requests, it does not refuse them: continue lets them through."""
    engine = start_standin(spawn)
    wait_http(engine)
    body = (
        GENERATE
        if route == "/generate"
        else {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    )

    async def scenario() -> int:
        async with httpx.AsyncClient(base_url=engine.url, timeout=20.0) as client:
            await client.post("/pause_generation", json={"mode": "abort"})
            held = asyncio.ensure_future(client.post(route, json=body))
            await asyncio.sleep(0.3)
            await client.post("/continue_generation", json={})
            return (await held).status_code

    assert asyncio.run(scenario()) == 200


def test_a_request_that_comes_while_weights_load_from_disk_waits_for_them_and_gets_the_new_version(
    spawn: Callable[..., Proc],
) -> None:
    """With a control latency a disk update loads for that long; SGLang's scheduler serves nothing meanwhile:
    a generation that comes during the load is answered after it, with the new weights' version."""
    engine = start_standin(spawn, env={"MSP_STANDIN_CONTROL_LATENCY_S": "1.0"})
    wait_http(engine)
    answers: dict[str, httpx.Response] = {}

    def update() -> None:
        body = {"model_path": "/ckpt/9", "weight_version": "9"}
        answers["update"] = post(engine, "/update_weights_from_disk", body)

    loading = threading.Thread(target=update)
    loading.start()
    deadline = time.monotonic() + 20
    while "/update_weights_from_disk" not in str(stats(engine).get("control_calls", "")):
        assert time.monotonic() < deadline, stats(engine)
        time.sleep(0.02)
    answers["generate"] = post(engine, "/generate", GENERATE)  # sent while the load runs (it takes 1 s)
    loading.join(20)
    assert answers["update"].json()["success"] is True
    # answered once the load was done: a request served at once would carry the old version, "default"
    assert answers["generate"].json()["meta_info"]["weight_version"] == "9"
