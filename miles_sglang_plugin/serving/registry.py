"""Where rollout code finds the router of each model.

One sglang-router runs per model. :class:`RouterRegistry` maps a model name to its :class:`ModelRoute` (host,
port, routing policy, PD mode) and is what rollout code asks for URLs and routing headers. It plays the role
of ``get_model_url(args, name, endpoint)`` in Miles and slime, with one difference: an unknown model name is
an error (:class:`UnknownModelError`) instead of a silent fall-back to the default router.

A trainer subprocess finds the routers through the environment: :meth:`RouterRegistry.to_env` gives
``{"MSP_ROUTERS": <json>}`` and :meth:`RouterRegistry.from_env` reads it back.

This module has no third-party imports, so rollout workers can import it cheaply.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from miles_sglang_plugin.addresses import http_base_url, strip_brackets
from miles_sglang_plugin.rendering.router_specs import ROUTER_POLICIES, ROUTING_KEY_POLICIES, RouterLaunchSpec

__all__ = [
    "ENV_VAR",
    "ROUTING_KEY_HEADER",
    "ModelRoute",
    "RouterRegistry",
    "UnknownModelError",
    "get_model_url",
]

ENV_VAR = "MSP_ROUTERS"
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


_JSON_VERSION = 1
_ROUTE_KEYS = ("name", "host", "port", "policy", "pd_disaggregation")


def _close_matches(word: str, candidates: Iterable[str]) -> list[str]:
    return difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)


class UnknownModelError(KeyError):
    """No router is registered under the requested model name."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known: tuple[str, ...] = tuple(sorted(known))
        if self.known:
            msg = f"no router for model {name!r}; known models: {', '.join(self.known)}"
            close = _close_matches(name, self.known)
            if close:
                msg += f". Did you mean {' or '.join(repr(c) for c in close)}?"
        else:
            msg = f"no router for model {name!r}: no routers are registered"
        self.message = msg
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


