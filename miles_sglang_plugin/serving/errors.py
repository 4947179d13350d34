"""The errors of the serving stage: a deployment that failed or stopped, an operation some engines failed, a
start-up interrupted by a signal, a state change the fleet does not allow."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from miles_sglang_plugin.backends.base import LaunchError

__all__ = [
    "ApplyTimeoutError",
    "ControlError",
    "DeploymentFailedError",
    "DeploymentStoppedError",
    "IllegalTransitionError",
    "StartupInterrupted",
]


class DeploymentFailedError(LaunchError):
    """The deployment failed while serving (an engine or router could not be brought back, or
    ``supervision.max_restarts=0``): every engine and router it started has been stopped."""


class DeploymentStoppedError(LaunchError):
    """A control operation on a deployment that stopped (normally: not failed): one called once it stops, or one
    still in flight when it stopped (its engines were stopped under it)."""


class ApplyTimeoutError(LaunchError):
    """``apply`` stopped waiting before the change converged. The change goes on in the reconcile loop and is
    neither undone nor lost: ``deployment.plan`` is its plan, ``deployment.state()`` shows where each engine
    stands, and a later ``apply`` first waits for it to end, then starts from the fleet as it is."""


class StartupInterrupted(LaunchError):
    """SIGINT or SIGTERM arrived during start-up and the program's own handler for it returned (under Python's
    defaults it raises ``KeyboardInterrupt`` or ends the process instead); everything started was stopped."""


class IllegalTransitionError(RuntimeError):
    """A state change of an engine or router that its state machine does not allow (a bug, never user input)."""


class _Failure(Protocol):
    """What :class:`ControlError` reads of a failed reply (read-only: a reply is frozen)."""

    @property
    def engine(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def error(self) -> str | None: ...


class _FailedOperation(Protocol):
    """What :class:`ControlError` reads of an :class:`~miles_sglang_plugin.serving.results.OperationResult`."""

    @property
    def operation(self) -> str: ...
    @property
    def replies(self) -> Sequence[object]: ...
    @property
    def failed(self) -> Sequence[_Failure]: ...


class ControlError(RuntimeError):
    """An operation failed on some engines; ``result`` (its
    :class:`~miles_sglang_plugin.serving.results.OperationResult`) holds every reply, the message names each
    failure."""

    def __init__(self, result: _FailedOperation) -> None:
        self.result = result
        failures = "\n".join(f"  {r.engine} ({r.url}): {r.error}" for r in result.failed)
        super().__init__(
            f"{result.operation} failed on {len(result.failed)} of {len(result.replies)} engine(s):\n{failures}"
        )
