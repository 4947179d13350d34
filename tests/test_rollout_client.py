"""The rollout client: versions and the stream's bookkeeping on their own, then against stand-in engines whose
greedy tokens depend on the weights alone (each engine of a model makes the same ones): an engine killed in
the middle of a stream, a router that does not answer, versions asked for, a client abort, text prompts.

The expected tokens are an uninterrupted run's, asked of an engine directly before anything is killed."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.serving.discovery import rl_workers
from miles_sglang_plugin.serving.fleet import EngineInfo
from miles_sglang_plugin.serving.registry import ModelRoute, RouterRegistry
from miles_sglang_plugin.serving.rollout import (
    AsyncRolloutClient,
    RolloutError,
    RolloutResult,
    Segment,
    VersionConstraint,
    VersionUnavailable,
    Worker,
    _Broken,
    _event,
    _refusal,
    _Try,
    _worker,
)
from miles_sglang_plugin.standin.engine import Prompt, fake_generate
from tests.launch_helpers import refusing_port
from tests.test_standin import HOST, Proc, spawn, start_standin, wait_http  # noqa: F401

#: 0.1 s per decode step: a 40-token answer streams for about 4 s, and the next token comes 0.1 s after the
#: one whose arrival kills its engine (a loaded machine's delays stay well below).
PACED = {"MSP_STANDIN_SPEED": json.dumps({"decode_step_s": 0.1, "decode_token_s": 0.0})}
PROMPT = [101, 202, 303, 404]
GREEDY = {"max_new_tokens": 40, "temperature": 0}


# ----------------------------------------------------------------------------------------------- versions
def test_a_minimum_version_is_compared_as_a_number_and_an_exact_one_as_text() -> None:
    at_least_3 = VersionConstraint.of(3, None)
    assert at_least_3 is not None
    assert [at_least_3.allows(v) for v in ("2", "3", "10", "default", None)] == [
        False,
        True,
        True,
        False,
        False,
    ]
    exact = VersionConstraint.of(None, "v2")
    assert exact is not None and [exact.allows(v) for v in ("v2", "v3", None)] == [True, False, False]
    assert VersionConstraint.of(None, None) is None
    assert str(VersionConstraint.of("7", None)) == "version >= 7"
    with pytest.raises(ValueError, match="not both"):
        VersionConstraint.of(1, "1")
    with pytest.raises(ValueError, match="min_version must be an integer"):
        VersionConstraint.of("v2", None)


# ----------------------------------------------------------------------------------------------- the stream
def _event_of(ids: list[int], completion: int, **meta: Any) -> dict[str, Any]:
    return {"text": "", "output_ids": ids, "meta_info": {"completion_tokens": completion, **meta}}


def test_a_stream_of_the_output_so_far_and_one_of_the_new_tokens_give_the_same_ids() -> None:
    so_far, new = _Try(), _Try()
    for ids in ([7], [7, 8], [7, 8, 9]):
        so_far.take(_event_of(ids, len(ids)))
    for count, ids in enumerate(([7], [8], [9]), 1):
        new.take(_event_of(ids, count))
    assert so_far.ids == new.ids == [7, 8, 9]
    with pytest.raises(_Broken, match="2 output ids with completion_tokens 6 after 3"):
        new.take(_event_of([1, 2], 6))


def test_tokens_are_attributed_to_the_weight_version_that_made_them() -> None:
    got = _Try()
    spans = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 5}]
    got.take(_event_of([1, 2, 3, 4, 5], 5, weight_versions=spans, weight_version="5"))
    assert [got.version_at(i) for i in range(5)] == ["4", "4", "5", "5", "5"]
    plain = _Try()
    plain.take(_event_of([1, 2], 2, weight_version="9"))
    assert [plain.version_at(i) for i in range(2)] == ["9", "9"]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=31999), min_size=1, max_size=12),
    total=st.integers(min_value=1, max_value=30),
    data=st.data(),
)
def test_the_stand_in_goes_on_from_its_own_tokens_as_a_language_model_does(
    prompt: list[int], total: int, data: st.DataObject
) -> None:
    """What a resubmission relies on: the prompt followed by the first k generated tokens makes the rest."""
    whole = fake_generate(Prompt(tuple(prompt)), total, "m|1")
    k = data.draw(st.integers(min_value=0, max_value=total))
    rest = fake_generate(Prompt((*prompt, *whole.ids[:k])), total - k, "m|1")
    assert rest.ids == whole.ids[k:] and rest.logprobs == whole.logprobs[k:]


# ----------------------------------------------------------------------------------------------- live
class Fleet:
    """A fixed list of engines, as the deployment would give them."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.list = list(workers)

    def workers(self, model: str) -> Sequence[Worker]:
        return [w for w in self.list if w.model == model]


