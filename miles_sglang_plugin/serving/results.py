"""What a control operation gives back: one reply per engine, the engines it skipped or deferred, and the
weights update group it formed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_sglang_plugin.serving.errors import ControlError

__all__ = ["EngineReply", "OperationResult", "WeightUpdateGroup", "WeightUpdateRank"]


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
    #: ``time.monotonic()`` when the call went out (0.0: it was not sent).
    started_at: float = 0.0

    @property
    def ended_at(self) -> float:
        return self.started_at + self.elapsed_s


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
    #: Engines it concerns that are down or being brought back now: they get the operation's state from the
    #: ledger before they serve again (only when some engine accepted it; otherwise they are among the failed).
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
    def accepted(self) -> tuple[str, ...]:
        """The engines that took it, in deployment order."""
        return tuple(reply.engine for reply in self.replies if reply.ok)

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines it reached (or tried to), in deployment order."""
        return tuple(reply.engine for reply in self.replies)

    def overlapped(self) -> bool:
        """Every call was out at one moment (they went out in parallel, not one after the other)."""
        return bool(self.replies) and max(r.started_at for r in self.replies) < min(
            r.ended_at for r in self.replies
        )

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
