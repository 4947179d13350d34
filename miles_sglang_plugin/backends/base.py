"""The backend interface: where a plan's nodes run, and how engine processes are started and stopped there.

A backend does two things for the serving stage:

1. :meth:`Backend.prepare` places the plan's nodes on machines (their addresses), finds ports on each of them
   and renders every launch spec, so that nothing the serving stage starts can collide; every check the
   backend can make (what it supports, what the machines can give) runs here, before anything starts.
2. :meth:`Backend.start` runs one rendered engine process on its node and returns an :class:`EngineProcess`
   handle (alive or not, exit code, log tail); :meth:`Backend.stop` stops such processes, leaving nothing on
   any node; :meth:`Backend.close` gives back what :meth:`prepare` took (port claims, placement).
3. A process can be started again: :meth:`Backend.start` with the same launch after its process exited or was
   stopped runs it anew with the same argv, environment, GPUs and node (a restart), until :meth:`close`.

Everything above process level (routers, health, worker registration, the registry, the running-deployment
handle) is the serving stage's (:mod:`miles_sglang_plugin.serving.deployment`), the same for every backend.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch
from miles_sglang_plugin.rendering.ports import PortAssignment
from miles_sglang_plugin.rendering.prepared import PreparedDeployment

if TYPE_CHECKING:  # the child processes' module loads with a backend that starts them, not with the interface
    from miles_sglang_plugin.backends.processes import ExitWatcher


class LaunchError(RuntimeError):
    """The deployment did not come up; everything that was started has been stopped."""


class UnsupportedPlanError(LaunchError):
    """The plan needs something this backend cannot do (several nodes, engines wider than a node)."""


class EngineProcess(abc.ABC):
    """One engine process that a backend started, wherever it runs."""

    def __init__(self, launch: EngineProcessLaunch) -> None:
        self.launch = launch
        #: ``time.monotonic()`` when it was started.
        self.started_at = time.monotonic()

    @property
    def name(self) -> str:
        return self.launch.name

    @abc.abstractmethod
    def exit_code(self) -> int | None:
        """None while it runs."""

    @property
    def running(self) -> bool:
        return self.exit_code() is None

    def exit_reason(self) -> str | None:
        """Why it exited, where the exit code alone does not say (its node was lost, its host process died);
        None while it runs or when the code says it all."""
        return None

    @abc.abstractmethod
    def tail(self, lines: int = 20) -> str:
        """The last lines of its log (fetched from its node)."""

    @property
    @abc.abstractmethod
    def where(self) -> str:
        """Where it runs, for messages: ``pid 1234 on this machine``, ``pid 77 on node 10.0.0.2``."""

    @property
    @abc.abstractmethod
    def log_location(self) -> str:
        """Its log file, as a person would look for it."""


class Backend(abc.ABC):
    """Places a plan's nodes and runs engine processes on them (see the module docstring)."""

    #: The name ``sglang_deploy.launch.backend`` selects it by.
    name: ClassVar[str]

    @abc.abstractmethod
    def prepare(
        self,
        plan: DeploymentPlan,
        settings: SGLangDeployConf,
        *,
        server_arg_fields: Collection[str] | None = None,
        fixed_ports: PortAssignment | None = None,
    ) -> PreparedDeployment:
        """Addresses, ports and launch specs for ``plan`` on this backend's machines, every check included.
        ``fixed_ports``: the ports of the processes and routers of a running deployment that keep running through
        a change of it (``Deployment.apply``; a backend that cannot change a running deployment raises
        :class:`UnsupportedPlanError` for them). Raises :class:`~miles_sglang_plugin.errors.DeploymentConfigError`
        or :class:`UnsupportedPlanError`."""

    @abc.abstractmethod
    def check(self, prepared: PreparedDeployment) -> list[str]:
        """Raise :class:`UnsupportedPlanError` if this backend cannot run ``prepared``; else notes to show."""

    @abc.abstractmethod
    def start(self, launch: EngineProcessLaunch, *, log_path: Path) -> EngineProcess:
        """Start one engine process on its node (returns at once; readiness is the caller's to wait for).
        Callable again for the same launch once its earlier process has exited or was stopped: a restart with
        the same argv, environment, GPUs and node. Raises :class:`OSError` if it cannot be started here."""

    @abc.abstractmethod
    def stop(self, processes: Sequence[EngineProcess], *, grace_s: float) -> None:
        """Stop ``processes`` (SIGTERM, then SIGKILL after ``grace_s``), children included."""

    def watch_exit(self, process: EngineProcess, watcher: ExitWatcher, on_exit: Callable[[], None]) -> None:
        """Have ``watcher`` call ``on_exit()`` once ``process`` exits (a backend that can be told of exits
        watches them; by default the process is asked every :data:`~.processes.EXIT_POLL_S`)."""
        watcher.watch_polled(lambda: process.exit_code() is not None, on_exit)

    def cannot_restart(self, launch: EngineProcessLaunch) -> str | None:
        """Why ``launch`` cannot be started again where the plan put it (its node left the cluster), or None.
        Supervision fails the deployment at once on such a reason instead of retrying in vain."""
        return None

    def place_again(
        self, prepared: PreparedDeployment, engines: Collection[str]
    ) -> PreparedDeployment | None:
        """``engines`` cannot start where they were (:meth:`cannot_restart` said why: their node is gone): place
        them on free capacity and return ``prepared`` rendered with their new nodes, GPUs and ports (every other
        process and the routers as they are), or None where this backend has nowhere else (supervision then
        fails the deployment at once). Raises :class:`LaunchError` while there is no room for them (a failed
        restart: tried again after the backoff, while the restart budget lasts)."""
        return None

    def release(self, before: PreparedDeployment, after: PreparedDeployment) -> None:  # noqa: B027
        """A change of a running deployment (``Deployment.apply``) took it from ``before`` to ``after``, and
        every process of ``before`` that ``after`` lacks has stopped: give back what only those held (port
        claims, placement). Called once per change that ended; nothing by default."""

    def close(self) -> None:  # noqa: B027 - optional hook: nothing to give back by default
        """Give back what :meth:`prepare` took (port claims, placement); idempotent."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
