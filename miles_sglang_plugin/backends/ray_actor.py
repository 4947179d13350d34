"""The small Ray actor under each engine process: it holds that process's GPUs on its node and runs the engine
command there as a child process (the :class:`~miles_sglang_plugin.backends.processes.ManagedProcess` of the
local backend: own process group, log file, ``PR_SET_PDEATHSIG``, so the engine dies with the actor).

The ray backend creates one per engine process (``ray.remote(EngineHost)``, an async actor: its methods run on
one event-loop thread that lives as long as the actor, which is the thread the parent-death signal is tied
to; calls may start in any order, so each names the run of the process it is about) and keeps it until the deployment is closed, so that a restart runs the same command on the same GPUs.
The first actor of each node also finds and claims the ports of the engine processes on that node.

This module does not import Ray at the top: it is imported on the driver to define the actor, and by Ray on
the nodes to run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_sglang_plugin.backends.processes import ManagedProcess, stop_processes
from miles_sglang_plugin.rendering.ports import PortClaims, default_lock_dir, free_port_runs

#: Exit code reported for an engine command that could not be started (as a shell reports it).
EXIT_NOT_STARTED = 127
#: How often the actor looks at its process while waiting for it to exit.
POLL_S = 0.1


class EngineHost:
    """Holds one engine process's GPUs on its node and runs the engine there (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.process: ManagedProcess | None = None
        self.start_error: str | None = None
        self.log_path: Path | None = None
        self.runs = 0
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
        self, host: str, runs: Sequence[Sequence[int]], port_base: int, port_max: int
    ) -> list[list[int]]:
        """Free ports on this node for the engine processes here (see ``free_port_runs``), claimed by this
        actor until :meth:`release_ports` or its death."""
        if self.claims is None:
            self.claims = PortClaims(default_lock_dir())
        return free_port_runs(host, runs, port_base=port_base, port_max=port_max, claims=self.claims)

    async def release_ports(self) -> None:
        if self.claims is not None:
            self.claims.release()

    async def spawn(
        self, run: int, argv: Sequence[str], env: Mapping[str, str], log_path: str, display_command: str
    ) -> dict[str, Any]:
        """Start run number ``run`` of the engine process. Returns its pid, or the reason it could not be
        started."""
        if self.process is not None and self.process.running:
            raise RuntimeError(f"{self.name} is still running (pid {self.process.pid}); stop it first")
        self.runs = run
        self.start_error = None
        self.log_path = Path(log_path)
        self.process = ManagedProcess(
            name=self.name,
            argv=list(argv),
            env=dict(env),
            log_path=self.log_path,
            display_command=display_command,
        )
        try:
            self.process.start()
        except OSError as exc:
            self.start_error = f"could not be started on this node: {exc}"
            with contextlib.suppress(OSError):
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with self.log_path.open("a") as log:
                    log.write(f"[{self.name}] {self.start_error}\n")
            return {"pid": None, "run": self.runs, "error": self.start_error}
        return {"pid": self.process.pid, "run": self.runs, "error": None}

    async def wait_exit(self, run: int) -> dict[str, Any]:
        """Returns when run number ``run`` of the process has exited: its exit code (and a reason when it
        never started). Ray does not promise that an async actor starts calls in the order they were made:
        this call may come before the ``spawn`` of its run, and then waits for it."""
        while True:
            if self.runs < run:
                await asyncio.sleep(POLL_S)
                continue
            if self.runs > run or self.process is None:
                return {"code": None, "reason": "superseded by a later start"}
            if self.start_error is not None:
                return {"code": EXIT_NOT_STARTED, "reason": self.start_error}
            code = self.process.exit_code()
            if code is not None:
                return {"code": code, "reason": None}
            await asyncio.sleep(POLL_S)

    async def status(self) -> dict[str, Any]:
        p = self.process
        return {
            "pid": p.pid if p else None,
            "code": p.exit_code() if p else None,
            "run": self.runs,
            "error": self.start_error,
        }

    async def tail(self, lines: int = 20) -> str:
        return self.process.tail(lines) if self.process is not None else ""

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the engine's process group, SIGKILL after ``grace_s``; its exit code."""
        if self.process is None or self.process.popen is None:
            return None
        codes = await asyncio.to_thread(stop_processes, [self.process], grace_s)
        return codes.get(self.name)


def gpu_probe() -> dict[str, Any]:
    """A task run in one bundle of a trainer's placement group: the node and the GPU id Ray gives that bundle."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "address": ray.util.get_node_ip_address(),
        "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
    }


__all__ = ["EXIT_NOT_STARTED", "EngineHost", "gpu_probe"]