@pytest.fixture
def no_router() -> Iterator[RouterRegistry]:
    """A registry whose router port refuses connections: the client must go to the engines."""
    with refusing_port() as port:
        yield RouterRegistry([ModelRoute("actor", HOST, port, policy="round_robin")])


def engines(spawn: Callable[..., Proc], *versions: str) -> list[Proc]:
    procs = [start_standin(spawn, "--weight-version", v, env=PACED) for v in versions]
    for proc in procs:
        wait_http(proc)
    return procs


def uninterrupted(engine: Proc, prompt: list[int], sampling: dict[str, Any] = GREEDY) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": sampling}
    return list(httpx.post(engine.url + "/generate", json=body, timeout=60).json()["output_ids"])


def run(client: AsyncRolloutClient, **kwargs: Any) -> RolloutResult:
    async def go() -> RolloutResult:
        async with client:
            return await client.generate(**kwargs)

    return asyncio.run(go())


def killer(procs: dict[str, Proc], after: int) -> Callable[[str, int], None]:
    """An ``on_tokens`` that SIGKILLs the engine a request is on once the request has ``after`` tokens."""
    killed: list[str] = []

    def on_tokens(target: str, count: int) -> None:
        if count >= after and not killed and target in procs:
            killed.append(target)
            os.kill(procs[target].popen.pid, signal.SIGKILL)

    return on_tokens


@pytest.mark.parametrize("after", [1, 20, 39])
def test_an_engine_killed_in_the_middle_of_a_stream_loses_no_token(
    spawn: Callable[..., Proc], after: int, no_router: RouterRegistry
) -> None:
    """Killed after 1, half and all but one of 40 tokens: the other engine goes on from the prompt and the
    tokens so far, and the answer is the uninterrupted run's."""
    a, b = engines(spawn, "default", "default")
    whole = uninterrupted(b, PROMPT)
    fleet = Fleet([Worker(a.url, "actor", id="a"), Worker(b.url, "actor", id="b")])
    client = AsyncRolloutClient(no_router, "actor", workers=fleet, router_retry_s=60)
    result = run(client, input_ids=PROMPT, sampling_params=GREEDY, on_tokens=killer({"a": a, "b": b}, after))
    assert list(result.output_ids) == whole and len(whole) == 40
    first, second = result.segments
    assert (first.start, second.end) == (0, 40) and first.end == second.start >= after
    assert {first.engine, second.engine} == {"a", "b"} and first.weight_version == "default"
    router_try, broken, finished = result.attempts
    assert router_try.target == "router actor" and "ConnectError" in router_try.outcome
    assert broken.target == first.engine and broken.kept_tokens == first.end
    assert (finished.sent_tokens, finished.kept_tokens, finished.outcome) == (
        4 + first.end,
        40 - first.end,
        "finished",
    )
    assert result.finish_reason == {"type": "length", "length": 40 - first.end}


def test_a_request_asking_for_a_version_goes_to_the_engine_that_has_it(
    spawn: Callable[..., Proc], no_router: RouterRegistry
) -> None:
    one, two = engines(spawn, "1", "2")
    by_one, by_two = uninterrupted(one, PROMPT), uninterrupted(two, PROMPT)
    assert by_one != by_two  # greedy tokens depend on the weights
    fleet = Fleet(
        [
            Worker(one.url, "actor", weight_version="1", id="one"),
            Worker(two.url, "actor", "regular", "2", id="two"),
        ]
    )
    client = AsyncRolloutClient(no_router, "actor", workers=fleet)
    result = run(client, input_ids=PROMPT, sampling_params=GREEDY, min_version=2)
    assert list(result.output_ids) == by_two
    assert result.segments == (Segment(0, 40, "two", "2"),) and result.weight_version == "2"
    with pytest.raises(
        VersionUnavailable, match=r"no engine has version '3' after \d+\.\d s \(versions: 1, 2\)"
    ):
        run(
            AsyncRolloutClient(no_router, "actor", workers=fleet, version_wait_s=0.3),
            input_ids=PROMPT,
            sampling_params=GREEDY,
            exact_version=3,
        )


