"""External engines: engines that already run elsewhere, which a model's router serves (Miles' and slime's
``rollout_external``). They hold no GPU of the deployment, are never started or stopped by it, and take no
part in offloading; health, routing, weight updates and the other control calls reach them like any engine.

Each is written as a URL (a regular engine) or as ``{url, worker_type, bootstrap_port}`` (a prefill or decode
engine of a PD model); this module checks what was written and numbers them per model.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable

from miles_sglang_plugin.config.deployment_spec import ExternalEngineSpec, WorkerType, is_int
from miles_sglang_plugin.errors import ProblemCollector
from miles_sglang_plugin.planning.plan import ExternalEnginePlan

#: What an external engine can serve (a placeholder reserves GPUs, which an external engine has none of here).
EXTERNAL_WORKER_TYPES = (WorkerType.regular.value, WorkerType.prefill.value, WorkerType.decode.value)


def normalise_engine_url(url: object) -> str | None:
    """``http://host:port`` (scheme added when missing, trailing ``/`` dropped), or None when ``url`` is not the
    base URL of an HTTP server (no host, no port, a path, a query)."""
    if not isinstance(url, str) or not url.strip():
        return None
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        return None
    return f"{parts.scheme}://{parts.netloc}"


def _worker_type(spec: ExternalEngineSpec, problems: ProblemCollector) -> WorkerType | None:
    if str(spec.worker_type) not in EXTERNAL_WORKER_TYPES:
        problems.add(
            f"{spec.key}.worker_type",
            f"{spec.worker_type!r} is not what an external engine serves; valid: {', '.join(EXTERNAL_WORKER_TYPES)}",
        )
        return None
    return WorkerType(str(spec.worker_type))


def _bootstrap_port(spec: ExternalEngineSpec, worker_type: WorkerType, problems: ProblemCollector) -> bool:
    port = spec.bootstrap_port
    if port is None:
        return True
    if worker_type is not WorkerType.prefill:
        problems.add(f"{spec.key}.bootstrap_port", f"is only for prefill engines, not {worker_type.value!r}")
        return False
    if not is_int(port) or not 0 < port < 65536:
        problems.add(f"{spec.key}.bootstrap_port", f"must be an integer in 1..65535, got {port!r}")
        return False
    return True


def external_engine_plans(
    model: str, specs: Iterable[ExternalEngineSpec], seen: dict[str, str], problems: ProblemCollector
) -> tuple[ExternalEnginePlan, ...]:
    """The external engines of ``model``, checked: each URL a server's base URL, given once in the whole
    deployment (``seen``: URL -> where it was first written, filled in here), a worker type an engine can
    serve, a bootstrap port only for a prefill engine."""
    plans = []
    for index, spec in enumerate(specs):
        key = spec.key or f"sglang.{model}.external[{index}]"
        spec = ExternalEngineSpec(spec.url, spec.worker_type, spec.bootstrap_port, key)
        url = normalise_engine_url(spec.url)
        if url is None:
            problems.add(
                key,
                f"{spec.url!r} is not an engine's base URL; write http://HOST:PORT (or HOST:PORT), no path",
            )
            continue
        if url in seen:
            problems.add(key, f"{url} is already an external engine at {seen[url]}; give each engine once")
            continue
        seen[url] = key
        worker_type = _worker_type(spec, problems)
        if worker_type is None or not _bootstrap_port(spec, worker_type, problems):
            continue
        plans.append(ExternalEnginePlan(model, index, url, worker_type, spec.bootstrap_port))
    return tuple(plans)
