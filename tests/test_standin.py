"""Tests of the stand-in SGLang engine (``python -m miles_sglang_plugin.standin``).

Unit tests of the argv parser, then process tests that start the stand-in (and the real sglang-router) on
free local ports; every process is started in its own session and its group is killed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_sglang_plugin.standin.engine import (
    EngineState,
    FaultConfig,
    Prompt,
    RequestError,
    fake_generate,
    serves_on,
    token_id,
)
from miles_sglang_plugin.standin.flags import (
    StandInFlagError,
    mask_argv,
    parse_launch_argv,
    server_args_fields,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
API_KEY = "s3cret-key"


# --------------------------------------------------------------------------------------------------------
# parse_launch_argv


def test_shipped_field_list() -> None:
    fields = server_args_fields()
    assert len(fields) == 546
    assert {"model_path", "tp_size", "disaggregation_mode", "mem_fraction_static"} <= fields


def test_parse_dash_and_underscore_spellings() -> None:
    dash = parse_launch_argv(["--model-path", "m", "--tp-size", "4", "--dp-size", "2", "--base-gpu-id", "3"])
    under = parse_launch_argv(["--model_path", "m", "--tp_size", "4", "--dp_size", "2", "--base_gpu_id", "3"])
    assert (dash.tp_size, dash.dp_size, dash.base_gpu_id) == (4, 2, 3)
    assert (under.model_path, under.tp_size, under.dp_size, under.base_gpu_id) == ("m", 4, 2, 3)
    assert (dash.host, dash.port, dash.pp_size, dash.node_rank) == ("127.0.0.1", 30000, 1, 0)
    assert dash.disaggregation_mode == "null"


def test_parse_equals_form_and_aliases() -> None:
    args = parse_launch_argv(
        [
            "--model=org/m",
            "--tensor-parallel-size=2",
            "--pipeline-parallel-size",
            "2",
            "--ep",
            "2",
            "--data-parallel-size=1",
            "--nccl-init-addr=10.0.0.1:5000",
            "--port=31000",
            "--nnodes",
            "2",
            "--node-rank=1",
            "--disaggregation-mode=prefill",
            "--disaggregation-bootstrap-port=9001",
        ]
    )
    assert args.model_path == "org/m"
    assert (args.tp_size, args.pp_size, args.ep_size, args.dp_size) == (2, 2, 2, 1)
    assert args.dist_init_addr == "10.0.0.1:5000"
    assert (args.port, args.nnodes, args.node_rank) == (31000, 2, 1)
    assert (args.disaggregation_mode, args.disaggregation_bootstrap_port) == ("prefill", 9001)
    assert args.world_size == 4


def test_parse_booleans() -> None:
    args = parse_launch_argv(
        [
            "--model-path",
            "m",
            "--enable-memory-saver",
            "--skip-server-warmup",
            "--enable-metrics=false",
            "--enable-lora",
            "--trust-remote-code",
            "--port",
            "1234",
        ]
    )
    assert args.enable_memory_saver and args.skip_server_warmup and args.enable_lora
    assert args.enable_metrics is False
    assert args.extra_dict()["trust_remote_code"] == ()
    assert args.port == 1234
    defaults = parse_launch_argv(["--model-path", "m"])
    assert not defaults.enable_memory_saver and defaults.enable_lora is None and defaults.lora_paths is None
    with pytest.raises(StandInFlagError, match="boolean"):
        parse_launch_argv(["--model-path", "m", "--enable-memory-saver", "yes-please"])


def test_parse_multi_value_and_raw_flags() -> None:
    args = parse_launch_argv(
        [
            "--model-path",
            "m",
            "--lora-paths",
            "a=/x/a",
            "b=/x/b",
            "/x/c",
            "--served-model-name",
            "srv",
            "--mem-fraction-static",
            "0.7",
            "--random-seed",
            "-3",
            "--json-model-override-args",
            '{"a": 1}',
            "--cuda-graph-bs-decode",
            "1",
            "2",
            "4",
            "--api-key",
            "k",
        ]
    )
    assert args.lora_paths == ("a=/x/a", "b=/x/b", "/x/c")
    assert args.served_model_name == "srv" and args.model_name == "srv"
    assert args.random_seed == -3
    assert args.api_key == "k"
    extra = args.extra_dict()
    assert extra["mem_fraction_static"] == ("0.7",)
    assert extra["json_model_override_args"] == ('{"a": 1}',)
    assert extra["cuda_graph_bs_decode"] == ("1", "2", "4")
    assert parse_launch_argv(["--model-path", "m", "--lora-paths"]).lora_paths == ()


def test_unknown_flag_is_rejected_with_suggestion() -> None:
    with pytest.raises(StandInFlagError) as info:
        parse_launch_argv(["--model-path", "m", "--mem-fraction-statc", "0.8"])
    message = str(info.value)
    assert "--mem-fraction-statc" in message and "--mem-fraction-static" in message
    with pytest.raises(StandInFlagError, match="--tp-sise"):
        parse_launch_argv(["--model-path", "m", "--tp-sise", "2"])


def test_missing_model_path_is_rejected() -> None:
    with pytest.raises(StandInFlagError, match="--model-path is required"):
        parse_launch_argv(["--tp-size", "2"])
    with pytest.raises(StandInFlagError, match="--model-path"):
        parse_launch_argv(["--model-path"])


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--model-path", "m", "--tp-size", "two"], "integer"),
        (["--model-path", "m", "--tp-size", "2", "3"], "exactly one value"),
        (["--model-path", "m", "--disaggregation-mode", "both"], "null, prefill, decode"),
        (["--model-path", "m", "--nnodes", "2", "--node-rank", "2"], "node-rank"),
        (["--model-path", "m", "--port", "70000"], "1..65535"),
        (["m", "--model-path", "m"], "unexpected argument 'm'"),
        (["--model-path", "m", "--tp-size", "0"], ">= 1"),
    ],
)
def test_bad_values_are_rejected(argv: list[str], pattern: str) -> None:
    with pytest.raises(StandInFlagError, match=pattern):
        parse_launch_argv(argv)


def test_api_key_never_in_errors() -> None:
    with pytest.raises(StandInFlagError) as info:
        parse_launch_argv(["--model-path", "m", "--api-key", "topsecret", "stray"])
    assert "topsecret" not in str(info.value) and "--api-key" in str(info.value)


def test_mask_argv() -> None:
    argv = ["--model-path", "m", "--api-key", "k1", "--api_key=k2", "--admin-api-key", "k3", "--port", "1"]
    masked = mask_argv(argv)
    assert masked == [
        "--model-path",
        "m",
        "--api-key",
        "***",
        "--api_key=***",
        "--admin-api-key",
        "***",
        "--port",
        "1",
    ]
    assert parse_launch_argv(argv).masked_argv() == masked


def test_fault_config_and_fake_generation() -> None:
    assert FaultConfig.from_env({}) == FaultConfig()
    faults = FaultConfig.from_env(
        {
            "MSP_STANDIN_START_DELAY_S": "1.5",
            "MSP_STANDIN_FAIL_AT_START": "0",
            "MSP_STANDIN_DIE_AFTER_S": "2",
            "MSP_STANDIN_NEVER_HEALTHY": "1",
        }
    )
    assert faults == FaultConfig(start_delay_s=1.5, fail_at_start=False, die_after_s=2.0, never_healthy=True)
    with pytest.raises(ValueError, match="MSP_STANDIN_DIE_AFTER_S"):
        FaultConfig.from_env({"MSP_STANDIN_DIE_AFTER_S": "soon"})
    prompt = Prompt.from_text("the quick brown fox")
    one, two = fake_generate(prompt, 8, "a"), fake_generate(prompt, 8, "a")
    assert one == two and len(one.ids) == 8 and all(lp < 0 for lp in one.logprobs)
    assert fake_generate(prompt, 8, "b") != one
    assert fake_generate(prompt, 0, "a").text == ""


# --------------------------------------------------------------------------------------------------------
# PD bootstrap fields against the engine's own flags


def _state(*flags: str) -> EngineState:
    args = parse_launch_argv(["--model-path", "m", "--host", HOST, "--port", "31000", *flags])
    return EngineState(args=args, faults=FaultConfig(), model_dir="/m", cuda_visible_devices=None)


def _bootstrap_error(state: EngineState, **fields: Any) -> str:
    body = {"text": "x", "bootstrap_host": HOST, "bootstrap_port": 9001, "bootstrap_room": 7, **fields}
    with pytest.raises(RequestError) as info:
        state.check_bootstrap(body)
    assert info.value.status == 400
    return info.value.message


def test_prefill_accepts_only_its_own_bootstrap_server() -> None:
    prefill = _state("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001")
    good = {"bootstrap_host": HOST, "bootstrap_port": 9001, "bootstrap_room": 7}
    prefill.check_bootstrap({"text": "x", **good})
    assert prefill.last_bootstrap == good
    assert (
        "bootstrap_port 9002 is not this engine's --disaggregation-bootstrap-port 9001"
        in _bootstrap_error(prefill, bootstrap_port=9002)
    )
    assert "bootstrap_port 8998 is not" in _bootstrap_error(prefill, bootstrap_port=8998)  # SGLang's default
    assert "bootstrap_port '9001' is not" in _bootstrap_error(prefill, bootstrap_port="9001")
    assert "bootstrap_port True is not" in _bootstrap_error(prefill, bootstrap_port=True)
    # null: the decode engine would fall back to its own port (8998 by default), not this engine's 9001
    assert "bootstrap_port is null" in _bootstrap_error(prefill, bootstrap_port=None)
    assert "bootstrap_host '10.9.8.7' is not an address it serves on (--host 127.0.0.1)" in _bootstrap_error(
        prefill, bootstrap_host="10.9.8.7"
    )
    assert "bootstrap_host 7 is not" in _bootstrap_error(prefill, bootstrap_host=7)
    assert prefill.last_bootstrap == good  # rejected requests are not recorded


def test_prefill_on_the_default_bootstrap_port_accepts_null() -> None:
    prefill = _state("--disaggregation-mode", "prefill")  # --disaggregation-bootstrap-port 8998 (default)
    for port in (None, 8998):
        prefill.check_bootstrap({"bootstrap_host": HOST, "bootstrap_port": port, "bootstrap_room": 1})
    assert (
        "bootstrap_port 9001 is not this engine's --disaggregation-bootstrap-port 8998"
        in _bootstrap_error(prefill)
    )


def test_decode_and_regular_engines_do_not_check_the_prefill_bootstrap_server() -> None:
    decode = _state("--disaggregation-mode", "decode")  # its own bootstrap port (8998) is not the prefill's
    decode.check_bootstrap({"bootstrap_host": "10.9.8.7", "bootstrap_port": 9001, "bootstrap_room": 7})
    assert "lacks bootstrap_room" in _bootstrap_error(decode, bootstrap_room=None)
    _state().check_bootstrap({"text": "x"})  # a regular engine needs no bootstrap fields


def test_serves_on() -> None:
    assert serves_on("127.0.0.1", "127.0.0.1") and serves_on("::1", "[::1]") and serves_on("[::1]", "::1")
    assert serves_on("LocalHost", "localhost")
    assert not serves_on("127.0.0.1", "10.9.8.7") and not serves_on("127.0.0.1", "::1")
    # A wildcard host serves on every address of this machine, and on no other.
    assert serves_on("0.0.0.0", "127.0.0.1") and serves_on("0.0.0.0", "localhost")
    assert not serves_on("0.0.0.0", "192.0.2.1")  # TEST-NET-1: never an address of this machine


# --------------------------------------------------------------------------------------------------------
# Process helpers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in the group
    proc.wait(timeout=10)


class Proc:
    """A subprocess in its own session, with stdout/stderr captured to files."""

    def __init__(self, popen: subprocess.Popen[bytes], out: Path, err: Path, port: int | None) -> None:
        self.popen, self.out, self.err, self.port = popen, out, err, port

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    procs: list[subprocess.Popen[bytes]] = []

    def _spawn(argv: list[str], *, env: dict[str, str] | None = None, port: int | None = None) -> Proc:
        python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, "PYTHONPATH": python_path}
        full_env.pop("CUDA_VISIBLE_DEVICES", None)
        full_env.update(env or {})
        out, err = tmp_path / f"p{len(procs)}.out", tmp_path / f"p{len(procs)}.err"
        with out.open("wb") as fo, err.open("wb") as fe:
            popen = subprocess.Popen(
                [sys.executable, *argv],
                cwd=REPO_ROOT,
                env=full_env,
                stdout=fo,
                stderr=fe,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        procs.append(popen)
        return Proc(popen, out, err, port)

    yield _spawn
    for popen in procs:
        _kill_group(popen)


def start_standin(spawn: Callable[..., Proc], *flags: str, env: dict[str, str] | None = None) -> Proc:
    port = free_port()
    argv = [
        "-m",
        "miles_sglang_plugin.standin",
        "--model-path",
        "Qwen/Qwen3-4B",
        "--host",
        HOST,
        "--port",
        str(port),
        *flags,
    ]
    return spawn(argv, env=env, port=port)


def wait_http(proc: Proc, path: str = "/health", timeout: float = 20.0, status: int = 200) -> float:
    """Poll until ``path`` answers ``status``; return the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.popen.poll() is not None:
            raise AssertionError(f"process exited {proc.popen.returncode}: {proc.stderr()}")
        try:
            if httpx.get(proc.url + path, timeout=1.0).status_code == status:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{proc.url}{path} did not answer {status} within {timeout} s")


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --------------------------------------------------------------------------------------------------------
# Process tests


