"""The local backend: every engine process a subprocess of this machine, pinned with ``CUDA_VISIBLE_DEVICES``.

Each process runs in its own process group with a log file and ``PR_SET_PDEATHSIG``
(:class:`~miles_sglang_plugin.backends.processes.ManagedProcess`); ports are probed on this machine and
claimed against concurrent launches (:mod:`miles_sglang_plugin.rendering.ports`) for as long as the backend
is open.

GPUs: an inherited ``CUDA_VISIBLE_DEVICES`` (a scheduler's, a sweep job's slice) is honoured: the plan's local
GPU ids are positions in it, and a plan needing more GPUs than it lists is refused before anything starts, as
is a list that does not name distinct GPUs (``0,0``, an empty entry, ``-1``, indices mixed with UUIDs; see
:mod:`miles_sglang_plugin.backends.visible_gpus`).

It runs on one machine: it refuses engines wider than a node and plans spread over several nodes, except with
the stand-in engines, whose planned nodes run side by side here (ports kept apart), so that multi-node plans
can be exercised without a cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from miles_sglang_plugin.backends.base import Backend, EngineProcess, UnsupportedPlanError
from miles_sglang_plugin.backends.processes import ExitWatcher, ManagedProcess, stop_processes
from miles_sglang_plugin.backends.visible_gpus import (
    checked_visible_devices,
    inherited_visible_devices,
    restrict_to_visible,
)
from miles_sglang_plugin.config.schema import EngineKind, SGLangDeployConf
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch
from miles_sglang_plugin.rendering.ports import PortAssignment, PortClaims, default_lock_dir, ports_held
from miles_sglang_plugin.rendering.prepared import PreparedDeployment, prepare_deployment


class LocalEngineProcess(EngineProcess):
    """An engine process started here: a :class:`ManagedProcess`."""

    def __init__(self, launch: EngineProcessLaunch, process: ManagedProcess) -> None:
        super().__init__(launch)
        self.process = process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def argv(self) -> Sequence[str]:
        return self.process.argv

    def exit_code(self) -> int | None:
        return self.process.exit_code()

    def tail(self, lines: int = 20) -> str:
        return self.process.tail(lines)

    @property
    def where(self) -> str:
        return f"pid {self.pid} on this machine"

    @property
    def log_location(self) -> str:
        return str(self.process.log_path)


class LocalBackend(Backend):
    """Engines as subprocesses of this machine.

    ``claims``: port claims to use (and release at :meth:`close`); by default the backend takes its own in the
    user's lock directory when it prepares a deployment. ``visible_devices``: the GPUs it may use (the plan's
    local ids index into them); by default the ``CUDA_VISIBLE_DEVICES`` this process inherited, else all. Either
    list must name distinct GPUs (:class:`DeploymentConfigError` otherwise, before anything starts)."""

    name = "local"

    def __init__(
        self, claims: PortClaims | None = None, visible_devices: Sequence[str] | None = None
    ) -> None:
        self.claims = claims
        self.visible_devices = (
            checked_visible_devices(
                [str(gpu).strip() for gpu in visible_devices],
                "visible_devices",
                "the GPUs given to the local backend",
            )
            if visible_devices is not None
            else None
        )

    def prepare(
        self,
        plan: DeploymentPlan,
        settings: SGLangDeployConf,
        *,
        server_arg_fields: Collection[str] | None = None,
        fixed_ports: PortAssignment | None = None,
    ) -> PreparedDeployment:
        visible = self.visible_devices if self.visible_devices is not None else inherited_visible_devices()
        if self.claims is None:
            self.claims = PortClaims(default_lock_dir())
        prepared = prepare_deployment(
            plan,
            settings,
            server_arg_fields=server_arg_fields,
            probe=True,
            claims=self.claims,
            fixed_ports=fixed_ports,
        )
        try:
            self.check(prepared)
        except UnsupportedPlanError:
            if (
                fixed_ports is not None and prepared.ports is not None
            ):  # a change refused: its new claims back
                for port in sorted(ports_held(prepared.ports, plan) - ports_held(fixed_ports, plan)):
                    self.claims.drop(port, unlock=True)
            raise
        return restrict_to_visible(prepared, visible) if visible is not None else prepared

    def check(self, prepared: PreparedDeployment) -> list[str]:
        plan = prepared.plan
        wide = [e.id for e in plan.engines if e.nnodes > 1]
        if len(plan.nodes) <= 1 and not wide:
            return []
        what = []
        if len(plan.nodes) > 1:
            what.append(
                f"the plan places engines on {len(plan.nodes)} nodes ({', '.join(map(str, plan.nodes))})"
            )
        if wide:
            what.append(f"engine(s) {', '.join(wide[:4])}{'…' if len(wide) > 4 else ''} span several nodes")
        text = " and ".join(what)
        if prepared.launch.engine_kind is not EngineKind.simulated:
            raise UnsupportedPlanError(
                f"the local launcher runs on one machine, but {text}. Use a multi-node backend, or shrink the "
                "deployment to one node (colocate=true or debug_rollout_only=true puts rollout GPUs at slot 0)"
            )
        return [f"stand-in engines: {text}; they run side by side on this machine"]

    def start(self, launch: EngineProcessLaunch, *, log_path: Path) -> LocalEngineProcess:
        process = ManagedProcess(
            name=launch.name,
            argv=launch.argv,
            env=launch.env,
            log_path=log_path,
            display_command=launch.display_command(),
        )
        handle = LocalEngineProcess(launch, process)
        process.start()
        return handle

    def watch_exit(self, process: EngineProcess, watcher: ExitWatcher, on_exit: Callable[[], None]) -> None:
        if isinstance(process, LocalEngineProcess):
            watcher.watch(process.process, on_exit)  # a pidfd: the exit is told at once
        else:
            super().watch_exit(process, watcher, on_exit)

    def stop(self, processes: Sequence[EngineProcess], *, grace_s: float) -> None:
        stop_processes([p.process for p in processes if isinstance(p, LocalEngineProcess)], grace_s=grace_s)

    def release(self, before: PreparedDeployment, after: PreparedDeployment) -> None:
        """Give back the claims of every port ``before`` held that ``after`` does not (the whole runs of the
        engines a change removed, and the routers of the models it removed)."""
        if self.claims is None or before.ports is None:
            return
        kept = ports_held(after.ports, after.plan) if after.ports is not None else set()
        for port in sorted(ports_held(before.ports, before.plan) - kept):
            self.claims.drop(port, unlock=True)

    def close(self) -> None:
        if self.claims is not None:
            self.claims.release()
