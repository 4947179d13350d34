"""The per-job rollout benchmark: a bounded load against each model's router, measured as SGLang reports it.

For each model, ``num_prompts`` ``/generate`` requests of exactly ``input_len`` prompt token ids and
``output_len`` output tokens (``ignore_eos``), ``concurrency`` in flight, streamed by default. Per request:

* TTFT: SGLang's ``meta_info.first_token_latency`` (0.5.23 reports it with ``--enable-metrics``, which every
  plan sets), else the client's time to the first streamed token;
* latency: ``meta_info.e2e_latency`` (SGLang always reports it), else the client's time to the last byte;
* output tokens: ``meta_info.completion_tokens``, else the ids received;
* ``queue_time`` where the engine reports it.

The summary per model: requests/s and output tokens/s over the model's wall time (first request sent to last
answer), TTFT, latency and client latency percentiles (p50, p90, p99, linear interpolation), and errors (HTTP
status, transport errors, streamed error events, deadlines), each kind counted with one sample message.
``metrics.json`` (beside ``plan.json``, in the job's output directory) also holds the job's overrides (the
sweep parameters), the deployment's shape and whether the engines were stand-ins (and their speed model).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from miles_sglang_plugin.errors import DeploymentConfigError, Problem
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.serving.deployment import Deployment

METRICS_FILE = "metrics.json"
PLAN_FILE = "plan.json"
FORMAT_VERSION = 1
#: Bounds of the settings (a benchmark is bounded work).
LIMITS = {"num_prompts": 100_000, "concurrency": 4096, "input_len": 1_000_000, "output_len": 1_000_000}
TOKEN_ID_RANGE = (1000, 20000)


@dataclass(frozen=True)
class BenchSettings:
    num_prompts: int = 64
    concurrency: int = 8
    input_len: int = 128
    output_len: int = 32
    #: Empty: every model with engines.
    models: tuple[str, ...] = ()
    stream: bool = True
    request_timeout_s: float = 120.0
    timeout_s: float = 900.0
    seed: int = 0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], plan: DeploymentPlan | None = None) -> BenchSettings:
        """Checked settings from ``sglang_bench`` (a mapping); every problem in one error."""
        data = dict(values)
        data["models"] = tuple(data.get("models") or ())
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        problems = [Problem(f"sglang_bench.{k}", "is not a setting of the benchmark") for k in unknown]
        if not unknown:
            settings = cls(**data)
            problems += settings.problems(plan)
            if not problems:
                return settings
        raise DeploymentConfigError(problems, source="sglang_bench")

    def problems(self, plan: DeploymentPlan | None) -> list[Problem]:
        out = []
        for name, limit in LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                out.append(Problem(f"sglang_bench.{name}", f"{value!r} must be an integer in 1..{limit}"))
        for name in ("request_timeout_s", "timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
                out.append(Problem(f"sglang_bench.{name}", f"{value!r} must be a number of seconds > 0"))
        if plan is not None:
            known = [m.name for m in plan.models if m.engines]
            for name in self.models:
                if name not in known:
                    out.append(Problem("sglang_bench.models", f"{name!r} has no engines; models: {known}"))
        return out

    def models_of(self, plan: DeploymentPlan) -> list[str]:
        return list(self.models) or [m.name for m in plan.models if m.engines]


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    client_latency: float | None = None
    client_ttft: float | None = None
    engine: dict[str, float] = field(default_factory=dict)
    output_tokens: int = 0


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default): p50 of [1, 2, 3, 4] is 2.5."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = pct / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    stats = {f"p{p}": percentile(values, p) for p in (50, 90, 99)}
    return {**stats, "mean": sum(values) / len(values), "max": max(values)}


def prompt_ids(settings: BenchSettings) -> list[list[int]]:
    """``num_prompts`` distinct prompts of exactly ``input_len`` token ids (seeded, so every job gets the same)."""
    rng = random.Random(settings.seed)
    low, high = TOKEN_ID_RANGE
    return [
        [rng.randrange(low, high) for _ in range(settings.input_len)] for _ in range(settings.num_prompts)
    ]


def _request_body(ids: list[int], settings: BenchSettings) -> dict[str, Any]:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": settings.output_len, "ignore_eos": True, "temperature": 0.0},
        "stream": settings.stream,
    }


ENGINE_KEYS = {"first_token_latency": "ttft", "e2e_latency": "latency", "queue_time": "queue_time"}


def _read_meta(record: RequestRecord, chunk: Mapping[str, Any]) -> None:
    meta = chunk.get("meta_info") or {}
    for key, name in ENGINE_KEYS.items():
        value = meta.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            record.engine[name] = float(value)
    tokens = meta.get("completion_tokens")
    record.output_tokens = tokens if isinstance(tokens, int) else len(chunk.get("output_ids") or [])


async def _streamed(
    client: httpx.AsyncClient, url: str, body: Any, headers: Any, record: RequestRecord
) -> None:
    start = time.perf_counter()
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code >= 400:
            text = (await response.aread()).decode(errors="replace")
            raise _HTTPStatus(response.status_code, text)
        last: dict[str, Any] | None = None
        async for line in response.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise _StreamError(str(chunk["error"]))
            if record.client_ttft is None and (chunk.get("output_ids") or chunk.get("text")):
                record.client_ttft = time.perf_counter() - start
            last = chunk
    if last is None:
        raise _StreamError("the stream ended without a result")
    _read_meta(record, last)


class _HTTPStatus(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text.strip()[:200]}")


class _StreamError(Exception):
    pass


async def _one_request(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any]
) -> RequestRecord:
    record = RequestRecord()
    start = time.perf_counter()
    try:
        if body["stream"]:
            await _streamed(client, url, body, headers, record)
        else:
            response = await client.post(url, json=body, headers=headers)
            if response.status_code >= 400:
                raise _HTTPStatus(response.status_code, response.text)
            _read_meta(record, response.json())
        record.ok = True
    except (httpx.HTTPError, _HTTPStatus, _StreamError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, _HTTPStatus) else str(exc)
    record.client_latency = time.perf_counter() - start
    return record


async def _bench_model(
    url: str, headers_for: Any, prompts: list[list[int]], settings: BenchSettings
) -> tuple[list[RequestRecord], float]:
    """Every prompt once, ``concurrency`` at a time; the records and the wall time."""
    records: list[RequestRecord | None] = [None] * len(prompts)
    cursor = iter(range(len(prompts)))
    limits = httpx.Limits(
        max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency
    )

    async def worker(client: httpx.AsyncClient) -> None:
        for index in cursor:
            body = _request_body(prompts[index], settings)
            records[index] = await _one_request(client, url, headers_for(index), body)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=settings.request_timeout_s, limits=limits) as client:
        workers = [
            asyncio.create_task(worker(client)) for _ in range(min(settings.concurrency, len(prompts)))
        ]
        _done, pending = await asyncio.wait(workers, timeout=settings.timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    late = f"not answered within the benchmark's timeout_s={settings.timeout_s:g}"
    return [r if r is not None else RequestRecord(error=late) for r in records], wall


def _metric(records: list[RequestRecord], engine_key: str, client_attr: str) -> tuple[list[float], str]:
    """Per request the engine's value where it reports one, else the client's; and which source it was."""
    values, sources = [], set()
    for r in records:
        if engine_key in r.engine:
            values.append(r.engine[engine_key])
            sources.add("engine")
        elif getattr(r, client_attr, None) is not None:
            values.append(getattr(r, client_attr))
            sources.add("client")
    return values, "+".join(sorted(sources)) or "none"


def summarize_model(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """The summary of one model's requests (see the module docstring)."""
    ok = [r for r in records if r.ok]
    errors = Counter(r.error.split(":", 1)[0] for r in records if r.error)
    samples = {
        kind: next(r.error for r in records if r.error and r.error.startswith(kind)) for kind in errors
    }
    ttft, ttft_source = _metric(ok, "ttft", "client_ttft")
    latency, latency_source = _metric(ok, "latency", "client_latency")
    output_tokens = sum(r.output_tokens for r in ok)
    queue = [r.engine["queue_time"] for r in ok if "queue_time" in r.engine]
    return {
        "requests": len(records),
        "succeeded": len(ok),
        "failed": len(records) - len(ok),
        "errors": [{"kind": k, "count": n, "sample": samples[k][:300]} for k, n in errors.most_common(5)],
        "duration_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "output_tokens": output_tokens,
        "ttft_s": summarize(ttft),
        "ttft_source": ttft_source,
        "latency_s": summarize(latency),
        "latency_source": latency_source,
        "client_latency_s": summarize([r.client_latency for r in ok if r.client_latency is not None]),
        "client_ttft_s": summarize([r.client_ttft for r in ok if r.client_ttft is not None]),
        "queue_time_s": summarize(queue),
    }