def test_engine_endpoints(spawn: Callable[..., Proc]) -> None:
    proc = start_standin(
        spawn,
        "--tp-size",
        "2",
        "--api-key",
        API_KEY,
        "--mem-fraction-static",
        "0.7",
        "--enable-memory-saver",
        env={"CUDA_VISIBLE_DEVICES": "3,4", "MSP_ENGINE_NODE_ID": "node-a"},
    )
    wait_http(proc)
    assert (
        "NOT a real SGLang engine" in proc.stdout()
        and "CUDA_VISIBLE_DEVICES=3,4, node node-a" in proc.stdout()
    )
    # Like SGLang's engine it logs its server_args at start, the key included (the launcher masks the log
    # lines it quotes); nowhere else.
    (logged,) = [line for line in proc.stdout().splitlines() if API_KEY in line]
    assert "server_args={'model_path'" in logged and f"'api_key': '{API_KEY}'" in logged
    assert API_KEY not in proc.stderr()
    with httpx.Client(base_url=proc.url, timeout=5.0) as client:
        for path in ("/health", "/health_generate", "/ready", "/metrics"):  # open, as SGLang's (by prefix)
            assert client.get(path).status_code == 200, path
        assert (client.get("/health").text, client.get("/health_generate").text) == ("", "")
        for path in ("/liveness", "/readiness", "/get_load", "/get_weight_version"):  # none in SGLang 0.5.23
            answer = client.get(path, headers=auth())
            assert (answer.status_code, answer.json()) == (404, {"detail": "Not Found"}), path
        assert client.get("/server_info").status_code == 401
        assert client.get("/server_info", headers=auth("wrong")).status_code == 401
        assert client.post("/generate", json={"text": "hi"}).status_code == 401

        info = client.get("/server_info", headers=auth()).json()
        assert info["stand_in"] is True and info["cuda_visible_devices"] == "3,4"
        assert info["node_id"] == "node-a"
        assert info["tp_size"] == 2 and info["internal_states"][0]["world_size"] == 2
        assert info["disaggregation_mode"] == "null" and info["enable_memory_saver"] is True
        assert Path(info["model_path"]).is_dir() and info["tokenizer_path"] == info["model_path"]
        assert (
            info["requested_model_path"] == "Qwen/Qwen3-4B" and info["served_model_name"] == "Qwen/Qwen3-4B"
        )
        assert info["mem_fraction_static"] == 0.7 and info["pid"] == proc.popen.pid
        assert API_KEY not in str(info) and info["argv"][info["argv"].index("--api-key") + 1] == "***"
        assert client.get("/get_server_info", headers=auth()).json()["port"] == proc.port

        model = client.get("/model_info", headers=auth()).json()
        assert model["is_generation"] is True and Path(model["model_path"]).is_dir()
        assert client.get("/get_model_info", headers=auth()).json()["weight_version"] == "default"

        body = {
            "text": "one two three four",
            "sampling_params": {"max_new_tokens": 5, "temperature": 0.7},
            "return_logprob": True,
            "logprob_start_len": 0,
            "background": False,
            "model": None,
            "stream": False,
        }
        out = client.post("/generate", json=body, headers=auth()).json()
        meta = out["meta_info"]
        assert isinstance(out["text"], str) and len(out["text"].split()) == 5
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (4, 5, 0)
        assert len(meta["input_token_logprobs"]) == 4 and meta["input_token_logprobs"][0][0] is None
        assert len(meta["output_token_logprobs"]) == 5
        for logprob, tid, text in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]:
            assert isinstance(logprob, float) and logprob < 0 and isinstance(tid, int) and text is None
        assert meta["stand_in"] == {
            "port": proc.port,
            "disaggregation_mode": "null",
            "cuda_visible_devices": "3,4",
            "node_id": "node-a",
        }
        assert client.post("/generate", json=body, headers=auth()).json()["text"] == out["text"]

        no_start = {k: v for k, v in body.items() if k != "logprob_start_len"}  # SGLang's default -1: none
        assert (
            client.post("/generate", json=no_start, headers=auth()).json()["meta_info"][
                "input_token_logprobs"
            ]
            == []
        )
        ids = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
               "logprob_start_len": 0}  # fmt: skip
        scored = client.post("/generate", json=ids, headers=auth()).json()
        assert scored["text"] == "" and scored["meta_info"]["completion_tokens"] == 0
        assert scored["meta_info"]["output_token_logprobs"] == []
        assert [t for _, t, _ in scored["meta_info"]["input_token_logprobs"]] == [5, 6, 7]
        assert client.post("/generate", json={"sampling_params": {}}, headers=auth()).status_code == 400
        bad = {"text": "x", "sampling_params": {"max_new_tokens": -1}}
        assert client.post("/generate", json=bad, headers=auth()).status_code == 400

        stream = client.post(
            "/generate",
            json={"text": "a b", "stream": True, "sampling_params": {"max_new_tokens": 3}},
            headers=auth(),
        )
        events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
        assert len(events) == 4 and events[-1] == "[DONE]"

        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": "Qwen/Qwen3-4B",
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 3,
                "logprobs": True,
            },
            headers=auth(),
        ).json()
        choice = chat["choices"][0]
        assert chat["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert len(choice["message"]["content"].split()) == 3 and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["content"]) == 3 and chat["usage"]["completion_tokens"] == 3

        completion = client.post("/v1/completions", json={"prompt": "x y", "max_tokens": 2}, headers=auth())
        assert completion.json()["choices"][0]["text"] and completion.json()["usage"]["prompt_tokens"] == 2
        assert client.get("/v1/models", headers=auth()).json()["data"][0]["id"] == "Qwen/Qwen3-4B"
        assert client.get("/flush_cache", headers=auth()).status_code == 200
        assert client.post("/flush_cache", headers=auth()).status_code == 200
        assert "sglang:num_requests_total" in client.get("/metrics").text
        assert client.post("/abort_request", json={"abort_all": True}, headers=auth()).status_code == 200
        released = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]}, headers=auth())
        assert (released.status_code, released.json()) == (200, None)
        resumed = client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}, headers=auth())
        assert (resumed.status_code, resumed.json()) == (200, None)
        client.post("/update_weights_from_disk", json={"model_path": "/x"}, headers=auth())
        assert client.get("/model_info", headers=auth()).json()["weight_version"] == "default"
        body = {"model_path": "/x", "weight_version": "1"}
        client.post("/update_weights_from_disk", json=body, headers=auth())
        assert client.get("/model_info", headers=auth()).json()["weight_version"] == "1"

        stats = client.get("/stand_in/stats", headers=auth()).json()
        assert stats["requests_served"]["/generate"] == 5 and stats["requests_received"]["/generate"] == 8
        assert stats["requests_served"]["/v1/chat/completions"] == 1
        assert (stats["cuda_visible_devices"], stats["node_id"]) == ("3,4", "node-a")

    os.killpg(proc.popen.pid, signal.SIGTERM)
    assert proc.wait(10) == 0
    assert "stopping: signal received" in proc.stdout()


