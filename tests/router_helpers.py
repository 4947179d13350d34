"""Router calls for tests that are not async themselves: each runs the package's own router client
(:mod:`miles_sglang_plugin.serving.router_client`, what the reconciler calls) on an event loop of its own,
over a :class:`~miles_sglang_plugin.serving.wire.ClientPool` that carries the router's key as the deployment's
pool does, and closes the pool before it returns."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from miles_sglang_plugin.serving import router_client
from miles_sglang_plugin.serving.wire import ClientPool

T = TypeVar("T")


def on_router(step: Callable[[ClientPool], Awaitable[T]], api_key: str | None = None) -> T:
    """``await step(pool)`` on a fresh loop and pool (``Authorization: Bearer api_key`` when given)."""

    async def run() -> T:
        pool = ClientPool({"Authorization": f"Bearer {api_key}"} if api_key else {})
        try:
            return await step(pool)
        finally:
            await pool.aclose()

    return asyncio.run(run())


def router_workers(router_url: str, api_key: str | None = None) -> list[dict[str, Any]]:
    """The router's ``GET /workers`` list, read by :func:`router_client.workers_of`; AssertionError with the
    client's reason when it cannot be read."""
    workers, problem = on_router(lambda pool: router_client.workers_of(pool, router_url), api_key)
    assert workers is not None, problem
    return workers
