"""The reconciler's calls to a model's router, on its kept client with one deadline each (:mod:`.wire`):
register an engine and wait until the router lists it healthy, take one out, check that the router lists
the engines it should. The router's wire format is described in :mod:`.routers`.

Engines that register at the same time (every engine of a start-up turns healthy within a poll or two) share
the router's answers: while one ``GET /workers`` (or ``/readiness``) to a router is out, every registration
that waits on that router awaits the same answer (:class:`SharedReads`), so K registrations read the list
about once per poll between them, not K times (each read of a list of K workers, K times per poll).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Coroutine
from typing import Any

from miles_sglang_plugin.rendering.router_specs import WorkerRegistration
from miles_sglang_plugin.serving.routers import others_note, registration_problems, same_worker
from miles_sglang_plugin.serving.wire import Answer, ClientPool

__all__ = [
    "REGISTRATION_TIMEOUT_S",
    "ROUTER_CALL_TIMEOUT_S",
    "SharedReads",
    "deregister",
    "listed",
    "register",
]

#: One call to a router (it answers control calls at once).
ROUTER_CALL_TIMEOUT_S = 10.0
#: How long a registered engine may take to be listed healthy by its router.
REGISTRATION_TIMEOUT_S = 60.0
#: How often the router's list is read while waiting for it.
LIST_POLL_S = 0.02
#: The most a router's answer may hold (a list of a few thousand workers).
ROUTER_ANSWER_BYTES = 16 * 1024 * 1024


class SharedReads:
    """One ``GET`` in flight per router and path: a caller that asks while one is out awaits its answer (an
    answer that is never older than the call). The request runs as a task of its own (``spawn``: the serving
    loop's tracked tasks, so that stopping cancels it), so that a waiter that is cancelled does not cancel
    it for the others."""

    def __init__(
        self, pool: ClientPool, spawn: Callable[[Coroutine[Any, Any, Answer]], asyncio.Future[Answer]]
    ) -> None:
        self.pool = pool
        self._spawn = spawn
        self._out: dict[tuple[str, str], asyncio.Future[Answer]] = {}

    async def get(self, router_url: str, path: str, max_bytes: int) -> Answer:
        key = (router_url, path)
        out = self._out.get(key)
        if out is None or out.done():
            out = self._out[key] = self._spawn(
                self.pool.call(router_url, "GET", path, deadline_s=ROUTER_CALL_TIMEOUT_S, max_bytes=max_bytes)
            )
        return await asyncio.shield(out)


def _reads(pool: ClientPool | SharedReads) -> SharedReads:
    return pool if isinstance(pool, SharedReads) else SharedReads(pool, asyncio.ensure_future)


async def workers_of(
    pool: ClientPool | SharedReads, router_url: str
) -> tuple[list[dict[str, Any]] | None, str]:
    """The router's ``GET /workers`` list, or None and why it could not be read."""
    answer = await _reads(pool).get(router_url, "/workers", ROUTER_ANSWER_BYTES)
    problem = answer.problem()
    if problem is not None:
        return None, f"GET {router_url}/workers: {problem}"
    workers = answer.body.get("workers") if isinstance(answer.body, dict) else None
    if not isinstance(workers, list) or not all(isinstance(w, dict) for w in workers):
        return None, f"GET {router_url}/workers: unexpected answer {str(answer.body)[:300]}"
    return workers, ""


async def listed(
    pool: ClientPool | SharedReads, router_url: str, expected: Collection[WorkerRegistration]
) -> tuple[bool, str]:
    """``(ready, detail)``: the router lists every ``expected`` worker healthy with its worker type (and
    bootstrap port), and ``/readiness`` answers 200 when it should serve any."""
    reads = _reads(pool)
    workers, problem = await workers_of(reads, router_url)
    if workers is None:
        return False, problem
    problems = registration_problems(workers, expected)
    note = others_note(workers, expected)
    if problems:
        listed_problems = "; ".join(message for messages in problems.values() for message in messages)
        return False, f"waiting for {len(problems)} of {len(expected)} workers: {listed_problems}{note}"
    if expected:
        ready = await reads.get(router_url, "/readiness", 65536)
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
    pool: ClientPool | SharedReads, router_url: str, registration: WorkerRegistration, api_key: str | None
) -> str | None:
    """Register one engine (with either gateway, also on a URL the router still lists) and wait until the
    router lists it healthy (reading the router's list with the other registrations that wait on it, when
    ``pool`` is a :class:`SharedReads`). The problem, or None."""
    reads = _reads(pool)
    deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
    problem = await _post(reads.pool, router_url, registration, api_key, deadline)
    if problem is not None:
        return problem
    detail = ""
    while time.monotonic() < deadline:
        ok, detail = await listed(reads, router_url, [registration])
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