def test_pd_prefill_requires_bootstrap_fields(spawn: Callable[..., Proc]) -> None:
    proc = start_standin(spawn, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001")
    wait_http(proc)
    with httpx.Client(base_url=proc.url, timeout=5.0) as client:
        info = client.get("/server_info").json()
        assert info["disaggregation_mode"] == "prefill" and info["disaggregation_bootstrap_port"] == 9001
        assert info["internal_states"][0]["disaggregation_mode"] == "prefill"
        plain = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
        rejected = client.post("/generate", json=plain)
        assert rejected.status_code == 400 and "bootstrap_room" in rejected.text
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=chat).status_code == 400
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9001, "bootstrap_room": 12345}
        elsewhere = client.post("/generate", json={**plain, **boot, "bootstrap_port": 9002})
        assert elsewhere.status_code == 400 and "--disaggregation-bootstrap-port 9001" in elsewhere.text
        out = client.post("/generate", json={**plain, **boot}).json()
        assert out["meta_info"]["stand_in"]["bootstrap_room"] == 12345
        assert client.post("/v1/chat/completions", json={**chat, **boot}).status_code == 200
        stats = client.get("/stand_in/stats").json()
        assert stats["last_bootstrap"] == boot
        served = stats["requests_served"]
        assert (served["/generate"], served["/v1/chat/completions"], served["/server_info"]) == (1, 1, 1)
        assert stats["requests_received"]["/generate"] == 3


