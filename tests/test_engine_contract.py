"""The engine contract: the same calls against SGLang 0.5.23's own server (on the CPU, engine kind ``cpu_sglang``)
and against the stand-in (``simulated``), each started by the project's launch, and the same status codes and
the same shape of answer from both, for every route the project and its routers use (serving and control).

The expected answers are written down by hand from what the real server answered (``tests/test_real_engine.py``
has the lane's set-up): a shape lists the keys the project, the routers or a trainer read, each with its type
or its exact value. ``{"k": str}`` is a JSON object that has at least key ``k`` holding a string; ``ListOf(x,
n)`` a list of ``n`` items each shaped ``x``; a list or a plain value, exactly that. Either engine may add keys
(the stand-in its ``stand_in`` marker; SGLang many more): the project must not need them.

The stand-in half runs in the main test run (marker ``engine_contract``); the real half in the real-engine lane
(marker ``real_engine``, ``make test-real-engine``, which runs both halves), so that the stand-in cannot drift
from SGLang again. Timing is not part of the contract (SGLang's ``/health_generate`` waits a second).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_sglang_plugin import compose_config, launch_from_config
from tests import real_engine_helpers as real

pytestmark = pytest.mark.timeout(900)

NO_BODY = object()
PROMPT = "the engine serves"


# ------------------------------------------------------------------------------------------------ shapes
@dataclass(frozen=True)
class ListOf:
    item: Any
    length: int | None = None


@dataclass(frozen=True)
class Text:
    """A text (not JSON) answer starting with ``prefix``, or containing ``part``."""

    prefix: str = ""
    part: str = ""


def problems(value: Any, shape: Any, where: str = "answer") -> list[str]:
    """How ``value`` differs from ``shape`` (empty: it conforms)."""
    if isinstance(shape, type):
        ok = isinstance(value, shape) and not (shape is int and isinstance(value, bool))
        return [] if ok else [f"{where}: {value!r} is not {shape.__name__}"]
    if isinstance(shape, Text):
        ok = isinstance(value, str) and value.startswith(shape.prefix) and shape.part in value
        return [] if ok else [f"{where}: {value!r} is not text starting {shape.prefix!r} with {shape.part!r}"]
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not an object"]
        missing = [f"{where}: no key {k!r} (keys: {sorted(value)})" for k in shape if k not in value]
        return missing + [
            p for k, s in shape.items() if k in value for p in problems(value[k], s, f"{where}.{k}")
        ]
    if isinstance(shape, ListOf):
        if not isinstance(value, list) or (shape.length is not None and len(value) != shape.length):
            return [f"{where}: {value!r} is not a list of {shape.length or 'any number of'} items"]
        return [p for i, v in enumerate(value) for p in problems(v, shape.item, f"{where}[{i}]")]
    if isinstance(shape, list):
        if not isinstance(value, list) or len(value) != len(shape):
            return [f"{where}: {value!r} is not a list of {len(shape)} items"]
        return [
            p
            for i, (v, s) in enumerate(zip(value, shape, strict=True))
            for p in problems(v, s, f"{where}[{i}]")
        ]
    return [] if value == shape and type(value) is type(shape) else [f"{where}: {value!r} != {shape!r}"]


def weight_versions(n: int) -> ListOf:
    return ListOf({"version": str, "start": 0, "end": n}, 1)


def generated(n: int) -> dict[str, Any]:
    """A ``/generate`` answer of ``n`` tokens."""
    return {
        "text": str,
        "output_ids": ListOf(int, n),
        "meta_info": {
            "id": str,
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": int,
            "completion_tokens": n,
            "cached_tokens": int,
            "weight_version": str,
            "weight_versions": weight_versions(n),
            "e2e_latency": float,
        },
    }


USAGE = {"prompt_tokens": int, "completion_tokens": 4, "total_tokens": int}
METADATA = {"weight_version": str, "weight_versions": weight_versions(4)}
#: FastAPI's answer when SGLang cannot take the body (none, not its request class, a value out of its type).
BAD_BODY = {"object": "error", "message": str, "type": "Bad Request", "param": None, "code": 400}
NOT_FOUND = {"detail": "Not Found"}
LORA_DISABLED = {
    "success": False,
    "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
    "loaded_adapters": None,
}
SERVER_INFO = {
    "model_path": str,
    "tokenizer_path": str,
    "served_model_name": str,
    "host": "127.0.0.1",
    "port": int,
    "tp_size": 1,
    "dp_size": 1,
    "pp_size": 1,
    "random_seed": 1234,
    "disaggregation_mode": "null",
    "disaggregation_bootstrap_port": int,
    "enable_memory_saver": False,
    "max_total_num_tokens": int,
    "weight_version": "default",
    "version": str,
    "status": "ready",
    "internal_states": ListOf({"last_gen_throughput": float}, 1),
}
MODEL_INFO = {
    "model_path": str,
    "tokenizer_path": str,
    "served_model_name": str,
    "is_generation": True,
    "preferred_sampling_params": None,
    "weight_version": "default",
    "has_image_understanding": False,
    "has_audio_understanding": False,
    "model_type": str,
    "architectures": ListOf(str, 1),
}
FLUSHED = Text(prefix="Cache flushed.")
GENERATE = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
CHAT = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
COMPLETE = {"model": "x", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}

# fmt: off
#: (name, method, route, body, status, shape), each call on its own (none changes the engine's state).
CALLS = [
    ("health", "GET", "/health", NO_BODY, 200, ""),
    ("health_generate", "GET", "/health_generate", NO_BODY, 200, ""),
    ("server_info", "GET", "/server_info", NO_BODY, 200, SERVER_INFO),
    ("get_server_info", "GET", "/get_server_info", NO_BODY, 200, SERVER_INFO),
    ("model_info", "GET", "/model_info", NO_BODY, 200, MODEL_INFO),
    ("get_model_info", "GET", "/get_model_info", NO_BODY, 200, MODEL_INFO),
    ("v1_models", "GET", "/v1/models", NO_BODY, 200, {"object": "list", "data": [
        {"id": str, "object": "model", "created": int, "owned_by": "sglang", "root": str, "parent": None,
         "max_model_len": int}]}),
    ("metrics", "GET", "/metrics", NO_BODY, 200, Text(part="sglang:")),
    ("generate", "POST", "/generate", GENERATE, 200, generated(4)),
    ("generate_batch", "POST", "/generate", {**GENERATE, "text": [PROMPT, "a b"]}, 200, ListOf(generated(4), 2)),
    ("generate_output_logprobs", "POST", "/generate", {**GENERATE, "return_logprob": True}, 200,
     {"meta_info": {"input_token_logprobs": [],
                    "output_token_logprobs": ListOf([float, int, None], 4)}}),
    ("generate_prompt_logprobs", "POST", "/generate",
     {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True,
      "logprob_start_len": 0}, 200,
     {"meta_info": {"input_token_logprobs": [[None, 5, None], [float, 6, None], [float, 7, None]],
                    "output_token_logprobs": ListOf([float, int, None], 2)}}),
    ("generate_nothing", "POST", "/generate", {}, 400, {"error": {"message": str}}),
    ("chat", "POST", "/v1/chat/completions", CHAT, 200, {
        "id": str, "object": "chat.completion", "created": int, "model": "x",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": str, "reasoning_content": None},
                     "logprobs": None, "finish_reason": "length", "matched_stop": None}],
        "usage": USAGE, "metadata": METADATA}),
    ("completions", "POST", "/v1/completions", COMPLETE, 200, {
        "id": str, "object": "text_completion", "created": int, "model": "x",
        "choices": [{"index": 0, "text": str, "logprobs": None, "finish_reason": "length", "matched_stop": None}],
        "usage": USAGE, "metadata": METADATA}),
    ("flush_cache_post", "POST", "/flush_cache", NO_BODY, 200, FLUSHED),
    ("flush_cache_get", "GET", "/flush_cache", NO_BODY, 200, FLUSHED),
    ("flush_cache_with_body", "POST", "/flush_cache", {}, 200, FLUSHED),
    # Control routes need a JSON body, also on GET: without one, FastAPI's 400.
    *[(f"{route[1:]}_without_body", method, route, NO_BODY, 400, BAD_BODY) for method, route in (
        ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/release_memory_occupation"),
        ("POST", "/resume_memory_occupation"), ("GET", "/release_memory_occupation"),
        ("GET", "/resume_memory_occupation"), ("POST", "/abort_request"), ("POST", "/update_weight_version"),
        ("POST", "/update_weights_from_disk"), ("POST", "/destroy_weights_update_group"),
        ("POST", "/load_lora_adapter"), ("POST", "/unload_lora_adapter"))],
    ("pause_unknown_mode", "POST", "/pause_generation", {"mode": "later"}, 400, BAD_BODY),
    ("update_weights_without_path", "POST", "/update_weights_from_disk", {}, 400, BAD_BODY),
    ("update_weight_version_without_version", "POST", "/update_weight_version", {}, 400, BAD_BODY),
    ("abort_all", "POST", "/abort_request", {"abort_all": True}, 200, ""),
    ("destroy_unknown_group", "POST", "/destroy_weights_update_group", {"group_name": "g"}, 400,
     {"success": False, "message": "The group to be destroyed does not exist."}),
    ("load_lora_disabled", "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/lora/a"}, 400,
     LORA_DISABLED),
    ("unload_lora_disabled", "POST", "/unload_lora_adapter", {"lora_name": "a"}, 400, LORA_DISABLED),
    # Not in SGLang 0.5.23 (the stand-in used to serve them).
    *[(f"no{route.replace('/', '_')}", "GET", route, NO_BODY, 404, NOT_FOUND)
      for route in ("/get_weight_version", "/get_load", "/liveness", "/readiness")],
]
# fmt: on


# ------------------------------------------------------------------------------------------------ engines
@dataclass
class Answer:
    status: int
    body: Any
    content_type: str


@dataclass
class Engine:
    kind: str
    url: str
    models: dict[str, Path]
    deployment: Any

    def call(self, method: str, route: str, body: Any = NO_BODY, timeout_s: float = 120) -> Answer:
        kwargs = {} if body is NO_BODY else {"json": body}
        response = httpx.request(method, self.url + route, timeout=timeout_s, **kwargs)
        kind = response.headers.get("content-type", "")
        data = response.json() if kind.startswith("application/json") else response.text
        return Answer(response.status_code, data, kind)

    def check(self, method: str, route: str, body: Any, status: int, shape: Any) -> Answer:
        answer = self.call(method, route, body)
        assert (answer.status, problems(answer.body, shape)) == (status, []), (self.kind, route, answer.body)
        return answer


ENGINES = [
    pytest.param("simulated", marks=pytest.mark.engine_contract, id="stand-in"),
    pytest.param("cpu_sglang", marks=pytest.mark.real_engine, id="real-sglang"),
]


def _models(kind: str, root: Path) -> dict[str, Path]:
    """Two checkpoints: real ones (the tiny model, seeds 1 and 2) for SGLang, empty directories for the stand-in."""
    if kind == "cpu_sglang":
        real.require_real_sglang()
        return {name: real.make_tiny_model(root / name, seed) for name, seed in (("first", 1), ("second", 2))}
    for name in ("first", "second"):
        (root / name).mkdir()
    return {"first": root / "first", "second": root / "second"}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    kind = request.param
    root = tmp_path_factory.mktemp(f"contract-{kind}")
    models = _models(kind, root)
    cfg = compose_config([
        f"hf_checkpoint={models['first']}", f"sglang_deploy={kind}", "debug_rollout_only=true",
        "sglang.actor.regular.num_gpus=1", f"sglang_deploy.launch.host={real.HOST}",
        f"sglang_deploy.launch.port_base={real.random_port_base()}", "sglang_deploy.launch.live=never",
        "sglang_deploy.launch.startup_timeout_s=600", "sglang_deploy.launch.shutdown_grace_s=30",
        # Calls go to the engine itself; the last one ends it, which must not be healed here.
        "sglang_deploy.supervision.enabled=false",
    ])  # fmt: skip
    with launch_from_config(cfg, log_dir=root / "logs") as deployment:
        (info,) = deployment.engines()
        yield Engine(kind, info.url, models, deployment)


# ------------------------------------------------------------------------------------------------ the calls
@pytest.mark.parametrize(("method", "route", "body", "status", "shape"), [c[1:] for c in CALLS],
                         ids=[c[0] for c in CALLS])  # fmt: skip
def test_each_call_answers_as_sglang(
    engine: Engine, method: str, route: str, body: Any, status: int, shape: Any
):
    engine.check(method, route, body, status, shape)


def test_the_answer_types(engine: Engine):
    """Empty and text answers come without a JSON content type, JSON ones (``null`` included) with it: a client
    decides by it."""
    assert not engine.call("GET", "/health").content_type.startswith("application/json")
    assert not engine.call("POST", "/flush_cache").content_type.startswith("application/json")
    released = engine.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert (released.content_type.startswith("application/json"), released.body) == (True, None)
    assert engine.call("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}).body is None


def test_pause_and_continue_answer_and_hold_requests_past_an_abort(engine: Engine):
    paused = {"message": "Generation paused successfully.", "status": "ok"}
    continued = {"message": "Generation continued successfully.", "status": "ok"}
    for mode in ("abort", "retract"):
        engine.check("POST", "/pause_generation", {"mode": mode}, 200, paused)
        engine.check("POST", "/continue_generation", {}, 200, continued)
    engine.check("POST", "/pause_generation", {}, 200, paused)  # no mode: SGLang's default, abort
    engine.check("POST", "/continue_generation", {}, 200, continued)
    engine.check("POST", "/pause_generation", {"mode": "in_place"}, 200, paused)
    outcome: dict[str, Any] = {}

    def held() -> None:
        outcome["answer"] = engine.call("POST", "/generate", GENERATE)
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    thread.join(timeout=3)
    engine.check("POST", "/abort_request", {"abort_all": True}, 200, "")  # does not reach a held request
    thread.join(timeout=2)
    assert "answer" not in outcome
    continue_sent_at = time.monotonic()
    engine.check("POST", "/continue_generation", {}, 200, continued)
    thread.join(timeout=120)
    assert outcome["at"] > continue_sent_at
    assert (outcome["answer"].status, problems(outcome["answer"].body, generated(4))) == (200, [])


def test_released_memory_answers_null_and_the_engine_keeps_serving(engine: Engine):
    """Without the memory saver (a CPU engine: it cannot have one) nothing is released: SGLang answers null and
    goes on serving. (With it, on a GPU, the stand-in refuses generation until resumed: not checked here.)"""
    engine.check("POST", "/release_memory_occupation", {}, 200, None)
    engine.check("POST", "/generate", GENERATE, 200, generated(4))
    engine.check("GET", "/health_generate", NO_BODY, 200, "")
    engine.check("POST", "/resume_memory_occupation", {}, 200, None)
    for _ in range(2):  # releasing twice is no error
        engine.check("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}, 200, None)
    engine.check("GET", "/resume_memory_occupation", {"tags": ["kv_cache"]}, 200, None)


def test_streamed_generation(engine: Engine):
    with httpx.stream("POST", engine.url + "/generate", json={**GENERATE, "stream": True}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
        assert (r.status_code, r.headers["content-type"].split(";")[0]) == (200, "text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    # Cumulative (SGLang's default, no incremental_streaming_output): each event holds all tokens so far, the
    # last one the whole answer. At most one event per token: SGLang may send several tokens in one.
    assert 1 <= len(events) <= 4
    last = events[-1]
    assert problems(last, generated(4)) == []
    partial = {"text": str, "output_ids": ListOf(int), "meta_info": {"finish_reason": None}}
    for event in events[:-1]:
        assert problems(event, partial) == []
        assert event["output_ids"] == last["output_ids"][: len(event["output_ids"])]


def test_streamed_chat(engine: Engine):
    with httpx.stream(
        "POST", engine.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120
    ) as r:
        lines = [line for line in r.iter_lines() if line]
        assert (r.status_code, r.headers["content-type"].split(";")[0]) == (200, "text/event-stream")
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "x" for c in chunks)
    assert problems(chunks[0]["choices"], [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]) == []  # fmt: skip
    assert problems(chunks[-1]["choices"], [{"index": 0, "finish_reason": "length"}]) == []


def test_weights_from_disk_and_the_version(engine: Engine):
    second = str(engine.models["second"])
    engine.check("POST", "/update_weights_from_disk", {"model_path": second, "weight_version": "v2"}, 200, {
        "success": True, "message": "Succeeded to update model weights. Weight version updated to v2.",
        "num_paused_requests": 0})  # fmt: skip
    engine.check(
        "GET", "/model_info", NO_BODY, 200, {**MODEL_INFO, "model_path": second, "weight_version": "v2"}
    )
    answer = engine.check("POST", "/generate", GENERATE, 200, generated(4))
    assert answer.body["meta_info"]["weight_versions"] == [{"version": "v2", "start": 0, "end": 4}]
    engine.check("POST", "/update_weights_from_disk", {"model_path": second}, 200, {
        "success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})  # fmt: skip
    engine.check("POST", "/update_weight_version", {"new_version": "v3"}, 200,
                 {"success": True, "message": "Weight version updated to v3", "new_version": "v3"})  # fmt: skip
    engine.check(
        "GET", "/model_info", NO_BODY, 200, {**MODEL_INFO, "model_path": second, "weight_version": "v3"}
    )
    # /server_info keeps the start-up --weight-version (and model path): SGLang's ServerArgs.
    engine.check(
        "GET", "/server_info", NO_BODY, 200, {**SERVER_INFO, "model_path": str(engine.models["first"])}
    )
    engine.check(
        "POST", "/update_weight_version", {"new_version": "default"}, 200, {"new_version": "default"}
    )


def test_resuming_memory_that_was_not_released_ends_the_engine(engine: Engine):
    """SGLang's scheduler raises (KeyError on its set of released tags) and the engine exits without answering:
    the control handle must resume only what it released. Last: the engine is gone afterwards."""
    engine.check("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}, 200, None)
    with pytest.raises(httpx.RemoteProtocolError):
        engine.call("POST", "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})
    deadline = time.monotonic() + 120
    while not engine.deployment.exited() and time.monotonic() < deadline:
        time.sleep(0.2)
    ((name, code),) = engine.deployment.exited()
    assert name == "actor.regular.0" and code != 0
    with contextlib.suppress(httpx.TransportError):
        pytest.fail(f"the engine still answers: {engine.call('GET', '/health', timeout_s=5)}")


# ------------------------------------------------------------------------------------------------ for serving
@pytest.mark.engine_contract
def test_onload_after_a_partial_offload_leaves_the_engines_serving(tmp_path: Path):
    cfg = compose_config([
        f"hf_checkpoint={tmp_path}", "sglang_deploy=simulated", "colocate=true", "actor_num_gpus_per_node=1",
        "sglang.actor.regular.num_gpus=1", f"sglang_deploy.launch.port_base={real.random_port_base()}",
        "sglang_deploy.launch.live=never", "sglang_deploy.supervision.enabled=false",
    ])  # fmt: skip
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as deployment:
        deployment.control.offload(["kv_cache"])
        result = deployment.control.onload()
        # only the KV cache was released, so only the KV cache is resumed; the engine keeps serving
        assert result.ok and result.engines == ("actor.regular.0",)
        time.sleep(1.0)  # an engine that was ended has exited by then
        assert deployment.exited() == []
        out = httpx.post(
            deployment.registry.get_model_url("actor"),
            json={"text": "a b", "sampling_params": {"max_new_tokens": 2}},
            timeout=30,
        )
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 2
