"""The trainer drives its engines: offload and onload, weight updates, pause and continue, cache, abort, LoRA.

``deployment.control`` (:class:`DeploymentControl`, synchronous) and ``deployment.async_control``
(:class:`AsyncDeploymentControl`, the same methods as coroutines) send each operation **in parallel** to
exactly the engines it concerns, as the plan decided them (never recomputed here):

* ``offload`` / ``onload``: the engines of groups with ``needs_offload``;
* weight updates (``update_weights_from_disk``, the distributed path, ``update_weight_version``): the engines
  of models with ``update_weights`` (external engines of such a model included);
* LoRA adapters: the engines that serve LoRA (``--enable-lora``);
* ``pause_generation`` / ``continue_generation`` / ``flush_cache`` / ``abort_all``: every engine;

each narrowed further with ``model=`` / ``group=``. An operation has one deadline (``timeout_s``, default
``sglang_deploy.control.timeout_s``) for all its engines, and gives one :class:`OperationResult`: a reply per
engine, the engines it skipped (not concerned) and those it deferred (lost and being restarted right now:
they get the deployment's state when they are back, see below). If any engine failed, :class:`ControlError`
is raised naming each one (``check=False`` returns the result instead).

**State kept for restarted engines.** The control handle remembers what its operations left the engines in
(memory released per engine, generation paused, the last weights from disk and weight version, loaded LoRA
adapters); an engine that the supervisor restarts gets it replayed before it serves again. Weights that came
through a weights update group (NCCL) cannot be replayed: such an engine waits (``pending_weights``, out of its
router) until the trainer has re-formed the group (:meth:`AsyncDeploymentControl.engines_outside_weight_group`
says which engines are new, like Miles' ``num_new_engines``) and sent it weights.

Request bodies follow the installed SGLang's request classes (``sglang/srt/managers/io_struct.py``; checked
by the tests and by the stand-in engine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from miles_sglang_plugin.serving.members import EngineMember
from miles_sglang_plugin.serving.supervision import DeploymentFailedError, DeploymentStoppedError

if TYPE_CHECKING:
    from miles_sglang_plugin.serving.deployment import Deployment

__all__ = [
    "AsyncDeploymentControl",
    "ControlError",
    "DeploymentControl",
    "EngineReply",
    "OperationResult",
    "WeightUpdateGroup",
    "WeightUpdateRank",
]

#: SGLang's default name of a weights update group (``InitWeightsUpdateGroupReqInput.group_name``).
DEFAULT_GROUP_NAME = "weight_update_group"
#: Engine states in which the control calls reach an engine: serving, or up and waiting for weights.
UP_STATES = frozenset({"registered", "pending_weights"})
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
#: How long closing the synchronous handle waits for the operations it cancels, and for its loop to stop.
CLOSE_TIMEOUT_S = 5.0
T = TypeVar("T")


# ------------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class EngineReply:
    """What one engine answered."""

    engine: str
    url: str
    ok: bool
    status: int | None
    #: The answer's JSON (or text; None for an empty answer).
    body: Any
    #: Why it failed (None when ``ok``).
    error: str | None
    elapsed_s: float


@dataclass(frozen=True)
class WeightUpdateRank:
    """One engine's place in a weights update group: its ranks are ``rank_offset .. rank_offset + num_gpus - 1``."""

    engine: str
    url: str
    rank_offset: int
    num_gpus: int
    #: How often the engine had been restarted when the group was formed.
    restarts: int = 0


@dataclass(frozen=True)
class WeightUpdateGroup:
    """The NCCL group a trainer broadcasts weights in: the trainer is rank 0, each engine's GPUs follow in
    deployment order (Miles ``connect_rollout_engines_from_distributed``: ``world_size = Σ engine GPUs + 1``,
    ranks from 1)."""

    model: str
    master_address: str
    master_port: int
    group_name: str
    backend: str
    world_size: int
    ranks: tuple[WeightUpdateRank, ...]

    def rank_of(self, engine: str) -> WeightUpdateRank:
        for rank in self.ranks:
            if rank.engine == engine:
                return rank
        raise KeyError(f"engine {engine!r} is not in weights update group {self.group_name!r}")


