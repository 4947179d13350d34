"""What a model's router is launched with: its gateway, its settings (checked against that gateway's
``RouterArgs``), its launch spec and the worker registrations it expects. Data and checks, no network I/O;
the HTTP side (registration, readiness) is :mod:`miles_sglang_plugin.serving.routers`.

Two gateways run a model's router, with the same settings: **sglang-router** (``sglang_router``, 0.3.2, the
default dependency and that package's last release) and its maintained successor **SMG** (``smg``, 1.13.0, the
``[smg]`` extra). ``gateway: auto`` is ``$MSP_ROUTER_GATEWAY`` when set, else SMG where it is installed, else
sglang-router; it is decided when the deployment is rendered (:meth:`RouterSettings.resolved`), so the launch
spec names the gateway its router runs.

Facts these checks encode (checked against the real gateways): the policies each accepts (sglang-router 0.3.2:
``consistent_hashing`` only through the Python ``RouterArgs``, ``prefix_hash`` answers 503; SMG adds
``least_load``, ``passthrough`` and a working ``prefix_hash``; ``bucket`` only as a prefill policy in both),
``RouterArgs`` annotations (``Optional[int]`` in sglang-router, ``int | None`` in SMG), and that a worker URL
with a trailing ``/`` is probed as ``…//health`` and never registers (URLs are normalised here).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.metadata
import importlib.util
import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from miles_sglang_plugin.addresses import http_base_url, strip_brackets
from miles_sglang_plugin.config.shared_fields import ReadOnlyFields, RouterFields
from miles_sglang_plugin.rendering.deploy_checks import (
    MAX_COUNT,
    MAX_DURATION_S,
    Bounds,
    choice_problem,
    flag_problem,
)

__all__ = [
    "DECODE_POLICIES",
    "GATEWAYS",
    "GATEWAY_CHOICES",
    "GATEWAY_ENV",
    "LOG_LEVELS",
    "PREFILL_POLICIES",
    "ROUTER_POLICIES",
    "ROUTING_KEY_POLICIES",
    "WORKER_TYPES",
    "Gateway",
    "RouterLaunchSpec",
    "RouterSettings",
    "WorkerRegistration",
    "gateway_info",
    "gateway_installed",
    "gateway_version",
    "normalize_worker_url",
    "resolve_gateway",
    "router_args_fields",
    "validate_router_settings",
    "worker_labels",
]

# Policies sglang-router 0.3.2 accepts for its main ``policy``. ``consistent_hashing`` is reachable only through
# the Python ``RouterArgs`` (not a CLI choice); ``bucket`` is only a prefill policy.
ROUTER_POLICIES: tuple[str, ...] = (
    "cache_aware",
    "round_robin",
    "power_of_two",
    "random",
    "manual",
    "consistent_hashing",
)
#: SMG 1.13.0's main policies (its ``COMMON_POLICY_CHOICES``), in this project's order: sglang-router's, then
#: SMG's own (``prefix_hash`` works there; ``least_load``, ``passthrough`` are new).
SMG_POLICIES: tuple[str, ...] = (*ROUTER_POLICIES, "prefix_hash", "least_load", "passthrough")
#: Policies that pick the worker from the ``X-SMG-Routing-Key`` header: a request must carry one.
ROUTING_KEY_POLICIES: frozenset[str] = frozenset({"consistent_hashing", "manual"})
PREFILL_POLICIES: tuple[str, ...] = (*ROUTER_POLICIES, "bucket")
DECODE_POLICIES: tuple[str, ...] = ROUTER_POLICIES
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warn", "error")
WORKER_TYPES: tuple[str, ...] = ("regular", "prefill", "decode")


@dataclass(frozen=True)
class Gateway:
    """One gateway that can run a model's router: its setting's name, its package and modules, what it
    accepts, and the version this project is tested against."""

    name: str
    #: Its name in messages.
    display: str
    #: The distribution whose installed version is looked up (``importlib.metadata``; SMG's own
    #: ``smg.__version__`` says 1.1.0 in 1.13.0, so the module's attribute is not used).
    distribution: str
    #: The Python package holding ``router``, ``router_args`` and ``launch_router``.
    module: str
    policies: tuple[str, ...]
    tested_version: str
    #: How to install it, for messages.
    install: str

    @property
    def prefill_policies(self) -> tuple[str, ...]:
        return (*self.policies, "bucket")


_GATEWAYS: dict[str, Gateway] = {
    "sglang_router": Gateway(
        name="sglang_router",
        display="sglang-router",
        distribution="sglang-router",
        module="sglang_router",
        policies=ROUTER_POLICIES,
        tested_version="0.3.2",
        install="pip install sglang-router",
    ),
    "smg": Gateway(
        name="smg",
        display="SMG",
        distribution="smg",
        module="smg",
        policies=SMG_POLICIES,
        tested_version="1.13.0",
        install="pip install 'miles_sglang_plugin[smg]'",
    ),
}
#: The gateways, by their setting's name (``sglang_deploy.router.gateway``).
GATEWAYS: tuple[str, ...] = tuple(_GATEWAYS)
GATEWAY_CHOICES: tuple[str, ...] = ("auto", *GATEWAYS)
#: What ``gateway: auto`` means when set (``sglang_router`` or ``smg``); unset: SMG where it is installed.
GATEWAY_ENV = "MSP_ROUTER_GATEWAY"


def gateway_info(name: str) -> Gateway:
    """The :class:`Gateway` called ``name`` (``sglang_router`` or ``smg``); KeyError for others."""
    return _GATEWAYS[name]


def gateway_installed(name: str) -> bool:
    """Whether the gateway's Python package can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(_GATEWAYS[name].module) is not None
    except (ImportError, ValueError):
        return False


