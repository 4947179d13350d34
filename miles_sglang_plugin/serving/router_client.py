"""The reconciler's calls to a model's router, on its kept client with one deadline each (:mod:`.wire`):
register an engine and wait until the router lists it healthy, take one out, check that the router lists
the engines it should. The router's wire format is described in :mod:`.routers`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any

from miles_sglang_plugin.rendering.router_specs import WorkerRegistration
from miles_sglang_plugin.serving.routers import others_note, registration_problems, same_worker
from miles_sglang_plugin.serving.wire import ClientPool

__all__ = ["REGISTRATION_TIMEOUT_S", "ROUTER_CALL_TIMEOUT_S", "deregister", "listed", "register"]

#: One call to a router (it answers control calls at once).
ROUTER_CALL_TIMEOUT_S = 10.0
#: How long a registered engine may take to be listed healthy by its router.
REGISTRATION_TIMEOUT_S = 60.0
#: How often the router's list is read while waiting for it.
LIST_POLL_S = 0.02
#: The most a router's answer may hold (a list of a few thousand workers).
ROUTER_ANSWER_BYTES = 16 * 1024 * 1024


async def workers_of(pool: ClientPool, router_url: str) -> tuple[list[dict[str, Any]] | None, str]:
    """The router's ``GET /workers`` list, or None and why it could not be read."""
    answer = await pool.call(
        router_url, "GET", "/workers", deadline_s=ROUTER_CALL_TIMEOUT_S, max_bytes=ROUTER_ANSWER_BYTES
    )
    problem = answer.problem()
    if problem is not None:
        return None, f"GET {router_url}/workers: {problem}"
    workers = answer.body.get("workers") if isinstance(answer.body, dict) else None
    if not isinstance(workers, list) or not all(isinstance(w, dict) for w in workers):
        return None, f"GET {router_url}/workers: unexpected answer {str(answer.body)[:300]}"
    return workers, ""


async def listed(
    pool: ClientPool, router_url: str, expected: Collection[WorkerRegistration]
) -> tuple[bool, str]:
    """``(ready, detail)``: the router lists every ``expected`` worker healthy with its worker type (and
    bootstrap port), and ``/readiness`` answers 200 when it should serve any."""
    workers, problem = await workers_of(pool, router_url)
    if workers is None:
        return False, problem
    problems = registration_problems(workers, expected)
    note = others_note(workers, expected)
    if problems:
        listed_problems = "; ".join(message for messages in problems.values() for message in messages)
        return False, f"waiting for {len(problems)} of {len(expected)} workers: {listed_problems}{note}"
    if expected:
        ready = await pool.call(
            router_url, "GET", "/readiness", deadline_s=ROUTER_CALL_TIMEOUT_S, max_bytes=65536
        )
        if ready.status != 200:
            return (
                False,
                f"all {len(expected)} expected workers registered, but /readiness: {ready.problem()}{note}",
            )
    return True, f"ready: {len(expected)} workers healthy{note}"


async def _post(
    pool: ClientPool, router_url: str, registration: WorkerRegistration, api_key: str | None, deadline: float
) -> str | None:
    """``POST /workers``, as often as SMG answers 409 (the URL is listed still: an entry of a process that is
    gone, or its removal still draining), taking that entry out each time, until ``deadline``."""
    while True:
        answer = await pool.call(
            router_url,
            "POST",
            "/workers",
            body=registration.payload(api_key),
            deadline_s=ROUTER_CALL_TIMEOUT_S,
        )
        if answer.status != 409 or time.monotonic() >= deadline:
            problem = answer.problem()
            return None if problem is None else f"POST {router_url}/workers: {problem}"
        await deregister(pool, router_url, registration.url)
        await asyncio.sleep(LIST_POLL_S)


async def register(
    pool: ClientPool, router_url: str, registration: WorkerRegistration, api_key: str | None
) -> str | None:
    """Register one engine (with either gateway, also on a URL the router still lists) and wait until the
    router lists it healthy. The problem, or None."""
    deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
    problem = await _post(pool, router_url, registration, api_key, deadline)
    if problem is not None:
        return problem
    detail = ""
    while time.monotonic() < deadline:
        ok, detail = await listed(pool, router_url, [registration])
        if ok:
            return None
        await asyncio.sleep(LIST_POLL_S)
    return f"its router does not list it as healthy after {REGISTRATION_TIMEOUT_S:g} s: {detail}"


async def deregister(pool: ClientPool, router_url: str, url: str) -> str | None:
    """Take every entry of the worker at ``url`` out of the router (dp-aware routers list one per rank). The
    problem, or None (also when it was not listed)."""
    workers, problem = await workers_of(pool, router_url)
    if workers is None:
        return problem
    for worker in workers:
        if same_worker(worker.get("url"), url) and worker.get("id"):
            answer = await pool.call(
                router_url, "DELETE", f"/workers/{worker['id']}", deadline_s=ROUTER_CALL_TIMEOUT_S
            )
            if answer.status != 404 and answer.problem() is not None:
                return f"DELETE {router_url}/workers/{worker['id']}: {answer.problem()}"
    return None
