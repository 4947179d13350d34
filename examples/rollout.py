"""One rollout step shaped like the custom rollout function of the Miles/slime guides: generate with the
actor (with logprobs), score prompt + response with the frozen reference model, and ask the reward model
through its OpenAI-style chat endpoint. Each model is reached through its own router, by name.

The actor's generations go through the deployment's rollout client (``deployment.async_client("actor")``): an
engine or the router lost in the middle of a generation costs no token, and each sample says which weight
version made it."""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from miles_sglang_plugin.serving.registry import RouterRegistry
from miles_sglang_plugin.serving.rollout import AsyncRolloutClient


@dataclass
class SampleResult:
    prompt: str
    response: str
    response_tokens: int
    actor_logprob: float
    ref_logprob: float | None
    reward_reply: str | None
    reward: float | None
    served_by: str
    #: The actor's weight version that generated it (``meta_info.weight_version``).
    weight_version: str | None = None

    @property
    def kl(self) -> float | None:
        """Per-token log-ratio of actor to reference on the response (the k1 estimator)."""
        if self.ref_logprob is None or not self.response_tokens:
            return None
        return (self.actor_logprob - self.ref_logprob) / self.response_tokens


async def _post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    resp = await client.post(url, json=body, headers=headers)
    resp.raise_for_status()
    return resp.json()


_SERVED: dict[str, str] = {}


async def _served_model(client: httpx.AsyncClient, registry: RouterRegistry, name: str) -> str:
    """The model id the engines of ``name`` serve (the router's ``/v1/models``; asked once): SMG routes an
    OpenAI request by its ``model``, sglang-router ignores it."""
    if name not in _SERVED:
        resp = await client.get(
            registry.get_model_url(name, "/v1/models"), headers=registry.routing_headers(name, "v1-models")
        )
        resp.raise_for_status()
        _SERVED[name] = resp.json()["data"][0]["id"]
    return _SERVED[name]


def _sum_logprobs(entries: list[list[Any]]) -> float:
    return float(sum(e[0] for e in entries if e and e[0] is not None))


async def generate_with_models(
    client: httpx.AsyncClient,
    registry: RouterRegistry,
    prompt: str,
    sampling_params: dict[str, Any],
    actor_client: AsyncRolloutClient,
) -> SampleResult:
    """``client`` carries the deployment's auth headers (``deployment.auth_headers()``)."""
    session = uuid.uuid4().hex  # routing key: a session sticks to one engine under consistent_hashing
    actor = await actor_client.generate(text=prompt, sampling_params=sampling_params, return_logprob=True)
    out_lp = [list(entry) for entry in actor.output_token_logprobs or ()]
    stand_in = (actor.meta_info or {}).get("stand_in") or {}
    served_by = (
        f"{stand_in.get('disaggregation_mode', '?')}@{stand_in.get('port', '?')}" if stand_in else "sglang"
    )
    if len(actor.attempts) > 1:
        served_by += f" ({len(actor.attempts)} tries)"

    ref_lp = None
    if "ref" in registry:
        ref = await _post(
            client,
            registry.get_model_url("ref", "/generate"),
            {
                "text": prompt + actor.text,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
            registry.routing_headers("ref", session),
        )
        # The reference's logprobs of the response tokens: the tail of its input logprobs.
        ref_lp = _sum_logprobs(ref["meta_info"]["input_token_logprobs"][-len(out_lp) :]) if out_lp else 0.0

    reward_reply = reward = None
    if "reward" in registry:
        chat = await _post(
            client,
            registry.get_model_url("reward", "/v1/chat/completions"),
            {
                "model": await _served_model(client, registry, "reward"),
                "messages": [{"role": "user", "content": f"Rate from 0 to 10:\n{prompt}{actor.text}"}],
                "max_tokens": 8,
            },
            registry.routing_headers("reward", session),
        )
        reward_reply = chat["choices"][0]["message"]["content"]
        number = re.search(r"-?\d+(\.\d+)?", reward_reply or "")
        reward = float(number.group()) if number else None

    return SampleResult(
        prompt=prompt,
        response=actor.text,
        response_tokens=len(out_lp),
        actor_logprob=_sum_logprobs(out_lp),
        ref_logprob=ref_lp,
        reward_reply=reward_reply,
        reward=reward,
        served_by=served_by,
        weight_version=actor.weight_version,
    )


async def rollout_step(
    registry: RouterRegistry,
    prompts: list[str],
    sampling_params: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    actor: AsyncRolloutClient | None = None,
) -> list[SampleResult]:
    """``actor``: the deployment's rollout client of the actor (``deployment.async_client("actor")``, made for
    this event loop); without it, a client that reaches the actor through its router only."""
    actor_client = actor or AsyncRolloutClient(registry, "actor", headers=headers, deadline_s=timeout_s)
    async with actor_client, httpx.AsyncClient(timeout=timeout_s, headers=headers or {}) as client:
        return list(
            await asyncio.gather(
                *(generate_with_models(client, registry, p, sampling_params, actor_client) for p in prompts)
            )
        )