def gateway_version(name: str) -> str | None:
    """The installed version of the gateway's distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(_GATEWAYS[name].distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def resolve_gateway(choice: str) -> str:
    """The gateway ``choice`` stands for: itself, or for ``auto`` ``$MSP_ROUTER_GATEWAY`` when that names a
    gateway, else ``smg`` where it is installed, else ``sglang_router``. Any other value is returned as it is
    (:func:`validate_router_settings` reports it)."""
    if choice != "auto":
        return choice
    chosen = os.environ.get(GATEWAY_ENV, "").strip()
    if chosen:
        return chosen
    return "smg" if gateway_installed("smg") else "sglang_router"


#: Settings of this project that are not ``RouterArgs`` fields (``drain_settle_secs`` is an argument of SMG's
#: Rust router that its ``RouterArgs`` does not carry: the router's process passes it itself).
_NOT_ROUTER_ARGS = frozenset({"extra", "gateway", "drain_settle_secs"})

# RouterArgs fields that must not come through ``RouterSettings.extra``, with the reason.
_MANAGED_BY_SPEC = {
    "host": "set by the launch spec",
    "port": "set by the launch spec",
    "prometheus_port": "set by the launch spec",
    "prometheus_host": "set by the launch spec (it follows the router host)",
    "pd_disaggregation": "set by the launch spec",
    "api_key": "pass it as RouterLaunchSpec.api_key (it travels in the environment, not in argv)",
    "worker_urls": "workers are registered through POST /workers by the deployment, not at launch",
    "prefill_urls": "workers are registered through POST /workers by the deployment, not at launch",
    "decode_urls": "workers are registered through POST /workers by the deployment, not at launch",
    "encode_urls": "workers are registered through POST /workers by the deployment, not at launch",
    "mini_lb": "the Python MiniLB is a debugging balancer (needs sglang); this launcher runs the Rust router",
    "control_plane_api_keys": "holds secrets, which would be visible in the router's argv",
    "oracle_password": "a secret, which would be visible in the router's argv",
    "postgres_db_url": "may hold a password, which would be visible in the router's argv",
    "redis_url": "may hold a password, which would be visible in the router's argv",
    "tenant_api_keys": "holds secrets, which would be visible in the router's argv",
}


# ----------------------------------------------------------------------------------------------------
# Settings and specs
# ----------------------------------------------------------------------------------------------------
@dataclass(unsafe_hash=True)
class RouterSettings(ReadOnlyFields, RouterFields):
    """User-facing router knobs, read-only. The fields are declared once, in
    :class:`~miles_sglang_plugin.config.shared_fields.RouterFields`, which the schema's
    :class:`~miles_sglang_plugin.config.schema.RouterConf` derives from as well. ``extra``: other ``RouterArgs``
    fields."""

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
        unknown = [key for key in data if key not in names]
        if unknown:
            parts = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
                parts.append(f"{key!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
            raise ValueError(
                f"unknown router setting(s) {', '.join(parts)}; other RouterArgs fields go under 'extra'"
            )
        kwargs = dict(data)
        if kwargs.get("extra") is None:
            kwargs.pop("extra", None)
        return cls(**kwargs)

    def router_args_kwargs(self) -> dict[str, Any]:
        """The ``RouterArgs`` keyword arguments these settings stand for (typed fields, then ``extra``; the
        gateway is which ``RouterArgs``, not one of its fields)."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_ROUTER_ARGS
        }
        if out.get("disable_circuit_breaker") is None:
            out.pop("disable_circuit_breaker", None)  # undecided: the gateway's own default
        out.update(self.extra)
        return out

    def resolved(self) -> RouterSettings:
        """These settings with ``gateway: auto`` decided (:func:`resolve_gateway`)."""
        return dataclasses.replace(self, gateway=resolve_gateway(self.gateway))


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
        object.__setattr__(self, "host", strip_brackets(self.host))
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
    """One engine to register with a router. ``url`` is normalised (scheme added, trailing ``/`` removed).

    ``labels`` (a mapping of strings, kept as sorted pairs so that a registration stays hashable) travel in
    ``POST /workers``: SMG lists them under ``labels`` (also in ``/v1/rl/workers``, where its selectors match
    them), sglang-router 0.3.2 under ``metadata``. :func:`worker_labels` gives the plan's."""

    url: str
    worker_type: str = "regular"
    bootstrap_port: int | None = None
    labels: tuple[tuple[str, str], ...] = ()

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
            port = self.bootstrap_port
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"bootstrap_port must be an integer in 1..65535, got {port!r}")
        object.__setattr__(self, "labels", _label_pairs(self.labels))

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    def payload(self, api_key: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"url": self.url, "worker_type": self.worker_type}
        if self.bootstrap_port is not None:
            body["bootstrap_port"] = self.bootstrap_port
        if self.labels:
            body["labels"] = self.label_map
        if api_key is not None:
            body["api_key"] = api_key
        return body

    def describe(self) -> str:
        extra = f", bootstrap_port={self.bootstrap_port}" if self.bootstrap_port is not None else ""
        return f"{self.url} ({self.worker_type}{extra})"


