"""How fast a stand-in engine generates: a small, documented model of a continuous-batching engine, so that
sweeps with stand-ins (over TP, engine counts, concurrency) give numbers that depend on the plan.

Off unless the engine's environment has ``MSP_STANDIN_SPEED`` (a JSON object of the parameters below; the
launcher sets it from ``sglang_deploy.standin.speed`` when ``enabled``). With it, every ``/generate`` request
really waits, so a client measures what the model says:

* a request is *admitted* while fewer than ``--max-running-requests`` requests run; otherwise it queues
  (first come, first served): ``queue_time``;
* its *prefill* takes ``latency_s + input_tokens / (prefill_tokens_per_s * tp)`` and yields the first token
  (TTFT = queue time + prefill; requests prefill side by side);
* then it joins the engine's *decode batch*: each step gives every request in the batch one token and takes
  ``step_s(b) = (decode_step_s + b * decode_token_s) / tp + tp_comm_s * (tp - 1)`` for a batch of ``b``
  (weights read once per step and per-sequence work, both split over the TP ranks, plus the all-reduce that
  grows with TP). A request with ``n`` output tokens is done after ``n - 1`` steps.

``tp`` is the engine's ``--tp-size``. So one engine's decode throughput is ``b / step_s(b)`` tokens/s: it
grows with TP and with the batch, while more TP costs communication per step; with a fixed number of GPUs, a
TP sweep trades fewer, faster engines against more, slower ones. A prefill engine of a PD pair only
prefills (one token); a decode engine waits its own prefill time as the KV transfer, then decodes.

SGLang reports ``e2e_latency``, ``first_token_latency`` and ``queue_time`` in ``meta_info`` (the last two with
``--enable-metrics``); the stand-in reports the same three from these waits.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from aiohttp import web

#: The environment variable that turns the model on: a JSON object of :class:`SpeedModel` fields.
SPEED_ENV = "MSP_STANDIN_SPEED"


@dataclass(frozen=True)
class SpeedModel:
    """Parameters at TP 1 (defaults: roughly an 8B model on one GPU). Times in seconds."""

    latency_s: float = 0.002
    prefill_tokens_per_s: float = 20000.0
    decode_step_s: float = 0.020
    decode_token_s: float = 0.0005
    tp_comm_s: float = 0.001

    def prefill_s(self, input_tokens: int, tp: int) -> float:
        return self.latency_s + input_tokens / (self.prefill_tokens_per_s * tp)

    def step_s(self, batch: int, tp: int) -> float:
        return (self.decode_step_s + batch * self.decode_token_s) / tp + self.tp_comm_s * (tp - 1)

    @classmethod
    def from_json(cls, raw: str) -> SpeedModel:
        """Parse ``MSP_STANDIN_SPEED``; a bad value is a ValueError naming the field."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{SPEED_ENV} must be a JSON object: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{SPEED_ENV} must be a JSON object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{SPEED_ENV}: unknown field(s) {unknown}; known: {sorted(known)}")
        for name, value in data.items():
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (name == "prefill_tokens_per_s" and value == 0):
                raise ValueError(f"{SPEED_ENV}: {name} must be a finite number >= 0 (> 0 for rates)")
        return cls(**{k: float(v) for k, v in data.items()})


def speed_from_env(env: Mapping[str, str]) -> SpeedModel | None:
    raw = env.get(SPEED_ENV, "").strip()
    return SpeedModel.from_json(raw) if raw else None


@dataclass(frozen=True)
class Timing:
    """What one request waited, as SGLang's ``meta_info`` names it."""

    queue_time: float
    first_token_latency: float
    e2e_latency: float

    def meta(self) -> dict[str, float]:
        return {k: round(getattr(self, k), 6) for k in ("queue_time", "first_token_latency", "e2e_latency")}