def test_tokens_of_a_version_below_the_minimum_are_never_kept(
    spawn: Callable[..., Proc], no_router: RouterRegistry
) -> None:
    """The deployment believes both engines have version 2, but "stale" still has 1: its tokens are dropped
    and made again by the engine that really has 2."""
    stale, fresh = engines(spawn, "1", "2")
    fleet = Fleet(
        [
            Worker(stale.url, "actor", "regular", "2", id="stale"),
            Worker(fresh.url, "actor", "regular", "2", id="fresh"),
        ]
    )
    client = AsyncRolloutClient(no_router, "actor", workers=fleet, router_retry_s=60)
    result = run(client, input_ids=PROMPT, sampling_params=GREEDY, min_version=2)
    assert list(result.output_ids) == uninterrupted(fresh, PROMPT)
    assert result.weight_versions == ("2",) and [s.engine for s in result.segments] == ["fresh"]
    assert [(a.target, a.kept_tokens) for a in result.attempts][1:] == [("stale", 0), ("fresh", 40)]
    assert "tokens of version '1', not version >= 2" in result.attempts[1].outcome


def test_a_client_abort_ends_the_request_with_its_tokens_so_far(
    spawn: Callable[..., Proc], no_router: RouterRegistry
) -> None:
    (a,) = engines(spawn, "default")
    client = AsyncRolloutClient(no_router, "actor", workers=Fleet([Worker(a.url, "actor", id="a")]))

    def abort_at_5(target: str, count: int) -> None:
        if count == 5:
            client.abort_all()

    result = run(
        client,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 200, "temperature": 0},
        on_tokens=abort_at_5,
    )
    assert result.aborted and result.finish_reason == {"type": "abort", "message": "aborted by the client"}
    assert 5 <= len(result.output_ids) < 200 and len(result.attempts) == 2


def test_a_text_prompt_is_continued_from_its_token_ids(
    spawn: Callable[..., Proc], no_router: RouterRegistry
) -> None:
    a, b = engines(spawn, "default", "default")
    text = "the quick brown fox jumps"
    whole = httpx.post(b.url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=60).json()
    fleet = Fleet([Worker(a.url, "actor", id="a"), Worker(b.url, "actor", id="b")])
    client = AsyncRolloutClient(no_router, "actor", workers=fleet, router_retry_s=60)
    result = run(client, text=text, sampling_params=GREEDY, on_tokens=killer({"a": a, "b": b}, 10))
    assert list(result.output_ids) == whole["output_ids"] and len(result.segments) == 2
    assert result.attempts[-1].sent_tokens == 5 + result.segments[0].end  # five words, then the tokens so far


def test_a_malformed_request_is_not_sent_again(spawn: Callable[..., Proc], no_router: RouterRegistry) -> None:
    (a,) = engines(spawn, "default")
    client = AsyncRolloutClient(no_router, "actor", workers=Fleet([Worker(a.url, "actor", id="a")]))
    with pytest.raises(
        RolloutError,
        match=r"(?s)refused.*try 2: a \(sent 4 tokens, kept 0, at [0-9.]+ s for [0-9.]+ s\): HTTP 400",
    ) as caught:
        run(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 10**9})
    assert len(caught.value.attempts) == 2


def test_the_engine_listing_has_smgs_shape_with_the_versions_engines_have_now() -> None:
    def info(engine_id: str, state: str, version: str | None, kind: str = "decode") -> EngineInfo:
        return EngineInfo(
            engine_id,
            "actor",
            "decode",
            kind,
            f"http://10.0.0.1:{len(engine_id)}",
            0,
            "0",
            1,
            state,
            weight_version=version,
        )

    listing = rl_workers(
        [
            info("actor.decode.0", "serving", "7"),
            info("actor.decode.1", "lost", "6"),
            info("actor.decode.2", "stopped", "7"),
        ]
    )
    assert listing["protocol_version"] == 1 and listing["total"] == 2
    first, second = listing["workers"]
    assert first == {
        "id": "actor.decode.0",
        "url": "http://10.0.0.1:14",
        "base_url": "http://10.0.0.1:14",
        "engine": "sglang",
        "model_id": "actor",
        "worker_type": "decode",
        "connection_mode": "http",
        "health": "ready",
        "state": "serving",
        "weight_version": "7",
        "labels": {"group": "decode", "engine_id": "actor.decode.0", "external": "false"},
        "capabilities": {
            "source": "static",
            "pause_modes": ["abort", "retract", "in_place"],
            "update_from": ["disk", "tensor", "distributed"],
            "abort": True,
            "flush_cache": True,
            "sleep_wake": True,
            "reports_weight_version": True,
        },
    }
    assert (second["health"], second["state"], second["weight_version"]) == ("unhealthy", "lost", "6")
    # What a client in another process makes of the rows (and of a row of a listing without our state).
    assert _worker(first) == Worker(
        "http://10.0.0.1:14", "actor", "decode", "7", "serving", "actor.decode.0", "decode"
    )
    smg_row = {
        "url": "http://h:1",
        "model_id": "actor",
        "worker_type": "regular",
        "health": "ready",
        "weight_version": "default",
    }
    assert _worker(smg_row) == Worker("http://h:1", "actor", "regular", "default", "serving")
    assert _worker({"url": 5}) is None


