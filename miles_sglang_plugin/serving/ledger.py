"""The desired control state of a running deployment: for each engine, the state the trainer's operations
should have left it in (memory released per tag, generation paused and how, LoRA adapters, weights from
disk or through a weights update group, the weight version), next to the state it is known to have
accepted. Weights update groups (who joined, in which process generation) are kept here too.

The rules (see :meth:`Ledger.record`):

* Only what engines accepted is recorded. An operation no engine accepted changes nothing, for anyone: it is
  never replayed into an engine that comes back later.
* Once some engine accepted it, every engine it concerned should have it: those that were down or being
  brought back (deferred) get it by replay before they serve again, and an engine that was up but did not
  take it now disagrees with the ledger: it is reported and brought to the ledger by replay as well.
* A replay (:func:`replay_calls`) is the difference between what an engine has and what it should have, in
  an order that works on SGLang (memory back first, adapters and weights, the weight version, memory
  released again, generation paused or continued last). A fresh process has the state of its command line
  (:func:`initial_state`); an external engine that comes back keeps what it had accepted.
* Weights that came through a weights update group cannot be replayed: an engine that lacks them waits,
  out of its router, until the trainer forms the group again with it and sends it weights.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "CHECKPOINT",
    "ControlState",
    "Effect",
    "Ledger",
    "Record",
    "ReplayCall",
    "Weights",
    "initial_state",
    "replay_calls",
]

#: SGLang's memory tags (``/release_memory_occupation``).
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass(frozen=True)
class Weights:
    """Where an engine's weights come from: its checkpoint, an ``update_weights_from_disk`` (``disk``: the
    request body), or the ``token``-th accepted bucket of an ``update_weights_from_distributed``."""

    source: str = "checkpoint"
    disk: str | None = None  # the body as canonical JSON (hashable)
    token: int = 0

    @property
    def disk_body(self) -> dict[str, Any] | None:
        return None if self.disk is None else json.loads(self.disk)

    @staticmethod
    def from_disk(body: Mapping[str, Any]) -> Weights:
        return Weights("disk", json.dumps(dict(body), sort_keys=True))


CHECKPOINT = Weights()


@dataclass(frozen=True)
class ControlState:
    """What one engine holds of the trainer's control operations."""

    released: frozenset[str] = frozenset()
    paused: str | None = None
    #: LoRA adapters as (name, path, pinned), sorted.
    lora: tuple[tuple[str, str, bool], ...] = ()
    weights: Weights = CHECKPOINT
    weight_version: str | None = None

    def with_lora(self, name: str, path: str, pinned: bool) -> ControlState:
        kept = [entry for entry in self.lora if entry[0] != name]
        return replace(self, lora=tuple(sorted([*kept, (name, path, pinned)])))

    def without_lora(self, name: str) -> ControlState:
        return replace(self, lora=tuple(entry for entry in self.lora if entry[0] != name))

    def lora_names(self) -> tuple[str, ...]:
        return tuple(entry[0] for entry in self.lora)


#: A control operation's effect on an engine's state.
Effect = Callable[[ControlState], ControlState]


def _replaced(**changes: Any) -> Effect:
    """The effect that sets ``changes`` (values bound now, not when it runs)."""

    def effect(state: ControlState) -> ControlState:
        return replace(state, **changes)

    return effect


def initial_state(
    lora_at_start: Iterable[tuple[str, str]] = (), weight_version: str | None = None
) -> ControlState:
    """The state of a freshly started engine process: its command line's adapters and weight version, its
    checkpoint, nothing released or paused."""
    return ControlState(
        lora=tuple(sorted((name, path, False) for name, path in lora_at_start)), weight_version=weight_version
    )


@dataclass(frozen=True)
class ReplayCall:
    """One call of a replay, and what the engine has once it accepted it."""

    route: str
    body: Mapping[str, Any]
    effect: Effect = field(compare=False)

    def describe(self) -> str:
        return f"{self.route} {json.dumps(dict(self.body), sort_keys=True)}"


def _memory(route: str, tags: Iterable[str], released: bool) -> ReplayCall:
    tags = sorted(tags)

    def effect(state: ControlState) -> ControlState:
        now = state.released | set(tags) if released else state.released - set(tags)
        return replace(state, released=frozenset(now))

    return ReplayCall(route, {"tags": tags}, effect)