def test_fail_at_start(spawn: Callable[..., Proc]) -> None:
    proc = start_standin(spawn, env={"MSP_STANDIN_FAIL_AT_START": "1", "MSP_STANDIN_START_DELAY_S": "0.2"})
    assert proc.wait(20) == 3
    assert "MSP_STANDIN_FAIL_AT_START" in proc.stderr()


def test_die_after(spawn: Callable[..., Proc]) -> None:
    proc = start_standin(spawn, env={"MSP_STANDIN_DIE_AFTER_S": "1.0"})
    wait_http(proc)
    assert proc.wait(20) == 4
    assert "simulated crash" in proc.stderr()


def test_start_delay_and_never_healthy(spawn: Callable[..., Proc]) -> None:
    delayed = start_standin(spawn, env={"MSP_STANDIN_START_DELAY_S": "1.5"})
    sick = start_standin(spawn, env={"MSP_STANDIN_NEVER_HEALTHY": "1"})
    assert wait_http(delayed) >= 1.2
    wait_http(sick, "/server_info")
    for path in ("/health", "/health_generate"):
        assert httpx.get(sick.url + path).status_code == 503
    assert httpx.get(sick.url + "/server_info").status_code == 200


def test_sigterm_during_start_delay(spawn: Callable[..., Proc]) -> None:
    proc = start_standin(spawn, env={"MSP_STANDIN_START_DELAY_S": "60"})
    deadline = time.monotonic() + 20
    while "NOT a real SGLang engine" not in proc.stdout() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.popen.pid, signal.SIGTERM)
    assert proc.wait(10) == 0


