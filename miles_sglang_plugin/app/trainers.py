"""Handing a running deployment to a trainer's own rollout client.

SkyRL (skyrl-train 0.3.1) talks to engines it did not start when ``generator.run_engines_locally=false``: one
``RemoteInferenceEngine`` per entry of ``generator.remote_inference_engine_urls``, each ``HOST:PORT`` (SkyRL
prepends ``http://``), and its ``validate_cfg`` wants as many entries as ``generator.num_inference_engines``.
:func:`fill_skyrl_engine_urls` fills that list from the deployment's engines, so that the config SkyRL reads
after the launch points at them::

    with launch_from_config(cfg) as deployment:
        fill_skyrl_engine_urls(cfg, deployment)
        validate_cfg(cfg)  # SkyRL's own check
        ...                # SkyRL's trainer, built from cfg

verl (0.9.1) has no such key: its rollout client reaches only the servers of its own rollout replicas, as Ray
actor handles (``LLMServerClient`` acquires ``(server_id, actor handle)`` pairs from its load balancer and
calls ``generate`` on the actor), and no rollout setting takes server addresses. A verl user reaches these
engines through the deployment's registry (``deployment.registry.get_model_url(...)``) from code of their own.

Only the public deployment API is used here: ``deployment.engines()`` (each an ``EngineInfo``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

#: Where SkyRL reads its remote engines, and how many it expects.
SKYRL_URLS_KEY = "generator.remote_inference_engine_urls"
SKYRL_COUNT_KEY = "generator.num_inference_engines"


def skyrl_engine_urls(deployment: Any, model: str = "actor") -> list[str]:
    """``HOST:PORT`` of every engine of ``model`` that SkyRL can send a whole request to (regular engines, in
    deployment order; SkyRL has no prefill/decode engines), as ``generator.remote_inference_engine_urls``
    wants them."""
    engines = [e for e in deployment.engines() if e.model == model]
    if not engines:
        models = sorted({e.model for e in deployment.engines()})
        raise ValueError(f"the deployment has no engines of model {model!r}; its models: {models}")
    regular = [e for e in engines if e.worker_type == "regular"]
    if len(regular) != len(engines):
        kinds = sorted({e.worker_type for e in engines if e.worker_type != "regular"})
        raise ValueError(
            f"model {model!r} has {', '.join(kinds)} engines, which SkyRL cannot use as remote engines (it sends "
            "each request to one engine): give it regular engines"
        )
    return [_host_port(e.url) for e in regular]


def _host_port(url: str) -> str:
    for scheme in ("http://", "https://"):
        if url.startswith(scheme):
            return url[len(scheme) :].rstrip("/")
    return url.rstrip("/")


def fill_skyrl_engine_urls(cfg: DictConfig, deployment: Any, model: str = "actor") -> list[str]:
    """Set SkyRL's ``generator.remote_inference_engine_urls`` in ``cfg`` to the deployment's engines of
    ``model`` (:func:`skyrl_engine_urls`) and return them. ``generator.num_inference_engines`` must already say
    as many (with ``sglang_trainer=skyrl`` it sized the group, so it does); a mismatch is an error naming it,
    never a silent change of the trainer's setting."""
    urls = skyrl_engine_urls(deployment, model)
    expected = OmegaConf.select(cfg, SKYRL_COUNT_KEY, default=None)
    if expected is not None and expected != len(urls):
        raise ValueError(
            f"{SKYRL_COUNT_KEY}={expected}, but the deployment runs {len(urls)} engine(s) of model {model!r}; "
            f"SkyRL wants one URL per engine: set {SKYRL_COUNT_KEY}={len(urls)} or resize the deployment"
        )
    _set(cfg, SKYRL_URLS_KEY, urls)
    return urls


def _set(cfg: DictConfig, key: str, value: Sequence[str]) -> None:
    with open_dict(cfg):
        OmegaConf.update(cfg, key, list(value), merge=False, force_add=True)
