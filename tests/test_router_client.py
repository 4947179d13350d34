"""The routers' reads shared by the registrations that wait on one router (``serving/router_client.py``):
while a ``GET`` to a router is out, every caller that asks for the same path awaits that one answer; a
caller that asks after it came back gets a new one; a waiter that is cancelled does not cancel it for the
others. A fake pool stands in for the HTTP clients: it counts the calls and answers when the test says so."""

from __future__ import annotations

import asyncio
from typing import Any

from miles_sglang_plugin.rendering.router_specs import WorkerRegistration
from miles_sglang_plugin.serving.router_client import SharedReads, deregister, listed, workers_of
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


class ScriptedPool:
    """Answers each call from a table of ``"METHOD path"`` -> Answer at once; records each call."""

    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def call(self, base_url: str, method: str, path: str, **_kw: Any) -> Answer:
        self.calls.append(f"{method} {path}")
        return self.answers[f"{method} {path}"]


def _ok(body: Any, status: int = 200) -> Answer:
    return Answer(status, body, None, 0.0)


def test_listed_names_what_is_wrong_with_each_entry() -> None:
    prefill = WorkerRegistration("http://127.0.0.1:31000", "prefill", 8998)
    decode = WorkerRegistration("http://127.0.0.1:31001", "decode")
    entries = [
        {"url": prefill.url, "worker_type": "prefill", "bootstrap_port": 9000, "is_healthy": True, "id": "p"},
        {"url": decode.url, "worker_type": "decode", "is_healthy": False, "id": "d"},
        {"url": "http://127.0.0.1:31002", "worker_type": "regular", "is_healthy": True, "id": "r"},
    ]
    pool = ScriptedPool({"GET /workers": _ok({"workers": entries})})
    assert asyncio.run(listed(pool, ROUTER, [prefill, decode])) == (  # type: ignore[arg-type]
        False,
        "waiting for 2 of 2 workers: http://127.0.0.1:31000 has bootstrap_port 9000, expected 8998; "
        "http://127.0.0.1:31001 (decode) registered but not healthy; also registered: http://127.0.0.1:31002",
    )
    assert pool.calls == ["GET /workers"]  # /readiness is asked only once every worker is listed as expected


def test_listed_counts_a_dp_aware_workers_ranks_as_its_entries() -> None:
    worker = WorkerRegistration("http://127.0.0.1:31000")
    ranks = [
        {"url": f"{worker.url}@{rank}", "worker_type": "regular", "is_healthy": healthy, "id": f"w{rank}"}
        for rank, healthy in ((0, True), (1, False))
    ]
    pool = ScriptedPool({"GET /workers": _ok({"workers": ranks}), "GET /readiness": _ok({"status": "ready"})})
    assert asyncio.run(listed(pool, ROUTER, [worker])) == (  # type: ignore[arg-type]
        False,
        "waiting for 1 of 1 workers: http://127.0.0.1:31000@1 (regular) registered but not healthy",
    )
    ranks[1]["is_healthy"] = True
    assert asyncio.run(listed(pool, ROUTER, [worker])) == (True, "ready: 1 workers healthy")  # type: ignore[arg-type]


def test_a_list_that_is_not_one_is_a_problem_not_an_exception() -> None:
    for body in ({"workers": "none"}, ["w0"], {"workers": [1]}, None):
        pool = ScriptedPool({"GET /workers": _ok(body)})
        assert asyncio.run(workers_of(pool, ROUTER)) == (  # type: ignore[arg-type]
            None,
            f"GET {ROUTER}/workers: unexpected answer {body}",
        )
    pool = ScriptedPool({"GET /workers": _ok("Unauthorized", 401)})
    assert asyncio.run(listed(pool, ROUTER, [])) == (False, f"GET {ROUTER}/workers: HTTP 401: Unauthorized")  # type: ignore[arg-type]


def test_deregister_deletes_every_entry_of_the_url_and_takes_404_as_gone() -> None:
    url = "http://127.0.0.1:31000"
    entries = [
        {"url": f"{url}@0", "id": "a"},
        {"url": f"{url}@1", "id": "b"},
        {"url": "http://127.0.0.1:310001", "id": "c"},  # another port that starts with the same digits
        {"url": url},  # no id: nothing to delete by
    ]
    answers = {
        "GET /workers": _ok({"workers": entries}),
        "DELETE /workers/a": _ok({"status": "accepted"}, 202),
        "DELETE /workers/b": _ok({"error": "not found"}, 404),
    }
    pool = ScriptedPool(answers)
    assert asyncio.run(deregister(pool, ROUTER, url)) is None  # type: ignore[arg-type]
    assert pool.calls == ["GET /workers", "DELETE /workers/a", "DELETE /workers/b"]
    answers["DELETE /workers/a"] = _ok("busy", 500)
    pool = ScriptedPool(answers)
    assert asyncio.run(deregister(pool, ROUTER, url)) == f"DELETE {ROUTER}/workers/a: HTTP 500: busy"  # type: ignore[arg-type]
    assert pool.calls == ["GET /workers", "DELETE /workers/a"]
