"""The Ray actor that starts and watches engine processes on its node: it holds their GPUs there and runs each
engine command as a child process (the :class:`~miles_sglang_plugin.backends.processes.ManagedProcess` of
the local backend: own process group, log file, parent-death signal, so the engines die with the actor).

The ray backend creates one per plan node, for all engine processes of that node
(``sglang_deploy.launch.ray.engine_actors=per_node``), or one per engine process (``per_process``), as an async
actor (``ray.remote(EngineHost)``): its methods run on one event-loop thread that lives as long as the actor,
which is the thread the parent-death signal is tied to. Calls may start in any order, so each names the
process (by its launch name) and the run of it that it is about. The backend keeps the actor until the
deployment is closed, so that a restart runs the same command on the same GPUs. Each actor also finds and
claims the ports of its engine processes on its node (the claims end with the actor).

This module does not import Ray at the top: it is imported on the driver to define the actor, and by Ray on
the nodes to run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_sglang_plugin.backends.processes import ManagedProcess, stop_processes
from miles_sglang_plugin.rendering.ports import PortClaims, default_lock_dir, free_port_runs

#: Exit code reported for an engine command that could not be started (as a shell reports it).
EXIT_NOT_STARTED = 127
#: How often the actor looks at a process while waiting for it to exit.
POLL_S = 0.1


@dataclass
class _Run:
    """The latest run of one engine process."""

    number: int = 0
    process: ManagedProcess | None = None
    start_error: str | None = None


class EngineHost:
    """Starts and watches engine processes on its node, holding their GPUs (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.runs: dict[str, _Run] = {}
        self.claims: PortClaims | None = None

    async def where(self) -> dict[str, Any]:
        """This actor's node (id, address), the GPU ids Ray assigned to it, its pid."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "pid": os.getpid(),
        }

    async def find_ports(
        self,
        host: str,
        runs: Sequence[Sequence[int]],
        port_base: int,
        port_max: int,
        reserved: Sequence[int] = (),
    ) -> list[list[int]]:
        """Free ports on this node for the engine processes here (see ``free_port_runs``), claimed by this
        actor until :meth:`drop_ports`, :meth:`release_ports` or its death. ``reserved``: ports of processes
        that run on this node already (a change of a running deployment keeps them), never handed out, even
        where no claim holds them any more (they are claimed for the search and let go after it)."""
        if self.claims is None:
            self.claims = PortClaims(default_lock_dir())
        held_for_search = PortClaims(default_lock_dir())
        try:
            for port in reserved:
                if port not in self.claims.fds:
                    held_for_search.try_claim(port)  # taken elsewhere already: skipped by the search anyway
            return free_port_runs(host, runs, port_base=port_base, port_max=port_max, claims=self.claims)
        finally:
            held_for_search.release()

    async def drop_ports(self, ports: Sequence[int]) -> list[int]:
        """Give back this actor's claims of ``ports`` (those of processes a change removed); the ports it held."""
        if self.claims is None:
            return []
        held = [port for port in ports if port in self.claims.fds]
        for port in held:
            self.claims.drop(port, unlock=True)
        return held

    async def release_ports(self) -> None:
        if self.claims is not None:
            self.claims.release()

    async def spawn(
        self,
        name: str,
        run: int,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: str,
        display_command: str,
    ) -> dict[str, Any]:
        """Start run number ``run`` of engine process ``name``. Returns its pid, or the reason it could not be
        started."""
        latest = self.runs.get(name)
        if latest is not None and latest.process is not None and latest.process.running:
            raise RuntimeError(f"{name} is still running (pid {latest.process.pid}); stop it first")
        path = Path(log_path)
        process = ManagedProcess(
            name=name, argv=list(argv), env=dict(env), log_path=path, display_command=display_command
        )
        self.runs[name] = latest = _Run(run, process)
        try:
            process.start()
        except OSError as exc:
            latest.start_error = f"could not be started on this node: {exc}"
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as log:
                    log.write(f"[{name}] {latest.start_error}\n")
            return {"pid": None, "run": run, "error": latest.start_error}
        return {"pid": process.pid, "run": run, "error": None}

    async def wait_exit(self, name: str, run: int) -> dict[str, Any]:
        """Returns when run number ``run`` of process ``name`` has exited: its exit code (and a reason when it
        never started). Ray does not promise that an async actor starts calls in the order they were made:
        this call may come before the ``spawn`` of its run, and then waits for it."""
        while True:
            latest = self.runs.get(name)
            if latest is None or latest.number < run:
                await asyncio.sleep(POLL_S)
                continue
            if latest.number > run or latest.process is None:
                return {"code": None, "reason": "superseded by a later start"}
            if latest.start_error is not None:
                return {"code": EXIT_NOT_STARTED, "reason": latest.start_error}
            code = latest.process.exit_code()
            if code is not None:
                return {"code": code, "reason": None}
            await asyncio.sleep(POLL_S)

    async def status(self) -> dict[str, Any]:
        """Every process's pid, exit code and run (an answer at all says the actor lives)."""
        return {
            name: {
                "pid": r.process.pid if r.process else None,
                "code": r.process.exit_code() if r.process else None,
                "run": r.number,
                "error": r.start_error,
            }
            for name, r in self.runs.items()
        }

    async def tail(self, name: str, lines: int = 20) -> str:
        latest = self.runs.get(name)
        return latest.process.tail(lines) if latest is not None and latest.process is not None else ""

    async def stop(self, names: Sequence[str], grace_s: float) -> dict[str, int | None]:
        """SIGTERM to the process groups of ``names`` (together), SIGKILL after ``grace_s``; their exit codes."""
        processes = [
            r.process
            for name in names
            if (r := self.runs.get(name)) is not None
            and r.process is not None
            and r.process.popen is not None
        ]
        if not processes:
            return {}
        return await asyncio.to_thread(stop_processes, processes, grace_s)


def gpu_probe() -> dict[str, Any]:
    """A task run in one bundle of a trainer's placement group: the node and the GPU id Ray gives that bundle."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "address": ray.util.get_node_ip_address(),
        "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
    }


__all__ = ["EXIT_NOT_STARTED", "EngineHost", "gpu_probe"]
