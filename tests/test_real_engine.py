"""The real-engine lane: SGLang 0.5.23's own server on the CPU (engine kind ``cpu_sglang``), two engines of a
tiny Llama model made locally, started by the project's own launch behind the real sglang-router, driven through
the public API only (``launch_from_config``, ``deployment.control``, ``deployment.engines()``,
``deployment.registry``, ``deployment.wait_for_event``): so that they keep working whatever the serving code
becomes inside.

What only the real server can prove: that the command line the plan renders (minus the CPU substitutions of
``rendering/cpu_engine.py``) starts it; generation through the router; the trainer loop's control operations
with the real server's answers (release/resume answer ``null``, a weight update from disk changes the output
and the version, ``in_place`` holds a request until ``continue``); a SIGKILLed engine healed and given its state
back (the new weights and version); the rollout client's choice of the engine that has the weight version a
request asks for; nothing left after stop.

Run with ``make test-real-engine`` (its own venv, ``.venv-real``); elsewhere these tests skip, and fail with
``MSP_REQUIRE_REAL_ENGINE_TESTS=1`` (``.ci/run``). At most two engines run at a time (about 3 GB each).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_sglang_plugin import compose_config, launch_from_config, prepare_from_config
from miles_sglang_plugin.serving.rollout import AsyncRolloutClient, Worker
from tests import real_engine_helpers as real
from tests.launch_helpers import port_accepts

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

SHIM = Path(__file__).resolve().parent.parent / "miles_sglang_plugin" / "cpu_engine_shim"
PROMPT = "the engine serves"
ENGINES = ("actor.regular.0", "actor.regular.1")
#: Colocated with a 2-GPU actor: rollout takes the actor's 2 GPU slots, offload is on (Miles' colocate rule)
#: and the model's path is the trainer's checkpoint, so it receives weight updates.
TWO_ENGINES = [
    "colocate=true",
    "actor_num_gpus_per_node=2",
    "sglang.actor.regular.num_gpus=2",
    "sglang_deploy.router.policy=round_robin",
    "sglang_deploy.supervision.health_interval_s=1",
    "sglang_deploy.supervision.health_timeout_s=10",
    "sglang_deploy.supervision.failure_threshold=3",
    "sglang_deploy.supervision.restart_backoff_s=0.5",
]
#: Each flag the cpu_sglang kind adds after the plan's own (rendering/cpu_engine.py).
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
             "--disable-cuda-graph"]  # fmt: skip
PORT_FLAGS = ("--port", "--nccl-port", "--dist-init-addr", "--engine-info-bootstrap-port")


def overrides(checkpoint: Path, *extra: str, kind: str = "cpu_sglang") -> list[str]:
    return [
        f"hf_checkpoint={checkpoint}",
        f"sglang_deploy={kind}",
        f"sglang_deploy.launch.host={real.HOST}",
        f"sglang_deploy.launch.port_base={real.random_port_base()}",
        "sglang_deploy.launch.startup_timeout_s=600",
        "sglang_deploy.launch.shutdown_grace_s=30",
        "sglang_deploy.launch.live=never",
        *extra,
    ]


def generate_body(max_new_tokens: int = 8) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}


@dataclass
class Lane:
    """The module's deployment and what the tests learn about it on the way."""

    deployment: Any
    stack: contextlib.ExitStack
    models: dict[str, Path]
    log_dir: Path
    #: Output ids of PROMPT with the first and the second checkpoint.
    outputs: dict[str, list[int]] = field(default_factory=dict)
    #: Every engine process seen (PID -> command line): none may be left at the end.
    seen: dict[int, str] = field(default_factory=dict)

    def url(self, engine: str) -> str:
        (info,) = [e for e in self.deployment.engines() if e.id == engine]
        return info.url

    def port(self, engine: str) -> int:
        return int(self.url(engine).rsplit(":", 1)[1])

    def record_processes(self) -> None:
        self.seen.update(real.engine_processes())


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    real.require_real_sglang()
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: real.make_tiny_model(root / name, seed) for name, seed in (("first", 1), ("second", 2))}


