"""The rollout client: generation requests to one model of a deployment that lose no generated token when
an engine or a router goes away, and that say which weight version made which tokens.

A request is sent to SGLang's native ``/generate`` as a stream, so the client knows every token the moment it
is made. When the stream breaks before its finish (the connection drops, a 5xx, an ``abort`` finish from a
weight update, an engine the deployment lost, no token for ``stall_s``), the client sends the prompt followed
by the tokens it already has, with the rest of ``max_new_tokens``, to a healthy engine of the same model
(through the router; straight to an engine when the router does not answer and the client knows the engines):
the engine pre-fills them and goes on. With greedy decoding the tokens are those of an uninterrupted run; with
sampling, a valid sample of the same distribution. The price is one pre-fill of what was already generated
(:attr:`RolloutResult.resubmitted_tokens`).

Each answer says which weight version produced which of its tokens (SGLang's ``meta_info.weight_versions``):
the result's :class:`Segment` s carry them. A request may ask for ``min_version`` (integer versions) or
``exact_version``: it is sent only to engines that have it, tokens made with another version are dropped and
made again, and when no engine has it within ``version_wait_s`` the request ends in
:class:`VersionUnavailable` (retryable: ask again later).

What is not guaranteed: a request whose prompt is text and whose engines cannot tokenize it (``/tokenize``)
is started again from its prompt (its tokens so far are dropped, not mixed); :attr:`RolloutResult.text` of a
resubmitted request is the texts of its segments joined (token ids are exact; a detokenizer may join a seam
differently); a request is given up after ``deadline_s`` in all, with a :class:`RolloutError` listing every
try.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import httpx

from miles_sglang_plugin.serving import wire
from miles_sglang_plugin.serving.registry import ModelRoute, RouterRegistry

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "AsyncRolloutClient",
    "Attempt",
    "ClientSet",
    "HttpWorkers",
    "RolloutClient",
    "RolloutError",
    "RolloutResult",
    "Segment",
    "VersionConstraint",
    "VersionUnavailable",
    "Worker",
    "WorkerSource",
]

T = TypeVar("T")

#: SGLang's ``max_new_tokens`` when a request gives none (``SamplingParams``).
DEFAULT_MAX_NEW_TOKENS = 128
#: The largest single event of a stream (one ``data:`` line) the client reads.
MAX_EVENT_BYTES = 16 * 1024 * 1024
#: Engine states in which the deployment sends an engine requests.
_SERVING = "serving"
#: Engine states after which a request running on it will not finish there.
_GONE = frozenset({"lost", "restarting", "failed", "stopped"})
#: HTTP statuses of a request that a resubmission can fix (the rest of the 4xx: the request itself is wrong).
_RETRYABLE_4XX = frozenset({404, 408, 409, 425, 429})
_FIRST_PAUSE_S = 0.05
_ABORTED = "aborted by the client"
#: Constrained decoding (``sampling_params``): its grammar state cannot be continued in another request.
_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
#: How long the end of a stream (``[DONE]``) is waited for after its finish.
_AFTER_FINISH_S = 1.0
_MAX_PAUSE_S = 1.0


# ----------------------------------------------------------------------------------------------- versions
def _as_int(version: object) -> int | None:
    if isinstance(version, bool):
        return None
    if isinstance(version, int):
        return version
    if isinstance(version, str):
        text = version.strip()
        if text.lstrip("-").isdigit():
            return int(text)
    return None


@dataclass(frozen=True)
class VersionConstraint:
    """Which weight versions may make a request's tokens: at least ``minimum`` (versions that are integers,
    as the trainer's steps), or exactly ``exact`` (any string)."""

    minimum: int | None = None
    exact: str | None = None

    @staticmethod
    def of(min_version: int | str | None, exact_version: int | str | None) -> VersionConstraint | None:
        """The constraint of a request (None: any version); ValueError for both, or a non-integer minimum."""
        if min_version is not None and exact_version is not None:
            raise ValueError("give min_version or exact_version, not both")
        if min_version is not None:
            minimum = _as_int(min_version)
            if minimum is None:
                raise ValueError(f"min_version must be an integer (a training step), got {min_version!r}")
            return VersionConstraint(minimum=minimum)
        if exact_version is not None:
            return VersionConstraint(exact=str(exact_version))
        return None

    def allows(self, version: str | None) -> bool:
        if self.exact is not None:
            return version == self.exact
        if self.minimum is not None:
            number = _as_int(version)
            return number is not None and number >= self.minimum
        return True

    def __str__(self) -> str:
        return f"version {self.exact!r}" if self.exact is not None else f"version >= {self.minimum}"


# ----------------------------------------------------------------------------------------------- the fleet
@dataclass(frozen=True)
class Worker:
    """One engine the client may send a request to."""

    url: str
    model: str
    #: ``regular``, ``prefill`` or ``decode``.
    worker_type: str = "regular"
    #: Its weight version as last known (None: not known).
    weight_version: str | None = None
    #: The deployment's state of it (``serving``, ``lost``, ...).
    state: str = _SERVING
    id: str = ""
    group: str = ""

    @property
    def name(self) -> str:
        return self.id or self.url