def _label_pairs(labels: Any) -> tuple[tuple[str, str], ...]:
    """Labels (a mapping, or pairs) as sorted ``(key, value)`` string pairs; ValueError for anything else."""
    items = labels.items() if isinstance(labels, Mapping) else labels
    try:
        pairs = [(key, value) for key, value in items]
    except (TypeError, ValueError):
        raise ValueError(f"labels must be a mapping of strings, got {labels!r}") from None
    for key, value in pairs:
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise ValueError(f"labels must map non-empty strings to strings, got {key!r}: {value!r}")
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError(f"labels name a key twice: {labels!r}")
    return tuple(sorted(pairs))


def worker_labels(
    *, model: str, group: str, worker_type: str, engine_id: str, needs_offload: bool, update_weights: bool
) -> dict[str, str]:
    """The labels an engine is registered with: what the plan decided for it, so that a gateway's worker list
    (SMG's ``/v1/rl/workers`` and its label selectors) shows the plan."""
    return {
        "model": model,
        "group": group,
        "worker_type": worker_type,
        "engine_id": engine_id,
        "needs_offload": "true" if needs_offload else "false",
        "update_weights": "true" if update_weights else "false",
    }


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
def router_args_fields(gateway: str = "sglang_router") -> dict[str, Any]:
    """The gateway's ``RouterArgs`` dataclass field name -> type annotation (imports ``<module>.router_args`` on
    first use; ImportError when the gateway is not installed)."""
    module = importlib.import_module(f"{_GATEWAYS[gateway].module}.router_args")
    router_args = module.RouterArgs
    hints = typing.get_type_hints(router_args)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(router_args)}


