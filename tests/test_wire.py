"""The wire's one call (deadline and size cap) against a server whose answer never ends, on the deployment's
serving loop."""

from __future__ import annotations

import gc
import logging

import httpx
import pytest

from miles_sglang_plugin.serving.reconciler import ServingLoop
from miles_sglang_plugin.serving.wire import call
from tests.misbehaving_engine import MisbehavingEngine


def test_an_answer_cut_at_its_size_cap_leaves_nothing_pending_when_the_serving_loop_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Reading stops at the cap (64 KiB here) of an endless ``/server_info``. The iterators of the body that
    httpx leaves open are closed by tasks the garbage collector schedules; a serving loop closed under them
    printed "Task was destroyed but it is pending!" (twice, before a launch's clean error)."""
    serving = ServingLoop()
    serving.start()

    async def ask(url: str) -> str | None:
        async with httpx.AsyncClient() as client:
            answer = await call(client, "GET", url + "/server_info", deadline_s=30, max_bytes=64 * 1024)
        return answer.error

    with MisbehavingEngine("endless_info") as bad, caplog.at_level(logging.ERROR, logger="asyncio"):
        error = serving.submit(ask(bad.url)).result(timeout=60)
        serving.close()
        del serving
        gc.collect()
    assert error == "its answer is larger than 65536 bytes"
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