class WorkerSource(Protocol):
    """The engines of a model as the deployment sees them now (cheap: called for every try)."""

    def workers(self, model: str) -> Sequence[Worker]: ...


#: The environment variable with the URL of a deployment's engine listing (``deployment.rollout_env()``).
WORKERS_ENV_VAR = "MSP_RL_WORKERS"
#: The largest engine listing :class:`HttpWorkers` reads.
MAX_LISTING_BYTES = 8 * 1024 * 1024


class HttpWorkers:
    """A rollout client's view of the engines, read from a deployment's ``/v1/rl/workers`` (or SMG's) once
    when it is made, then every ``interval_s`` by a thread of its own (so that a slow answer never holds up a
    request); the last good listing is kept while the listing does not answer."""

    def __init__(
        self, url: str, headers: Mapping[str, str] | None = None, *, interval_s: float = 0.5
    ) -> None:
        self.url = url
        self._headers = dict(headers or {})
        self.interval_s = interval_s
        self._rows: list[Worker] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client = httpx.Client(headers=self._headers, timeout=httpx.Timeout(2.0))
        self._rows = _read_listing(self._client, self.url) or []  # here, not on the caller's event loop
        self._thread = threading.Thread(target=self._poll, name="msp-rl-workers", daemon=True)
        self._thread.start()

    def workers(self, model: str) -> list[Worker]:
        with self._lock:
            return [w for w in self._rows if w.model == model]

    def _poll(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                rows = _read_listing(self._client, self.url)
                if rows is not None:
                    with self._lock:
                        self._rows = rows
        finally:
            self._client.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _read_listing(client: httpx.Client, url: str, deadline_s: float = 5.0) -> list[Worker] | None:
    """The listing at ``url`` (None: no whole answer within ``deadline_s``, larger than the cap, or not one)."""
    until = time.monotonic() + deadline_s
    try:
        with client.stream("GET", url) as response:
            if response.status_code != 200:
                return None
            raw = b""
            for chunk in response.iter_raw():
                raw += chunk
                if len(raw) > MAX_LISTING_BYTES or time.monotonic() > until:
                    return None
        listing = json.loads(raw)
    except Exception:  # whatever the listing does, the client goes on with the last good one
        return None
    rows = listing.get("workers") if isinstance(listing, dict) else None
    if not isinstance(rows, list):
        return None
    return [w for w in (_worker(row) for row in rows) if w is not None]


def _worker(row: Any) -> Worker | None:
    if (
        not isinstance(row, dict)
        or not isinstance(row.get("url"), str)
        or not isinstance(row.get("model_id"), str)
    ):
        return None
    state = row.get("state") if isinstance(row.get("state"), str) else None
    if state is None:  # a listing of another server: ready is serving
        state = "serving" if row.get("health") == "ready" else "starting"
    version = row.get("weight_version")
    labels = row.get("labels")
    group = labels.get("group") if isinstance(labels, dict) else None
    return Worker(
        url=row["url"],
        model=row["model_id"],
        worker_type=str(row.get("worker_type") or "regular"),
        weight_version=None if version is None else str(version),
        state=state,
        id=str(row.get("id") or ""),
        group=str(group or ""),
    )


# ----------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Segment:
    """Output tokens ``[start, end)`` of a result, made by ``engine`` with weights ``weight_version``."""

    start: int
    end: int
    engine: str
    weight_version: str | None


@dataclass(frozen=True)
class Attempt:
    """One submission of a request."""

    target: str
    #: Tokens sent (the prompt and what was generated before), and output tokens kept from this try.
    sent_tokens: int
    kept_tokens: int
    #: ``finished``, or why the try ended early.
    outcome: str
    #: When it began, in seconds from the request's start, and how long it took.
    began_s: float = 0.0
    took_s: float = 0.0

    def describe(self) -> str:
        return (
            f"{self.target} (sent {self.sent_tokens} tokens, kept {self.kept_tokens}, "
            f"at {self.began_s:.2f} s for {self.took_s:.2f} s): {self.outcome}"
        )


@dataclass(frozen=True)
class RolloutResult:
    """One request's output, whatever happened on the way."""

    output_ids: tuple[int, ...]
    text: str
    #: SGLang's ``meta_info.finish_reason`` of the last try (``{"type": "length" | "stop" | "abort", ...}``).
    finish_reason: Mapping[str, Any] | None
    segments: tuple[Segment, ...]
    attempts: tuple[Attempt, ...]
    prompt_tokens: int
    #: ``[logprob, token_id, text]`` per output token, when the request asked (``return_logprob``).
    output_token_logprobs: tuple[tuple[Any, ...], ...] | None = None
    #: The last try's last ``meta_info`` as the engine sent it (latencies, cached tokens, ...).
    meta_info: Mapping[str, Any] | None = None

    @property
    def weight_version(self) -> str | None:
        """The version of the last token (None when nothing was generated)."""
        return self.segments[-1].weight_version if self.segments else None

    @property
    def weight_versions(self) -> tuple[str | None, ...]:
        """The versions that made its tokens, in order, each once."""
        seen: list[str | None] = []
        for segment in self.segments:
            if segment.weight_version not in seen:
                seen.append(segment.weight_version)
        return tuple(seen)

    @property
    def resubmitted_tokens(self) -> int:
        """Tokens pre-filled again because a try broke off (the work continuity costs)."""
        return sum(a.sent_tokens for a in self.attempts[1:])

    @property
    def aborted(self) -> bool:
        """Ended by the client's :meth:`AsyncRolloutClient.abort_all` (the tokens so far are kept)."""
        return (self.finish_reason or {}).get("type") == "abort"


class RolloutError(RuntimeError):
    """A request given up: its deadline passed, or an engine refused it as malformed."""

    def __init__(self, message: str, attempts: Sequence[Attempt] = ()) -> None:
        self.attempts = tuple(attempts)
        tried = "".join(f"\n  try {i}: {a.describe()}" for i, a in enumerate(self.attempts, 1))
        super().__init__(message + tried)


class VersionUnavailable(RolloutError):
    """No engine has the weight version a request asked for (retryable: ask again once the update is out)."""

    retryable = True

    def __init__(
        self,
        constraint: VersionConstraint,
        seen: Sequence[str | None],
        waited_s: float,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        self.constraint = constraint
        self.seen = tuple(seen)
        shown = ", ".join(sorted({str(v) for v in seen})) or "no engine serving"
        super().__init__(f"no engine has {constraint} after {waited_s:.1f} s (versions: {shown})", attempts)


# ----------------------------------------------------------------------------------------------- one try
class _Broken(Exception):
    """A try ended before its finish; the tokens it made so far are kept."""

    def __init__(self, why: str, *, retry: bool = True, wrong_version: str | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.retry = retry
        self.wrong_version = wrong_version


@dataclass
class _Try:
    """The output of one try as it streams in (SGLang streams the output so far, or with
    ``--incremental-streaming-output`` only what is new: told apart by ``meta_info.completion_tokens``)."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[tuple[Any, ...]] = field(default_factory=list)
    #: (version, start, end) within this try's output.
    spans: list[tuple[str | None, int, int]] = field(default_factory=list)
    finish: Mapping[str, Any] | None = None
    prompt_tokens: int | None = None
    meta: Mapping[str, Any] | None = None

    def take(self, event: Mapping[str, Any]) -> None:
        ids = event.get("output_ids")
        meta = event.get("meta_info")
        if not isinstance(ids, list) or not isinstance(meta, dict):
            raise _Broken(f"an event without output_ids and meta_info: {_brief(event)}")
        completion = meta.get("completion_tokens", len(ids))
        if len(ids) == completion:  # the output so far (its first tokens are those already taken)
            self.ids.extend(ids[len(self.ids) :])
            self.text = str(event.get("text", ""))
            cumulative = True
        elif len(self.ids) + len(ids) == completion:  # only what is new
            self.ids.extend(ids)
            self.text += str(event.get("text", ""))
            cumulative = False
        else:
            raise _Broken(f"{len(ids)} output ids with completion_tokens {completion} after {len(self.ids)}")
        logprobs = meta.get("output_token_logprobs")
        if isinstance(logprobs, list):
            new = logprobs[len(self.logprobs) :] if cumulative else logprobs
            self.logprobs.extend(tuple(e) if isinstance(e, list) else (e,) for e in new)
        if isinstance(meta.get("prompt_tokens"), int):
            self.prompt_tokens = meta["prompt_tokens"]
        self.spans = _spans(meta, len(self.ids), self.spans)
        self.meta = meta
        self.finish = meta.get("finish_reason") if isinstance(meta.get("finish_reason"), dict) else None

    def version_at(self, index: int) -> str | None:
        for version, start, end in self.spans:
            if start <= index < end:
                return version
        return self.spans[-1][0] if self.spans else None


def _spans(
    meta: Mapping[str, Any], count: int, before: list[tuple[str | None, int, int]]
) -> list[tuple[str | None, int, int]]:
    """The versions of a try's ``count`` tokens: SGLang's exact spans where the event has them (its last one);
    else the tokens new in this event are the event's ``weight_version``'s (SGLang's intermediate events carry
    only the version the engine has as it sends them)."""
    spans = meta.get("weight_versions")
    out: list[tuple[str | None, int, int]] = []
    if isinstance(spans, list):
        for span in spans:
            if (
                isinstance(span, dict)
                and isinstance(span.get("start"), int)
                and isinstance(span.get("end"), int)
            ):
                out.append((str(span.get("version")), span["start"], min(span["end"], count)))
    if out:
        return out
    raw = meta.get("weight_version")
    version = None if raw is None else str(raw)
    out = [span for span in before if span[2] <= count]
    done = out[-1][2] if out else 0
    if count > done:
        if out and out[-1][0] == version:
            out[-1] = (version, out[-1][1], count)
        else:
            out.append((version, done, count))
    return out or [(version, 0, count)]


def _brief(value: Any) -> str:
    return wire.short(value, 300)


class _Chunks:
    """The body of a stream, read by a task of its own so that waiting for it can be given up every half
    second (to look at the engine) without cutting a read in half."""

    def __init__(self, response: httpx.Response) -> None:
        self._queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(maxsize=64)
        self._reader = asyncio.create_task(self._pump(response))

    async def _pump(self, response: httpx.Response) -> None:
        try:
            async for chunk in response.aiter_raw():
                await self._queue.put(chunk)
            await self._queue.put(None)
        except Exception as exc:  # handed to the reader, which says what broke
            await self._queue.put(exc)

    async def next(self, stall_s: float | None, alive: Callable[[], str | None]) -> bytes | None:
        """The next chunk (None at the end); :class:`_Broken` when the stream broke, nothing came for
        ``stall_s``, or ``alive()`` names why the engine will not finish it."""
        quiet_since = time.monotonic()
        while True:
            try:
                if self._queue.empty():  # (asyncio.wait_for would make a task of every wait)
                    async with asyncio.timeout(0.5 if stall_s is None else min(0.5, stall_s)):
                        item = await self._queue.get()
                else:
                    item = self._queue.get_nowait()
            except TimeoutError:
                gone = alive()
                if gone:
                    raise _Broken(gone) from None
                if stall_s is not None and time.monotonic() - quiet_since >= stall_s:
                    raise _Broken(f"no output for {stall_s:g} s") from None
                continue
            if isinstance(item, BaseException):
                raise _Broken(f"the stream broke: {type(item).__name__}: {item or 'no detail'}")
            return item

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader


async def _events(
    response: httpx.Response, stall_s: Callable[[], float | None], alive: Callable[[], str | None]
) -> AsyncGenerator[Mapping[str, Any], None]:
    """The ``data:`` events of a server-sent stream, each at most :data:`MAX_EVENT_BYTES`, until ``[DONE]``;
    ``stall_s()``: how long the next chunk may take."""
    chunks = _Chunks(response)
    buffer = b""
    done = False
    try:
        while (chunk := await chunks.next(stall_s(), alive)) is not None:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                payload = line.strip()[5:].strip() if line.strip().startswith(b"data:") else None
                done = done or payload == b"[DONE]"
                if payload is not None and not done:
                    yield _event(payload)
            if done:  # the body's end is read too (a connection read to its end is kept for the next request)
                buffer = b""
            if len(buffer) > MAX_EVENT_BYTES:
                raise _Broken(f"an event larger than {MAX_EVENT_BYTES} bytes")
    finally:
        await chunks.close()


def _event(payload: bytes) -> Mapping[str, Any]:
    try:
        event = json.loads(payload)
    except ValueError:
        raise _Broken(f"an event that is not JSON: {_brief(payload.decode(errors='replace'))}") from None
    if not isinstance(event, dict):
        raise _Broken(f"an event that is not an object: {_brief(event)}")
    if "error" in event and "output_ids" not in event:
        # SGLang refuses some requests only once their stream has begun (a prompt longer than the context, a
        # rid in use): an error event with the HTTP code it would have answered, and ``retryable``.
        error = event["error"]
        code = error.get("code") if isinstance(error, dict) else None
        refused = isinstance(error, dict) and (error.get("retryable") is False or _refusal(code))
        raise _Broken(f"the engine reports an error: {_brief(error)}", retry=not refused)
    return event


def _refusal(status: object) -> bool:
    """An HTTP status that says the request itself is wrong (sending it again cannot help)."""
    return isinstance(status, int) and 400 <= status < 500 and status not in _RETRYABLE_4XX


# ----------------------------------------------------------------------------------------------- the client
@dataclass
class _Request:
    prompt_ids: list[int] | None
    text: str | None
    sampling: dict[str, Any]
    max_new_tokens: int
    return_logprob: bool
    extra: dict[str, Any]
    constraint: VersionConstraint | None
    deadline: float
    rid: str | None
    started: float = field(default_factory=time.monotonic)
    # -- what it has so far
    ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[tuple[Any, ...]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    prompt_tokens: int | None = None
    finish: Mapping[str, Any] | None = None
    meta: Mapping[str, Any] | None = None
    version_wait_started: float | None = None
    #: A try came back with tokens of a version the constraint does not allow (go to engines, not the router).
    wrong_version_seen: bool = False
    #: Engines that answered this request with a version it does not allow -> the version the deployment
    #: listed for them then (they are asked again once it lists another).
    wrong_engines: dict[str, str | None] = field(default_factory=dict)
    on_tokens: Callable[[str, int], None] | None = None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.ids)

    def keep(self, target: str, got: _Try, upto: int) -> None:
        """Keep the first ``upto`` tokens of a try as segments by version."""
        base = len(self.ids)
        start = 0
        for index in range(1, upto + 1):
            if index == upto or got.version_at(index) != got.version_at(start):
                self.segments.append(Segment(base + start, base + index, target, got.version_at(start)))
                start = index
        self.ids.extend(got.ids[:upto])
        if upto:
            self.text_parts.append(got.text if upto == len(got.ids) else "")
        self.logprobs.extend(got.logprobs[:upto])
        self.meta = got.meta if got.meta is not None else self.meta
        if self.prompt_tokens is None and got.prompt_tokens is not None:
            self.prompt_tokens = got.prompt_tokens


class AsyncRolloutClient:
    """Generation requests to one model, on the caller's event loop.

    ``registry``: where the model's router is. ``workers``: the deployment's engines (lets the client go
    straight to an engine when the router does not answer, and pick engines by weight version); without it
    every try goes through the router. ``headers``: the deployment's ``Authorization`` (never logged).
    """

    def __init__(
        self,
        registry: RouterRegistry,
        model: str,
        *,
        workers: WorkerSource | None = None,
        headers: Mapping[str, str] | None = None,
        deadline_s: float = 1800.0,
        stall_s: float = 60.0,
        version_wait_s: float = 60.0,
        router_retry_s: float = 1.0,
        max_connections: int = 1024,
    ) -> None:
        self.route: ModelRoute = registry[model]
        self.model = model
        self._workers = workers
        #: Where the engines are known from (None: the router only).
        self.workers_source = workers
        self._headers = dict(headers or {})
        self.deadline_s = deadline_s
        self.stall_s = stall_s
        self.version_wait_s = version_wait_s
        self.router_retry_s = router_retry_s
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self._http: httpx.AsyncClient | None = None
        self._router_down_until = 0.0
        self._avoid: dict[str, float] = {}
        self._load: dict[str, int] = {}
        self._turn = itertools.count()
        #: Raised by abort_all: requests running then end with their tokens so far.
        self._abort_epoch = 0
        self._closed = False

    # -- lifecycle
    def _client(self) -> httpx.AsyncClient:
        if self._closed:
            raise RuntimeError("the rollout client is closed")
        if self._http is None:
            self._http = httpx.AsyncClient(
                headers=self._headers, limits=self._limits, timeout=httpx.Timeout(None)
            )
        return self._http

    async def aclose(self) -> None:
        """Close its connections, and the engine listing it reads (:class:`HttpWorkers`), if any."""
        self._closed = True
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        close = getattr(self.workers_source, "close", None)
        if callable(close):
            await asyncio.to_thread(close)

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def abort_all(self) -> None:
        """End every request running now with the tokens it has (``finish_reason`` ``abort``), as a trainer
        ends a rollout step early; requests started afterwards are not affected."""
        self._abort_epoch += 1

    # -- the request
    async def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        return_logprob: bool = False,
        min_version: int | str | None = None,
        exact_version: int | str | None = None,
        deadline_s: float | None = None,
        rid: str | None = None,
        extra: Mapping[str, Any] | None = None,
        on_tokens: Callable[[str, int], None] | None = None,
    ) -> RolloutResult:
        """Generate for one prompt (token ids, or ``text``) with SGLang's ``sampling_params``; see the module
        docstring for what happens when something breaks. ``extra``: more ``/generate`` fields, sent as given
        on the first try only where they concern the prompt (``logprob_start_len``, ...). ``on_tokens(target,
        count)``: called on the client's loop after every streamed event with where the try went and how many
        output tokens the request has in all (a progress view; it must not block)."""
        request = self._request(
            input_ids,
            text,
            sampling_params,
            return_logprob,
            min_version,
            exact_version,
            deadline_s,
            rid,
            extra,
        )
        request.on_tokens = on_tokens
        epoch = self._abort_epoch
        pause = _FIRST_PAUSE_S
        while True:
            if request.remaining <= 0 and (request.attempts or request.max_new_tokens > 0):
                request.finish = request.finish or {"type": "length", "length": len(request.ids)}
                return self._result(request)
            if self._abort_epoch != epoch:
                request.finish = {"type": "abort", "message": _ABORTED}
                return self._result(request)
            where = await self._target(request, epoch)
            if where is None:
                request.finish = {"type": "abort", "message": _ABORTED}
                return self._result(request)
            target, url = where
            try:
                await self._try(request, target, url, epoch)
            except _Broken as broken:
                self._give_up_unless_worth_another_try(request, broken)
                await asyncio.sleep(min(pause, max(0.0, request.deadline - time.monotonic())))
                pause = min(pause * 2, _MAX_PAUSE_S)
                continue
            if request.finish is not None:
                return self._result(request)

    def _give_up_unless_worth_another_try(self, request: _Request, broken: _Broken) -> None:
        """Raise what ends the request after a broken try: a refusal, no engine with its version in time, or
        its deadline."""
        if not broken.retry:
            raise RolloutError(f"{self.model}: the request was refused", request.attempts) from None
        if broken.wrong_version is not None and request.constraint is not None:
            request.wrong_version_seen = True
            waited = self._version_wait(request, time.monotonic())
            if waited >= self.version_wait_s:
                raise VersionUnavailable(request.constraint, [broken.wrong_version], waited, request.attempts)
        if time.monotonic() >= request.deadline:
            raise RolloutError(
                f"{self.model}: no finish within the deadline of the request", request.attempts
            )

    def _request(
        self,
        input_ids: Sequence[int] | None,
        text: str | None,
        sampling_params: Mapping[str, Any] | None,
        return_logprob: bool,
        min_version: int | str | None,
        exact_version: int | str | None,
        deadline_s: float | None,
        rid: str | None,
        extra: Mapping[str, Any] | None,
    ) -> _Request:
        if (input_ids is None) == (text is None):
            raise ValueError("give input_ids or text (one of them)")
        if input_ids is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            raise ValueError("input_ids must be integers")
        sampling = dict(sampling_params or {})
        if sampling.get("n", 1) != 1:
            raise ValueError("the rollout client sends one sample per request (sampling_params.n = 1)")
        max_new = sampling.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be an integer >= 0, got {max_new!r}")
        reserved = {"input_ids", "text", "sampling_params", "stream", "return_logprob", "rid"} & set(
            extra or {}
        )
        if reserved:
            raise ValueError(f"extra may not set {', '.join(sorted(reserved))}: they are the client's")
        total = self.deadline_s if deadline_s is None else deadline_s
        return _Request(
            prompt_ids=None if input_ids is None else list(input_ids),
            text=text,
            sampling=sampling,
            max_new_tokens=max_new,
            return_logprob=return_logprob,
            extra=dict(extra or {}),
            constraint=VersionConstraint.of(min_version, exact_version),
            deadline=time.monotonic() + total,
            rid=rid,
        )

    def _result(self, request: _Request) -> RolloutResult:
        prompt = request.prompt_tokens
        if prompt is None:
            prompt = len(request.prompt_ids) if request.prompt_ids is not None else 0
        return RolloutResult(
            output_ids=tuple(request.ids),
            text="".join(request.text_parts),
            finish_reason=request.finish,
            segments=tuple(request.segments),
            attempts=tuple(request.attempts),
            prompt_tokens=prompt,
            output_token_logprobs=tuple(request.logprobs) if request.return_logprob else None,
            meta_info=request.meta,
        )

    # -- where a try goes
    def _engines(self) -> list[Worker]:
        if self._workers is None:
            return []
        return [w for w in self._workers.workers(self.model) if w.state == _SERVING]

    async def _target(self, request: _Request, epoch: int) -> tuple[str, str] | None:
        """(name, base URL) of where the next try goes: the router, or one engine. With a version constraint,
        the router only while every engine that decides tokens has the version (for a PD model, which is
        reached only through its router: otherwise wait); else an engine that has it."""
        router = (f"router {self.model}", self.route.base_url)
        while True:
            if self._abort_epoch != epoch:
                return None  # the client aborted its requests while this one waited
            now = time.monotonic()
            deciding = [w for w in self._engines() if w.worker_type != "prefill"]
            constraint = request.constraint
            allowed = (
                deciding
                if constraint is None
                else [w for w in deciding if constraint.allows(w.weight_version)]
            )
            everyone = len(allowed) == len(deciding)
            if self._workers is None or self.route.pd_disaggregation or not deciding:
                if constraint is None or self._workers is None or (deciding and everyone):
                    return router
                eligible: list[Worker] = []
            elif everyone and now >= self._router_down_until and not request.wrong_version_seen:
                return router
            else:
                eligible = allowed
            eligible = [w for w in eligible if request.wrong_engines.get(w.url, ...) != w.weight_version]
            if eligible:
                usable = [w for w in eligible if self._avoid.get(w.url, 0.0) <= now] or eligible
                turn = next(self._turn)
                order = {w.url: (i - turn) % len(usable) for i, w in enumerate(usable)}
                chosen = min(usable, key=lambda w: (self._load.get(w.url, 0), order[w.url]))
                return chosen.name, chosen.url
            assert constraint is not None
            waited = self._version_wait(request, now)
            if waited >= self.version_wait_s or now >= request.deadline:
                raise VersionUnavailable(
                    constraint, [w.weight_version for w in deciding], waited, request.attempts
                )
            await asyncio.sleep(min(0.1, self.version_wait_s - waited))

    @staticmethod
    def _version_wait(request: _Request, now: float) -> float:
        if request.version_wait_started is None:
            request.version_wait_started = now
        return now - request.version_wait_started

    def _alive(self, url: str, direct: bool, epoch: int) -> Callable[[], str | None]:
        """Why a try will not finish where it runs (asked every half second while no output comes)."""
        gone = self._gone(url) if direct else _answers

        def check() -> str | None:
            return _ABORTED if self._abort_epoch != epoch else gone()

        return check

    def _gone(self, url: str) -> Callable[[], str | None]:
        def check() -> str | None:
            if self._workers is None:
                return None
            for worker in self._workers.workers(self.model):
                if worker.url == url:
                    return f"the engine is {worker.state}" if worker.state in _GONE else None
            return "the engine left the deployment"

        return check

    # -- one try
    def _body(self, request: _Request, prompt_ids: list[int] | None) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if (
            request.ids
        ):  # going on from tokens it has: what concerns the prompt's own logprobs is not asked again
            body.update(
                {k: v for k, v in request.extra.items() if k not in ("logprob_start_len", "top_logprobs_num")}
            )
        else:
            body.update(request.extra)
        if prompt_ids is not None:
            body["input_ids"] = prompt_ids + request.ids
        else:
            body["text"] = request.text
        sampling = dict(request.sampling)
        sampling["max_new_tokens"] = request.remaining
        min_new = sampling.get("min_new_tokens")
        if isinstance(min_new, int) and not isinstance(min_new, bool):
            sampling["min_new_tokens"] = max(0, min_new - len(request.ids))
        body["sampling_params"] = sampling
        body["stream"] = True
        if request.return_logprob:
            body["return_logprob"] = True
        if request.rid is not None:
            body["rid"] = request.rid if not request.attempts else f"{request.rid}-{len(request.attempts)}"
        return body

    async def _prompt_ids(self, request: _Request, url: str) -> list[int] | None:
        """The prompt as token ids: given, or (a text prompt with tokens to continue) from a tokenizer of the
        model (``/tokenize`` of the target, else of its engines); None: send the text (and start again)."""
        if request.ids and any(request.sampling.get(k) is not None for k in _GRAMMARS):
            # A grammar's state cannot be carried over a seam: such a request starts again from its prompt.
            request.ids, request.text_parts, request.logprobs, request.segments = [], [], [], []
        if request.prompt_ids is not None or not request.ids:
            return request.prompt_ids
        for base in dict.fromkeys([url, *(w.url for w in self._engines())]):
            deadline_s = max(0.1, min(10.0, request.deadline - time.monotonic()))
            answer = await wire.call(
                self._client(), "POST", base + "/tokenize", body={"prompt": request.text},
                deadline_s=deadline_s, max_bytes=MAX_EVENT_BYTES,
            )  # fmt: skip
            tokens = answer.body.get("tokens") if answer.ok and isinstance(answer.body, dict) else None
            if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
                request.prompt_ids = tokens
                return tokens
        # No tokenizer answers: drop what was made and start again from the text (never mix the two).
        request.ids, request.text_parts, request.logprobs, request.segments = [], [], [], []
        return None

    async def _try(self, request: _Request, target: str, url: str, epoch: int) -> None:
        """One submission; the request keeps what it made. :class:`_Broken` when it ended before its finish."""
        prompt_ids = await self._prompt_ids(request, url)
        body = self._body(request, prompt_ids)
        sent = len(body["input_ids"]) if "input_ids" in body else request.prompt_tokens or 0
        got = _Try()
        direct = url != self.route.base_url
        began = time.monotonic()
        self._load[url] = self._load.get(url, 0) + 1
        try:
            await self._stream(request, target, url, body, got, epoch)
            if got.finish is None:
                raise _Broken(f"the stream ended after {len(got.ids)} tokens without a finish")
            if got.finish.get("type") == "abort":  # a 4xx status: the scheduler refused it (too long, ...)
                why = f"the engine aborted it: {_brief(got.finish.get('message', ''))}"
                raise _Broken(why, retry=not _refusal(got.finish.get("status_code")))
        except _Broken as broken:
            kept = self._allowed(request, got)
            request.keep(target, got, kept)
            request.attempts.append(Attempt(target, sent, kept, broken.why, *_times(request, began)))
            if broken.why == _ABORTED:
                request.finish = {"type": "abort", "message": _ABORTED}
                return
            if direct:
                self._avoid[url] = time.monotonic() + self.router_retry_s
                if broken.wrong_version is not None:
                    listed = [w.weight_version for w in self._engines() if w.url == url]
                    request.wrong_engines[url] = listed[0] if listed else None
            if kept:
                request.version_wait_started = None  # it got somewhere: the wait for its version starts anew
            raise
        finally:
            self._load[url] -= 1
        request.version_wait_started = None
        request.keep(target, got, len(got.ids))
        request.finish = got.finish
        request.attempts.append(Attempt(target, sent, len(got.ids), "finished", *_times(request, began)))

    async def _stream(
        self, request: _Request, target: str, url: str, body: Mapping[str, Any], got: _Try, epoch: int
    ) -> None:
        """Read one try's stream into ``got`` until its finish; :class:`_Broken` for anything else."""
        direct = url != self.route.base_url
        remaining = request.deadline - time.monotonic()
        if remaining <= 0:
            raise _Broken("the deadline passed")
        try:
            async with asyncio.timeout(remaining):
                async with self._client().stream("POST", url + "/generate", json=dict(body)) as response:
                    if response.status_code != 200:
                        raw = await _bounded(response)
                        status = response.status_code
                        if not direct and status >= 500:
                            self._router_down_until = time.monotonic() + self.router_retry_s
                        why = f"HTTP {status}: {_brief(raw.decode(errors='replace'))}"
                        raise _Broken(why, retry=not _refusal(status))
                    await self._read(request, target, got, epoch, response, self._alive(url, direct, epoch))
        except TimeoutError:
            raise _Broken("the deadline passed") from None
        except httpx.HTTPError as exc:
            if not direct and not got.ids:
                self._router_down_until = time.monotonic() + self.router_retry_s
            raise _Broken(f"{type(exc).__name__}: {exc or 'no answer'}") from None

    async def _read(
        self,
        request: _Request,
        target: str,
        got: _Try,
        epoch: int,
        response: httpx.Response,
        alive: Callable[[], str | None],
    ) -> None:
        """The events of one try into ``got``. After the finish, the rest of the stream (``[DONE]``) is read
        too, for at most a second, so that its connection is kept for the next request."""
        finished = [False]  # (read by the stall below, set by the loop)

        def stall_s() -> float | None:
            """Until its first token a request may wait in the engine's queue or behind a paused engine as
            long as its deadline allows (a lost engine is seen by ``alive``); then ``stall_s`` between two
            events; after its finish, a second for the stream's end."""
            if finished[0]:
                return _AFTER_FINISH_S
            return self.stall_s if got.ids else None

        try:
            async with contextlib.aclosing(_events(response, stall_s, alive)) as events:
                async for event in events:
                    if not finished[0]:
                        finished[0] = self._took(request, target, got, event, epoch)
        except _Broken:
            if not finished[0]:
                raise

    def _took(self, request: _Request, target: str, got: _Try, event: Mapping[str, Any], epoch: int) -> bool:
        """Take one event into ``got``; True at the finish. :class:`_Broken` for tokens of a version the
        request does not allow, or once the client aborted its requests."""
        got.take(event)
        kept = self._allowed(request, got)
        if request.on_tokens is not None:
            request.on_tokens(target, len(request.ids) + kept)
        if kept < len(got.ids):
            wrong = got.version_at(kept)
            raise _Broken(f"tokens of version {wrong!r}, not {request.constraint}", wrong_version=wrong)
        if self._abort_epoch != epoch:
            raise _Broken(_ABORTED)
        return got.finish is not None

    def _allowed(self, request: _Request, got: _Try) -> int:
        """How many of a try's tokens the request's version constraint lets it keep (the first not allowed
        and everything after it go)."""
        if request.constraint is None:
            return len(got.ids)
        for index in range(len(got.ids)):
            if not request.constraint.allows(got.version_at(index)):
                return index
        return len(got.ids)


def _times(request: _Request, began: float) -> tuple[float, float]:
    """(began_s, took_s) of a try that began at ``began`` and ends now."""
    return began - request.started, time.monotonic() - began


def _answers() -> str | None:
    return None


async def _bounded(response: httpx.Response, limit: int = 64 * 1024) -> bytes:
    chunks, size = [], 0
    async with contextlib.aclosing(wire.raw_chunks(response)) as body:  # closed here when it stops early
        async for chunk in body:
            chunks.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
    return b"".join(chunks)[:limit]


# ----------------------------------------------------------------------------------------------- blocking
class RolloutClient:
    """The same requests for code without an event loop: each call blocks (or :meth:`submit` returns a
    future); the requests run on one event loop of a thread of the client's own."""

    def __init__(self, registry: RouterRegistry, model: str, **kwargs: Any) -> None:
        registry[model]  # an unknown model raises before any thread starts
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"rollout-{model}", daemon=True)
        self._thread.start()
        self.aio = AsyncRolloutClient(registry, model, **kwargs)
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_registry(
        cls,
        model: str,
        registry: RouterRegistry | str | None = None,
        *,
        api_key: str | None = None,
        workers_url: str | None = None,
        **kwargs: Any,
    ) -> RolloutClient:
        """For a process that has only the registry: a :class:`RouterRegistry`, its JSON, or (None) the
        environment a deployment gave its trainer (``deployment.rollout_env()``: ``MSP_ROUTERS``, and
        ``MSP_RL_WORKERS`` where the deployment serves its engine listing). With the listing
        (``workers_url``, else that variable) the client knows the engines and their weight versions, as in
        the trainer's own process; without it every try goes through the router."""
        environ = os.environ
        if registry is None:
            registry = RouterRegistry.from_env(environ)
        elif isinstance(registry, str):
            registry = RouterRegistry.from_json(registry)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        url = workers_url or environ.get(WORKERS_ENV_VAR)
        registry[model]  # an unknown model raises before the listing's thread starts
        if url and "workers" not in kwargs:
            kwargs["workers"] = HttpWorkers(url, headers)
        return cls(registry, model, headers=headers, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError("the rollout client is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def submit(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future[RolloutResult]:
        """:meth:`generate` without waiting."""
        return self._run(self.aio.generate(*args, **kwargs))

    def generate(self, *args: Any, **kwargs: Any) -> RolloutResult:
        """:meth:`AsyncRolloutClient.generate`, blocking."""
        return self.submit(*args, **kwargs).result()

    def abort_all(self) -> None:
        self._loop.call_soon_threadsafe(self.aio.abort_all)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _shut(self) -> None:
        """Requests still running end (their callers get CancelledError), then the connections close."""
        running = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self.aio.aclose()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ClientSet:
    """The rollout clients a deployment made (held weakly): the trainer's ``abort_all`` through the control
    handle ends their running requests with the tokens they have, instead of their being sent again."""

    def __init__(self) -> None:
        self._clients: weakref.WeakSet[AsyncRolloutClient] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, client: AsyncRolloutClient) -> None:
        with self._lock:
            self._clients.add(client)

    def abort_all(self, model: str | None = None) -> int:
        """Abort the running requests of every client (of ``model``); how many clients were told."""
        with self._lock:
            clients = [c for c in self._clients if model is None or c.model == model]
        for client in clients:
            client.abort_all()
        return len(clients)