@dataclass(frozen=True)
class ModelRoute:
    """How to reach the router of one model."""

    name: str
    host: str
    port: int
    policy: str = "cache_aware"
    pd_disaggregation: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"model name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.host, str) or not strip_brackets(self.host):
            raise ValueError(
                f"router host of model {self.name!r} must be a non-empty string, got {self.host!r}"
            )
        object.__setattr__(self, "host", strip_brackets(self.host))
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(
                f"router port of model {self.name!r} must be an integer in 1..65535, got {self.port!r}"
            )
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router policy of model {self.name!r} is {self.policy!r}; "
                f"valid: {', '.join(ROUTER_POLICIES)}"
            )
        if not isinstance(self.pd_disaggregation, bool):
            raise ValueError(f"pd_disaggregation of model {self.name!r} must be a bool")

    @property
    def base_url(self) -> str:
        """``http://host:port`` (IPv6 hosts in ``[]``), no trailing slash."""
        return http_base_url(self.host, self.port)

    @property
    def requires_routing_key(self) -> bool:
        return self.policy in ROUTING_KEY_POLICIES

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _ROUTE_KEYS}

    @classmethod
    def from_launch_spec(cls, spec: RouterLaunchSpec) -> ModelRoute:
        """The route to the router that ``spec`` starts."""
        return cls(
            name=spec.model,
            host=spec.host,
            port=spec.port,
            policy=spec.settings.policy,
            pd_disaggregation=spec.pd_disaggregation,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelRoute:
        unknown = sorted(set(data) - set(_ROUTE_KEYS))
        if unknown:
            raise ValueError(f"unknown ModelRoute keys {unknown}; valid: {', '.join(_ROUTE_KEYS)}")
        missing = [k for k in ("name", "host", "port") if k not in data]
        if missing:
            raise ValueError(f"ModelRoute is missing {', '.join(missing)}")
        return cls(**data)


class RouterRegistry(Mapping[str, ModelRoute]):
    """Immutable mapping ``model name -> ModelRoute``; strict about unknown names."""

    __slots__ = ("_routes",)

    def __init__(self, routes: Iterable[ModelRoute] | Mapping[str, ModelRoute] = ()) -> None:
        items: Iterable[ModelRoute] = routes.values() if isinstance(routes, Mapping) else routes
        table: dict[str, ModelRoute] = {}
        if isinstance(routes, Mapping):
            for key, route in routes.items():
                if not isinstance(route, ModelRoute) or key != route.name:
                    raise ValueError(
                        f"registry entry {key!r} must be a ModelRoute named {key!r}, got {route!r}"
                    )
        for route in items:
            if not isinstance(route, ModelRoute):
                raise TypeError(f"expected ModelRoute, got {type(route).__name__}")
            if route.name in table:
                raise ValueError(f"model {route.name!r} is registered twice")
            table[route.name] = route
        self._routes: Mapping[str, ModelRoute] = MappingProxyType(table)

    # -- Mapping -------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ModelRoute:
        try:
            return self._routes[name]
        except (KeyError, TypeError):
            raise UnknownModelError(str(name), self._routes) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._routes)

    def __len__(self) -> int:
        return len(self._routes)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._routes

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{n}={r.base_url} ({r.policy}{', pd' if r.pd_disaggregation else ''})"
            for n, r in self._routes.items()
        )
        return f"RouterRegistry({inner})"

    def names(self) -> tuple[str, ...]:
        """The model names, sorted."""
        return tuple(sorted(self._routes))

    def route(self, name: str) -> ModelRoute:
        return self[name]

    # -- what rollout code calls ---------------------------------------------------------------------------
    def get_model_url(self, name: str, endpoint: str = "/generate") -> str:
        """``http://host:port{endpoint}`` of the router of ``name``; unknown names raise UnknownModelError."""
        if not isinstance(endpoint, str) or not endpoint.startswith("/"):
            raise ValueError(f"endpoint must start with '/', got {endpoint!r}")
        return self[name].base_url + endpoint

    def routing_headers(self, name: str, routing_key: str | None) -> dict[str, str]:
        """Headers that pin a request to a worker.

        For ``consistent_hashing`` and ``manual`` the router picks the worker from ``X-SMG-Routing-Key``, so a
        key is required (ValueError without one, as in Miles). For every other policy the result is ``{}`` and
        a given key is ignored.
        """
        route = self[name]
        if not route.requires_routing_key:
            return {}
        if routing_key is None or not isinstance(routing_key, str) or not routing_key:
            raise ValueError(
                f"model {name!r} is routed with policy {route.policy!r}, which needs a routing key "
                f"(header {ROUTING_KEY_HEADER}); got {routing_key!r}"
            )
        return {ROUTING_KEY_HEADER: routing_key}

    # -- serialisation -------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {"version": _JSON_VERSION, "routers": [r.to_dict() for r in self._routes.values()]},
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> RouterRegistry:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"router registry JSON is not valid JSON: {e}") from None
        if not isinstance(data, dict) or set(data) != {"version", "routers"}:
            raise ValueError("router registry JSON must be an object with keys 'version' and 'routers'")
        if data["version"] != _JSON_VERSION:
            raise ValueError(
                f"router registry JSON version {data['version']!r} is not supported ({_JSON_VERSION})"
            )
        if not isinstance(data["routers"], list) or not all(isinstance(r, dict) for r in data["routers"]):
            raise ValueError("router registry JSON: 'routers' must be a list of objects")
        return cls(ModelRoute.from_dict(r) for r in data["routers"])

    def to_env(self) -> dict[str, str]:
        """Environment entries that let a subprocess rebuild this registry with :meth:`from_env`."""
        return {ENV_VAR: self.to_json()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RouterRegistry:
        env = os.environ if environ is None else environ
        text = env.get(ENV_VAR)
        if text is None:
            raise LookupError(
                f"environment variable {ENV_VAR} is not set: this process was not started with the router "
                "registry (RouterRegistry.to_env())"
            )
        return cls.from_json(text)

    @classmethod
    def from_miles_args(cls, args: Any, policy: str | None = None) -> RouterRegistry:
        """From a Miles/slime args namespace: ``args.sglang_model_routers = {name: (host, port)}``.

        The policy is ``policy`` if given, else ``args.sglang_router_policy`` / ``args.router_policy`` when
        set, else the router default ``cache_aware``.
        """
        table = getattr(args, "sglang_model_routers", None)
        if not isinstance(table, Mapping):
            raise ValueError(
                "args has no 'sglang_model_routers' mapping {name: (host, port)}; refusing to fall back to "
                "sglang_router_ip/port (an unknown model would silently reach the wrong router)"
            )
        if policy is None:
            policy = getattr(args, "sglang_router_policy", None) or getattr(args, "router_policy", None)
        policy = policy or "cache_aware"
        routes = []
        for name, addr in table.items():
            if isinstance(addr, ModelRoute):
                routes.append(addr)
                continue
            if isinstance(addr, str) or not isinstance(addr, Iterable):
                raise ValueError(f"sglang_model_routers[{name!r}] must be (host, port), got {addr!r}")
            parts = list(addr)
            if len(parts) != 2:
                raise ValueError(f"sglang_model_routers[{name!r}] must be (host, port), got {addr!r}")
            host, port = parts
            routes.append(ModelRoute(name=str(name), host=str(host), port=int(port), policy=policy))
        return cls(routes)


def get_model_url(registry_or_args: RouterRegistry | Any, name: str, endpoint: str = "/generate") -> str:
    """Strict ``get_model_url``: a :class:`RouterRegistry`, or a Miles/slime args namespace with
    ``sglang_model_routers``. An unknown name raises :class:`UnknownModelError`; there is no fall-back."""
    if isinstance(registry_or_args, RouterRegistry):
        registry = registry_or_args
    else:
        registry = RouterRegistry.from_miles_args(registry_or_args)
    return registry.get_model_url(name, endpoint)