def test_a_refusal_inside_a_stream_is_not_sent_again_and_a_lost_stream_is() -> None:
    """SGLang refuses some requests only once their stream has begun (an error event with its HTTP code and
    ``retryable``), and its scheduler ends others with an abort finish whose status is 400."""
    with pytest.raises(_Broken) as refused:
        _event(b'{"error": {"message": "The input is longer than the context", "code": 400}}')
    assert refused.value.retry is False
    with pytest.raises(_Broken) as busy:
        _event(b'{"error": {"message": "try later", "code": 503, "retryable": true}}')
    assert busy.value.retry is True
    with pytest.raises(_Broken) as said_no:
        _event(b'{"error": {"message": "no", "code": 429, "retryable": false}}')
    assert said_no.value.retry is False
    assert _refusal(400) and _refusal(422) and not _refusal(429) and not _refusal(503) and not _refusal(None)


def test_the_versions_of_tokens_streamed_without_spans_are_those_of_their_events() -> None:
    """Intermediate events carry only the engine's version as they are sent: two tokens came under 4, then an
    in-place update, two more under 5; the last event's spans, where there are some, are SGLang's own."""
    got = _Try()
    got.take(_event_of([1, 2], 2, weight_version="4"))
    got.take(_event_of([1, 2, 3, 4], 4, weight_version="5"))
    assert [got.version_at(i) for i in range(4)] == ["4", "4", "5", "5"]
    spans = [{"version": "4", "start": 0, "end": 3}, {"version": "5", "start": 3, "end": 5}]
    got.take(_event_of([1, 2, 3, 4, 5], 5, weight_version="5", weight_versions=spans))
    assert [got.version_at(i) for i in range(5)] == ["4", "4", "4", "5", "5"]


def test_a_listing_that_is_wrong_about_versions_ends_in_version_unavailable_not_a_loop(
    spawn: Callable[..., Proc], no_router: RouterRegistry
) -> None:
    """Both engines are listed with version 2 but have 1: each is tried once, its tokens dropped, and the
    request ends in VersionUnavailable after its version wait, long before its deadline (before: the wait
    started over with every try, so the engines were asked again and again until the deadline)."""
    one, other = engines(spawn, "1", "1")
    fleet = Fleet(
        [
            Worker(one.url, "actor", "regular", "2", id="one"),
            Worker(other.url, "actor", "regular", "2", id="other"),
        ]
    )
    client = AsyncRolloutClient(no_router, "actor", workers=fleet, version_wait_s=1.0, router_retry_s=600)
    with pytest.raises(VersionUnavailable) as caught:
        run(client, input_ids=PROMPT, sampling_params=GREEDY, min_version=2, deadline_s=600)
    tried = [a.target for a in caught.value.attempts]
    assert sorted(tried[1:]) == ["one", "other"] and all(a.kept_tokens == 0 for a in caught.value.attempts)


def test_a_client_abort_ends_a_request_that_waits_for_its_version(
    spawn: Callable[..., Proc], no_router: RouterRegistry
) -> None:
    (a,) = engines(spawn, "1")
    client = AsyncRolloutClient(
        no_router,
        "actor",
        workers=Fleet([Worker(a.url, "actor", "regular", "1", id="a")]),
        version_wait_s=600,
    )

    async def go() -> RolloutResult:
        async with client:
            asyncio.get_running_loop().call_later(0.3, client.abort_all)
            return await client.generate(PROMPT, sampling_params=GREEDY, min_version=2)

    result = asyncio.run(go())
    assert result.aborted and result.output_ids == () and result.attempts == ()