@dataclass(frozen=True)
class OperationResult:
    """One operation over its engines."""

    operation: str
    replies: tuple[EngineReply, ...]
    #: Engines the operation does not concern (by the plan: e.g. groups without needs_offload).
    skipped: tuple[str, ...] = ()
    #: Engines it concerns that are down now (lost, restarting): they get the state when they are back.
    deferred: tuple[str, ...] = ()
    #: The group formed (``init_weights_update_group`` only).
    group: WeightUpdateGroup | None = None

    @property
    def ok(self) -> bool:
        return all(reply.ok for reply in self.replies)

    @property
    def failed(self) -> tuple[EngineReply, ...]:
        return tuple(reply for reply in self.replies if not reply.ok)

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines it reached (or tried to), in deployment order."""
        return tuple(reply.engine for reply in self.replies)

    def describe(self) -> str:
        """One line per engine: what it did."""
        lines = [f"{self.operation}: {len(self.replies)} engine(s)"]
        for reply in self.replies:
            outcome = "ok" if reply.ok else f"FAILED: {reply.error}"
            lines.append(f"  {reply.engine} ({reply.url}): {outcome} [{reply.elapsed_s * 1000:.0f} ms]")
        lines += [f"  {engine}: deferred (down now; gets it when back)" for engine in self.deferred]
        return "\n".join(lines)

    def raise_for_errors(self) -> OperationResult:
        if not self.ok:
            raise ControlError(self)
        return self


class ControlError(RuntimeError):
    """An operation failed on some engines; ``result`` holds every reply, the message names each failure."""

    def __init__(self, result: OperationResult) -> None:
        self.result = result
        failures = "\n".join(f"  {r.engine} ({r.url}): {r.error}" for r in result.failed)
        super().__init__(
            f"{result.operation} failed on {len(result.failed)} of {len(result.replies)} engine(s):\n{failures}"
        )


# --------------------------------------------------------------------------------------------- request bodies
def memory_body(tags: Sequence[str] | None) -> dict[str, Any]:
    """``/release_memory_occupation`` and ``/resume_memory_occupation`` (``tags`` None: all memory)."""
    return {} if tags is None else {"tags": list(tags)}


def disk_weights_body(
    model_path: str,
    *,
    weight_version: str | None = None,
    load_format: str | None = None,
    abort_all_requests: bool = False,
    flush_cache: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model_path": model_path,
        "abort_all_requests": abort_all_requests,
        "flush_cache": flush_cache,
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    if load_format is not None:
        body["load_format"] = load_format
    return body


def init_group_body(group: WeightUpdateGroup, rank: WeightUpdateRank) -> dict[str, Any]:
    return {
        "master_address": group.master_address,
        "master_port": group.master_port,
        "rank_offset": rank.rank_offset,
        "world_size": group.world_size,
        "group_name": group.group_name,
        "backend": group.backend,
    }


def _dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` -> ``"bfloat16"`` (Miles sends dtypes without ``torch.``)."""
    return str(dtype).removeprefix("torch.")


