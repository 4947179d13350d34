"""The trainer drives its engines: offload and onload, weight updates, pause and continue, cache, abort, LoRA.

``deployment.control`` (:class:`DeploymentControl`, blocking), ``deployment.async_control``
(:class:`AsyncDeploymentControl`, the same operations as coroutines, from any event loop) and
``deployment.control.background`` (:class:`BackgroundControl`: started, a ``concurrent.futures.Future`` back)
send each operation **in parallel** to exactly the engines it concerns, as the plan decided them (the table of
:mod:`.operations`), with one deadline for all of them (``timeout_s``: a finite number of seconds > 0; default
``sglang_deploy.control.timeout_s``), and give one :class:`~.results.OperationResult`: a reply per engine, the
engines skipped (not concerned) and those deferred (down or being brought back now). If an engine failed,
:class:`~.errors.ControlError` names each one (``check=False`` returns the result instead).

**The ledger** (:mod:`.ledger`) records what the engines accepted, and only that: an operation no engine took
changes nothing and is never replayed (the engines it could not reach are then among the failed, not the
deferred). Once some engine took it, the deferred engines get it by replay before they serve again, and an
engine that was up but did not take it is reported (``engine_diverged``) and brought there by replay too.
Weights that came through a weights update group (NCCL) cannot be replayed: an engine that lacks them waits
(``pending_weights``, out of its router) until the trainer forms the group again with it
(:meth:`AsyncDeploymentControl.engines_outside_weight_group`, like Miles' ``num_new_engines``) and sends it
weights.

Every operation runs on the deployment's serving loop, with the kept client of each engine; a deadline is
never held up by anything else the deployment does (a replay, a restart, a slow engine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.serving import operations as ops
from miles_sglang_plugin.serving.errors import DeploymentFailedError, DeploymentStoppedError
from miles_sglang_plugin.serving.fleet import CatchUp, EngineInfo, EngineRow, EngineState, Fleet
from miles_sglang_plugin.serving.ledger import Effect, Ledger
from miles_sglang_plugin.serving.operations import DEFAULT_GROUP_NAME, OPERATIONS, OperationSpec
from miles_sglang_plugin.serving.reconciler import Reconciler, ServingLoop
from miles_sglang_plugin.serving.results import (
    EngineReply,
    OperationResult,
    WeightUpdateGroup,
    WeightUpdateRank,
)
from miles_sglang_plugin.serving.rolling import GroupProgress, check_fraction, next_wave
from miles_sglang_plugin.serving.rollout import ClientSet
from miles_sglang_plugin.serving.wire import Answer, ClientPool

__all__ = ["AsyncDeploymentControl", "BackgroundControl", "DeploymentControl"]

#: An engine that answers busy (:attr:`OperationSpec.busy_status`) is asked again after this pause, doubled
#: each time up to the most.
BUSY_FIRST_PAUSE_S = 0.05
BUSY_MAX_PAUSE_S = 1.0

P = ParamSpec("P")
R = TypeVar("R")


class Serving(Protocol):
    """What the handles use of a running deployment."""

    @property
    def fleet(self) -> Fleet: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def reconciler(self) -> Reconciler: ...
    @property
    def serving_loop(self) -> ServingLoop: ...
    @property
    def pool(self) -> ClientPool: ...
    @property
    def settings(self) -> SGLangDeployConf: ...
    @property
    def rollout_clients(self) -> ClientSet: ...

    def refusal(self, when: str) -> Exception | None:
        """Why operations no longer run (stopped or failed), ``when`` saying at which point; None: they do."""


async def _ask_while_busy(
    pool: ClientPool,
    url: str,
    spec: OperationSpec,
    route: str,
    payload: Mapping[str, Any] | None,
    ends: float,
    deadline_s: float,
) -> Answer:
    """One engine's call, asked again while it answers busy and the deadline allows another try."""
    answer = await pool.call(url, spec.method, route, body=payload, deadline_s=ends - time.monotonic())
    tries, pause = 1, BUSY_FIRST_PAUSE_S
    while spec.busy_status is not None and answer.status == spec.busy_status:
        if ends - time.monotonic() <= pause:  # no time for another answer after the pause
            problem = f"still busy after {tries} tries in {deadline_s:g} s: {answer.problem()}"
            return dataclasses.replace(answer, error=problem)
        await asyncio.sleep(pause)
        pause, tries = min(pause * 2, BUSY_MAX_PAUSE_S), tries + 1
        answer = await pool.call(url, spec.method, route, body=payload, deadline_s=ends - time.monotonic())
    return answer


def _serving_now(fleet: Fleet, engine: str) -> bool:
    return (
        engine in fleet
        and not fleet.engine(engine).retired
        and fleet.engine(engine).state is EngineState.SERVING
    )


def _drained_or_gone(fleet: Fleet, engine: str) -> bool:
    """A held engine is ready for its update: out of its router with its requests finished (or its time to
    finish them over), or no longer there to update (lost, removed: it gets the weights by replay)."""
    if engine not in fleet or fleet.engine(engine).retired:
        return True
    row = fleet.engine(engine)
    if row.state is EngineState.SERVING:
        return row.update_hold is None
    return row.state is not EngineState.UPDATING or row.drained