@pytest.fixture(scope="module")
def lane(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lane]:
    log_dir = tmp_path_factory.mktemp("real-engine-logs")
    cfg = compose_config(overrides(tiny_models["first"], *TWO_ENGINES))
    stack = contextlib.ExitStack()
    started = time.monotonic()
    deployment = stack.enter_context(launch_from_config(cfg, log_dir=log_dir))
    ready_s = time.monotonic() - started
    state = Lane(deployment, stack, tiny_models, log_dir)
    state.record_processes()
    for info in deployment.engines():
        real.record_measurement(
            f"{info.id} start (process to healthy)", f"{info.healthy_at - info.started_at:.1f} s"
        )
        real.record_measurement(
            f"{info.id} RSS", f"{real.process_tree_rss_mib(engine_pid_of(state, info.id)):.0f} MiB"
        )
    real.record_measurement("deployment ready (2 engines, router)", f"{ready_s:.1f} s")
    try:
        yield state
    finally:
        stack.close()


def engine_pid_of(lane: Lane, engine: str) -> int:
    return real.engine_pid(lane.port(engine))


def post(url: str, route: str, body: Any, timeout_s: float = 120) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=timeout_s)


# ------------------------------------------------------------------------------------------------ the shim
def test_the_shims_kernel_assigns_token_slots_as_sglangs_triton_kernel():
    real.require_real_sglang()
    code = (
        "import torch, sgl_kernel\n"
        "pool = torch.zeros((3, 6), dtype=torch.int32)\n"
        "sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), pool, torch.tensor([1, 0]),\n"
        "    torch.tensor([3, 3]), torch.tensor([7, 8, 9, 10, 11], dtype=torch.int32), 6)\n"
        "print(pool.tolist())\n"
        "print(torch.get_device_module().__name__)\n"
        "try:\n"
        "    sgl_kernel.fill_bonus_tokens_cpu()\n"
        "except NotImplementedError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SHIM)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pool, device_module, refusal = out.stdout.splitlines()
    # Request 0 (pool row 2) takes slots 7, 8 at positions 1-2; request 1 (row 0) takes 9, 10, 11 at 0-2.
    assert pool == "[[9, 10, 11, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 7, 8, 0, 0, 0]]"
    assert device_module == "torch.cpu"  # no CUDA device here: the CUDA build of torch would say torch.cuda
    assert refusal.startswith("sgl_kernel.fill_bonus_tokens_cpu is not available")
    # Without the shim on the path, the same torch answers torch.cuda (what made memory release kill SGLang).
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check = "import torch; print(torch.get_device_module().__name__)"
    out = subprocess.run(
        [sys.executable, "-c", check], env=plain, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "torch.cuda"


# -------------------------------------------------------------------------------------------- the argv
def _without_ports(argv: list[str]) -> list[str]:
    return [("<port>" if i and argv[i - 1] in PORT_FLAGS else a) for i, a in enumerate(argv)]


def test_the_rendered_command_line_minus_the_cpu_substitutions_started_the_real_server(lane: Lane):
    # What the plan renders for real SGLang on GPUs (the sglang kind), and what each engine process runs.
    sglang = prepare_from_config(
        compose_config(overrides(lane.models["first"], *TWO_ENGINES, kind="default"))
    )
    for engine, rendered in zip(ENGINES, sglang.launch.engines, strict=True):
        running = real.engine_processes()[engine_pid_of(lane, engine)].split()
        assert f"--port {lane.port(engine)}" in " ".join(running)
        # Colocated: the sglang kind has --cuda-graph-backend-prefill disabled (Miles) and --enable-memory-saver.
        expected = list(rendered.argv)
        assert expected[3:5] == ["--cuda-graph-backend-prefill", "disabled"]
        assert "--enable-memory-saver" in expected
        expected = [expected[0], expected[1], expected[2], "--max-total-tokens", "8192", *expected[5:]]
        expected.remove("--enable-memory-saver")
        assert _without_ports(running) == _without_ports([*expected, *CPU_FLAGS])
    # The server took them: what it reports is what the plan decided.
    info = httpx.get(lane.url(ENGINES[1]) + "/server_info", timeout=30).json()
    assert (info["tp_size"], info["random_seed"], info["device"], info["attention_backend"]) == (
        1, 1235, "cpu", "torch_native"
    )  # fmt: skip
    assert (info["max_total_num_tokens"], info["enable_memory_saver"], info["disable_cuda_graph"]) == (
        8192, False, True
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- serving
def test_generation_through_the_real_router(lane: Lane):
    url = lane.deployment.registry.get_model_url("actor", "/generate")
    answers = [post(url, "", generate_body()).json() for _ in range(2)]  # round robin: one per engine
    for answer in answers:
        meta = answer["meta_info"]
        assert len(answer["output_ids"]) == 8 and isinstance(answer["text"], str)
        assert (meta["finish_reason"], meta["completion_tokens"], meta["weight_version"]) == (
            {"type": "length", "length": 8}, 8, "default"
        )  # fmt: skip
    # Greedy decoding of one checkpoint: both engines and the router give the same tokens.
    direct = [post(lane.url(e), "/generate", generate_body()).json()["output_ids"] for e in ENGINES]
    assert direct[0] == direct[1] == answers[0]["output_ids"] == answers[1]["output_ids"]
    lane.outputs["first"] = direct[0]
    lane.record_processes()


def _generate_in_background(url: str) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome["answer"] = post(url, "/generate", generate_body(), timeout_s=600).json()
        outcome["done_at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_the_trainer_loop_with_the_real_servers_answers(lane: Lane):
    control = lane.deployment.control
    assert "first" in lane.outputs, "runs after test_generation_through_the_real_router"
    paused = control.pause_generation("in_place")
    assert {r.engine: (r.status, r.body) for r in paused.replies} == {
        e: (200, {"message": "Generation paused successfully.", "status": "ok"}) for e in ENGINES
    }
    held, outcome = _generate_in_background(lane.url(ENGINES[0]))
    offloaded = control.offload()  # all memory; on a CPU nothing is released, and SGLang answers null
    assert {r.engine: (r.status, r.body) for r in offloaded.replies} == {e: (200, None) for e in ENGINES}
    assert {r.engine: r.body for r in control.onload(["weights"]).replies} == dict.fromkeys(ENGINES)
    updated = control.update_weights_from_disk(str(lane.models["second"]), weight_version="1")
    assert {r.engine: r.body for r in updated.replies} == {
        e: {"success": True, "message": "Succeeded to update model weights. Weight version updated to 1.",
            "num_paused_requests": 0}
        for e in ENGINES
    }  # fmt: skip
    assert {r.engine: r.body for r in control.onload(["kv_cache", "cuda_graph"]).replies} == dict.fromkeys(
        ENGINES
    )
    assert "answer" not in outcome  # held in place all along
    continue_sent_at = time.monotonic()
    continued = control.continue_generation()
    assert {r.body["message"] for r in continued.replies} == {"Generation continued successfully."}
    held.join(timeout=600)
    # The held request ran after continue, on the new weights.
    assert outcome["done_at"] > continue_sent_at
    assert outcome["answer"]["meta_info"]["weight_version"] == "1"
    flushed = control.flush_cache()
    assert {r.engine: (r.status, r.body.splitlines()[0]) for r in flushed.replies} == {
        e: (200, "Cache flushed.") for e in ENGINES
    }
    assert control.weight_versions() == dict.fromkeys(ENGINES, "1")
    second = [post(lane.url(e), "/generate", generate_body()).json() for e in ENGINES]
    assert second[0]["output_ids"] == second[1]["output_ids"] == outcome["answer"]["output_ids"]
    assert second[0]["output_ids"] != lane.outputs["first"]  # other weights, other tokens
    assert {a["meta_info"]["weight_version"] for a in second} == {"1"}
    lane.outputs["second"] = second[0]["output_ids"]


# ---------------------------------------------------------------------------------------------- healing
def test_a_sigkilled_real_engine_is_healed_and_given_its_state_back(lane: Lane):
    assert "second" in lane.outputs, "runs after test_the_trainer_loop_with_the_real_servers_answers"
    deployment, victim = lane.deployment, ENGINES[0]
    pid = engine_pid_of(lane, victim)
    old = {pid: real.engine_processes()[pid], **real.engine_processes(pid)}  # the server and its children
    assert len(old) == 3, old  # server, scheduler, detokenizer
    since = len(deployment.events())
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    lost = deployment.wait_for_event("engine_lost", subject=victim, since=since, timeout_s=120)
    recovered = deployment.wait_for_event("engine_recovered", subject=victim, since=since, timeout_s=600)
    real.record_measurement(
        "SIGKILL to recovered (restart, state replay, router)", f"{time.monotonic() - killed_at:.1f} s"
    )
    assert lost.kind == "engine_lost" and recovered.kind == "engine_recovered"
    assert real.wait_until_gone(old, timeout_s=60) == {}  # the old scheduler and detokenizer went too
    (info,) = [e for e in deployment.engines() if e.id == victim]
    assert (info.restarts, info.state) == (1, "serving")
    new_pid = engine_pid_of(lane, victim)
    assert new_pid != pid
    # Its state given back: the weights of the second checkpoint and their version.
    assert deployment.control.weight_versions() == dict.fromkeys(ENGINES, "1")
    answer = post(lane.url(victim), "/generate", generate_body()).json()
    assert answer["output_ids"] == lane.outputs["second"]
    assert answer["meta_info"]["weight_version"] == "1"
    url = deployment.registry.get_model_url("actor", "/generate")
    assert [post(url, "", generate_body()).json()["output_ids"] for _ in range(2)] == [
        lane.outputs["second"]
    ] * 2
    lane.record_processes()


# -------------------------------------------------------------------------------------- the rollout client
class _Fleet:
    """The lane's two engines as a rollout client's fleet (the test knows which engine a try is on)."""

    def __init__(self, workers: list[Worker]) -> None:
        self.list = workers

    def workers(self, model: str) -> list[Worker]:
        return self.list


def test_a_request_for_a_minimum_version_gets_a_real_engine_that_has_it(lane: Lane):
    """One engine has taken the first checkpoint as version 2 (a weight update that reached it first), the other
    is still on version 1: a request with ``min_version=2`` comes back with version 2 and the first checkpoint's
    tokens, its segments all of version 2."""
    assert "second" in lane.outputs, "runs after test_the_trainer_loop_with_the_real_servers_answers"
    ahead, behind = ENGINES
    update = {"model_path": str(lane.models["first"]), "weight_version": "2"}
    assert post(lane.url(ahead), "/update_weights_from_disk", update).json()["success"] is True
    try:
        fleet = _Fleet(
            [Worker(lane.url(ahead), "actor", weight_version="2", id=ahead),
             Worker(lane.url(behind), "actor", weight_version="1", id=behind)]
        )  # fmt: skip
        client = AsyncRolloutClient(lane.deployment.registry, "actor", workers=fleet)
        sampling = {"max_new_tokens": 8, "temperature": 0}

        async def ask() -> Any:
            async with client:
                return await client.generate(text=PROMPT, sampling_params=sampling, min_version=2)

        result = asyncio.run(ask())
        assert list(result.output_ids) == lane.outputs["first"] and result.weight_versions == ("2",)
        assert [s.engine for s in result.segments] == [ahead]
    finally:
        back = {"model_path": str(lane.models["second"]), "weight_version": "1"}
        assert post(lane.url(ahead), "/update_weights_from_disk", back).json()["success"] is True


# ---------------------------------------------------------------------------------------------- teardown
def test_nothing_is_left_after_stop(lane: Lane):
    lane.record_processes()
    ports = [lane.port(e) for e in ENGINES]
    router_url = lane.deployment.registry.get_model_url("actor", "/generate")
    started = time.monotonic()
    lane.stack.close()
    real.record_measurement("stop (2 engines, router)", f"{time.monotonic() - started:.1f} s")
    assert len(lane.seen) >= 9  # 3 processes per engine, one engine restarted
    assert real.wait_until_gone(lane.seen, timeout_s=30) == {}
    assert real.engine_processes() == {}
    router_port = int(router_url.split(":")[2].split("/")[0])
    assert [p for p in [*ports, router_port] if port_accepts(p)] == []