def _is_union(annotation: Any) -> bool:
    """``Optional[int]`` / ``Union[...]`` (sglang-router) and ``int | None`` (SMG) alike."""
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if _is_union(annotation):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation in (list, tuple) or origin in (list, tuple):
        return isinstance(value, list | tuple)
    if annotation is dict or origin is dict:
        return isinstance(value, Mapping)
    return True


def _type_name(annotation: Any) -> str:
    """``int`` for a class, ``Optional[int]`` / ``int | None`` for a generic (whose ``__name__`` would be
    ``Optional`` or missing)."""
    if isinstance(annotation, type):  # list[str] is not a type (Python 3.11+)
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _policy_problem(key: str, value: Any, valid: tuple[str, ...], gateway: str) -> str | None:
    if value in valid:
        return None
    msg = f"{key}: unknown policy {value!r}; valid: {', '.join(valid)}"
    if value == "bucket":
        msg = f"{key}: 'bucket' is only valid as prefill_policy; valid here: {', '.join(valid)}"
    elif value == "prefix_hash" and gateway == "sglang_router":
        msg += (
            " ('prefix_hash' exists in sglang-router 0.3.2 but answers 503 no_available_workers in HTTP mode; "
            "SMG serves it: gateway=smg)"
        )
    elif value in SMG_POLICIES and gateway == "sglang_router":
        msg += f" ({value!r} is an SMG policy: gateway=smg)"
    else:
        close = difflib.get_close_matches(str(value), valid, n=2, cutoff=0.6)
        if close:
            msg += f" (did you mean {' or '.join(close)}?)"
    return msg


#: The numeric settings and their bounds.
_SETTING_BOUNDS = {
    **{
        name: Bounds(1, integer=True, maximum=MAX_DURATION_S, why="at most 30 days")
        for name in (
            "request_timeout_secs",
            "health_check_interval_secs",
            "health_check_timeout_secs",
            "cb_timeout_duration_secs",
        )
    },
    **{
        name: Bounds(1, integer=True, maximum=24 * 3600 * 1000, why="at most a day")
        for name in ("retry_initial_backoff_ms", "retry_max_backoff_ms")
    },
    **{
        name: Bounds(1, integer=True, maximum=MAX_COUNT)
        for name in (
            "health_failure_threshold",
            "health_success_threshold",
            "retry_max_retries",
            "cb_failure_threshold",
        )
    },
    "drain_settle_secs": Bounds(0, integer=True, maximum=MAX_DURATION_S, why="at most 30 days"),
    "shutdown_grace_period_secs": Bounds(0, integer=True, maximum=MAX_DURATION_S, why="at most 30 days"),
    "retry_backoff_multiplier": Bounds(1.0, maximum=100.0),
    "retry_jitter_factor": Bounds(0.0, maximum=1.0),
}
_BOOL_SETTINGS = ("disable_health_check", "disable_retries", "disable_circuit_breaker")
#: The switches that may be left undecided (null: decided per router).
_AUTO_SETTINGS = frozenset({"disable_circuit_breaker"})
#: The settings with a field of their own (anything else goes under ``extra``).
_TYPED_SETTINGS = frozenset(f.name for f in dataclasses.fields(RouterSettings)) - {"extra"}


def _gateway_problem(choice: Any, gateway: str) -> str | None:
    """What is wrong with the gateway setting (``choice``) that resolved to ``gateway``; None: fine."""
    if choice not in GATEWAY_CHOICES:
        return f"gateway: {choice!r} is not one of {', '.join(GATEWAY_CHOICES)}"
    if gateway not in _GATEWAYS:
        return f"gateway: auto, but ${GATEWAY_ENV}={gateway!r} is not one of {', '.join(GATEWAYS)}"
    if not gateway_installed(gateway):
        install = _GATEWAYS[gateway].install
        if choice == "auto":
            return (
                f"gateway: auto is {gateway} here (${GATEWAY_ENV}={gateway}), which is not installed: {install}, "
                f"or set ${GATEWAY_ENV} to another gateway"
            )
        others = " or ".join(name for name in GATEWAYS if name != gateway)
        return f"gateway: {gateway} is not installed: {install}, or choose {others}"
    return None