def _lora_calls(has: ControlState, should: ControlState) -> list[ReplayCall]:
    calls = []
    wanted = {entry[0]: entry for entry in should.lora}
    for name, path, pinned in has.lora:
        if wanted.get(name) != (name, path, pinned):
            calls.append(
                ReplayCall(
                    "/unload_lora_adapter",
                    {"lora_name": name},
                    functools.partial(ControlState.without_lora, name=name),
                )
            )
    held = set(has.lora)
    for name, path, pinned in should.lora:
        if (name, path, pinned) not in held:
            calls.append(
                ReplayCall(
                    "/load_lora_adapter",
                    {"lora_name": name, "lora_path": path, "pinned": pinned},
                    functools.partial(ControlState.with_lora, name=name, path=path, pinned=pinned),
                )
            )
    return calls


def _weight_calls(has: ControlState, should: ControlState) -> list[ReplayCall]:
    calls = []
    if should.weights.source == "disk" and has.weights != should.weights:
        body = {**(should.weights.disk_body or {}), "abort_all_requests": False}
        version = body.get("weight_version")

        def effect(s: ControlState, w: Weights = should.weights, v: Any = version) -> ControlState:
            return replace(s, weights=w, weight_version=str(v) if v is not None else s.weight_version)

        calls.append(ReplayCall("/update_weights_from_disk", body, effect))
        has = effect(has)
    if should.weight_version is not None and has.weight_version != should.weight_version:
        version = should.weight_version
        calls.append(
            ReplayCall(
                "/update_weight_version",
                {"new_version": version, "abort_all_requests": False},
                _replaced(weight_version=version),
            )
        )
    return calls


def _pause_calls(has: ControlState, should: ControlState) -> list[ReplayCall]:
    if has.paused == should.paused:
        return []
    if should.paused is None:
        return [ReplayCall("/continue_generation", {}, _replaced(paused=None))]
    mode = should.paused
    return [ReplayCall("/pause_generation", {"mode": mode}, _replaced(paused=mode))]


def replay_calls(has: ControlState, should: ControlState) -> list[ReplayCall]:
    """The calls that take an engine from ``has`` to ``should`` (see the module docstring for the order; an
    engine whose weights are released gets them back for a weight update, and released again after it).
    Weights that only a weights update group can give are not among them (:func:`needs_weights`)."""
    weights = _weight_calls(has, should)
    loads_weights = any(call.route == "/update_weights_from_disk" for call in weights)
    resume = has.released - should.released
    if loads_weights and "weights" in has.released:
        resume = resume | {"weights"}
    calls: list[ReplayCall] = []
    if resume:
        calls.append(_memory("/resume_memory_occupation", resume, released=False))
    calls += _lora_calls(has, should)
    calls += weights
    release = should.released - (has.released - resume)
    if release:
        calls.append(_memory("/release_memory_occupation", release, released=True))
    calls += _pause_calls(has, should)
    return calls


def needs_weights(has: ControlState, should: ControlState) -> bool:
    """The engine lacks weights that came through a weights update group (they cannot be replayed)."""
    return should.weights.source == "distributed" and has.weights != should.weights


@dataclass(frozen=True)
class Record:
    """What recording an operation did."""

    #: Some engine accepted it, so the ledger changed.
    recorded: bool
    #: Engines that were up, were sent it and did not take it while others did: they disagree now.
    diverged: tuple[str, ...] = ()
    #: Engines that get it by replay (down, being brought back, or restarted while it was out).
    deferred: tuple[str, ...] = ()


