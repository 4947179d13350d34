"""Stand-in for ``python -m sglang.launch_server``: NOT a real SGLang engine.

SGLang engines cannot run on CPU-only machines, so launchers, routers and trainers are tested against this
small aiohttp server instead. It takes the same argv (checked against the sglang 0.5.23 ``ServerArgs``
fields, see ``flags.py``), binds ``--host``/``--port`` and answers the endpoints a real engine serves, with
deterministic fake generations: words of a fixed vocabulary, each a function of every token before it (so a
request for the prompt and its first tokens goes on as the whole request would) and of the weights (greedy
requests, ``temperature`` 0: the model path and weight version, the same on every engine of a model) or of the
engine (sampling: its port and seed). Everything it returns carries a ``stand_in`` marker.

Usage::

    python -m miles_sglang_plugin.standin --model-path Qwen/Qwen3-4B --host 127.0.0.1 --port 30000 [...]

Fault injection, read from the environment at start:

``MSP_STANDIN_START_DELAY_S``
    float seconds to wait before listening (SIGTERM during the wait still exits 0).
``MSP_STANDIN_FAIL_AT_START``
    non-empty and not ``0``: after the delay, print an error to stderr and exit with code 3, never listening.
``MSP_STANDIN_DIE_AFTER_S``
    float: exit with code 4 that many seconds after it started serving (a simulated crash).
``MSP_STANDIN_NEVER_HEALTHY``
    non-empty and not ``0``: serve normally, but ``/health``, ``/health_generate`` and ``/readiness``
    answer 503 forever (``/liveness`` stays 200: the process is alive).
``MSP_STANDIN_CONTROL_LATENCY_S``
    float: each control call (memory, weights, pause, LoRA: :mod:`.control`) takes that long.
``MSP_STANDIN_SPEED``
    a JSON object: ``/generate`` takes as long as the speed model of ``speed.py`` says for this engine's
    ``--tp-size`` (real waits; timing in ``meta_info`` as SGLang's). Unset: requests answer at once.

``MSP_ENGINE_NODE_ID`` (set by the backend that started it) is reported as ``node_id`` in ``/server_info``,
``/stand_in/stats`` and each response's stand-in metadata, next to the ``CUDA_VISIBLE_DEVICES`` it got.

At SIGTERM/SIGINT it logs ``stopping: signal received``, with the control calls it had not answered yet
(``; control calls unanswered: /pause_generation``): a stop that did not wait for them shows there.

Exit codes: 0 on SIGTERM/SIGINT, 1 when the port cannot be bound, 2 for a bad argv or a bad fault variable,
3 for ``MSP_STANDIN_FAIL_AT_START``, 4 for ``MSP_STANDIN_DIE_AFTER_S``, 5 for a call that crashes SGLang's
scheduler (resuming memory that was not released: :mod:`.control`).

With ``--node-rank`` > 0 it behaves as the follower process of a multi-node engine: it binds nothing and
waits to be terminated (the fault variables still apply).

Endpoints, answered as SGLang 0.5.23's server answers them (statuses and the shape of each answer: held to it
by ``tests/test_engine_contract.py``, run against both): ``/health`` and ``/health_generate`` (200 with an
empty body; ``/health_generate`` 503 while generation is paused or, with the memory saver, memory is released:
SGLang's never answers then, and says 503 after 20 s; the stand-in does not wait), ``/ready`` (503 while
paused), ``/server_info``, ``/get_server_info``, ``/model_info``, ``/get_model_info``, ``POST /generate``
(optionally SSE; input logprobs only from ``logprob_start_len`` on, as SGLang: none by default),
``POST /v1/chat/completions``, ``POST /v1/completions``, ``/v1/models``, ``POST /tokenize`` and
``/v1/tokenize`` (the ids ``/generate`` makes of a text), ``/flush_cache`` (its text answer;
400 while a generation request runs), ``/metrics`` (served whether or not ``--enable-metrics`` is given), the
control routes with their state (:mod:`miles_sglang_plugin.standin.control`: memory release/resume, weight
updates and version, pause/continue, abort, LoRA adapters; bodies checked against SGLang's request classes), Miles' weight-update bracket (no-ops),
and ``/stand_in/stats`` (request counters, the last PD bootstrap fields seen, the control state and the
control calls received). Any other path is 404 ``{"detail": "Not Found"}`` (FastAPI's): SGLang 0.5.23 serves
no ``/liveness``, ``/readiness``, ``/get_load`` or ``/get_weight_version``. Not emulated: how long SGLang
takes (``/health_generate`` waits a second before it answers; ``/health`` does too unless
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``, which Miles' engine environment sets). In PD mode the answers are a disaggregated server's: a
prefill engine generates one token and returns the prompt's logprobs; a decode engine returns no input
logprobs. With ``--disaggregation-mode prefill|decode``,
``/generate`` and ``/v1/chat/completions`` answer 400 unless the body has ``bootstrap_host``,
``bootstrap_port`` (may be null: the router sends null when it was given no port) and ``bootstrap_room``.
A prefill engine also answers 400 unless they name its own bootstrap server, where the decode engine that gets
the same body would look for it: ``bootstrap_host`` an address it serves on (its ``--host``; any address of
this machine for ``0.0.0.0`` / ``::``) and ``bootstrap_port`` its ``--disaggregation-bootstrap-port``. A null
``bootstrap_port`` is accepted only if that is SGLang's default, 8998: SGLang replaces null with the decode
engine's own ``--disaggregation-bootstrap-port``, 8998 unless set.
With ``--api-key K`` every endpoint except those starting with ``/health``, ``/ready`` and ``/metrics`` (as
SGLang's) needs ``Authorization: Bearer K``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from miles_sglang_plugin.engine_env import NODE_ID_ENV
from miles_sglang_plugin.masking import SECRET_FIELDS
from miles_sglang_plugin.standin.common import BodyError, Refusal, RequestError, error_response, json_object
from miles_sglang_plugin.standin.control import (
    CONTROL,
    CONTROL_LATENCY_ENV,
    EXIT_CRASHED,
    ControlState,
    SchedulerCrash,
    control_routes,
)
from miles_sglang_plugin.standin.flags import (
    SGLANG_DEFAULT_BOOTSTRAP_PORT,
    StandInArgs,
    StandInFlagError,
    parse_launch_argv,
)
from miles_sglang_plugin.standin.speed import (
    PACER,
    SpeedModel,
    StreamPacing,
    make_pacer,
    pace_requests,
    paced_meta,
    pacer_for,
    speed_from_env,
    stream_pacing,
)

TAG = "[stand-in engine]"
VERSION = "0.5.23+standin"
DEFAULT_MAX_NEW_TOKENS = 16
MAX_NEW_TOKENS_LIMIT = 1 << 16
VOCAB_SIZE = 32000
FIRST_WORD_ID = 256
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
#: SGLang answers these without an API key (by prefix: ``/health_generate`` too).
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)
FLUSH_FAILED = "Flush cache failed.\n"
VOCAB = (
    "the", "model", "is", "a", "stand", "in", "for", "sglang", "on", "cpu", "tokens", "flow", "through",
    "router", "engine", "rollout", "reward", "policy", "gradient", "batch", "and", "then", "we", "sample",
    "again", "with", "care", "so", "that", "tests", "pass", "quickly",
)  # fmt: skip

EXIT_OK, EXIT_BIND, EXIT_USAGE, EXIT_FAIL_AT_START, EXIT_DIED = 0, 1, 2, 3, 4


# --------------------------------------------------------------------------------------------------------
# Fault injection


def _flag_set(value: str | None) -> bool:
    return value is not None and value.strip() not in ("0", "")


def _float_env(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {raw!r}")
    return value


@dataclass(frozen=True)
class FaultConfig:
    """What the ``MSP_STANDIN_*`` environment variables ask for."""

    start_delay_s: float = 0.0
    fail_at_start: bool = False
    die_after_s: float | None = None
    never_healthy: bool = False
    control_latency_s: float = 0.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FaultConfig:
        return cls(
            start_delay_s=_float_env(env, "MSP_STANDIN_START_DELAY_S") or 0.0,
            fail_at_start=_flag_set(env.get("MSP_STANDIN_FAIL_AT_START")),
            die_after_s=_float_env(env, "MSP_STANDIN_DIE_AFTER_S"),
            never_healthy=_flag_set(env.get("MSP_STANDIN_NEVER_HEALTHY")),
            control_latency_s=_float_env(env, CONTROL_LATENCY_ENV) or 0.0,
        )


# --------------------------------------------------------------------------------------------------------
# Fake tokenizer and generator


def token_id(word: str) -> int:
    """A stable id for a whitespace-separated word."""
    digest = hashlib.blake2b(word.encode("utf-8"), digest_size=4).digest()
    return FIRST_WORD_ID + int.from_bytes(digest, "big") % (VOCAB_SIZE - FIRST_WORD_ID)


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    words: tuple[str, ...] | None = None  # known when the prompt came as text

    @classmethod
    def from_text(cls, text: str) -> Prompt:
        words = tuple(text.split())
        return cls(tuple(token_id(w) for w in words), words)

    def logprobs(self) -> list[float | None]:
        """Deterministic negative logprobs per prompt token; the first one is None (as in sglang)."""
        return [None if i == 0 else -round(0.5 + (t % 997) / 200, 4) for i, t in enumerate(self.ids)]


@dataclass(frozen=True)
class Generated:
    words: tuple[str, ...]
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    @property
    def text(self) -> str:
        return " ".join(self.words)

    def part(self, start: int, stop: int) -> Generated:
        return Generated(self.words[start:stop], self.ids[start:stop], self.logprobs[start:stop])


def _step(state: bytes, token: int) -> bytes:
    return hashlib.blake2b(state + token.to_bytes(4, "big"), digest_size=16).digest()


def fake_generate(prompt: Prompt, max_new_tokens: int, salt: str) -> Generated:
    """``max_new_tokens`` words from VOCAB, made one at a time as a language model does: each token is a
    function of ``salt`` and every token before it (the prompt's and those generated so far). So a request
    for the prompt followed by its first ``k`` generated tokens goes on with exactly the tokens the whole
    request would have made next (what a resubmitted request relies on)."""
    state = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for token in prompt.ids:
        state = _step(state, token)
    words: list[str] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        draw = int.from_bytes(state[:8], "big")
        word = VOCAB[draw % len(VOCAB)]
        words.append(word)
        logprobs.append(-round(0.01 + 3 * (int.from_bytes(state[8:], "big") / 2**64), 6))
        state = _step(state, token_id(word))
    return Generated(tuple(words), tuple(token_id(w) for w in words), tuple(logprobs))


# --------------------------------------------------------------------------------------------------------
# Engine state


def serves_on(host_flag: str, address: str) -> bool:
    """Is ``address`` one this engine serves on with ``--host host_flag``? The same address (IPv6 brackets
    and case aside), or, for a wildcard host, any address of this machine."""
    host, addr = host_flag.strip("[]").lower(), address.strip("[]").lower()
    if addr == host:
        return True
    return host in WILDCARD_HOSTS and _is_local_address(addr)


def _is_local_address(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address == "localhost"
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))  # binds only to an address of this machine
        except OSError:
            return False
    return True


def _sanitise(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")
    return cleaned[:120] or "model"


def local_model_dir(model_path: str) -> str:
    """An existing local directory to report as model/tokenizer path (keeps the router off the HF hub)."""
    if os.path.isdir(model_path):
        return os.path.abspath(model_path)
    path = Path(tempfile.gettempdir()) / "msp-standin-models" / _sanitise(model_path)
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _coerce(values: tuple[str, ...]) -> Any:
    if not values:
        return True
    out: list[Any] = []
    for raw in values:
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        if isinstance(value, float) and not math.isfinite(value):
            value = raw
        out.append(value)
    return out[0] if len(out) == 1 else out


def _int_extra(extra: Mapping[str, tuple[str, ...]], name: str, default: int) -> int:
    values = extra.get(name, ())
    try:
        return int(values[0]) if len(values) == 1 else default
    except ValueError:
        return default


@dataclass
class EngineState:
    """Everything the handlers share; lives on the aiohttp app."""

    args: StandInArgs
    faults: FaultConfig
    model_dir: str
    cuda_visible_devices: str | None
    #: The node it runs on as its backend names it (``MSP_ENGINE_NODE_ID``: the Ray node id), None if unset.
    node_id: str | None = None
    started_at: float = field(default_factory=time.time)
    received: Counter[str] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)
    last_bootstrap: dict[str, Any] | None = None
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    #: Generation requests being answered now (what /metrics reports as running, as SGLang does).
    in_flight: int = 0
    #: Of those, the ones held while generation is paused (SGLang's waiting queue, which a flush then ignores).
    held: int = 0
    #: What the control routes change (memory, weights, pause, LoRA adapters): :mod:`.control`.
    control: ControlState = field(init=False)
    max_total_num_tokens: int = field(init=False)
    max_running_requests: int = field(init=False)
    gpu_id_step: int = field(init=False)
    start_weight_version: str = field(init=False)

    def __post_init__(self) -> None:
        extra = self.args.extra_dict()
        self.control = ControlState(
            enable_lora=bool(self.args.enable_lora),
            memory_saver=bool(self.args.enable_memory_saver),
            tp_size=self.args.tp_size,
            pp_size=self.args.pp_size,
            latency_s=self.faults.control_latency_s,
            model_path=self.args.model_path,
        )
        if len(extra.get("weight_version", ())) == 1:
            self.control.weight_version = extra["weight_version"][0]
        self.start_weight_version = self.control.weight_version
        self.max_total_num_tokens = _int_extra(extra, "max_total_tokens", 65536)
        self.max_running_requests = _int_extra(extra, "max_running_requests", 128)
        self.gpu_id_step = _int_extra(extra, "gpu_id_step", 1)

    @property
    def salt(self) -> str:
        return f"{self.args.port}:{self.args.random_seed}"

    def greedy_salt(self) -> str:
        """Greedy decoding depends on the weights alone: every engine of a model with the same weight
        version makes the same tokens (sampling also depends on the engine's seed: :attr:`salt`)."""
        return f"{self.args.model_path}|{self.control.weight_version}"

    def complete(self, prompt: Prompt, max_new_tokens: int, *, greedy: bool = False) -> Generated:
        generated = fake_generate(prompt, max_new_tokens, self.greedy_salt() if greedy else self.salt)
        self.prompt_tokens_total += len(prompt.ids)
        self.generation_tokens_total += len(generated.ids)
        return generated

    def check_bootstrap(self, body: Mapping[str, Any]) -> None:
        """PD requests must carry the bootstrap fields; a prefill engine also checks that they point at its
        own bootstrap server (``--host``, ``--disaggregation-bootstrap-port``), where the decode engine that
        gets the same body would look for it."""
        present = {k: body[k] for k in BOOTSTRAP_KEYS if k in body}
        if self.args.disaggregation_mode != "null":
            missing = [
                k for k in BOOTSTRAP_KEYS if k not in body or (body[k] is None and k != "bootstrap_port")
            ]
            if missing:
                raise RequestError(
                    400,
                    f"stand-in engine in PD {self.args.disaggregation_mode} mode: the request lacks "
                    f"{', '.join(missing)} (a PD router adds bootstrap_host, bootstrap_port and "
                    "bootstrap_room)",
                )
            if self.args.disaggregation_mode == "prefill":
                self._check_own_bootstrap(body["bootstrap_host"], body["bootstrap_port"])
        if present:
            self.last_bootstrap = present

    def _check_own_bootstrap(self, host: Any, port: Any) -> None:
        own = self.args.disaggregation_bootstrap_port
        where = "stand-in prefill engine"
        if port is None:
            # SGLang's scheduler replaces a null bootstrap_port with the engine's own
            # --disaggregation-bootstrap-port: the decode engine then looks on its own port (SGLang's default
            # unless set), which reaches this engine only if it serves on that default too.
            if own != SGLANG_DEFAULT_BOOTSTRAP_PORT:
                raise RequestError(
                    400,
                    f"{where}: bootstrap_port is null, so the decode engine would look for the bootstrap "
                    f"server on its own --disaggregation-bootstrap-port ({SGLANG_DEFAULT_BOOTSTRAP_PORT} by "
                    f"default), but this engine's is {own} (register the prefill worker with its bootstrap_port)",
                )
        elif isinstance(port, bool) or port != own:
            raise RequestError(
                400,
                f"{where}: bootstrap_port {port!r} is not this engine's --disaggregation-bootstrap-port {own}",
            )
        if not isinstance(host, str) or not serves_on(self.args.host, host):
            raise RequestError(
                400,
                f"{where}: bootstrap_host {host!r} is not an address it serves on (--host {self.args.host})",
            )

    def stand_in_meta(self, body: Mapping[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "port": self.args.port,
            "disaggregation_mode": self.args.disaggregation_mode,
            "cuda_visible_devices": self.cuda_visible_devices,
            "node_id": self.node_id,
        }
        meta.update({k: body[k] for k in BOOTSTRAP_KEYS if k in body})
        return meta

    def gpu_ids(self) -> list[int]:
        per_node = max(1, self.args.world_size // self.args.nnodes)
        return [self.args.base_gpu_id + i * self.gpu_id_step for i in range(per_node)]

    def server_info(self) -> dict[str, Any]:
        args = self.args
        info: dict[str, Any] = {
            name: _coerce(values) for name, values in args.extra if name not in SECRET_FIELDS
        }
        info.update(
            model_path=self.model_dir,
            tokenizer_path=self.model_dir,
            requested_model_path=args.model_path,
            served_model_name=args.model_name,
            host=args.host,
            port=args.port,
            tp_size=args.tp_size,
            dp_size=args.dp_size,
            pp_size=args.pp_size,
            ep_size=args.ep_size,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            dist_init_addr=args.dist_init_addr,
            base_gpu_id=args.base_gpu_id,
            gpu_ids=self.gpu_ids(),
            disaggregation_mode=args.disaggregation_mode,
            disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
            enable_memory_saver=args.enable_memory_saver,
            random_seed=args.random_seed,
            enable_lora=args.enable_lora,
            lora_paths=list(args.lora_paths) if args.lora_paths is not None else None,
            skip_server_warmup=args.skip_server_warmup,
            enable_metrics=args.enable_metrics,
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            version=VERSION,
            status="ready",
            # As SGLang: the start-up --weight-version (its ServerArgs); the current one is /model_info's.
            weight_version=self.start_weight_version,
            internal_states=[
                {
                    "world_size": args.world_size,
                    "tp_size": args.tp_size,
                    "pp_size": args.pp_size,
                    "dp_size": args.dp_size,
                    "disaggregation_mode": args.disaggregation_mode,
                    "max_total_num_tokens": self.max_total_num_tokens,
                    "last_gen_throughput": 0.0,
                }
            ],
            stand_in=True,
            cuda_visible_devices=self.cuda_visible_devices,
            node_id=self.node_id,
            hostname=socket.gethostname(),
            argv=args.masked_argv(),
            pid=os.getpid(),
        )
        return info

    def model_info(self) -> dict[str, Any]:
        loaded = self.control.disk_model_path
        return {
            # As SGLang: the checkpoint last loaded from disk (a local directory, for the router).
            "model_path": self.model_dir if loaded is None else local_model_dir(loaded),
            "tokenizer_path": self.model_dir,
            "requested_model_path": self.args.model_path,
            "served_model_name": self.args.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.control.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "stand_in",
            "architectures": ["StandInForCausalLM"],
            "stand_in": True,
        }


STATE: web.AppKey[EngineState] = web.AppKey("standin_state", EngineState)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --------------------------------------------------------------------------------------------------------
# Request helpers


def _is_ids(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _generate_prompts(body: Mapping[str, Any]) -> tuple[list[Prompt], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None:
        if isinstance(text, str):
            return [Prompt.from_text(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [Prompt.from_text(t) for t in text], True
        raise RequestError(400, "text must be a string or a non-empty list of strings")
    if ids is not None:
        if _is_ids(ids):
            return [Prompt(tuple(ids))], False
        if isinstance(ids, list) and ids and all(_is_ids(x) for x in ids):
            return [Prompt(tuple(x)) for x in ids], True
        raise RequestError(400, "input_ids must be a list of integers or a non-empty list of such lists")
    raise RequestError(400, "the request needs text or input_ids")


def _max_tokens(value: Any, what: str) -> int:
    if value is None:
        return DEFAULT_MAX_NEW_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_NEW_TOKENS_LIMIT:
        raise RequestError(400, f"{what} must be an integer in 0..{MAX_NEW_TOKENS_LIMIT}, got {value!r}")
    return value


def _rid(value: Any, index: int) -> str:
    item = value[index] if isinstance(value, list) and index < len(value) else None
    if isinstance(item, str):
        return item
    if isinstance(value, str) and index == 0:
        return value
    return uuid.uuid4().hex


#: SGLang's finish reason of a request ended by an abort of all requests (``schedule_batch.py``: FINISH_ABORT).
ABORT_FINISH = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


async def _sse(
    request: web.Request,
    events: Iterable[dict[str, Any]],
    pacing: StreamPacing | None = None,
    aborted: Callable[[], bool] | None = None,
) -> web.StreamResponse:
    """Stream ``events``; once ``aborted()`` (an abort of all requests while this one runs), the last event
    sent is sent again as the final one, with SGLang's abort finish reason, and the stream ends."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    previous: dict[str, Any] | None = None
    try:
        for index, event in enumerate(events):
            timing = await pacing.before(index) if pacing is not None else None
            if aborted is not None and aborted():
                if previous is not None:
                    final = previous
                    final["meta_info"] = {**final["meta_info"], "finish_reason": dict(ABORT_FINISH)}
                else:  # aborted before its first token: nothing made
                    meta = {**event["meta_info"], "completion_tokens": 0, "finish_reason": dict(ABORT_FINISH)}
                    meta["weight_versions"] = [{**meta["weight_versions"][0], "end": 0}]
                    if "output_token_logprobs" in meta:
                        meta["output_token_logprobs"] = []
                    final = {**event, "text": "", "output_ids": [], "meta_info": meta}
                await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
                break
            if timing is not None:  # the last event: what the request waited, as SGLang reports it
                event["meta_info"].update(timing.meta())
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            previous = event
    finally:
        if pacing is not None:
            pacing.cancel()
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _stream_steps(max_new_tokens: int) -> list[int]:
    return list(range(1, max_new_tokens + 1)) or [0]


# --------------------------------------------------------------------------------------------------------
# Middlewares


#: The routes that generate (their requests in flight are /metrics' running requests).
GENERATION_PATHS = frozenset({"/generate", "/v1/chat/completions", "/v1/completions"})


@web.middleware
async def _count_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    routed = request.match_info.http_exception is None
    generating = routed and request.path in GENERATION_PATHS
    if routed:
        state.received[request.path] += 1
    state.in_flight += generating
    try:
        response = await handler(request)
    finally:
        state.in_flight -= generating
    if routed and response.status < 400:
        state.served[request.path] += 1
    return response


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[STATE].args.api_key
    if key and not request.path.startswith(OPEN_PREFIXES):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return error_response(401, "missing or wrong Authorization: Bearer <api key>")
    return await handler(request)


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BodyError as exc:
        return exc.response()
    except RequestError as exc:
        return error_response(exc.status, exc.message)
    except Refusal as exc:
        return web.json_response(exc.body, status=exc.status)
    except SchedulerCrash as exc:
        # SGLang's scheduler raises, the engine exits, the request gets no answer (the connection drops).
        print(
            f"{TAG} scheduler crashed as SGLang 0.5.23's would: {exc}; exiting", file=sys.stderr, flush=True
        )
        os._exit(EXIT_CRASHED)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)  # FastAPI's answer
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


# --------------------------------------------------------------------------------------------------------
# Handlers


async def health(request: web.Request) -> web.Response:
    """200 with an empty body, as SGLang's. ``/health_generate`` runs a one-token generation in SGLang: an
    engine that cannot generate (paused; memory released with the memory saver) never answers it and says 503
    after 20 s (the stand-in at once); ``/health`` answers without generating where
    ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false, as in Miles' engine environment."""
    state = request.app[STATE]
    if state.faults.never_healthy:
        return web.Response(status=503)
    cannot_generate = state.control.paused is not None or state.control.generation_refusal() is not None
    if request.path == "/health_generate" and cannot_generate:
        return web.Response(status=503)
    return web.Response(status=200)


async def ready(request: web.Request) -> web.Response:
    """SGLang's readiness for new requests: 503 while generation is paused (or never healthy)."""
    state = request.app[STATE]
    unready = state.faults.never_healthy or state.control.paused is not None
    return web.Response(status=503 if unready else 200)


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].server_info())


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].model_info())


def _generate_item(
    state: EngineState,
    body: Mapping[str, Any],
    prompt: Prompt,
    generated: Generated,
    *,
    rid: str,
    finished: bool,
    started: float,
) -> dict[str, Any]:
    completion_tokens = len(generated.ids)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": "length", "length": completion_tokens} if finished else None,
        "prompt_tokens": len(prompt.ids),
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
        "weight_version": state.control.weight_version,
        "weight_versions": [{"version": state.control.weight_version, "start": 0, "end": completion_tokens}],
        "e2e_latency": round(time.perf_counter() - started, 6),
        "stand_in": state.stand_in_meta(body),
    }
    if body.get("return_logprob"):
        with_text = bool(body.get("return_text_in_logprobs"))
        in_words = prompt.words if with_text and prompt.words else (None,) * len(prompt.ids)
        out_words = generated.words if with_text else (None,) * completion_tokens
        # As SGLang's disaggregated servers: the prefill engine computes the prompt's logprobs, the decode
        # engine never sends input logprobs (output_streamer.py: "Decode server does not send input
        # logprobs"); a PD router puts the prefill's in front of the decode's.
        # SGLang computes input logprobs from logprob_start_len on (-1, its default: none).
        start = body.get("logprob_start_len")
        start = start if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else None
        meta["input_token_logprobs"] = (
            []
            if state.args.disaggregation_mode == "decode" or start is None
            else [[lp, t, w] for lp, t, w in zip(prompt.logprobs(), prompt.ids, in_words, strict=True)][
                start:
            ]
        )
        meta["output_token_logprobs"] = [
            [lp, t, w] for lp, t, w in zip(generated.logprobs, generated.ids, out_words, strict=True)
        ]
    return {"text": generated.text, "output_ids": list(generated.ids), "meta_info": meta}


async def _admitted(state: EngineState) -> None:
    """A generation request may run: it waits while generation is paused (SGLang queues it, whatever the
    trainer does to the memory meanwhile), then 503 while memory is released (with the memory saver)."""
    state.held += 1
    try:
        await state.control.wait_until_running()
    finally:
        state.held -= 1
    refusal = state.control.generation_refusal()
    if refusal is not None:
        raise RequestError(503, refusal)


def _metadata(state: EngineState, completion_tokens: int) -> dict[str, Any]:
    """The OpenAI routes' ``metadata`` (SGLang's): the weight version of the tokens."""
    version = state.control.weight_version
    return {
        "weight_version": version,
        "weight_versions": [{"version": version, "start": 0, "end": completion_tokens}],
    }


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    started = time.perf_counter()
    body = await json_object(request)
    state.check_bootstrap(body)
    prompts, batch = _generate_prompts(body)
    await _admitted(state)
    sampling = body.get("sampling_params") or {}
    if isinstance(sampling, list):  # a batch may carry one dict per prompt; the stand-in uses the first
        sampling = sampling[0] if sampling else {}
    if not isinstance(sampling, dict):
        raise RequestError(400, "sampling_params must be an object")
    max_new = _max_tokens(sampling.get("max_new_tokens"), "sampling_params.max_new_tokens")
    if state.args.disaggregation_mode == "prefill":
        max_new = min(max_new, 1)  # SGLang's prefill server generates the first token only
    greedy = sampling.get("temperature") == 0 or sampling.get("top_k") == 1
    results = [state.complete(p, max_new, greedy=greedy) for p in prompts]
    rids = [_rid(body.get("rid"), i) for i in range(len(prompts))]
    if body.get("stream"):
        if batch:
            raise RequestError(400, "the stand-in engine does not stream batched requests")
        prompt, generated = prompts[0], results[0]
        events = (
            _generate_item(
                state, body, prompt, generated.part(0, k), rid=rids[0], finished=k == max_new, started=started
            )
            for k in _stream_steps(max_new)
        )
        pacing = stream_pacing(pacer_for(request.app), len(prompt.ids), max_new)
        aborts = state.control.aborts
        return await _sse(request, events, pacing, lambda: state.control.aborts != aborts)
    timings = await pace_requests(pacer_for(request.app), [len(p.ids) for p in prompts], max_new)
    items = [
        _generate_item(state, body, p, g, rid=r, finished=True, started=started)
        for p, g, r in zip(prompts, results, rids, strict=True)
    ]
    paced_meta(items, timings)
    return web.json_response(items if batch else items[0])


def _chat_prompt(messages: Any) -> Prompt:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list")
    lines = []
    for message in messages:
        if not isinstance(message, dict):
            raise RequestError(400, "each message must be an object")
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        lines.append(f"{message.get('role', 'user')}: {content or ''}")
    return Prompt.from_text("\n".join(lines))


def _openai_max_tokens(body: Mapping[str, Any]) -> int:
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    return _max_tokens(value, "max_tokens")


def _usage(prompt: Prompt, generated: Generated) -> dict[str, int]:
    prompt_tokens, completion_tokens = len(prompt.ids), len(generated.ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _chat_logprobs(body: Mapping[str, Any], generated: Generated) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice or a chunk (None unless the request asks for them)."""
    if not body.get("logprobs"):
        return None
    content = [
        {
            "token": word,
            "token_id": token_id,
            "logprob": logprob,
            "bytes": list(word.encode()),
            "top_logprobs": [],
        }
        for word, token_id, logprob in zip(generated.words, generated.ids, generated.logprobs, strict=True)
    ]
    return {"content": content}


def _chat_chunks(
    chunk: dict[str, Any], body: Mapping[str, Any], prompt: Prompt, generated: Generated
) -> Iterable[dict[str, Any]]:
    """The streamed answer: the role, one chunk per token, then the finish reason (with the usage when the
    request's ``stream_options.include_usage`` asks for it, as OpenAI's and SGLang's)."""
    yield {
        **chunk,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
    }
    for k in range(len(generated.ids)):
        delta = {"content": (" " if k else "") + generated.words[k]}
        logprobs = _chat_logprobs(body, generated.part(k, k + 1))
        yield {
            **chunk,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}],
        }
    last = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        last["usage"] = _usage(prompt, generated)
    yield last


def _chat_choice(body: Mapping[str, Any], generated: Generated) -> dict[str, Any]:
    return {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": generated.text,
            "reasoning_content": None,
        },
        "logprobs": _chat_logprobs(body, generated),
        "finish_reason": "length",
        "matched_stop": None,
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await json_object(request)
    state.check_bootstrap(body)
    prompt = _chat_prompt(body.get("messages"))
    await _admitted(state)
    max_new = _openai_max_tokens(body)
    generated = state.complete(prompt, max_new)
    model = body.get("model") or state.args.model_name
    common = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    stand_in = state.stand_in_meta(body)
    if body.get("stream"):
        chunk = {**common, "object": "chat.completion.chunk", "stand_in": stand_in}
        return await _sse(request, _chat_chunks(chunk, body, prompt, generated))
    return web.json_response(
        {
            **common,
            "object": "chat.completion",
            "choices": [_chat_choice(body, generated)],
            "usage": _usage(prompt, generated),
            "metadata": _metadata(state, len(generated.ids)),
            "stand_in": stand_in,
        }
    )


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await json_object(request)
    raw = body.get("prompt")
    if isinstance(raw, str):
        prompt = Prompt.from_text(raw)
    elif _is_ids(raw):
        prompt = Prompt(tuple(raw))
    else:
        raise RequestError(400, "prompt must be a string or a list of token ids")
    await _admitted(state)
    generated = state.complete(prompt, _openai_max_tokens(body))
    common = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or state.args.model_name,
        "stand_in": state.stand_in_meta(body),
    }
    if body.get("stream"):
        raise RequestError(400, "the stand-in engine does not stream /v1/completions")
    logprobs = None
    if body.get("logprobs"):
        logprobs = {
            "tokens": list(generated.words),
            "token_logprobs": list(generated.logprobs),
            "top_logprobs": None,
            "text_offset": None,
        }
    choice = {
        "index": 0,
        "text": generated.text,
        "logprobs": logprobs,
        "finish_reason": "length",
        "matched_stop": None,
    }
    usage = _usage(prompt, generated)
    return web.json_response(
        {**common, "choices": [choice], "usage": usage, "metadata": _metadata(state, len(generated.ids))}
    )


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = {
        "id": state.args.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "sglang",
        "root": state.args.model_path,
        "parent": None,
        "max_model_len": state.max_total_num_tokens,
    }
    adapters = [  # loaded LoRA adapters, as SGLang lists them
        {"id": name, "object": "model", "root": path, "parent": state.args.model_name, "max_model_len": None}
        for name, path in state.control.lora_adapters.items()
    ]
    return web.json_response({"object": "list", "data": [model, *adapters]})


async def tokenize(request: web.Request) -> web.Response:
    """SGLang's ``/tokenize`` (``/v1/tokenize``): ``prompt`` (a string or a list of them) as token ids, with
    the stand-in's word tokenizer (the ids ``/generate`` makes of the same text)."""
    state = request.app[STATE]
    body = await json_object(request)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = list(Prompt.from_text(prompt).ids)
        return web.json_response(
            {"tokens": ids, "count": len(ids), "max_model_len": state.max_total_num_tokens}
        )
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        lists = [list(Prompt.from_text(p).ids) for p in prompt]
        return web.json_response(
            {"tokens": lists, "count": [len(x) for x in lists], "max_model_len": state.max_total_num_tokens}
        )
    raise RequestError(400, "prompt must be a string or a non-empty list of strings")


async def flush_cache(request: web.Request) -> web.Response:
    """Refused (400) while a generation request runs, as SGLang's scheduler refuses unless it is idle; requests
    held by a pause do not count (SGLang then ignores its waiting queue)."""
    state = request.app[STATE]
    if state.in_flight > state.held:
        return web.Response(status=400, text=FLUSH_FAILED)
    return web.Response(text=FLUSHED)


def _prom_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    labels = f'{{model_name="{_prom_label(state.args.model_name)}"}}'
    rows = [
        (
            "sglang:num_requests_total",
            "counter",
            "Requests served (stand-in).",
            sum(state.served[p] for p in ("/generate", "/v1/chat/completions", "/v1/completions")),
        ),
        ("sglang:prompt_tokens_total", "counter", "Prompt tokens processed.", state.prompt_tokens_total),
        ("sglang:generation_tokens_total", "counter", "Tokens generated.", state.generation_tokens_total),
        ("sglang:num_running_reqs", "gauge", "Running requests.", state.in_flight),
        ("sglang:num_queue_reqs", "gauge", "Queued requests.", 0),
        ("sglang:token_usage", "gauge", "KV cache usage.", 0.0),
    ]
    lines = []
    for name, kind, text, value in rows:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{labels} {value}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")


async def weight_update_bracket(request: web.Request) -> web.Response:
    """Miles' weight-update bracket (``/begin_weight_update``, ``/end_weight_update``) and
    ``/update_weights_from_tensor`` (CUDA IPC, which a stand-in cannot receive): accepted, nothing changes."""
    await json_object(request, required=False)
    return web.json_response({"success": True, "message": "stand-in engine: no-op"})


async def stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "stand_in": True,
            "port": state.args.port,
            "pid": os.getpid(),
            "disaggregation_mode": state.args.disaggregation_mode,
            "cuda_visible_devices": state.cuda_visible_devices,
            "node_id": state.node_id,
            "requests_received": dict(state.received),
            "requests_served": dict(state.served),
            "in_flight": state.in_flight,
            "last_bootstrap": state.last_bootstrap,
            **state.control.stats(),
            "prompt_tokens_total": state.prompt_tokens_total,
            "generation_tokens_total": state.generation_tokens_total,
            "uptime_s": round(time.time() - state.started_at, 3),
        }
    )


