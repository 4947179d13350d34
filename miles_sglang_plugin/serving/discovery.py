"""``GET /v1/rl/workers``: the deployment's engines for trainers that find their fleet by asking, in the shape
SMG's RL control plane lists workers (``protocol_version`` 1: a row per engine with its URL, model, worker type,
health, weight version, labels and capabilities), read by a rollout client in another process
(``RolloutClient.from_registry``, through ``rollout.HttpWorkers``).

Unlike SMG's listing, whose ``weight_version`` is the one an engine registered with, this one is what the
deployment knows the engine has now (its command line's, then what the weight updates it accepted set), and
each row also carries the deployment's ``state`` of the engine.

The server (:class:`DiscoveryServer`, started with ``deployment.serve_discovery()``) is a small threaded HTTP
server of the standard library: GET only, no request body read, the deployment's API key required when it has
one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

from miles_sglang_plugin.addresses import http_base_url
from miles_sglang_plugin.serving.fleet import EngineInfo
from miles_sglang_plugin.serving.loopback_http import LoopbackServer, Reply, json_reply
from miles_sglang_plugin.serving.rollout import WORKERS_ENV_VAR

__all__ = ["ENV_VAR", "PATH", "DiscoveryServer", "rl_workers"]

PATH = "/v1/rl/workers"
#: The environment variable that hands the listing's URL to a trainer subprocess (next to ``MSP_ROUTERS``).
ENV_VAR = WORKERS_ENV_VAR

#: What an SGLang engine of a deployment can be asked through the control handle.
_CAPABILITIES = {
    "source": "static",
    "pause_modes": ["abort", "retract", "in_place"],
    "update_from": ["disk", "tensor", "distributed"],
    "abort": True,
    "flush_cache": True,
    "sleep_wake": True,
    "reports_weight_version": True,
}
#: The deployment's engine states as SMG's ``health`` values.
_HEALTH = {
    "serving": "ready",
    "draining": "draining",
    "updating": "draining",
    "lost": "unhealthy",
    "failed": "unhealthy",
}


def _row(engine: EngineInfo) -> dict[str, Any]:
    return {
        "id": engine.id,
        "url": engine.url,
        "base_url": engine.url,
        "engine": "sglang",
        "model_id": engine.model,
        "worker_type": engine.worker_type,
        "connection_mode": "http",
        "health": _HEALTH.get(engine.state, "not_ready"),
        "state": engine.state,
        "weight_version": engine.weight_version,
        "labels": {"group": engine.group, "engine_id": engine.id, "external": str(engine.external).lower()},
        "capabilities": dict(_CAPABILITIES),
    }


def rl_workers(engines: Sequence[EngineInfo], model: str | None = None) -> dict[str, Any]:
    """The listing of ``engines`` (of ``model``); stopped engines are left out."""
    rows = [_row(e) for e in engines if e.state != "stopped" and (model is None or e.model == model)]
    return {"protocol_version": 1, "total": len(rows), "workers": rows}


class DiscoveryServer(LoopbackServer):
    """Serves :func:`rl_workers` of ``engines()`` on ``host:port`` (port 0: one the system picks)."""

    def __init__(
        self,
        engines: Callable[[], Sequence[EngineInfo]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        def answer(path: str, _accept: str) -> Reply:
            listing = rl_workers(engines())
            if path == PATH:
                return json_reply(HTTPStatus.OK, listing)
            by_id = {w["id"]: w for w in listing["workers"]}
            if path.startswith(PATH + "/") and path[len(PATH) + 1 :] in by_id:
                return json_reply(HTTPStatus.OK, by_id[path[len(PATH) + 1 :]])
            return json_reply(HTTPStatus.NOT_FOUND, {"error": "not_found", "message": f"no route {path}"})

        super().__init__(
            answer,
            unauthorized=json_reply(HTTPStatus.UNAUTHORIZED, {"error": "missing or wrong Authorization"}),
            name="msp-discovery",
            host=host,
            port=port,
            api_key=api_key,
        )

    @property
    def url(self) -> str:
        """The listing's URL."""
        return http_base_url(self.host, self.port) + PATH