def _policy_problems(settings: RouterSettings, gateway: str) -> list[str]:
    info = _GATEWAYS.get(gateway, _GATEWAYS["sglang_router"])
    checked = [("policy", settings.policy, info.policies)]
    if settings.prefill_policy is not None:
        checked.append(("prefill_policy", settings.prefill_policy, info.prefill_policies))
    if settings.decode_policy is not None:
        checked.append(("decode_policy", settings.decode_policy, info.policies))
    problems = [_policy_problem(key, value, valid, info.name) for key, value, valid in checked]
    return [problem for problem in problems if problem]


def _typed_setting_problems(settings: RouterSettings) -> list[str]:
    """The log level, the numeric settings within their bounds, and the boolean ones."""
    problems: list[str] = []
    level = choice_problem(settings.log_level, LOG_LEVELS)
    if level:
        hint = " (did you mean 'warn'?)" if str(settings.log_level).lower().startswith("warn") else ""
        problems.append(f"log_level: {level}{hint}")
    checked = [
        *((name, bounds.problem(getattr(settings, name))) for name, bounds in _SETTING_BOUNDS.items()),
        *(
            (name, flag_problem(getattr(settings, name)))
            for name in _BOOL_SETTINGS
            if not (name in _AUTO_SETTINGS and getattr(settings, name) is None)
        ),
    ]
    return problems + [f"{name}: {problem}" for name, problem in checked if problem]


def _extra_problem(key: Any, value: Any, fields: Mapping[str, Any] | None, package: str) -> str | None:
    """What is wrong with ``extra[key] = value`` (``fields``: the gateway's RouterArgs fields, None when
    unknown; ``package``: the gateway's name in messages)."""
    if not isinstance(key, str):
        return f"extra: key {key!r} is not a string"
    if key in _TYPED_SETTINGS:
        return f"extra.{key}: set '{key}' directly in the router settings, not under extra"
    if key in _MANAGED_BY_SPEC:
        return f"extra.{key}: not allowed here: {_MANAGED_BY_SPEC[key]}"
    if fields is None:
        return None
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return f"extra.{key}: not a {package} RouterArgs field{hint}"
    if not _type_ok(value, fields[key]):
        return f"extra.{key}: expected {_type_name(fields[key])}, got {value!r}"
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return f"extra.{key}: value {value!r} is not JSON-serialisable"
    return None


def _extra_problems(extra: Mapping[Any, Any], gateway: str) -> list[str]:
    if not extra:  # nothing to check: the gateway's RouterArgs (a large dataclass, ~25 ms) stays unimported
        return []
    problems: list[str] = []
    info = _GATEWAYS.get(gateway, _GATEWAYS["sglang_router"])
    try:
        fields = router_args_fields(info.name)
    except Exception as e:  # the gateway missing or broken: report, do not raise
        fields = None
        if extra:
            problems.append(f"extra: cannot check keys against RouterArgs ({info.module} import failed: {e})")
    for key, value in extra.items():
        problem = _extra_problem(key, value, fields, info.display)
        if problem:
            problems.append(problem)
    return problems


def validate_router_settings(settings: RouterSettings) -> list[str]:
    """Every problem with ``settings``, as messages (empty list: fine), checked against the gateway they
    resolve to (``auto``: :func:`resolve_gateway`). Never raises for bad values."""
    gateway = resolve_gateway(settings.gateway) if isinstance(settings.gateway, str) else settings.gateway
    problem = _gateway_problem(settings.gateway, gateway)
    return [
        *([problem] if problem else []),
        *_policy_problems(settings, gateway),
        *_typed_setting_problems(settings),
        *_extra_problems(settings.extra, gateway),
    ]