def distributed_weights_body(
    names: Sequence[str],
    dtypes: Sequence[Any],
    shapes: Sequence[Sequence[int]],
    *,
    group_name: str = DEFAULT_GROUP_NAME,
    weight_version: str | None = None,
    flush_cache: bool = False,
    abort_all_requests: bool = False,
    load_format: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "names": list(names),
        "dtypes": [_dtype_name(dtype) for dtype in dtypes],
        "shapes": [[int(n) for n in shape] for shape in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    if load_format is not None:
        body["load_format"] = load_format
    return body


def weight_version_body(new_version: str, *, abort_all_requests: bool = False) -> dict[str, Any]:
    return {"new_version": str(new_version), "abort_all_requests": abort_all_requests}


def pause_body(mode: str) -> dict[str, Any]:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
    return {"mode": mode}


def lora_load_body(name: str, path: str, *, pinned: bool = False) -> dict[str, Any]:
    return {"lora_name": name, "lora_path": path, "pinned": pinned}


def lora_unload_body(name: str) -> dict[str, Any]:
    return {"lora_name": name}


# ------------------------------------------------------------------------------------------ remembered state
@dataclass
class RememberedState:
    """What the control operations left the engines in, for engines that come back after a restart."""

    #: Bumped by every change; a restarted engine is admitted only once it got the latest version.
    version: int = 0
    #: engine id -> memory tags released on it.
    released: dict[str, set[str]] = field(default_factory=dict)
    #: engine id -> pause mode.
    paused: dict[str, str] = field(default_factory=dict)
    #: model -> the last ``update_weights_from_disk`` body.
    disk_weights: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: model -> the weight version last set.
    weight_version: dict[str, str] = field(default_factory=dict)
    #: model -> weights came through a weights update group since the last load from disk.
    distributed_weights: dict[str, bool] = field(default_factory=dict)
    #: model -> LoRA adapter name -> path.
    lora: dict[str, dict[str, str]] = field(default_factory=dict)
    #: group name -> engine id -> its restarts when the group was formed.
    weight_groups: dict[str, dict[str, int]] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def change(self, apply: Callable[[RememberedState], None]) -> None:
        with self.lock:
            apply(self)
            self.version += 1

    def replay_calls(self, member: EngineMember) -> list[tuple[str, dict[str, Any]]]:
        """The calls that bring a restarted ``member`` to this state: LoRA adapters, weights from disk, the
        weight version, released memory, pause; in that order."""
        with self.lock:
            calls = [
                ("/load_lora_adapter", lora_load_body(name, path))
                for name, path in self.lora.get(member.model, {}).items()
                if member.serves_lora
            ]
            disk = self.disk_weights.get(member.model) if member.update_weights else None
            if disk is not None:
                calls.append(("/update_weights_from_disk", {**disk, "abort_all_requests": False}))
            version = self.weight_version.get(member.model) if member.update_weights else None
            if version is not None and (disk is None or disk.get("weight_version") != version):
                calls.append(("/update_weight_version", weight_version_body(version)))
            if self.released.get(member.id):
                calls.append(("/release_memory_occupation", memory_body(sorted(self.released[member.id]))))
            if member.id in self.paused:
                calls.append(("/pause_generation", pause_body(self.paused[member.id])))
            return calls

    def needs_weights(self, member: EngineMember) -> bool:
        """A restarted ``member`` lacks weights that only a weights update group can give it."""
        with self.lock:
            return member.update_weights and self.distributed_weights.get(member.model, False)


# ----------------------------------------------------------------------------------------------- the handle
@dataclass(frozen=True)
class _Targets:
    members: tuple[EngineMember, ...]
    skipped: tuple[str, ...]
    deferred: tuple[str, ...]


class AsyncDeploymentControl:
    """The control handle's coroutines; see the module docstring. Use from any event loop."""

    def __init__(self, deployment: Deployment) -> None:
        self._deployment = deployment
        self.remembered = RememberedState()
        #: The synchronous handle's loop, on which one HTTP client serves every operation.
        self.shared_loop: asyncio.AbstractEventLoop | None = None
        self._shared_client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------------------------------ engines
    def engines(self, model: str | None = None, group: str | None = None) -> tuple[Any, ...]:
        """The engines (:class:`~miles_sglang_plugin.serving.members.EngineInfo`), optionally of one model /
        group, in deployment order."""
        return tuple(m.info() for m in self._select(model, group))

    def _select(self, model: str | None, group: str | None) -> list[EngineMember]:
        members = self._deployment.members
        if model is not None:
            known = sorted({m.model for m in members})
            if model not in known:
                raise ValueError(f"no model {model!r} in the deployment; models: {', '.join(known)}")
            members = [m for m in members if m.model == model]
        if group is not None:
            known = sorted({m.group for m in members})
            if group not in known:
                raise ValueError(
                    f"no group {group!r} among {model or 'the models'}; groups: {', '.join(known)}"
                )
            members = [m for m in members if m.group == group]
        return members

    def _targets(
        self, concerned: Callable[[EngineMember], bool], model: str | None, group: str | None
    ) -> _Targets:
        self._deployment.check_running()
        selected = self._select(model, group)
        mine = [m for m in selected if concerned(m)]
        return _Targets(
            members=tuple(m for m in mine if m.state in UP_STATES),
            skipped=tuple(m.id for m in selected if not concerned(m)),
            deferred=tuple(m.id for m in mine if m.state not in UP_STATES),
        )

    # ------------------------------------------------------------------------------------------ fan-out
    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[httpx.AsyncClient]:
        """The HTTP client of one operation: on the synchronous handle's own loop one kept for all of them
        (creating a client costs milliseconds), on any other loop one of its own."""
        limits = httpx.Limits(max_connections=self._deployment.settings.control.max_concurrency)
        headers = self._deployment.auth_headers()
        if self.shared_loop is not None and asyncio.get_running_loop() is self.shared_loop:
            if self._shared_client is None:
                self._shared_client = httpx.AsyncClient(limits=limits, headers=headers)
            yield self._shared_client
            return
        async with httpx.AsyncClient(limits=limits, headers=headers) as client:
            yield client

    async def _call(
        self,
        client: httpx.AsyncClient,
        member: EngineMember,
        method: str,
        route: str,
        body: Any,
        timeout_s: float,
    ) -> EngineReply:
        started = time.monotonic()
        try:
            response = await client.request(method, member.url + route, json=body, timeout=timeout_s)
        except httpx.HTTPError as exc:
            return _reply(member, started, None, None, f"{type(exc).__name__}: {exc or 'no answer'}")
        try:
            data: Any = response.json() if response.content else None
        except ValueError:
            data = response.text
        if response.status_code >= 400:
            return _reply(member, started, response.status_code, data, f"HTTP {response.status_code}: {data}")
        if isinstance(data, dict) and data.get("success") is False:
            message = data.get("message") or data.get("error_message") or data
            return _reply(
                member, started, response.status_code, data, f"the engine reports failure: {message}"
            )
        return _reply(member, started, response.status_code, data, None)

    async def _fan_out(
        self,
        operation: str,
        targets: _Targets,
        route: str,
        body: Callable[[EngineMember], Any] | Any,
        *,
        timeout_s: float | None,
        method: str = "POST",
    ) -> OperationResult:
        deadline = self._deployment.settings.control.timeout_s if timeout_s is None else timeout_s
        restarts = {m.id: m.restarts for m in targets.members}  # an engine replaced meanwhile is caught up
        async with self._client() as client:
            tasks = {
                asyncio.ensure_future(
                    self._call(client, m, method, route, body(m) if callable(body) else body, deadline)
                ): m
                for m in targets.members
            }
            if tasks:
                await asyncio.wait(tasks, timeout=deadline)
            replies = [_task_reply(task, member, deadline) for task, member in tasks.items()]
        replies, deferred = self._settle(replies, restarts)
        return OperationResult(
            operation=operation,
            replies=tuple(replies),
            skipped=targets.skipped,
            deferred=(*targets.deferred, *deferred),
        )

    def _settle(
        self, replies: list[EngineReply], restarts: dict[str, int]
    ) -> tuple[list[EngineReply], list[str]]:
        """Failures of engines that are down (their process exited, or the supervisor took them out) are
        deferred, not failed: the supervisor brings them back with the remembered state. So is any reply of
        an engine restarted while the call was out (``restarts``: before it): what it answered, if anything,
        was its old process's; the new one gets the state replayed, and is sent the operation if it came back
        before the operation was recorded (see :meth:`_remember`)."""
        by_id = {m.id: m for m in self._deployment.members}
        kept, deferred = [], []
        for reply in replies:
            member = by_id[reply.engine]
            down = member.state not in UP_STATES or any(p.exit_code() is not None for p in member.processes)
            replaced = member.restarts != restarts.get(member.id, member.restarts)
            if not member.external and (replaced or (down and not reply.ok)):
                deferred.append(reply.engine)
            else:
                kept.append(reply)
        return kept, deferred

    async def _operate(
        self,
        operation: str,
        targets: _Targets,
        route: str,
        body: Callable[[EngineMember], Any] | Any,
        *,
        timeout_s: float | None,
        check: bool,
        remember: Callable[[RememberedState, OperationResult], None] | None = None,
        only_if_ok: bool = False,
    ) -> OperationResult:
        """Fan out, remember what the engines are left in (``remember``; with ``only_if_ok`` only when every
        engine took it), then catch up on the deferred engines that came back meanwhile, and check."""
        restarts = {m.id: m.restarts for m in targets.members}
        result = await self._fan_out(operation, targets, route, body, timeout_s=timeout_s)
        # Stopped while the calls were out (an async caller's own loop is not cancelled by stop()): say so,
        # and remember nothing of engines that are gone.
        self._deployment.check_running()
        if remember is not None and (result.ok or not only_if_ok):
            late = await asyncio.to_thread(self._remember, remember, result, restarts)
            if late:
                extra = await self._fan_out(
                    operation, _Targets(tuple(late), (), ()), route, body, timeout_s=timeout_s
                )
                caught = {m.id for m in late}
                result = dataclasses.replace(  # a replaced engine's reply is its new process's
                    result,
                    replies=(*(r for r in result.replies if r.engine not in caught), *extra.replies),
                    deferred=tuple(e for e in result.deferred if e not in caught) + extra.deferred,
                )
        self._admit_updated(result)
        return result.raise_for_errors() if check else result

    def _remember(
        self,
        apply: Callable[[RememberedState, OperationResult], None],
        result: OperationResult,
        restarts: Mapping[str, int] | None = None,
    ) -> list[EngineMember]:
        """Record the state; the deferred engines that are up again (they came back before the record, so
        the replay they got lacked it): they are sent the operation too. One that the supervisor is catching
        up right now (its replay was read before this record) is waited for, then sent it if it came up. So
        is an engine that answered but was replaced since (``restarts``: the counts when the calls went out):
        the answer was its old process's."""
        before = restarts or {}
        with self.remembered.lock:
            self.remembered.change(lambda state: apply(state, result))
            replaced = [m for m in self._by_ids(result.engines) if m.restarts != before.get(m.id, m.restarts)]
            deferred = [*self._by_ids(result.deferred), *replaced]
            late = [m for m in deferred if m.state in UP_STATES and not m.catching_up]
            catching_up = [(m, m.restarts) for m in deferred if m.catching_up]
        for member, restarts in catching_up:
            with member.catch_up:  # its replay and registration are done
                if member.state in UP_STATES and member.restarts == restarts and member not in late:
                    late.append(member)
        return late

    def _models_of(self, result: OperationResult) -> set[str]:
        return {m.model for m in self._by_ids([*result.engines, *result.deferred])}

    async def close_shared_client(self) -> None:
        client, self._shared_client, self.shared_loop = self._shared_client, None, None
        if client is not None:
            await client.aclose()

    # ------------------------------------------------------------------------------------------ memory
    async def offload(
        self,
        tags: Sequence[str] | None = None,
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/release_memory_occupation`` on the engines of groups with ``needs_offload`` (``tags``: of
        ``weights``, ``kv_cache``, ``cuda_graph``; None: all)."""
        released = set(tags) if tags is not None else set(MEMORY_TAGS)
        return await self._operate(
            "offload",
            self._targets(lambda m: m.needs_offload, model, group),
            "/release_memory_occupation",
            memory_body(tags),
            timeout_s=timeout_s,
            check=check,
            remember=lambda state, result: _record_memory(state, result, lambda now: now | released),
        )

    async def onload(
        self,
        tags: Sequence[str] | None = None,
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/resume_memory_occupation`` on the engines of groups with ``needs_offload`` (Miles resumes
        ``weights`` before a weight update and ``kv_cache`` + ``cuda_graph`` after it)."""
        resumed = set(tags) if tags is not None else set(MEMORY_TAGS)
        return await self._operate(
            "onload",
            self._targets(lambda m: m.needs_offload, model, group),
            "/resume_memory_occupation",
            memory_body(tags),
            timeout_s=timeout_s,
            check=check,
            remember=lambda state, result: _record_memory(state, result, lambda now: now - resumed),
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
    ) -> OperationResult:
        """``/update_weights_from_disk`` on the engines of the model(s) with ``update_weights``."""
        body = disk_weights_body(
            model_path,
            weight_version=weight_version,
            load_format=load_format,
            abort_all_requests=abort_all_requests,
            flush_cache=flush_cache,
        )

        def remember(state: RememberedState, result: OperationResult) -> None:
            for name in self._models_of(result):
                state.disk_weights[name] = body
                state.distributed_weights[name] = False
                if weight_version is not None:
                    state.weight_version[name] = str(weight_version)

        return await self._operate(
            "update_weights_from_disk",
            self._targets(lambda m: m.update_weights, model, None),
            "/update_weights_from_disk",
            body,
            timeout_s=timeout_s,
            check=check,
            remember=remember,
            only_if_ok=True,
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
        targets = self._targets(lambda m: m.update_weights, model, None)
        models = sorted({m.model for m in targets.members})
        if len(models) != 1:
            raise ValueError(
                "a weights update group is formed over one model's engines; "
                + (f"got {', '.join(models)}: pass model=" if models else "no engine receiving weights is up")
            )
        ranks, cursor = [], 1
        for member in targets.members:
            ranks.append(WeightUpdateRank(member.id, member.url, cursor, member.num_gpus, member.restarts))
            cursor += member.num_gpus
        return WeightUpdateGroup(
            model=models[0],
            master_address=master_address,
            master_port=int(master_port),
            group_name=group_name,
            backend=backend,
            world_size=cursor,
            ranks=tuple(ranks),
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
        group = self.weight_update_group(
            master_address, master_port, group_name=group_name, backend=backend, model=model
        )
        by_id = {rank.engine: rank for rank in group.ranks}
        result = await self._fan_out(
            "init_weights_update_group",
            _Targets(tuple(self._by_ids(list(by_id))), (), ()),
            "/init_weights_update_group",
            lambda m: init_group_body(group, by_id[m.id]),
            timeout_s=timeout_s,
        )
        if result.ok:
            members = {r.engine: r.restarts for r in group.ranks}
            await asyncio.to_thread(
                self.remembered.change, lambda state: state.weight_groups.__setitem__(group_name, members)
            )
        result = dataclasses.replace(result, group=group)
        return result.raise_for_errors() if check else result

    def engines_outside_weight_group(
        self, group_name: str = DEFAULT_GROUP_NAME, model: str | None = None
    ) -> tuple[str, ...]:
        """Engines receiving weights that are up but not in the group as it was last formed (new, or
        restarted since): the group must be formed again before weights are broadcast (Miles re-connects when
        ``num_new_engines > 0``)."""
        formed = self.remembered.weight_groups.get(group_name, {})
        return tuple(
            m.id
            for m in self._select(model, None)
            if m.update_weights and m.state in UP_STATES and formed.get(m.id) != m.restarts
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
        from the trainer) on the engines of the group ``group_name`` as it was formed."""
        body = distributed_weights_body(
            names,
            dtypes,
            shapes,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            load_format=load_format,
        )
        formed = self.remembered.weight_groups.get(group_name, {})

        def remember(state: RememberedState, result: OperationResult) -> None:
            for name in self._models_of(result):
                state.distributed_weights[name] = True
                if weight_version is not None:
                    state.weight_version[name] = str(weight_version)

        return await self._operate(
            "update_weights_from_distributed",
            self._targets(lambda m: m.update_weights and formed.get(m.id) == m.restarts, model, None),
            "/update_weights_from_distributed",
            body,
            timeout_s=timeout_s,
            check=check,
            remember=remember,
            only_if_ok=True,
        )

    async def destroy_weights_update_group(
        self,
        group_name: str = DEFAULT_GROUP_NAME,
        *,
        model: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/destroy_weights_update_group`` on the engines receiving weights."""
        return await self._operate(
            "destroy_weights_update_group",
            self._targets(lambda m: m.update_weights, model, None),
            "/destroy_weights_update_group",
            {"group_name": group_name},
            timeout_s=timeout_s,
            check=check,
            remember=lambda state, _result: state.weight_groups.pop(group_name, None),
        )

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

        def remember(state: RememberedState, result: OperationResult) -> None:
            state.weight_version.update(dict.fromkeys(self._models_of(result), str(new_version)))

        return await self._operate(
            "update_weight_version",
            self._targets(lambda m: m.update_weights, model, None),
            "/update_weight_version",
            weight_version_body(new_version, abort_all_requests=abort_all_requests),
            timeout_s=timeout_s,
            check=check,
            remember=remember,
            only_if_ok=True,
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
        if not route.startswith("/"):
            raise ValueError(f"route must start with '/', got {route!r}")
        targets = self._targets(lambda m: True, model, group)
        result = await self._fan_out(f"GET {route}", targets, route, None, timeout_s=timeout_s, method="GET")
        return result.raise_for_errors() if check else result

    def _by_ids(self, ids: Sequence[str]) -> list[EngineMember]:
        wanted = set(ids)
        return [m for m in self._deployment.members if m.id in wanted]

    def _admit_updated(self, result: OperationResult) -> None:
        """Engines waiting for weights (restarted after weights came by NCCL) serve again once they got some."""
        if result.operation not in ("update_weights_from_disk", "update_weights_from_distributed"):
            return
        got = {r.engine for r in result.replies if r.ok}
        for member in self._by_ids(list(got)):
            if member.state == "pending_weights":
                self._deployment.supervisor.admit_in_background(member)

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

        def remember(state: RememberedState, result: OperationResult) -> None:
            state.paused.update(dict.fromkeys([*result.engines, *result.deferred], mode))

        return await self._operate(
            "pause_generation",
            self._targets(lambda m: True, model, group),
            "/pause_generation",
            pause_body(mode),
            timeout_s=timeout_s,
            check=check,
            remember=remember,
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

        def remember(state: RememberedState, result: OperationResult) -> None:
            for engine in [*result.engines, *result.deferred]:
                state.paused.pop(engine, None)

        return await self._operate(
            "continue_generation",
            self._targets(lambda m: True, model, group),
            "/continue_generation",
            {},
            timeout_s=timeout_s,
            check=check,
            remember=remember,
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
        targets = self._targets(lambda m: True, model, group)
        return await self._operate(
            "flush_cache", targets, "/flush_cache", None, timeout_s=timeout_s, check=check
        )

    async def abort_all(
        self,
        *,
        model: str | None = None,
        group: str | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> OperationResult:
        """``/abort_request`` with ``abort_all`` on every engine."""
        targets = self._targets(lambda m: True, model, group)
        return await self._operate(
            "abort_all", targets, "/abort_request", {"abort_all": True}, timeout_s=timeout_s, check=check
        )

    # ------------------------------------------------------------------------------------------ LoRA
    def _lora_targets(self, model: str | None) -> _Targets:
        targets = self._targets(lambda m: m.serves_lora, model, None)
        if not targets.members and not targets.deferred:
            raise ValueError(
                f"no engine of {f'model {model!r}' if model else 'the deployment'} serves LoRA adapters; "
                "turn it on with sglang_deploy.lora.enabled=true"
            )
        return targets

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
        (their ``lora_path``), no engine restarted."""

        def remember(state: RememberedState, result: OperationResult) -> None:
            for model_name in self._models_of(result):
                state.lora.setdefault(model_name, {})[name] = path

        return await self._operate(
            "load_lora_adapter",
            self._lora_targets(model),
            "/load_lora_adapter",
            lora_load_body(name, path, pinned=pinned),
            timeout_s=timeout_s,
            check=check,
            remember=remember,
        )

    async def unload_lora_adapter(
        self, name: str, *, model: str | None = None, timeout_s: float | None = None, check: bool = True
    ) -> OperationResult:
        """``/unload_lora_adapter`` on the engines that serve LoRA."""

        def remember(state: RememberedState, result: OperationResult) -> None:
            for model_name in self._models_of(result):
                state.lora.get(model_name, {}).pop(name, None)

        return await self._operate(
            "unload_lora_adapter",
            self._lora_targets(model),
            "/unload_lora_adapter",
            lora_unload_body(name),
            timeout_s=timeout_s,
            check=check,
            remember=remember,
        )


def _record_memory(
    state: RememberedState, result: OperationResult, update: Callable[[set[str]], set[str]]
) -> None:
    """Memory released per engine, for the engines that took the call or were deferred."""
    for engine in [*(r.engine for r in result.replies if r.ok), *result.deferred]:
        state.released[engine] = update(state.released.get(engine, set()))


def _reply(
    member: EngineMember, started: float, status: int | None, body: Any, error: str | None
) -> EngineReply:
    return EngineReply(
        engine=member.id,
        url=member.url,
        ok=error is None,
        status=status,
        body=body,
        error=error,
        elapsed_s=time.monotonic() - started,
    )


def _task_reply(task: asyncio.Future[EngineReply], member: EngineMember, deadline: float) -> EngineReply:
    if task.done() and not task.cancelled():
        error = task.exception()
        if error is None:
            return task.result()
        return EngineReply(
            member.id, member.url, False, None, None, f"{type(error).__name__}: {error}", deadline
        )
    task.cancel()
    return EngineReply(member.id, member.url, False, None, None, f"no answer within {deadline:g} s", deadline)


# ------------------------------------------------------------------------------------------ synchronous
class _LoopThread:
    """An event loop on a thread of its own, which the synchronous handle runs its coroutines on (so that it
    works from any thread, also one that runs an event loop of its own). Once closed it runs nothing more:
    what was still running is cancelled (its caller gets ``refusal(...)`` raised), what comes later is refused."""

    def __init__(
        self,
        on_start: Callable[[asyncio.AbstractEventLoop], None],
        refusal: Callable[[str], Exception],
    ) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._on_start = on_start
        self._refusal = refusal
        self._closed = False

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:
                coro.close()
                raise self._refusal(f"before {coro.__name__} was sent")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._on_start(self._loop)
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="msp-control", daemon=True
                )
                self._thread.start()
            return asyncio.run_coroutine_threadsafe(self._guarded(coro), self._loop)

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        name = coro.__name__
        try:
            return await coro
        except asyncio.CancelledError:
            if self._closed:  # cancelled by close(): the caller learns why
                raise self._refusal(f"while {name} was in flight") from None
            raise

    def close(self, before: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Cancel what runs (bounded wait), then ``before()`` (e.g. close the shared client), then stop."""
        with self._lock:
            self._closed = True
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        if thread is threading.current_thread():  # from an operation of its own: it cannot wait for itself,
            loop.create_task(_wind_down_then_stop(before, loop))  # so the wind-down runs, then the loop stops
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_wind_down(before), loop).result(timeout=CLOSE_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=CLOSE_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[Any]]:
    current = asyncio.current_task(loop)
    pending = [task for task in asyncio.all_tasks(loop) if task is not current and not task.done()]
    for task in pending:
        task.cancel()
    return pending


async def _wind_down_then_stop(
    before: Callable[[], Coroutine[Any, Any, None]], loop: asyncio.AbstractEventLoop
) -> None:
    """:func:`_wind_down` on the loop itself (a close from one of its own operations), then stop the loop:
    the cancelled operations finish first, so that their callers learn why."""
    try:
        await _wind_down(before)
    finally:
        loop.stop()


async def _wind_down(before: Callable[[], Coroutine[Any, Any, None]]) -> None:
    pending = _cancel_all(asyncio.get_running_loop())
    if pending:
        await asyncio.wait(pending, timeout=CLOSE_TIMEOUT_S / 2)
    await before()


class _Background:
    """``control.background.<operation>(...)``: the operation started, a ``concurrent.futures.Future`` back."""

    def __init__(self, control: DeploymentControl) -> None:
        self._control = control

    def __getattr__(self, name: str) -> Callable[..., concurrent.futures.Future[Any]]:
        method = getattr(self._control.aio, name, None)
        if method is None or name.startswith("_") or not asyncio.iscoroutinefunction(method):
            raise AttributeError(f"no control operation {name!r}")

        def start(*args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
            return self._control._loop.submit(method(*args, **kwargs))

        return start


def _blocking(operation: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """The synchronous twin of a coroutine method of :class:`AsyncDeploymentControl` (same signature and
    documentation)."""

    @functools.wraps(operation)
    def run(self: DeploymentControl, *args: Any, **kwargs: Any) -> T:
        return self._loop.submit(getattr(self.aio, operation.__name__)(*args, **kwargs)).result()

    return run


def _same(method: Callable[..., T]) -> Callable[..., T]:
    """A plain method of :class:`AsyncDeploymentControl`, offered as is."""

    @functools.wraps(method)
    def call(self: DeploymentControl, *args: Any, **kwargs: Any) -> T:
        return getattr(self.aio, method.__name__)(*args, **kwargs)

    return call


class DeploymentControl:
    """The synchronous control handle (``deployment.control``): every operation of
    :class:`AsyncDeploymentControl` with the same arguments, blocking until its result (it runs on an event
    loop of its own, so it works from any thread). ``control.background.<operation>(...)`` starts one and
    returns a ``concurrent.futures.Future`` (for calls that complete only once the trainer has done its part,
    such as :meth:`init_weights_update_group` and :meth:`update_weights_from_distributed`)."""

    def __init__(self, aio: AsyncDeploymentControl) -> None:
        self.aio = aio
        self._loop = _LoopThread(on_start=self._use_loop, refusal=self._refusal)
        self.background = _Background(self)

    def _refusal(self, when: str) -> Exception:
        """Why an operation did not run: the deployment failed, or it was stopped (``when``: at what point)."""
        failure = self.aio._deployment.failure
        if failure is not None:
            return DeploymentFailedError(f"the deployment failed and was stopped {when}: {failure}")
        return DeploymentStoppedError(f"the deployment was stopped {when}: its engines are no longer driven")

    def _use_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self.aio.shared_loop = loop

    def close(self) -> None:
        """Stop its event loop (the deployment does, when it stops): the operations in flight raise
        :class:`DeploymentStoppedError` (:class:`DeploymentFailedError` if it failed), as later ones do."""
        self._loop.close(before=self.aio.close_shared_client)

    engines = _same(AsyncDeploymentControl.engines)
    weight_update_group = _same(AsyncDeploymentControl.weight_update_group)
    engines_outside_weight_group = _same(AsyncDeploymentControl.engines_outside_weight_group)
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
