"""The routers' reads shared by the registrations that wait on one router (``serving/router_client.py``):
while a ``GET`` to a router is out, every caller that asks for the same path awaits that one answer; a
caller that asks after it came back gets a new one; a waiter that is cancelled does not cancel it for the
others. A fake pool stands in for the HTTP clients: it counts the calls and answers when the test says so."""

from __future__ import annotations

import asyncio
from typing import Any

from miles_sglang_plugin.rendering.router_specs import WorkerRegistration
from miles_sglang_plugin.serving.router_client import SharedReads, listed
from miles_sglang_plugin.serving.wire import Answer

ROUTER = "http://127.0.0.1:30000"


class FakePool:
    """Answers ``GET`` calls when the test releases them; records each call."""

    def __init__(self, bodies: dict[str, Any]) -> None:
        self.bodies = bodies
        self.calls: list[str] = []
        self.release = asyncio.Event()

    async def call(self, base_url: str, method: str, path: str, **_kw: Any) -> Answer:
        self.calls.append(f"{method} {base_url}{path}")
        await self.release.wait()
        return Answer(200, self.bodies[path], None, 0.0)


WORKER = {"url": "http://127.0.0.1:31000", "worker_type": "regular", "is_healthy": True, "id": "w0"}


def test_callers_that_ask_while_a_read_is_out_share_its_answer() -> None:
    async def scenario() -> tuple[list[str], list[Answer], list[str]]:
        pool = FakePool({"/workers": {"workers": [WORKER]}})
        reads = SharedReads(pool, asyncio.ensure_future)  # type: ignore[arg-type]
        waiting = [asyncio.ensure_future(reads.get(ROUTER, "/workers", 1024)) for _ in range(16)]
        await asyncio.sleep(0)
        pool.release.set()
        answers = list(await asyncio.gather(*waiting))
        first = list(pool.calls)
        await reads.get(ROUTER, "/workers", 1024)  # after the answer came: a read of its own
        return first, answers, pool.calls

    first, answers, calls = asyncio.run(scenario())
    assert first == [f"GET {ROUTER}/workers"]
    assert all(a.body == {"workers": [WORKER]} for a in answers)
    assert calls == [f"GET {ROUTER}/workers"] * 2


def test_reads_of_other_paths_or_routers_are_not_shared() -> None:
    async def scenario() -> list[str]:
        pool = FakePool({"/workers": {"workers": []}, "/readiness": {}})
        reads = SharedReads(pool, asyncio.ensure_future)  # type: ignore[arg-type]
        out = [
            asyncio.ensure_future(reads.get(ROUTER, "/workers", 1024)),
            asyncio.ensure_future(reads.get(ROUTER, "/readiness", 1024)),
            asyncio.ensure_future(reads.get("http://127.0.0.1:30002", "/workers", 1024)),
        ]
        await asyncio.sleep(0)
        pool.release.set()
        await asyncio.gather(*out)
        return sorted(pool.calls)

    assert asyncio.run(scenario()) == [
        f"GET {ROUTER}/readiness",
        f"GET {ROUTER}/workers",
        "GET http://127.0.0.1:30002/workers",
    ]


def test_a_cancelled_waiter_leaves_the_read_to_the_others() -> None:
    async def scenario() -> tuple[bool, Answer, list[str]]:
        pool = FakePool({"/workers": {"workers": [WORKER]}})
        reads = SharedReads(pool, asyncio.ensure_future)  # type: ignore[arg-type]
        quitter = asyncio.ensure_future(reads.get(ROUTER, "/workers", 1024))
        stayer = asyncio.ensure_future(reads.get(ROUTER, "/workers", 1024))
        await asyncio.sleep(0)
        quitter.cancel()
        await asyncio.sleep(0)
        pool.release.set()
        answer = await stayer
        return quitter.cancelled(), answer, pool.calls

    cancelled, answer, calls = asyncio.run(scenario())
    assert cancelled and answer.status == 200 and calls == [f"GET {ROUTER}/workers"]


def test_registrations_waiting_on_one_router_read_its_list_once_between_them() -> None:
    """``listed`` of 8 registrations at once through shared reads: one GET /workers and one GET /readiness,
    and each learns it is listed healthy."""
    workers = [
        {"url": f"http://127.0.0.1:{31000 + i}", "worker_type": "regular", "is_healthy": True, "id": f"w{i}"}
        for i in range(8)
    ]

    async def scenario() -> tuple[list[tuple[bool, str]], list[str]]:
        pool = FakePool({"/workers": {"workers": workers}, "/readiness": {"status": "ready"}})
        pool.release.set()
        reads = SharedReads(pool, asyncio.ensure_future)  # type: ignore[arg-type]
        registrations = [WorkerRegistration(url=w["url"], worker_type="regular") for w in workers]
        results = await asyncio.gather(*(listed(reads, ROUTER, [r]) for r in registrations))
        return list(results), pool.calls

    results, calls = asyncio.run(scenario())
    assert [ok for ok, _ in results] == [True] * 8
    assert results[0][1].startswith("ready: 1 workers healthy; also registered: ")
    assert sorted(calls) == [f"GET {ROUTER}/readiness", f"GET {ROUTER}/workers"]