BRACKET_PATHS = ("/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor")


def build_app(
    args: StandInArgs,
    faults: FaultConfig | None = None,
    *,
    cuda_visible_devices: str | None = None,
    node_id: str | None = None,
    speed: SpeedModel | None = None,
) -> web.Application:
    """The aiohttp application of a stand-in engine (node_rank 0)."""
    app = web.Application(
        middlewares=[_count_middleware, _auth_middleware, _error_middleware], client_max_size=64 * 2**20
    )
    app[STATE] = EngineState(
        args=args,
        faults=faults or FaultConfig(),
        model_dir=local_model_dir(args.model_path),
        cuda_visible_devices=cuda_visible_devices,
        node_id=node_id,
    )
    app[PACER] = make_pacer(
        speed, tp=args.tp_size, max_running=app[STATE].max_running_requests, mode=args.disaggregation_mode
    )
    get, post = web.get, web.post
    routes = [
        *(get(p, health) for p in ("/health", "/health_generate")),
        get("/ready", ready),
        *(get(p, server_info) for p in ("/server_info", "/get_server_info")),
        *(get(p, model_info) for p in ("/model_info", "/get_model_info")),
        post("/generate", generate),
        post("/v1/chat/completions", chat_completions),
        post("/v1/completions", completions),
        get("/v1/models", models),
        *(post(p, tokenize) for p in ("/tokenize", "/v1/tokenize")),
        get("/flush_cache", flush_cache),
        post("/flush_cache", flush_cache),
        get("/metrics", metrics),
        *control_routes(),
        *(post(p, weight_update_bracket) for p in BRACKET_PATHS),
        get("/stand_in/stats", stats),
    ]
    app.add_routes(routes)
    app[CONTROL] = app[STATE].control
    return app