@dataclass(eq=False)
class _Sequence:
    remaining: int
    produced: int = 0
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Pacer:
    """One engine's scheduler under :class:`SpeedModel`: admission, prefill, and a decode loop that runs
    while any request decodes. ``prefill_only``: a PD prefill engine."""

    def __init__(self, model: SpeedModel, *, tp: int, max_running: int, prefill_only: bool = False) -> None:
        self.model, self.tp, self.max_running = model, max(1, tp), max(1, max_running)
        self.prefill_only = prefill_only
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._batch: list[_Sequence] = []
        #: Set (and replaced) whenever tokens were produced: what streaming handlers wait on.
        self._tick = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    async def run(self, input_tokens: int, output_tokens: int, sequence: _Sequence | None = None) -> Timing:
        """Wait as the model says for one request; return its timing. ``sequence`` (from :meth:`sequence`)
        lets a streaming handler follow its tokens."""
        seq = sequence or self.sequence()
        clock = asyncio.get_running_loop().time  # the clock asyncio.sleep keeps: the waits are told in it
        arrived = clock()
        await self._admit()
        admitted = clock()
        try:
            await asyncio.sleep(self.model.prefill_s(input_tokens, self.tp))
            first = clock()
            seq.remaining = 0 if self.prefill_only else max(0, output_tokens - 1)
            seq.produced = 1
            self._notify()
            if seq.remaining:
                self._batch.append(seq)
                self._ensure_loop()
                await asyncio.shield(seq.done)
        finally:
            self._release()
            if seq in self._batch:  # cancelled while decoding
                self._batch.remove(seq)
            if not seq.done.done():
                seq.done.set_result(None)
            self._notify()
        return Timing(admitted - arrived, first - arrived, clock() - arrived)

    def sequence(self) -> _Sequence:
        """A handle to follow a request's tokens (:meth:`wait_tokens`), to pass to :meth:`run`."""
        return _Sequence(remaining=0)

    async def wait_tokens(self, sequence: _Sequence, count: int) -> None:
        """Until ``sequence`` has produced ``count`` tokens (or finished)."""
        while sequence.produced < count and not sequence.done.done():
            await self._tick.wait()

    async def _admit(self) -> None:
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            return
        ticket = asyncio.get_running_loop().create_future()
        self._waiting.append(ticket)
        try:
            await ticket  # _release hands its slot over: running stays counted
        except asyncio.CancelledError:
            if ticket.done() and not ticket.cancelled():
                self._release()  # handed a slot just before the cancel: pass it on
            raise

    def _release(self) -> None:
        while self._waiting:
            ticket = self._waiting.popleft()
            if not ticket.done():
                ticket.set_result(None)
                return
        self.running -= 1

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._decode_loop())

    async def _decode_loop(self) -> None:
        while self._batch:
            await asyncio.sleep(self.model.step_s(len(self._batch), self.tp))
            for seq in self._batch:
                seq.remaining -= 1
                seq.produced += 1
            for seq in [s for s in self._batch if s.remaining <= 0]:
                self._batch.remove(seq)
                seq.done.set_result(None)
            self._notify()

    def _notify(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()


#: A union is no class to pass as the key's type: the subscript carries it (aiohttp's way for such types).
PACER = web.AppKey[Pacer | None]("standin_pacer")


def pacer_for(app: web.Application) -> Pacer | None:
    """The engine's pacer, None when its speed is not modelled."""
    return app.get(PACER)


def make_pacer(model: SpeedModel | None, *, tp: int, max_running: int, mode: str) -> Pacer | None:
    if model is None:
        return None
    return Pacer(model, tp=tp, max_running=max_running, prefill_only=mode == "prefill")


def paced_meta(items: list[dict[str, Any]], timings: list[Timing]) -> None:
    """Put each request's timing into its ``meta_info`` (as SGLang with ``--enable-metrics``); nothing without
    a speed model (no timings)."""
    for item, timing in zip(items, timings, strict=False):
        item["meta_info"].update(timing.meta())


async def pace_requests(pacer: Pacer | None, input_lengths: list[int], output_tokens: int) -> list[Timing]:
    """Wait for the requests of one (possibly batched) ``/generate`` call; [] when speed is not modelled."""
    if pacer is None:
        return []
    return list(await asyncio.gather(*(pacer.run(n, output_tokens) for n in input_lengths)))


class StreamPacing:
    """Paces the events of one streamed ``/generate``: event ``i`` carries ``i + 1`` tokens and is sent once
    the engine has produced them; the last one carries the request's timing."""

    def __init__(self, pacer: Pacer, input_tokens: int, output_tokens: int) -> None:
        self.pacer, self.output_tokens = pacer, output_tokens
        self.sequence = pacer.sequence()
        self.task = asyncio.get_running_loop().create_task(
            pacer.run(input_tokens, output_tokens, self.sequence)
        )

    async def before(self, index: int) -> Timing | None:
        """Wait until event ``index`` may be sent; its timing if it is the last."""
        if index + 1 < self.output_tokens:
            await self.pacer.wait_tokens(self.sequence, index + 1)
            return None
        return await self.task

    def cancel(self) -> None:
        self.task.cancel()


def stream_pacing(pacer: Pacer | None, input_tokens: int, output_tokens: int) -> StreamPacing | None:
    return None if pacer is None else StreamPacing(pacer, input_tokens, output_tokens)