async def arun_rollout_bench(deployment: Deployment, settings: BenchSettings) -> dict[str, Any]:
    """Measure each model of ``deployment`` in turn; the ``models`` part of ``metrics.json``."""
    plan = deployment.prepared.plan
    registry, auth = deployment.registry, deployment.auth_headers()
    prompts = prompt_ids(settings)
    out: dict[str, Any] = {}
    for name in settings.models_of(plan):
        url = registry.get_model_url(name, "/generate")

        def headers_for(index: int, name: str = name) -> dict[str, str]:
            # a distinct routing key per request (the consistent_hashing and manual policies need one)
            return {**auth, **registry.routing_headers(name, f"bench-{index}")}

        records, wall = await _bench_model(url, headers_for, prompts, settings)
        out[name] = summarize_model(records, wall)
    return out


def run_rollout_bench(deployment: Deployment, settings: BenchSettings) -> dict[str, Any]:
    """:func:`arun_rollout_bench` for synchronous code (not from inside a running event loop)."""
    return asyncio.run(arun_rollout_bench(deployment, settings))


def deployment_shape(plan: DeploymentPlan) -> dict[str, Any]:
    """GPUs, engines and TP per model and group: what a report shows next to the numbers."""
    models = {}
    for model in plan.models:
        groups = {
            g.name: {
                "worker_type": g.worker_type.value,
                "gpus": g.num_gpus,
                "tp": g.tp_size,
                "engines": len(g.engines),
            }
            for g in model.groups
        }
        models[model.name] = {"gpus": model.num_gpus, "engines": len(model.engines), "groups": groups}
    return {"total_gpus": plan.total_gpus, "rollout_num_gpus": plan.rollout_num_gpus, "models": models}


def metrics_document(
    deployment: Deployment, settings: BenchSettings, models: dict[str, Any], overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """The whole ``metrics.json``: the models' numbers with what they were measured on."""
    launch = deployment.prepared.launch
    simulated = launch.engine_kind.value == "simulated"
    speed = asdict(deployment.settings.standin.speed) if simulated else None
    return {
        "format": FORMAT_VERSION,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "overrides": list(overrides),
        "engine_kind": launch.engine_kind.value,
        "simulated": simulated,
        "speed_model": speed if speed and speed.pop("enabled") else None,
        "settings": {**asdict(settings), "models": list(settings.models_of(deployment.prepared.plan))},
        "deployment": deployment_shape(deployment.prepared.plan),
        "models": models,
    }


def write_job_results(output_dir: Path, deployment: Deployment, document: dict[str, Any]) -> Path:
    """``plan.json`` (as ``miles-sglang plan --json``, secrets masked) and ``metrics.json`` in ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / PLAN_FILE).write_text(json.dumps(deployment.prepared.to_dict(), indent=2) + "\n")
    path = output_dir / METRICS_FILE
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path
