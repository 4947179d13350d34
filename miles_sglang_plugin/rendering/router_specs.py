"""One sglang-router (0.3.2) per model: settings, launch command, worker registration and readiness.

This module is data plus small synchronous HTTP helpers. It builds the command that starts a router
(``python -m miles_sglang_plugin.router_main``) but does not start or supervise processes.

What sglang-router 0.3.2 does on the wire (checked against the real router):

* ``POST /workers {"url", "worker_type", "bootstrap_port"?, "api_key"?}`` answers **202** with
  ``{"status": "accepted", "worker_id", "url", "location", "message"}``; the worker is probed (``/health``,
  ``/server_info``, ``/model_info``) and added in the background, usually within ~0.1 s. A worker that is down
  is retried until ``worker_startup_timeout_secs`` (1800 s by default) and is not listed meanwhile. A URL
  with a trailing ``/`` is probed as ``…//health`` and never registers, so URLs are normalised here.
* ``GET /workers`` answers ``{"workers": [{"id", "url", "model_id", "priority", "cost", "worker_type",
  "is_healthy", "load", "connection_mode", "bootstrap_port"? (prefill), "metadata": {...},
  "disable_health_check"}], "total": n, "stats": {"prefill_count", "decode_count", "regular_count"}}``.
* ``GET /readiness`` answers 200 ``{"status": "ready", "healthy_workers": n, "total_workers": n}`` or 503
  ``{"status": "not ready", "reason": "insufficient healthy workers"}``; in PD mode it needs a healthy prefill
  *and* decode worker. It does not need the API key.
* ``DELETE /workers/{id}`` answers 202 (removal queued).
* With an API key, ``/workers`` and ``/generate`` answer 401 without ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import site
import sys
import time
import typing
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx

from miles_sglang_plugin.registry import ROUTER_POLICIES, ModelRoute, http_base_url

__all__ = [
    "API_KEY_ENV",
    "DECODE_POLICIES",
    "LOG_LEVELS",
    "PREFILL_POLICIES",
    "ROUTER_POLICIES",
    "WORKER_TYPES",
    "RouterLaunchSpec",
    "RouterRequestError",
    "RouterSettings",
    "WorkerRegistration",
    "deregister_workers",
    "register_workers",
    "router_args_fields",
    "router_command",
    "router_ready",
    "router_workers",
    "validate_router_settings",
    "wait_router_ready",
]

API_KEY_ENV = "MSP_ROUTER_API_KEY"
ROUTER_MAIN_MODULE = "miles_sglang_plugin.router_main"

PREFILL_POLICIES: tuple[str, ...] = (*ROUTER_POLICIES, "bucket")
DECODE_POLICIES: tuple[str, ...] = ROUTER_POLICIES
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warn", "error")
WORKER_TYPES: tuple[str, ...] = ("regular", "prefill", "decode")

# RouterArgs fields that must not come through ``RouterSettings.extra``, with the reason.
_MANAGED_BY_SPEC = {
    "host": "set by the launch spec",
    "port": "set by the launch spec",
    "prometheus_port": "set by the launch spec",
    "prometheus_host": "set by the launch spec (it follows the router host)",
    "pd_disaggregation": "set by the launch spec",
    "api_key": "pass it as RouterLaunchSpec.api_key (it travels in the environment, not in argv)",
    "worker_urls": "workers are registered through POST /workers (register_workers), not at launch",
    "prefill_urls": "workers are registered through POST /workers (register_workers), not at launch",
    "decode_urls": "workers are registered through POST /workers (register_workers), not at launch",
    "mini_lb": "the Python MiniLB is a debugging balancer (needs sglang); this launcher runs the Rust router",
    "control_plane_api_keys": "holds secrets, which would be visible in the router's argv",
    "oracle_password": "a secret, which would be visible in the router's argv",
    "postgres_db_url": "may hold a password, which would be visible in the router's argv",
    "redis_url": "may hold a password, which would be visible in the router's argv",
}

_HTTP_TIMEOUT_S = 10.0


# ----------------------------------------------------------------------------------------------------
# Settings and specs
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterSettings:
    """User-facing router knobs (filled from a Hydra config node). ``extra``: other ``RouterArgs`` fields."""

    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    request_timeout_secs: int = 14400
    health_check_interval_secs: int = 60
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_timeout_secs: int = 5
    disable_health_check: bool = False
    retry_max_retries: int = 5
    disable_retries: bool = False
    cb_failure_threshold: int = 10
    cb_timeout_duration_secs: int = 60
    disable_circuit_breaker: bool = False
    log_level: str = "warn"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.extra, Mapping):
            raise TypeError(f"RouterSettings.extra must be a mapping, got {type(self.extra).__name__}")
        # A private read-only copy: the settings stay immutable even if the caller's dict changes.
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["extra"] = dict(self.extra)
        return out

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> RouterSettings:
        """Build from a plain mapping (e.g. a resolved Hydra node); an unknown key raises ValueError."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            parts = []
            for k in unknown:
                close = difflib.get_close_matches(str(k), names, n=3, cutoff=0.6)
                parts.append(f"{k!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
            raise ValueError(
                f"unknown router setting(s) {', '.join(parts)}; other RouterArgs fields go under 'extra'"
            )
        kwargs = dict(data)
        if kwargs.get("extra") is None:
            kwargs.pop("extra", None)
        return cls(**kwargs)

    def router_args_kwargs(self) -> dict[str, Any]:
        """The ``RouterArgs`` keyword arguments these settings stand for (typed fields, then ``extra``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out


@dataclass(frozen=True, repr=False)
class RouterLaunchSpec:
    """Everything needed to start the router of one model. ``api_key`` is a secret: never in argv or repr."""

    model: str
    host: str
    port: int
    prometheus_port: int
    pd_disaggregation: bool
    settings: RouterSettings = field(default_factory=RouterSettings)
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.host, str) or not self.host.strip("[]"):
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        object.__setattr__(self, "host", self.host[1:-1] if self.host.startswith("[") else self.host)
        for name in ("port", "prometheus_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
                raise ValueError(f"{name} must be an integer in 1..65535, got {value!r}")
        if self.port == self.prometheus_port:
            raise ValueError(f"port and prometheus_port must differ (both {self.port})")
        if not isinstance(self.pd_disaggregation, bool):
            raise ValueError("pd_disaggregation must be a bool")
        if not isinstance(self.settings, RouterSettings):
            raise TypeError(f"settings must be RouterSettings, got {type(self.settings).__name__}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")

    def __repr__(self) -> str:
        key = "None" if self.api_key is None else "'***'"
        return (
            f"RouterLaunchSpec(model={self.model!r}, host={self.host!r}, port={self.port}, "
            f"prometheus_port={self.prometheus_port}, pd_disaggregation={self.pd_disaggregation}, "
            f"settings={self.settings!r}, api_key={key})"
        )

    __str__ = __repr__

    @property
    def url(self) -> str:
        """The router's base URL (IPv6 hosts in ``[]``)."""
        return http_base_url(self.host, self.port)

    def route(self) -> ModelRoute:
        """The :class:`ModelRoute` for the registry rollout code uses."""
        return ModelRoute(
            name=self.model,
            host=self.host,
            port=self.port,
            policy=self.settings.policy,
            pd_disaggregation=self.pd_disaggregation,
        )

    def to_json(self) -> str:
        """JSON of everything but the key; ``api_key_in_env`` tells the reader whether to expect one."""
        return json.dumps(
            {
                "model": self.model,
                "host": self.host,
                "port": self.port,
                "prometheus_port": self.prometheus_port,
                "pd_disaggregation": self.pd_disaggregation,
                "settings": self.settings.to_dict(),
                "api_key_in_env": self.api_key is not None,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, api_key: str | None = None) -> RouterLaunchSpec:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("router spec JSON must be an object")
        data = dict(data)
        data.pop("api_key_in_env", None)
        if "api_key" in data:
            raise ValueError("router spec JSON must not contain the API key")
        settings = RouterSettings.from_mapping(data.pop("settings", {}) or {})
        return cls(settings=settings, api_key=api_key, **data)


@dataclass(frozen=True)
class WorkerRegistration:
    """One engine to register with a router. ``url`` is normalised (scheme added, trailing ``/`` removed)."""

    url: str
    worker_type: str = "regular"
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.strip():
            raise ValueError(f"worker url must be a non-empty string, got {self.url!r}")
        object.__setattr__(self, "url", normalize_worker_url(self.url))
        if self.worker_type not in WORKER_TYPES:
            raise ValueError(
                f"worker_type must be one of {', '.join(WORKER_TYPES)}, got {self.worker_type!r}"
            )
        if self.bootstrap_port is not None:
            if self.worker_type != "prefill":
                raise ValueError(f"bootstrap_port is only for prefill workers, not {self.worker_type!r}")
            bp = self.bootstrap_port
            if isinstance(bp, bool) or not isinstance(bp, int) or not 0 < bp < 65536:
                raise ValueError(f"bootstrap_port must be an integer in 1..65535, got {bp!r}")

    def payload(self, api_key: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"url": self.url, "worker_type": self.worker_type}
        if self.bootstrap_port is not None:
            body["bootstrap_port"] = self.bootstrap_port
        if api_key is not None:
            body["api_key"] = api_key
        return body

    def describe(self) -> str:
        extra = f", bootstrap_port={self.bootstrap_port}" if self.bootstrap_port is not None else ""
        return f"{self.url} ({self.worker_type}{extra})"


def normalize_worker_url(url: str) -> str:
    """Add ``http://`` when there is no scheme (as the router does); drop trailing ``/`` (the router would
    probe ``…//health`` and never register the worker)."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------
@functools.cache
def router_args_fields() -> dict[str, Any]:
    """``RouterArgs`` dataclass field name -> type annotation (imports sglang_router on first use)."""
    from sglang_router.router_args import RouterArgs

    hints = typing.get_type_hints(RouterArgs)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(RouterArgs)}


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return any(_type_ok(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is list or origin is list:
        return isinstance(value, list | tuple)
    if tp is dict or origin is dict:
        return isinstance(value, Mapping)
    return True


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _policy_problem(key: str, value: Any, valid: tuple[str, ...]) -> str | None:
    if value in valid:
        return None
    msg = f"{key}: unknown policy {value!r}; valid: {', '.join(valid)}"
    if value == "bucket":
        msg = f"{key}: 'bucket' is only valid as prefill_policy; valid here: {', '.join(valid)}"
    elif value == "prefix_hash":
        msg += (
            " ('prefix_hash' exists in sglang-router 0.3.2 but answers 503 no_available_workers in HTTP mode)"
        )
    else:
        close = difflib.get_close_matches(str(value), valid, n=2, cutoff=0.6)
        if close:
            msg += f" (did you mean {' or '.join(close)}?)"
    return msg


_INT_MINIMUMS = {
    "request_timeout_secs": 1,
    "health_check_interval_secs": 1,
    "health_failure_threshold": 1,
    "health_success_threshold": 1,
    "health_check_timeout_secs": 1,
    "retry_max_retries": 1,
    "cb_failure_threshold": 1,
    "cb_timeout_duration_secs": 1,
}
_BOOL_SETTINGS = ("disable_health_check", "disable_retries", "disable_circuit_breaker")


def validate_router_settings(settings: RouterSettings) -> list[str]:
    """Every problem with ``settings``, as messages (empty list: fine). Never raises for bad values."""
    problems: list[str] = []
    p = _policy_problem("policy", settings.policy, ROUTER_POLICIES)
    if p:
        problems.append(p)
    if settings.prefill_policy is not None:
        p = _policy_problem("prefill_policy", settings.prefill_policy, PREFILL_POLICIES)
        if p:
            problems.append(p)
    if settings.decode_policy is not None:
        p = _policy_problem("decode_policy", settings.decode_policy, DECODE_POLICIES)
        if p:
            problems.append(p)
    if settings.log_level not in LOG_LEVELS:
        hint = " (did you mean 'warn'?)" if str(settings.log_level).lower().startswith("warn") else ""
        problems.append(f"log_level: {settings.log_level!r} is not one of {', '.join(LOG_LEVELS)}{hint}")
    for name, minimum in _INT_MINIMUMS.items():
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{name}: must be an integer, got {value!r}")
        elif value < minimum:
            problems.append(f"{name}: must be >= {minimum}, got {value}")
    for name in _BOOL_SETTINGS:
        value = getattr(settings, name)
        if not isinstance(value, bool):
            problems.append(f"{name}: must be true or false, got {value!r}")

    typed = {f.name for f in dataclasses.fields(RouterSettings)} - {"extra"}
    try:
        fields = router_args_fields()
    except Exception as e:  # sglang_router missing or broken: report, do not raise
        fields = None
        if settings.extra:
            problems.append(f"extra: cannot check keys against RouterArgs (sglang_router import failed: {e})")
    for key, value in settings.extra.items():
        if not isinstance(key, str):
            problems.append(f"extra: key {key!r} is not a string")
            continue
        if key in typed:
            problems.append(f"extra.{key}: set '{key}' directly in the router settings, not under extra")
            continue
        if key in _MANAGED_BY_SPEC:
            problems.append(f"extra.{key}: not allowed here: {_MANAGED_BY_SPEC[key]}")
            continue
        if fields is None:
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            problems.append(f"extra.{key}: not a sglang-router RouterArgs field{hint}")
            continue
        if not _type_ok(value, fields[key]):
            problems.append(f"extra.{key}: expected {_type_name(fields[key])}, got {value!r}")
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            problems.append(f"extra.{key}: value {value!r} is not JSON-serialisable")
    return problems


# ----------------------------------------------------------------------------------------------------
# Launch command
# ----------------------------------------------------------------------------------------------------
def _source_root_env() -> dict[str, str]:
    """PYTHONPATH entry for a source checkout that is not installed, so ``-m`` works from any cwd."""
    root = Path(__file__).resolve().parent.parent
    site_dirs = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root in site_dirs:
        return {}
    existing = os.environ.get("PYTHONPATH")
    parts = [str(root)] + ([existing] if existing else [])
    return {"PYTHONPATH": os.pathsep.join(parts)}


def router_command(spec: RouterLaunchSpec, python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """``(argv, extra_env)`` that start the router of ``spec``: ``python -m miles_sglang_plugin.router_main``.

    The spec travels as JSON in argv; the API key never does (argv is world-readable through ``ps``): it is
    in ``extra_env[MSP_ROUTER_API_KEY]``. Merge ``extra_env`` over ``os.environ`` when starting the process.
    """
    argv = [python, "-m", ROUTER_MAIN_MODULE, "--spec-json", spec.to_json()]
    env = _source_root_env()
    env["PYTHONUNBUFFERED"] = "1"
    if spec.api_key is not None:
        env[API_KEY_ENV] = spec.api_key
    return argv, env


# ----------------------------------------------------------------------------------------------------
# HTTP helpers
# ----------------------------------------------------------------------------------------------------
class RouterRequestError(RuntimeError):
    """A router control-plane call failed (connection error or non-2xx answer)."""

    def __init__(self, message: str, status_code: int | None = None, body: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _base(router_url: str) -> str:
    return router_url.rstrip("/")


def _request(
    method: str,
    url: str,
    *,
    api_key: str | None,
    timeout_s: float,
    json_body: Any = None,
    ok: Callable[[int], bool] = lambda s: 200 <= s < 300,
) -> httpx.Response:
    try:
        resp = httpx.request(method, url, json=json_body, headers=_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as e:
        raise RouterRequestError(f"{method} {url} failed: {type(e).__name__}: {e}") from e
    if not ok(resp.status_code):
        body = resp.text
        shown = body if len(body) <= 2000 else body[:2000] + "…"
        hint = " (the router has an API key: pass api_key)" if resp.status_code == 401 and not api_key else ""
        raise RouterRequestError(
            f"{method} {url} answered {resp.status_code}{hint}: {shown or '<empty body>'}",
            status_code=resp.status_code,
            body=body,
        )
    return resp


def register_workers(
    router_url: str,
    workers: Iterable[WorkerRegistration],
    api_key: str | None = None,
    timeout_s: float = _HTTP_TIMEOUT_S,
    *,
    worker_api_key: str | None = None,
) -> list[dict[str, Any]]:
    """``POST {router_url}/workers`` for each worker; returns the router's answers (``worker_id`` etc.).

    ``api_key`` authenticates to the router (``Authorization: Bearer``) and is also sent as the worker's
    ``api_key`` unless ``worker_api_key`` is given. The router adds workers in the background (202): use
    :func:`router_ready` / :func:`wait_router_ready` to know when they are in. Raises RouterRequestError.
    """
    answers = []
    for worker in workers:
        if not isinstance(worker, WorkerRegistration):
            raise TypeError(f"expected WorkerRegistration, got {type(worker).__name__}")
        body = worker.payload(worker_api_key if worker_api_key is not None else api_key)
        resp = _request(
            "POST", f"{_base(router_url)}/workers", api_key=api_key, timeout_s=timeout_s, json_body=body
        )
        try:
            answers.append(resp.json())
        except ValueError:
            answers.append({"status": resp.status_code, "body": resp.text})
    return answers


def router_workers(
    router_url: str, api_key: str | None = None, timeout_s: float = _HTTP_TIMEOUT_S
) -> list[dict]:
    """The ``workers`` list of ``GET {router_url}/workers`` (only workers whose registration completed)."""
    resp = _request("GET", f"{_base(router_url)}/workers", api_key=api_key, timeout_s=timeout_s)
    try:
        data = resp.json()
    except ValueError as e:
        raise RouterRequestError(f"GET {router_url}/workers: not JSON: {resp.text[:500]}") from e
    workers = data.get("workers") if isinstance(data, dict) else None
    if not isinstance(workers, list):
        raise RouterRequestError(f"GET {router_url}/workers: unexpected answer {str(data)[:500]}")
    return workers


def _same_worker(listed_url: Any, url: str) -> bool:
    """A router entry belongs to ``url``; dp-aware routers list ``url@rank`` per data-parallel rank."""
    listed = str(listed_url or "").rstrip("/")
    return listed == url or listed.startswith(url + "@")


def router_ready(
    router_url: str,
    expected: Collection[WorkerRegistration],
    api_key: str | None = None,
    timeout_s: float = 5.0,
) -> tuple[bool, str]:
    """``(ready, detail)``: ready when every expected worker is listed by ``GET /workers`` with its
    worker_type (and bootstrap_port) and ``is_healthy``, and ``GET /readiness`` answers 200.

    ``detail`` says what is missing (or, when ready, how many workers are healthy). Never raises for a router
    that is down or not answering: that is reported as not ready.
    """
    base = _base(router_url)
    try:
        workers = router_workers(base, api_key=api_key, timeout_s=timeout_s)
    except RouterRequestError as e:
        if e.status_code is None:
            return False, f"router at {base} not reachable: {e}"
        return False, f"router at {base}: {e}"

    problems: dict[str, list[str]] = {}
    for exp in expected:
        entries = [w for w in workers if _same_worker(w.get("url"), exp.url)]
        if not entries:
            problems.setdefault(exp.url, []).append(f"{exp.describe()} not registered yet")
            continue
        for entry in entries:
            label = entry.get("url", exp.url)
            wtype = entry.get("worker_type")
            if wtype != exp.worker_type:
                msg = f"{label} registered as {wtype!r}, expected {exp.worker_type!r}"
            elif exp.worker_type == "prefill" and entry.get("bootstrap_port") != exp.bootstrap_port:
                got = entry.get("bootstrap_port")
                msg = f"{label} has bootstrap_port {got!r}, expected {exp.bootstrap_port!r}"
            elif not entry.get("is_healthy", False):
                msg = f"{label} ({wtype}) registered but not healthy"
            else:
                continue
            problems.setdefault(exp.url, []).append(msg)

    try:
        resp = httpx.get(f"{base}/readiness", headers=_headers(api_key), timeout=timeout_s)
        ready_ok = resp.status_code == 200
        try:
            data = resp.json()
            readiness = (
                f"{data.get('healthy_workers')}/{data.get('total_workers')} workers healthy"
                if ready_ok
                else f"not ready ({data.get('reason', resp.text)})"
            )
        except ValueError:
            readiness = f"HTTP {resp.status_code}: {resp.text[:200]}"
    except httpx.HTTPError as e:
        ready_ok, readiness = False, f"unreachable ({type(e).__name__}: {e})"

    others = sorted(
        str(w.get("url")) for w in workers if not any(_same_worker(w.get("url"), e.url) for e in expected)
    )
    note = f"; also registered: {', '.join(others)}" if others else ""

    if problems:
        listed = "; ".join(m for msgs in problems.values() for m in msgs)
        n_expected = len({e.url for e in expected})
        return False, f"waiting for {len(problems)} of {n_expected} workers: {listed}{note}"
    if not ready_ok:
        return False, f"all {len(expected)} expected workers registered, but /readiness: {readiness}{note}"
    return True, f"ready: {readiness}{note}"


def wait_router_ready(
    router_url: str,
    expected: Collection[WorkerRegistration],
    api_key: str | None = None,
    timeout_s: float = 60.0,
    interval_s: float = 0.1,
    alive: Callable[[], bool] | None = None,
) -> str:
    """Poll :func:`router_ready` until True; returns its detail. Raises TimeoutError with the last detail, or
    RuntimeError as soon as ``alive()`` returns False (e.g. ``lambda: proc.poll() is None``)."""
    deadline = time.monotonic() + timeout_s
    detail = "not checked yet"
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"router at {router_url} exited before it was ready (last state: {detail})")
        ok, detail = router_ready(router_url, expected, api_key=api_key, timeout_s=min(5.0, timeout_s))
        if ok:
            return detail
        if time.monotonic() >= deadline:
            raise TimeoutError(f"router at {router_url} not ready after {timeout_s:g}s: {detail}")
        time.sleep(interval_s)


def deregister_workers(
    router_url: str,
    api_key: str | None = None,
    timeout_s: float = _HTTP_TIMEOUT_S,
    wait: bool = True,
) -> list[str]:
    """Remove every worker the router lists (``GET /workers``, then ``DELETE /workers/{id}``).

    Removal is queued by the router (202); with ``wait`` this polls until the list no longer shows them (up
    to ``timeout_s``). Returns the removed URLs. A registration still in progress (not yet listed) is not
    affected.
    """
    base = _base(router_url)
    workers = router_workers(base, api_key=api_key, timeout_s=timeout_s)
    removed = []
    ids = set()
    for w in workers:
        wid = w.get("id")
        if not wid:
            continue
        _request(
            "DELETE",
            f"{base}/workers/{wid}",
            api_key=api_key,
            timeout_s=timeout_s,
            ok=lambda s: 200 <= s < 300 or s == 404,  # already gone is fine
        )
        ids.add(wid)
        removed.append(str(w.get("url")))
    if wait and ids:
        deadline = time.monotonic() + timeout_s
        while True:
            left = [
                w for w in router_workers(base, api_key=api_key, timeout_s=timeout_s) if w.get("id") in ids
            ]
            if not left:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"router at {base} still lists {', '.join(str(w.get('url')) for w in left)} "
                    f"{timeout_s:g}s after DELETE"
                )
            time.sleep(0.05)
    return removed