def test_bad_flag_exits_2(spawn: Callable[..., Proc]) -> None:
    proc = start_standin(spawn, "--mem-fraction-statc", "0.8")
    assert proc.wait(20) == 2
    assert "--mem-fraction-static" in proc.stderr()


def test_port_taken(spawn: Callable[..., Proc]) -> None:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        port = sock.getsockname()[1]
        argv = ["-m", "miles_sglang_plugin.standin", "--model-path", "m", "--host", HOST, "--port", str(port)]
        proc = spawn(argv)
        assert proc.wait(20) not in (0, None)
        assert "cannot listen" in proc.stderr()


def test_follower_node_does_not_serve(spawn: Callable[..., Proc]) -> None:
    proc = start_standin(
        spawn, "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.1.2.3:5000", "--tp-size", "16"
    )
    deadline = time.monotonic() + 20
    while "follower" not in proc.stdout() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "follower of --dist-init-addr 10.1.2.3:5000" in proc.stdout()
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError, match="Connection refused"):
        httpx.get(proc.url + "/health", timeout=1.0)
    assert proc.popen.poll() is None
    os.killpg(proc.popen.pid, signal.SIGTERM)
    assert proc.wait(10) == 0


# --------------------------------------------------------------------------------------------------------
# With the real sglang-router 0.3.2