def _back_or_gone(fleet: Fleet, engine: str) -> bool:
    """An updated engine is back: it serves again (or it is lost or removed: nothing to wait for)."""
    if engine not in fleet or fleet.engine(engine).retired:
        return True
    row = fleet.engine(engine)
    coming_back = row.state is EngineState.CATCHING_UP and row.catch_up == CatchUp.UPDATE
    return not (row.state is EngineState.UPDATING or coming_back)


def _progress(
    fleet: Fleet, groups: Mapping[tuple[str, str], Sequence[str]], waiting: Collection[str]
) -> dict[str, GroupProgress]:
    """Each group of a rolling update as it stands now."""
    return {
        f"{model}.{group}": GroupProgress(
            engines=tuple(ids),
            serving=frozenset(e for e in ids if _serving_now(fleet, e)),
            waiting=tuple(e for e in ids if e in waiting),
        )
        for (model, group), ids in groups.items()
    }


def _all(check: Callable[[Fleet, str], bool], fleet: Fleet, engines: Sequence[str]) -> bool:
    return all(check(fleet, engine) for engine in engines)


async def _bounded(future: asyncio.Future[None], seconds: float) -> bool:
    """Wait for ``future`` at most ``seconds``: True when it was set in time (it is cancelled otherwise)."""
    try:
        await asyncio.wait_for(future, seconds)
    except TimeoutError:
        return False
    return True


@dataclasses.dataclass
class _Roll:
    """A rolling update under way: what it sends, the engines still to update, and what came of the waves."""

    body: Mapping[str, Any]
    effect: Effect
    model: str | None
    deadline_s: float
    drain_s: float
    waiting: set[str]
    #: Engines down when their turn came, and why: deferred with the next wave that is sent.
    carried: list[str]
    why: dict[str, str]
    replies: list[EngineReply] = dataclasses.field(default_factory=list)
    deferred: list[str] = dataclasses.field(default_factory=list)
    accepted: bool = False
    stopped: str | None = None


@dataclasses.dataclass(frozen=True)
class _Targets:
    sent: tuple[EngineRow, ...]
    skipped: tuple[str, ...]
    deferred: tuple[str, ...]
    #: Why a deferred engine was not sent it (when the operation ends unrecorded it is a failure).
    why_deferred: Mapping[str, str]