def _locked(method: Callable[Concatenate[Ledger, P], R]) -> Callable[Concatenate[Ledger, P], R]:
    @functools.wraps(method)
    def run(self: Ledger, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return method(self, *args, **kwargs)

    return run


class Ledger:
    """Desired and accepted control state per engine, and the weights update groups (see the module
    docstring). Changed on the deployment's serving loop only."""

    def __init__(self, initial: Mapping[str, ControlState]) -> None:
        self._initial = dict(initial)
        self._desired: dict[str, ControlState] = dict(initial)
        self._has: dict[str, ControlState] = dict(initial)
        #: group name -> engine id -> the engine's generation (restarts) when it joined.
        self._groups: dict[str, dict[str, int]] = {}
        #: Accepted buckets of update_weights_from_distributed so far (their tokens).
        self._buckets = 0
        #: Bumped by every change.
        self.version = 0
        #: Held by every method: the ledger changes on the serving loop, views are read from any thread.
        self.lock = threading.RLock()

    # -------------------------------------------------------------------------------------------- views
    @_locked
    def desired(self, engine: str) -> ControlState:
        return self._desired[engine]

    @_locked
    def has(self, engine: str) -> ControlState:
        return self._has[engine]

    @_locked
    def replay(self, engine: str) -> list[ReplayCall]:
        return replay_calls(self._has[engine], self._desired[engine])

    @_locked
    def needs_weights(self, engine: str) -> bool:
        return needs_weights(self._has[engine], self._desired[engine])

    @_locked
    def groups(self) -> Mapping[str, Mapping[str, int]]:
        return MappingProxyType({name: MappingProxyType(dict(m)) for name, m in self._groups.items()})

    @_locked
    def group(self, name: str) -> Mapping[str, int]:
        return MappingProxyType(dict(self._groups.get(name, {})))

    # -------------------------------------------------------------------------------------------- changes
    @_locked
    def reset(self, engine: str) -> None:
        """A fresh process of ``engine`` started: it has its command line's state (what it should have is
        unchanged); it is in no weights update group."""
        self._has[engine] = self._initial[engine]
        for members in self._groups.values():
            members.pop(engine, None)
        self.version += 1

    @_locked
    def add_engine(self, engine: str, initial: ControlState, desired: ControlState) -> None:
        """An engine added by a change of the deployment: its command line's state, and what it should have."""
        self._initial[engine] = self._has[engine] = initial
        self._desired[engine] = desired
        self.version += 1

    @_locked
    def drop_engine(self, engine: str) -> None:
        """An engine removed by a change of the deployment."""
        for book in (self._initial, self._has, self._desired):
            book.pop(engine, None)
        for members in self._groups.values():
            members.pop(engine, None)
        self.version += 1

    @_locked
    def accepted(self, engine: str, effect: Effect) -> None:
        """``engine`` accepted one call of a replay."""
        self._has[engine] = effect(self._has[engine])
        self.version += 1

    @_locked
    def distributed_effect(self, weight_version: str | None) -> Effect:
        """The effect of the next accepted ``update_weights_from_distributed`` bucket (one token for all the
        engines that take the same bucket)."""
        self._buckets += 1
        token = self._buckets

        def effect(state: ControlState) -> ControlState:
            version = weight_version if weight_version is not None else state.weight_version
            return replace(state, weights=Weights("distributed", token=token), weight_version=version)

        return effect

    def record(
        self,
        effect: Effect,
        *,
        sent: Mapping[str, int],
        accepted: Iterable[str],
        deferred: Iterable[str],
        generations: Mapping[str, int],
    ) -> Record:
        """Record one operation: ``sent`` (engine -> its generation when the call went out), the engines
        among them that ``accepted`` it, the engines it ``deferred`` (not sent: down or being brought back),
        and every engine's generation now. An accepted answer from a process replaced since is its old
        process's: that engine counts as deferred."""
        replaced = {e for e, generation in sent.items() if generations[e] != generation}
        took = [e for e in accepted if e in sent and e not in replaced]
        later = [*dict.fromkeys([*deferred, *sorted(replaced)])]
        if not took:
            return Record(recorded=False, deferred=tuple(later))
        refused = [e for e in sent if e not in replaced and e not in set(took) and e not in set(later)]
        for engine in took:
            self._has[engine] = effect(self._has[engine])
        for engine in [*took, *later, *refused]:
            if engine in self._desired:  # not one a change of the deployment removed meanwhile
                self._desired[engine] = effect(self._desired[engine])
        self.version += 1
        return Record(recorded=True, diverged=tuple(refused), deferred=tuple(later))

    @_locked
    def extend(self, effect: Effect, engines: Iterable[str]) -> None:
        """An operation some engine accepted (recorded before) concerns ``engines`` too, which were down when
        it was sent to them: they should have it (they get it by replay)."""
        for engine in engines:
            if engine in self._desired:
                self._desired[engine] = effect(self._desired[engine])
        self.version += 1

    @_locked
    def join_group(self, name: str, members: Mapping[str, int]) -> None:
        """Engines (id -> generation) accepted ``/init_weights_update_group`` of group ``name``: the group as
        formed now (an earlier forming of the same name is replaced)."""
        self._groups[name] = dict(members)
        self.version += 1

    @_locked
    def leave_group(self, name: str, engines: Sequence[str]) -> None:
        members = self._groups.get(name)
        if members is None:
            return
        for engine in engines:
            members.pop(engine, None)
        if not members:
            del self._groups[name]
        self.version += 1
