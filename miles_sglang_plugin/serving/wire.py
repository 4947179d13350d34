"""Every HTTP call the deployment makes to an engine or a router: one total deadline per call (connecting,
sending and reading the whole answer, however slowly it drips) and a cap on the answer's size, on clients
kept per engine and router (a new client costs milliseconds of CPU).

POSTs always carry a JSON body (``{}`` when the operation has nothing to say): SGLang's server answers 400
to a control POST without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import httpx

__all__ = ["MAX_ANSWER_BYTES", "Answer", "ClientPool", "call"]

#: The largest answer read from an engine or router (a ``/metrics`` page is a few hundred KiB).
MAX_ANSWER_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Answer:
    """What one call got back."""

    #: The HTTP status (None: no answer: connection refused, deadline, too large).
    status: int | None
    #: The answer's JSON, or its text; None for an empty answer.
    body: Any
    #: Why there is no usable answer (None when an HTTP status came back with a whole body).
    error: str | None
    elapsed_s: float
    #: No whole answer came within the deadline.
    timed_out: bool = False
    #: ``time.monotonic()`` when the call went out.
    started_at: float = 0.0

    @property
    def ok(self) -> bool:
        """A whole answer with a 2xx status."""
        return self.error is None and self.status is not None and 200 <= self.status < 300

    def problem(self) -> str | None:
        """Why this is not a success (transport error, HTTP status, or ``success: false`` in the body)."""
        if self.error is not None:
            return self.error
        if self.status is None or self.status >= 400 or self.status < 200:
            return f"HTTP {self.status}: {short(self.body)}"
        if isinstance(self.body, dict) and self.body.get("success") is False:
            message = self.body.get("message") or self.body.get("error_message") or self.body
            return f"the engine reports failure: {short(message)}"
        return None


def short(value: Any, limit: int = 500) -> str:
    """``value`` (a body, an event, a message) in at most ``limit`` characters, for an error message."""
    text = (
        value
        if isinstance(value, str)
        else json.dumps(value, default=str)
        if value is not None
        else "<empty body>"
    )
    return text if len(text) <= limit else text[:limit] + "…"


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def raw_chunks(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """The body's chunks as they come (an async generator: close it, with ``contextlib.aclosing``, when the
    read may stop before its end)."""
    return cast("AsyncGenerator[bytes, None]", response.aiter_raw())


async def _read(response: httpx.Response, max_bytes: int) -> bytes | None:
    """The whole body, or None once it grows past ``max_bytes``. The body's iterator is closed here when the
    read stops early (left to the garbage collector, its closing became a task the loop never ran: "Task was
    destroyed but it is pending!")."""
    chunks, size = [], 0
    async with contextlib.aclosing(raw_chunks(response)) as body:
        async for chunk in body:
            size += len(chunk)
            if size > max_bytes:
                return None
            chunks.append(chunk)
    return b"".join(chunks)


async def call(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    body: Mapping[str, Any] | None = None,
    deadline_s: float,
    max_bytes: int = MAX_ANSWER_BYTES,
) -> Answer:
    """``method url`` with ``body`` as JSON (``{}`` for a POST without one), the whole exchange within
    ``deadline_s``; never raises for what the peer does (an :class:`Answer` with ``error`` instead)."""
    started = time.monotonic()
    payload = dict(body) if body is not None else ({} if method == "POST" else None)
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream(method, url, json=payload) as response:
                raw = await _read(response, max_bytes)
                status = response.status_code
    except TimeoutError:
        return Answer(
            None, None, f"no answer within {deadline_s:g} s", time.monotonic() - started, timed_out=True
        )
    except httpx.HTTPError as exc:
        return Answer(None, None, f"{type(exc).__name__}: {exc or 'no answer'}", time.monotonic() - started)
    elapsed = time.monotonic() - started
    if raw is None:
        return Answer(status, None, f"its answer is larger than {max_bytes} bytes", elapsed)
    return Answer(status, _decode(raw), None, elapsed)


class ClientPool:
    """One kept HTTP client per base URL (engine or router), made on first use on the loop that uses it
    (a client belongs to one event loop). Deadlines are the caller's (:func:`call`), so the clients have none."""

    def __init__(self, headers: Mapping[str, str] | None = None, max_connections: int = 128) -> None:
        self._headers = dict(headers or {})
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._closed = False

    def client(self, base_url: str) -> httpx.AsyncClient:
        if self._closed:
            raise RuntimeError("the deployment's HTTP clients are closed")
        client = self._clients.get(base_url)
        if client is None:
            client = self._clients[base_url] = httpx.AsyncClient(
                headers=self._headers, limits=self._limits, timeout=httpx.Timeout(None)
            )
        return client

    async def call(self, base_url: str, method: str, path: str, **kwargs: Any) -> Answer:
        return await call(self.client(base_url), method, base_url + path, **kwargs)

    def forget(self, base_url: str) -> httpx.AsyncClient | None:
        """Drop the client of ``base_url`` (its connections go to a process that is gone); the caller closes it."""
        return self._clients.pop(base_url, None)

    async def aclose(self) -> None:
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()