def start_router(spawn: Callable[..., Proc], *flags: str) -> Proc:
    port = free_port()
    argv = [
        "-m",
        "sglang_router.launch_router",
        "--host",
        HOST,
        "--port",
        str(port),
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
        *flags,
    ]
    return spawn(argv, port=port)


def wait_router_ready(router: Proc, timeout: float = 30.0) -> dict[str, Any]:
    start, last = time.monotonic(), None
    while time.monotonic() - start < timeout:
        if router.popen.poll() is not None:
            raise AssertionError(f"router exited {router.popen.returncode}: {router.stderr()}")
        try:
            last = httpx.get(router.url + "/readiness", timeout=1.0)
            if last.status_code == 200 and last.json().get("status") == "ready":
                return last.json()
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"router not ready within {timeout} s: {last and last.text}; {router.stderr()}")


def test_registers_with_real_router(spawn: Callable[..., Proc]) -> None:
    engine = start_standin(spawn)
    wait_http(engine)
    router = start_router(spawn, "--policy", "round_robin", "--worker-urls", engine.url)
    ready = wait_router_ready(router)
    assert ready["healthy_workers"] == 1
    body = {"text": "route me please", "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    out = httpx.post(router.url + "/generate", json=body, timeout=10.0).json()
    assert out["meta_info"]["stand_in"]["port"] == engine.port
    assert len(out["meta_info"]["output_token_logprobs"]) == 4
    stats = httpx.get(engine.url + "/stand_in/stats").json()["requests_served"]
    assert stats["/server_info"] >= 1 and stats["/model_info"] >= 1 and stats["/generate"] == 1
    assert "Traceback" not in engine.stderr()  # the router's gRPC probe is no traceback


def test_pd_pair_with_real_router(spawn: Callable[..., Proc]) -> None:
    prefill = start_standin(
        spawn, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001"
    )
    decode = start_standin(spawn, "--disaggregation-mode", "decode")
    wait_http(prefill)
    wait_http(decode)
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
    body = {"text": "split me", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
    out = httpx.post(router.url + "/generate", json=body, timeout=10.0).json()
    meta = out["meta_info"]["stand_in"]
    assert meta["port"] == decode.port and meta["disaggregation_mode"] == "decode"
    assert meta["bootstrap_host"] == HOST and meta["bootstrap_port"] == 9001
    prefill_boot = httpx.get(prefill.url + "/stand_in/stats").json()["last_bootstrap"]
    assert prefill_boot["bootstrap_room"] == meta["bootstrap_room"]


def test_greedy_tokens_depend_on_the_weights_and_a_tokenizer_gives_the_generate_ids(
    spawn: Callable[..., Proc],
) -> None:
    """Two engines of one model make the same greedy tokens (a resubmitted request may go to either); with
    another weight version they make others; sampling still differs by engine (its seed and port)."""
    one, two = start_standin(spawn), start_standin(spawn)
    wait_http(one)
    wait_http(two)

    def ids(engine: Proc, **sampling: Any) -> list[int]:
        body = {"text": "a b c", "sampling_params": {"max_new_tokens": 6, **sampling}}
        return httpx.post(engine.url + "/generate", json=body, timeout=10).json()["output_ids"]

    assert ids(one, temperature=0) == ids(two, temperature=0) and ids(one) != ids(two)
    httpx.post(two.url + "/update_weight_version", json={"new_version": "5"}, timeout=10).raise_for_status()
    assert ids(one, temperature=0) != ids(two, temperature=0)
    tokens = httpx.post(one.url + "/tokenize", json={"prompt": "a b c"}, timeout=10).json()
    assert tokens == {
        "tokens": [token_id("a"), token_id("b"), token_id("c")],
        "count": 3,
        "max_model_len": 65536,
    }
    same = httpx.post(
        one.url + "/generate",
        json={"input_ids": tokens["tokens"], "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        timeout=10,
    )
    assert same.json()["output_ids"] == ids(one, temperature=0)


def test_an_abort_of_all_requests_ends_a_running_stream_with_its_tokens(spawn: Callable[..., Proc]) -> None:
    """As SGLang's: the stream's last event has the tokens made so far and the abort finish reason."""
    engine = start_standin(spawn, env={"MSP_STANDIN_SPEED": '{"decode_step_s": 0.05, "decode_token_s": 0}'})
    wait_http(engine)
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 400}, "stream": True}
    events = []
    with httpx.stream("POST", engine.url + "/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    httpx.post(engine.url + "/abort_request", json={"abort_all": True}, timeout=10)
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert 3 <= len(last["output_ids"]) < 400 and last["output_ids"] == events[-2]["output_ids"]