# --------------------------------------------------------------------------------------------------------
# Process


class _ProbeFilter(logging.Filter):
    """Demote aiohttp's traceback for non-HTTP/1.1 bytes (sglang-router's gRPC probe) to a one-line INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], BadHttpMessage):
            record.msg, record.args = (
                "%s rejected a non-HTTP/1.1 request (e.g. a router's gRPC probe)",
                (TAG,),
            )
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _wait(stop: asyncio.Event, timeout: float | None) -> bool:
    """True if ``stop`` was set, False if ``timeout`` passed first."""
    try:
        await asyncio.wait_for(stop.wait(), timeout)
    except TimeoutError:
        return False
    return True


async def _run_until_stopped(
    stop: asyncio.Event, faults: FaultConfig, control: ControlState | None = None
) -> int:
    if await _wait(stop, faults.die_after_s):
        # What was still out when the signal came: a launcher that stops an engine without waiting for the
        # control calls it sent is seen doing so here.
        unanswered = (
            f"; control calls unanswered: {', '.join(control.unanswered)}"
            if control and control.unanswered
            else ""
        )
        print(f"{TAG} stopping: signal received{unanswered}", flush=True)
        return EXIT_OK
    print(
        f"{TAG} MSP_STANDIN_DIE_AFTER_S={faults.die_after_s} reached: exiting with code {EXIT_DIED} "
        "(simulated crash)",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_DIED


def _serving_app(args: StandInArgs, faults: FaultConfig, env: Mapping[str, str]) -> web.Application:
    return build_app(
        args,
        faults,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        node_id=env.get(NODE_ID_ENV) or None,
        speed=speed_from_env(env),
    )


async def serve(args: StandInArgs, faults: FaultConfig, env: Mapping[str, str]) -> int:
    """Run the stand-in until SIGTERM/SIGINT (or an injected fault); return the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    where = f"CUDA_VISIBLE_DEVICES={visible if visible is not None else '<unset>'}"
    if env.get(NODE_ID_ENV):
        where += f", node {env[NODE_ID_ENV]}"
    if args.node_rank > 0:
        print(
            f"{TAG} NOT a real SGLang engine: node_rank={args.node_rank} of nnodes={args.nnodes} for "
            f"{args.model_path}, follower of --dist-init-addr {args.dist_init_addr}; not serving HTTP, "
            f"{where}",
            flush=True,
        )
    else:
        print(
            f"{TAG} NOT a real SGLang engine: serving {args.model_path} on {_url(args.host, args.port)}, "
            f"mode={args.disaggregation_mode}, {where}",
            flush=True,
        )
    # As SGLang's engine does at start (engine.py: "server_args=..."): every field, the API key included, which
    # is why a log excerpt the launcher shows masks what the process was given.
    fields = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in ("extra", "argv")
    }
    print(f"{TAG} server_args={fields}", flush=True)
    if faults.start_delay_s and await _wait(stop, faults.start_delay_s):
        return EXIT_OK
    if faults.fail_at_start:
        print(
            f"{TAG} error: failing at start as asked by MSP_STANDIN_FAIL_AT_START",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAIL_AT_START
    if args.node_rank > 0:
        return await _run_until_stopped(stop, faults)
    logging.getLogger("aiohttp.server").addFilter(_ProbeFilter())
    app = _serving_app(args, faults, env)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, args.host, args.port).start()
        except OSError as exc:
            print(
                f"{TAG} error: cannot listen on {_url(args.host, args.port)}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_BIND
        print(f"{TAG} listening on {_url(args.host, args.port)} (pid {os.getpid()})", flush=True)
        return await _run_until_stopped(stop, faults, app[CONTROL])
    finally:
        await runner.cleanup()


USAGE = """usage: python -m miles_sglang_plugin.standin --model-path PATH [--host H] [--port P] [flags...]

Stand-in for `python -m sglang.launch_server` (NOT a real SGLang engine). Accepts the launch_server
flags of sglang 0.5.23 (checked against the ServerArgs field names); see the module docstring of
miles_sglang_plugin.standin.engine for endpoints and the MSP_STANDIN_* fault-injection variables."""


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Entry point of ``python -m miles_sglang_plugin.standin``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return EXIT_OK
    try:
        args = parse_launch_argv(argv)
        faults = FaultConfig.from_env(env)
        speed_from_env(env)  # a bad MSP_STANDIN_SPEED is a usage error, before anything binds
    except (StandInFlagError, ValueError) as exc:
        print(f"{TAG} error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return asyncio.run(serve(args, faults, env))