# ------------------------------------------------------------------------------------------ async handle
class AsyncDeploymentControl:
    """The control handle's coroutines (see the module docstring); use them from any event loop."""

    #: Told of each operation's end: its name, seconds from the call, and whether every engine it was sent to
    #: accepted it (the deployment's metrics); None: nobody is.
    on_done: Callable[[str, float, bool], None] | None = None

    def __init__(self, serving: Serving) -> None:
        self._serving = serving

    # ------------------------------------------------------------------------------------------ engines
    def engines(self, model: str | None = None, group: str | None = None) -> tuple[EngineInfo, ...]:
        """The engines, optionally of one model / group, in deployment order."""
        return tuple(row.info() for row in self._select(model, group))

    def _select(self, model: str | None, group: str | None) -> list[EngineRow]:
        rows = [r for r in self._serving.fleet.engines() if not r.retired]  # removed by a change: not driven
        if model is not None:
            known = sorted({r.model for r in rows})
            if model not in known:
                raise ValueError(f"no model {model!r} in the deployment; models: {', '.join(known)}")
            rows = [r for r in rows if r.model == model]
        if group is not None:
            known = sorted({r.group for r in rows})
            if group not in known:
                raise ValueError(
                    f"no group {group!r} among {model or 'the models'}; groups: {', '.join(known)}"
                )
            rows = [r for r in rows if r.group == group]
        return rows

    def _targets(
        self,
        spec: OperationSpec,
        model: str | None,
        group: str | None,
        also: Callable[[EngineRow], bool] | None = None,
        needed: Callable[[EngineRow], bool] | None = None,
    ) -> _Targets:
        """The engines ``spec`` concerns among ``model`` / ``group``: those up now are sent it (and pass
        ``also``, e.g. members of a weights update group), the others deferred; those it would change nothing
        on (``needed`` false: memory released already) are skipped."""
        selected = self._select(model, group)
        idle = [
            r.id for r in selected if spec.concerns(r) and r.state.up and needed is not None and not needed(r)
        ]
        selected = [r for r in selected if r.id not in idle]
        mine = [r for r in selected if spec.concerns(r)]
        sent = tuple(r for r in mine if r.state.up and (also is None or also(r)))
        taken = {r.id for r in sent}
        why = {
            r.id: (
                f"not sent: it is {r.state.value} now"
                if not r.state.up
                else "not sent: it is outside the weights update group"
            )
            for r in mine
            if r.id not in taken
        }
        skipped = (*(r.id for r in selected if not spec.concerns(r)), *idle)
        return _Targets(sent, skipped, tuple(why), why)

    # ------------------------------------------------------------------------------------------ running
    async def _on_loop(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run ``coro`` on the serving loop (at once when already there); refused once it stopped."""
        try:
            self._running()
        except BaseException:
            coro.close()
            raise
        serving_loop = self._serving.serving_loop
        if serving_loop.in_loop():
            return await coro
        name = _name_of(coro)
        try:
            future = serving_loop.submit(coro)
        except RuntimeError:
            raise self._refused(f"before {name} was sent") from None
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled() and self._serving.refusal("") is not None:
                raise self._refused(f"while {name} was in flight") from None
            raise

    def _refused(self, when: str) -> Exception:
        refusal = self._serving.refusal(when)
        return (
            refusal
            if refusal is not None
            else RuntimeError(f"the deployment's serving loop is closed {when}")
        )

    def _running(self) -> None:
        refusal = self._serving.refusal("")
        if refusal is not None:
            raise refusal

    async def _run(
        self,
        name: str,
        body: Callable[[EngineRow], Mapping[str, Any] | None] | Mapping[str, Any] | None,
        effect: Effect | None,
        *,
        model: str | None,
        group: str | None,
        timeout_s: float | None,
        check: bool,
        route: str | None = None,
        targets: _Targets | None = None,
    ) -> OperationResult:
        """Run operation ``name`` (its spec in :data:`OPERATIONS`): fan out, record, settle, check."""
        deadline = ops.check_timeout(timeout_s) or self._serving.settings.control.timeout_s
        self._running()
        return await self._timed(
            name,
            self._on_loop(
                self._execute(OPERATIONS[name], body, effect, model, group, deadline, check, route, targets)
            ),
        )

    async def _timed(self, name: str, operation: Awaitable[OperationResult]) -> OperationResult:
        """``operation``'s result, its end told to :attr:`on_done`."""
        began, ok = time.monotonic(), False
        try:
            result = await operation
            ok = result.ok
            return result
        finally:
            if self.on_done is not None:
                self.on_done(name, time.monotonic() - began, ok)

    async def _execute(
        self,
        spec: OperationSpec,
        body: Callable[[EngineRow], Mapping[str, Any] | None] | Mapping[str, Any] | None,
        effect: Effect | None,
        model: str | None,
        group: str | None,
        deadline_s: float,
        check: bool,
        route: str | None,
        targets: _Targets | None,
    ) -> OperationResult:
        self._running()
        targets = targets or self._targets(spec, model, group)
        concerned = [*(r.id for r in targets.sent), *targets.deferred]
        reconciler = self._serving.reconciler

        def covers(row: EngineRow) -> bool:  # an engine a change adds while the operation is out
            return (
                (model is None or row.model == model)
                and (group is None or row.group == group)
                and spec.concerns(row)
            )

        token = reconciler.begin_operation(concerned, covers if spec.records and effect is not None else None)
        try:
            sent = {r.id: r.restarts for r in targets.sent}
            answers = await self._fan_out(spec, route or spec.route, targets.sent, body, deadline_s)
            self._running()  # stopped while the calls were out: say so, record nothing
            joined = reconciler.joined(token)
            result = self._settle(spec, targets, answers, sent, effect, joined)
        finally:
            reconciler.end_operation(token)
        return result.raise_for_errors() if check else result

    async def _fan_out(
        self,
        spec: OperationSpec,
        route: str,
        rows: Sequence[EngineRow],
        body: Callable[[EngineRow], Mapping[str, Any] | None] | Mapping[str, Any] | None,
        deadline_s: float,
    ) -> dict[str, Answer]:
        pool, limit = self._serving.pool, asyncio.Semaphore(self._serving.settings.control.max_concurrency)
        ends = time.monotonic() + deadline_s

        async def one(row: EngineRow) -> Answer:
            payload = body(row) if callable(body) else body
            async with limit:
                left = ends - time.monotonic()
                if left <= 0:
                    return Answer(
                        None, None, f"no answer within {deadline_s:g} s", deadline_s, timed_out=True
                    )
                answer = await _ask_while_busy(pool, row.url, spec, route, payload, ends, deadline_s)
            if answer.timed_out:
                return dataclasses.replace(answer, error=f"no answer within {deadline_s:g} s")
            return answer

        tasks = [asyncio.ensure_future(one(row)) for row in rows]
        return dict(zip((r.id for r in rows), await asyncio.gather(*tasks), strict=True))

    def _settle(
        self,
        spec: OperationSpec,
        targets: _Targets,
        answers: Mapping[str, Answer],
        sent: Mapping[str, int],
        effect: Effect | None,
        joined: Collection[str] = (),
    ) -> OperationResult:
        """Record what the engines accepted and sort the replies: an engine replaced while the call was out,
        or a local one whose call failed because it went down, is deferred (it gets the state by replay) when
        some engine took it; when none did, nothing is recorded and the deferred engines failed. An engine a
        change removed while the call was out is left out (its answer no longer matters); one it added that
        the operation covers (``joined``) is deferred: it gets the state by replay before it serves."""
        fleet = self._serving.fleet
        targets, answers, sent = self._as_now(targets, answers, sent, joined)
        now = {r.id: fleet.engine(r.id) for r in targets.sent}
        accepted = [e for e, answer in answers.items() if answer.problem() is None]
        rows_sent = {r.id: r for r in targets.sent}
        # restarted while the call was out, or a fresh row of the same id a change put in (its answer is the
        # old process's): deferred, it gets the state by replay
        replaced = [e for e in sent if now[e].restarts != sent[e] or now[e] is not rows_sent[e]]
        down = [
            e
            for e, answer in answers.items()
            if answer.problem() is not None
            and e not in replaced
            and not now[e].external
            and not now[e].state.up
        ]
        recorded = True
        if spec.records and effect is not None:
            generations = {row.id: row.restarts for row in fleet.engines()}
            generations.update({e: -1 for e in replaced})  # not the process the call went to
            recorded = self._serving.ledger.record(
                effect,
                sent=sent,
                accepted=accepted,
                deferred=[*targets.deferred, *down],
                generations=generations,
            ).recorded
        late = {*replaced, *down}
        replies = [self._reply(row, answers[row.id]) for row in targets.sent if row.id not in late]
        deferred: tuple[str, ...] = (*targets.deferred, *(e for e in sent if e in late))
        if not recorded:
            replies += [self._reply(now[e], answers[e]) for e in down]
            replies += [self._not_recorded(e, "it was restarted while the call was out") for e in replaced]
            replies += [self._not_recorded(e, targets.why_deferred.get(e, "")) for e in targets.deferred]
            deferred = ()
        order = {r.id: i for i, r in enumerate(fleet.engines())}
        replies.sort(key=lambda reply: order.get(reply.engine, 0))
        return OperationResult(spec.name, tuple(replies), targets.skipped, deferred)

    def _as_now(
        self,
        targets: _Targets,
        answers: Mapping[str, Answer],
        sent: Mapping[str, int],
        joined: Collection[str],
    ) -> tuple[_Targets, dict[str, Answer], dict[str, int]]:
        """The operation's targets as the fleet is now: an engine a change removed while the call was out is
        left out (its answer no longer matters); one it added that the operation covers (``joined``) is
        deferred."""
        fleet = self._serving.fleet
        removed = {r.id for r in targets.sent if r.id not in fleet or fleet.engine(r.id).retired}
        answers = {e: answer for e, answer in answers.items() if e not in removed}
        sent = {e: generation for e, generation in sent.items() if e not in removed}
        targets = dataclasses.replace(
            targets,
            sent=tuple(r for r in targets.sent if r.id not in removed),
            deferred=(
                *(e for e in targets.deferred if e in fleet and not fleet.engine(e).retired),
                *(e for e in sorted(joined) if e not in targets.deferred and e not in sent and e in fleet),
            ),
            why_deferred={
                **{e: "not sent: a change added it while the operation was out" for e in joined},
                **targets.why_deferred,
            },
        )
        return targets, answers, sent

    @staticmethod
    def _reply(row: EngineRow, answer: Answer) -> EngineReply:
        problem = answer.problem()
        return EngineReply(
            row.id, row.url, problem is None, answer.status, answer.body, problem, answer.elapsed_s
        )

    def _not_recorded(self, engine: str, why: str) -> EngineReply:
        row = self._serving.fleet.engine(engine)
        return EngineReply(
            engine,
            row.url,
            False,
            None,
            None,
            f"{why}: no engine accepted the operation, so it is not recorded and will not be replayed into "
            "this engine when it is back",
            0.0,
        )

    # ------------------------------------------------------------------------------------------ memory
    async def offload(
        self,
        tags: str | Sequence[str] | None = None,
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/release_memory_occupation`` on the engines of groups with ``needs_offload`` (``tags``: some of
        ``weights``, ``kv_cache``, ``cuda_graph``, or one of them; None: all). Each engine is sent the tags it
        holds of them (one that released them all already is skipped). Pause generation first: SGLang's
        scheduler fails when memory is released under running requests."""
        return await self._memory(
            "offload", ops.memory_tags(tags), model, group, timeout_s, check, released=True
        )

    async def onload(
        self,
        tags: str | Sequence[str] | None = None,
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/resume_memory_occupation`` on the engines of groups with ``needs_offload`` (Miles resumes
        ``weights`` before a weight update and ``kv_cache`` + ``cuda_graph`` after it). Each engine is sent
        only the tags it released (resuming memory that is not released ends SGLang's scheduler); one that
        released none of them is skipped."""
        return await self._memory(
            "onload", ops.memory_tags(tags), model, group, timeout_s, check, released=False
        )

    async def _memory(
        self,
        name: str,
        tags: Sequence[str] | None,
        model: str | None,
        group: str | None,
        timeout_s: float | None,
        check: bool,
        *,
        released: bool,
    ) -> OperationResult:
        wanted = tuple(tags) if tags is not None else ops.MEMORY_TAGS
        ledger = self._serving.ledger

        def tags_of(row: EngineRow) -> list[str]:
            has = ledger.has(row.id).released
            return [t for t in wanted if (t not in has) == released]

        ops.check_timeout(timeout_s)
        targets = self._targets(OPERATIONS[name], model, group, needed=lambda r: bool(tags_of(r)))
        effect = ops.memory_effect(wanted, released=released)
        return await self._run(
            name,
            lambda row: {"tags": tags_of(row)},
            effect,
            model=model,
            group=group,
            timeout_s=timeout_s,
            check=check,
            targets=targets,
        )

    # ------------------------------------------------------------------------------------------ weights
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        model: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
        rolling: bool = False,
        min_serving_fraction: float = 0.75,
        drain_timeout_s: float | None = None,
    ) -> OperationResult:
        """``/update_weights_from_disk`` on the engines of the model(s) with ``update_weights``.

        ``rolling``: in waves, so that at least ``min_serving_fraction`` of each group serves throughout
        (:mod:`.rolling`): a wave's engines leave their router (``updating``), finish their requests (up to
        ``drain_timeout_s``, default ``sglang_deploy.launch.drain_timeout_s``; what is left then is aborted,
        and the rollout client carries it on elsewhere), load the weights, and serve again before the next
        wave leaves. ``timeout_s`` bounds each wave's load and its return to service. A wave that no engine
        accepts ends the update: the engines after it keep their weights and are among the failed."""
        if weight_version is not None:
            weight_version = ops.check_version(weight_version, "weight_version")
        body = ops.disk_weights_body(
            model_path,
            weight_version=weight_version,
            load_format=load_format,
            abort_all_requests=abort_all_requests,
            flush_cache=flush_cache,
        )
        effect = ops.disk_weights_effect(body)
        if not rolling:
            return await self._run(
                "update_weights_from_disk",
                body,
                effect,
                model=model,
                group=None,
                timeout_s=timeout_s,
                check=check,
            )
        fraction = check_fraction(min_serving_fraction)
        drain_s = ops.check_timeout(drain_timeout_s) or self._serving.settings.launch.drain_timeout_s
        deadline = ops.check_timeout(timeout_s) or self._serving.settings.control.timeout_s
        self._running()
        result = await self._timed(
            "update_weights_from_disk",
            self._on_loop(self._roll(body, effect, model, deadline, fraction, drain_s)),
        )
        return result.raise_for_errors() if check else result

    async def _roll(
        self,
        body: Mapping[str, Any],
        effect: Effect,
        model: str | None,
        deadline_s: float,
        fraction: float,
        drain_s: float,
    ) -> OperationResult:
        """The waves of a rolling disk update (on the serving loop)."""
        spec = OPERATIONS["update_weights_from_disk"]
        first = self._targets(spec, model, None)
        concerned = [r.id for r in self._select(model, None) if spec.concerns(r)]
        groups: dict[tuple[str, str], list[str]] = {}
        for engine in concerned:
            row = self._serving.fleet.engine(engine)
            groups.setdefault((row.model, row.group), []).append(engine)
        roll = _Roll(
            # what is left of a wave's requests once its drain time is over is aborted (the client goes on)
            body={**body, "abort_all_requests": True},
            effect=effect,
            model=model,
            deadline_s=deadline_s,
            drain_s=drain_s,
            waiting={r.id for r in first.sent},
            carried=list(first.deferred),
            why=dict(first.why_deferred),
        )
        while roll.waiting and roll.stopped is None:
            self._running()
            await self._roll_wave(
                roll, next_wave(_progress(self._serving.fleet, groups, roll.waiting), fraction)
            )
        return self._rolled(roll, first, concerned)

    async def _roll_wave(self, roll: _Roll, wave: Sequence[str]) -> None:
        """One wave: its serving engines out of their router and drained, the update sent, back in service."""
        fleet, reconciler = self._serving.fleet, self._serving.reconciler
        roll.waiting -= set(wave)
        held = tuple(e for e in wave if _serving_now(fleet, e))
        reconciler.hold_for_update(held, roll.drain_s)
        try:
            drained = reconciler.wait_until(functools.partial(_all, _drained_or_gone, fleet, held))
            await _bounded(drained, roll.drain_s * 2)
            rows = [fleet.engine(e) for e in wave if e in fleet and not fleet.engine(e).retired]
            # engines down when their turn came (or at the start) get the weights by replay once some engine
            # took them: they go with the next wave that is sent
            roll.carried += [r.id for r in rows if not r.state.up]
            roll.why.update({r.id: f"not sent: it is {r.state.value} now" for r in rows if not r.state.up})
            sent = tuple(r for r in rows if r.state.up)
            if not sent:
                return
            targets = _Targets(sent, (), tuple(roll.carried), roll.why)
            spec = OPERATIONS["update_weights_from_disk"]
            result = await self._execute(
                spec, roll.body, roll.effect, roll.model, None, roll.deadline_s, False, None, targets
            )
        finally:
            reconciler.release_update(held)
        roll.replies += result.replies
        if not result.accepted:
            roll.stopped = f"no engine of the wave of {', '.join(r.id for r in sent)} took it"
            return
        roll.accepted, roll.carried = True, []
        roll.deferred += result.deferred
        if not await _bounded(
            reconciler.wait_until(functools.partial(_all, _back_or_gone, fleet, held)), roll.deadline_s
        ):
            late = [e for e in held if not _back_or_gone(fleet, e)]
            roll.stopped = f"{', '.join(late)} did not serve again within {roll.deadline_s:g} s"

    def _rolled(self, roll: _Roll, first: _Targets, concerned: Sequence[str]) -> OperationResult:
        """The result of a rolling update once its waves are done (or it stopped)."""
        fleet = self._serving.fleet
        carried = [e for e in roll.carried if e in fleet and not fleet.engine(e).retired]
        if (
            carried and roll.accepted
        ):  # down when their wave came, after some engine took it: replayed when back
            self._serving.ledger.extend(roll.effect, carried)
            roll.deferred += carried
        elif carried:
            roll.replies += [self._not_recorded(e, roll.why.get(e, "")) for e in carried]
        for engine in sorted(roll.waiting, key=list(concerned).index):
            roll.replies.append(self._not_recorded_roll(engine, roll.stopped or ""))
        order = {r.id: i for i, r in enumerate(fleet.engines())}
        replies = sorted(roll.replies, key=lambda reply: order.get(reply.engine, 0))
        return OperationResult(
            "update_weights_from_disk", tuple(replies), first.skipped, tuple(dict.fromkeys(roll.deferred))
        )

    def _not_recorded_roll(self, engine: str, why: str) -> EngineReply:
        row = self._serving.fleet.engine(engine) if engine in self._serving.fleet else None
        return EngineReply(
            engine,
            row.url if row is not None else "",
            False,
            None,
            None,
            f"not sent: the rolling update stopped ({why}); it keeps the weights it has",
            0.0,
        )

    def weight_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
        model: str | None = None,
    ) -> WeightUpdateGroup:
        """The ranks of a weights update group over the engines (up now) of the model with ``update_weights``:
        rank 0 is the trainer, each engine's GPUs follow in deployment order (Miles'
        ``connect_rollout_engines_from_distributed``). Bookkeeping only: no call is made."""
        self._running()
        rows = self._targets(OPERATIONS["init_weights_update_group"], model, None).sent
        models = sorted({r.model for r in rows})
        if len(models) != 1:
            raise ValueError(
                "a weights update group is formed over one model's engines; "
                + (f"got {', '.join(models)}: pass model=" if models else "no engine receiving weights is up")
            )
        ranks, cursor = [], 1
        for row in rows:
            ranks.append(WeightUpdateRank(row.id, row.url, cursor, row.num_gpus, row.restarts))
            cursor += row.num_gpus
        return WeightUpdateGroup(
            models[0], master_address, int(master_port), group_name, backend, cursor, tuple(ranks)
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
        model: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/init_weights_update_group`` on every engine of :meth:`weight_update_group`, each with its
        ``rank_offset`` and the ``world_size``. SGLang answers once the trainer (rank 0) has joined too: start
        this call (a task, or ``control.background``), then join the group on the trainer side."""
        ops.check_timeout(timeout_s)
        return await self._on_loop(
            self._init_group(master_address, master_port, group_name, backend, model, timeout_s, check)
        )

    async def _init_group(
        self,
        master_address: str,
        master_port: int,
        group_name: str,
        backend: str,
        model: str | None,
        timeout_s: float | None,
        check: bool,
    ) -> OperationResult:
        group = self.weight_update_group(
            master_address, master_port, group_name=group_name, backend=backend, model=model
        )
        by_id = {rank.engine: rank for rank in group.ranks}
        spec = OPERATIONS["init_weights_update_group"]
        targets = self._targets(spec, model, None, also=lambda r: r.id in by_id)

        def body(row: EngineRow) -> dict[str, Any]:
            rank = by_id[row.id]
            return ops.init_group_body(
                master_address=group.master_address,
                master_port=group.master_port,
                rank_offset=rank.rank_offset,
                world_size=group.world_size,
                group_name=group_name,
                backend=backend,
            )

        result = await self._run(
            spec.name, body, None, model=model, group=None, timeout_s=timeout_s, check=False, targets=targets
        )
        if result.ok:
            self._serving.ledger.join_group(group_name, {rank.engine: rank.restarts for rank in group.ranks})
        result = dataclasses.replace(result, group=group)
        return result.raise_for_errors() if check else result

    def engines_outside_weight_group(
        self, group_name: str = DEFAULT_GROUP_NAME, model: str | None = None
    ) -> tuple[str, ...]:
        """Engines receiving weights that are up but not in the group as it was last formed (new, or
        restarted since): the group must be formed again before weights are broadcast (Miles re-connects when
        ``num_new_engines > 0``)."""
        formed = self._serving.ledger.group(group_name)
        return tuple(
            r.id
            for r in self._select(model, None)
            if r.update_weights and r.state.up and formed.get(r.id) != r.restarts
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        weight_version: str | None = None,
        flush_cache: bool = False,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        model: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/update_weights_from_distributed`` (one bucket's metadata; the tensors follow by NCCL broadcast
        from the trainer) on the engines of the group ``group_name`` as it was formed; the other engines
        receiving weights then lack them (``pending_weights``) until the group is formed again with them."""
        if weight_version is not None:
            weight_version = ops.check_version(weight_version, "weight_version")
        body = ops.distributed_weights_body(
            names,
            dtypes,
            shapes,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            load_format=load_format,
        )
        ops.check_timeout(timeout_s)
        return await self._on_loop(
            self._distributed(body, group_name, weight_version, model, timeout_s, check)
        )

    async def _distributed(
        self,
        body: dict[str, Any],
        group_name: str,
        weight_version: str | None,
        model: str | None,
        timeout_s: float | None,
        check: bool,
    ) -> OperationResult:
        formed = self._serving.ledger.group(group_name)
        spec = OPERATIONS["update_weights_from_distributed"]
        targets = self._targets(spec, model, None, also=lambda r: formed.get(r.id) == r.restarts)
        effect = self._serving.ledger.distributed_effect(weight_version)
        return await self._run(
            spec.name,
            body,
            effect,
            model=model,
            group=None,
            timeout_s=timeout_s,
            check=check,
            targets=targets,
        )

    async def destroy_weights_update_group(
        self,
        group_name: str = DEFAULT_GROUP_NAME,
        *,
        model: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/destroy_weights_update_group`` on the engines of the group as it was formed (an engine restarted
        since, or added, never joined it: skipped)."""
        ops.check_timeout(timeout_s)
        formed = self._serving.ledger.group(group_name)
        spec = OPERATIONS["destroy_weights_update_group"]
        targets = self._targets(spec, model, None, needed=lambda r: formed.get(r.id) == r.restarts)
        result = await self._run(
            spec.name,
            {"group_name": group_name},
            None,
            model=model,
            group=None,
            timeout_s=timeout_s,
            check=False,
            targets=targets,
        )
        await self._on_loop(self._leave(group_name, result.accepted))
        return result.raise_for_errors() if check else result

    async def _leave(self, group_name: str, engines: Sequence[str]) -> None:
        self._serving.ledger.leave_group(group_name, engines)

    async def update_weight_version(
        self,
        new_version: str,
        *,
        abort_all_requests: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/update_weight_version`` on the engines receiving weights (what ``meta_info.weight_version``
        reports from then on)."""
        version = ops.check_version(new_version)
        return await self._run(
            "update_weight_version",
            ops.weight_version_body(version, abort_all_requests=abort_all_requests),
            ops.weight_version_effect(version),
            model=model,
            group=None,
            timeout_s=timeout_s,
            check=check,
        )

    async def weight_versions(
        self, *, model: str | None = None, timeout_s: float | None = None
    ) -> dict[str, str | None]:
        """engine id -> the weight version it reports (``GET /model_info``); None where it did not answer."""
        result = await self.query("/model_info", model=model, timeout_s=timeout_s, check=False)
        return {
            r.engine: (r.body.get("weight_version") if r.ok and isinstance(r.body, dict) else None)
            for r in result.replies
        }

    async def query(
        self,
        route: str,
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``GET route`` on every engine that is up (e.g. ``/metrics``, ``/get_load``, ``/server_info``): each
        reply's ``body`` is its JSON, or its text."""
        if not isinstance(route, str) or not route.startswith("/"):
            raise ValueError(f"route must start with '/', got {route!r}")
        result = await self._run(
            "query", None, None, model=model, group=group, timeout_s=timeout_s, check=False, route=route
        )
        result = dataclasses.replace(result, operation=f"GET {route}")
        return result.raise_for_errors() if check else result

    # ------------------------------------------------------------------------------------------ scheduling
    async def pause_generation(
        self,
        mode: str = "retract",
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/pause_generation`` (``abort``, ``retract`` — Miles' default —, ``in_place``) on every engine."""
        body = ops.pause_body(mode)
        return await self._run(
            "pause_generation",
            body,
            ops.pause_effect(mode),
            model=model,
            group=group,
            timeout_s=timeout_s,
            check=check,
        )

    async def continue_generation(
        self,
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/continue_generation`` on every engine."""
        return await self._run(
            "continue_generation",
            {},
            ops.pause_effect(None),
            model=model,
            group=group,
            timeout_s=timeout_s,
            check=check,
        )

    async def flush_cache(
        self,
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/flush_cache`` (the radix cache) on every engine."""
        return await self._run(
            "flush_cache", {}, None, model=model, group=group, timeout_s=timeout_s, check=check
        )

    async def abort_all(
        self,
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/abort_request`` with ``abort_all`` on every engine. The deployment's rollout clients first end
        their running requests with the tokens they have (an abort from the trainer is not a loss to heal)."""
        if group is None:
            self._serving.rollout_clients.abort_all(model)
        return await self._run(
            "abort_all", {"abort_all": True}, None, model=model, group=group, timeout_s=timeout_s, check=check
        )

    # ------------------------------------------------------------------------------------------ LoRA
    def _check_lora(self, model: str | None) -> None:
        if not any(r.serves_lora for r in self._select(model, None)):
            raise ValueError(
                f"no engine of {f'model {model!r}' if model else 'the deployment'} serves LoRA adapters; "
                "turn it on with sglang_deploy.lora.enabled=true"
            )

    async def load_lora_adapter(
        self,
        name: str,
        path: str,
        *,
        pinned: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/load_lora_adapter`` on the engines that serve LoRA: requests can then ask for adapter ``name``
        (their ``lora_path``), no engine restarted. An adapter the engines refuse (a name already loaded, a
        bad path) is not recorded."""
        self._check_lora(model)
        return await self._run(
            "load_lora_adapter",
            ops.lora_load_body(name, path, pinned=pinned),
            ops.lora_load_effect(name, path, pinned),
            model=model,
            group=None,
            timeout_s=timeout_s,
            check=check,
        )

    async def unload_lora_adapter(
        self, name: str, *, model: str | None = None, timeout_s: float | None = None, check: bool = True
    ) -> OperationResult:
        """``/unload_lora_adapter`` on the engines that serve LoRA."""
        self._check_lora(model)
        return await self._run(
            "unload_lora_adapter",
            ops.lora_unload_body(name),
            ops.lora_unload_effect(name),
            model=model,
            group=None,
            timeout_s=timeout_s,
            check=check,
        )


# ------------------------------------------------------------------------------------------ blocking
def _blocking(
    operation: Callable[Concatenate[AsyncDeploymentControl, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[DeploymentControl, P], R]:
    """The blocking twin of a coroutine of :class:`AsyncDeploymentControl` (same signature and docstring)."""

    @functools.wraps(operation)
    def run(self: DeploymentControl, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._submit(operation(self.aio, *args, **kwargs)).result()

    return run


def _in_background(
    operation: Callable[Concatenate[AsyncDeploymentControl, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[BackgroundControl, P], concurrent.futures.Future[R]]:
    """The started twin of a coroutine of :class:`AsyncDeploymentControl`: a ``Future`` of its result."""

    @functools.wraps(operation)
    def start(self: BackgroundControl, /, *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[R]:
        return self._control._submit(operation(self._control.aio, *args, **kwargs))

    return start


def _plain(
    method: Callable[Concatenate[AsyncDeploymentControl, P], R],
) -> Callable[Concatenate[DeploymentControl, P], R]:
    """A plain method of :class:`AsyncDeploymentControl`, offered as is."""

    @functools.wraps(method)
    def call(self: DeploymentControl, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(self.aio, *args, **kwargs)

    return call


class DeploymentControl:
    """The blocking control handle (``deployment.control``): every operation of
    :class:`AsyncDeploymentControl` with the same arguments, blocking until its result (it runs on the
    deployment's serving loop, so it works from any thread). ``control.background.<operation>(...)`` starts
    one and returns a ``concurrent.futures.Future`` (for calls that complete only once the trainer has done
    its part, such as :meth:`init_weights_update_group` and :meth:`update_weights_from_distributed`)."""

    def __init__(self, aio: AsyncDeploymentControl) -> None:
        self.aio = aio
        self.background = BackgroundControl(self)

    def _submit(self, coro: Coroutine[Any, Any, R]) -> concurrent.futures.Future[R]:
        """Run ``coro`` on the serving loop; its future, whose cancellation at the deployment's stop becomes
        the refusal (:class:`~.errors.DeploymentStoppedError`, or ``DeploymentFailedError``)."""
        aio = self.aio
        name = _name_of(coro)
        refusal = aio._serving.refusal(f"before {name} was sent")
        if refusal is not None:
            _refuse(coro, refusal)  # its arguments are still checked first (a ValueError before the refusal)
        try:
            inner = aio._serving.serving_loop.submit(coro)
        except RuntimeError:
            raise aio._refused(f"before {name} was sent") from None
        outer: concurrent.futures.Future[R] = concurrent.futures.Future()

        def settle(done: concurrent.futures.Future[R]) -> None:
            if done.cancelled():
                outer.set_exception(aio._refused(f"while {name} was in flight"))
            elif (error := done.exception()) is not None:
                outer.set_exception(error)
            else:
                outer.set_result(done.result())

        inner.add_done_callback(settle)
        return outer

    engines = _plain(AsyncDeploymentControl.engines)
    weight_update_group = _plain(AsyncDeploymentControl.weight_update_group)
    engines_outside_weight_group = _plain(AsyncDeploymentControl.engines_outside_weight_group)
    offload = _blocking(AsyncDeploymentControl.offload)
    onload = _blocking(AsyncDeploymentControl.onload)
    update_weights_from_disk = _blocking(AsyncDeploymentControl.update_weights_from_disk)
    init_weights_update_group = _blocking(AsyncDeploymentControl.init_weights_update_group)
    update_weights_from_distributed = _blocking(AsyncDeploymentControl.update_weights_from_distributed)
    destroy_weights_update_group = _blocking(AsyncDeploymentControl.destroy_weights_update_group)
    update_weight_version = _blocking(AsyncDeploymentControl.update_weight_version)
    weight_versions = _blocking(AsyncDeploymentControl.weight_versions)
    query = _blocking(AsyncDeploymentControl.query)
    pause_generation = _blocking(AsyncDeploymentControl.pause_generation)
    continue_generation = _blocking(AsyncDeploymentControl.continue_generation)
    flush_cache = _blocking(AsyncDeploymentControl.flush_cache)
    abort_all = _blocking(AsyncDeploymentControl.abort_all)
    load_lora_adapter = _blocking(AsyncDeploymentControl.load_lora_adapter)
    unload_lora_adapter = _blocking(AsyncDeploymentControl.unload_lora_adapter)


def _name_of(coro: Coroutine[Any, Any, Any]) -> str:
    """The operation's name: a native coroutine's ``__name__`` (which ``typing.Coroutine`` does not declare)."""
    return str(getattr(coro, "__name__", type(coro).__name__))


def _refuse(coro: Coroutine[Any, Any, Any], refusal: Exception) -> None:
    """Run ``coro`` up to its first wait, here: an operation checks its arguments, then whether the deployment
    runs, before it waits for anything; so a bad argument raises its own error, anything else ``refusal``."""
    try:
        coro.send(None)
    except (StopIteration, DeploymentStoppedError, DeploymentFailedError):
        pass
    else:
        coro.close()
    raise refusal


class BackgroundControl:
    """``control.background.<operation>(...)``: the operation started on the serving loop, a
    ``concurrent.futures.Future`` of its result back."""

    def __init__(self, control: DeploymentControl) -> None:
        self._control = control

    offload = _in_background(AsyncDeploymentControl.offload)
    onload = _in_background(AsyncDeploymentControl.onload)
    update_weights_from_disk = _in_background(AsyncDeploymentControl.update_weights_from_disk)
    init_weights_update_group = _in_background(AsyncDeploymentControl.init_weights_update_group)
    update_weights_from_distributed = _in_background(AsyncDeploymentControl.update_weights_from_distributed)
    destroy_weights_update_group = _in_background(AsyncDeploymentControl.destroy_weights_update_group)
    update_weight_version = _in_background(AsyncDeploymentControl.update_weight_version)
    weight_versions = _in_background(AsyncDeploymentControl.weight_versions)
    query = _in_background(AsyncDeploymentControl.query)
    pause_generation = _in_background(AsyncDeploymentControl.pause_generation)
    continue_generation = _in_background(AsyncDeploymentControl.continue_generation)
    flush_cache = _in_background(AsyncDeploymentControl.flush_cache)
    abort_all = _in_background(AsyncDeploymentControl.abort_all)
    load_lora_adapter = _in_background(AsyncDeploymentControl.load_lora_adapter)
    unload_lora_adapter = _in_background(AsyncDeploymentControl.unload_lora_adapter)
