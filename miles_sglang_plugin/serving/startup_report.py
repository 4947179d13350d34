"""What a failed start-up says: one message naming what failed and why, from what the fleet holds of it (the
exit of an engine or router with where it ran, its command, exit code and log tail; a process that could not be
started, with its command; the deadline, with what each engine and router was doing then; or the reconcile loop's
own words)."""

from __future__ import annotations

import time

from miles_sglang_plugin.backends.status_view import StatusView
from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.masking import mask_argv
from miles_sglang_plugin.serving.fleet import EngineRow, EngineState, Fleet, RouterRow, RouterState
from miles_sglang_plugin.serving.policy import STARTUP_HEALTH_ENDPOINT
from miles_sglang_plugin.serving.reconciler import StartupFailure

__all__ = ["startup_message"]


def startup_message(
    fleet: Fleet, settings: SGLangDeployConf, status: StatusView, failure: StartupFailure
) -> str:
    """Why start-up failed, as one message: an exit (its name, where it ran, command, exit code, log tail), a
    router's exit, the deadline (what each engine and router was doing), or what the reconcile loop said."""
    if failure.cause == "exited" and failure.engine is not None:
        return _engine_exit_message(fleet.engine(failure.engine), status) or failure.message
    if failure.cause == "spawn" and failure.engine is not None:
        return _spawn_message(fleet.engine(failure.engine), failure.message, status)
    if failure.cause == "router_exited" and failure.router is not None:
        router = fleet.router(failure.router)
        if router is not None:
            return _router_exit_message(router)
    if failure.cause == "timeout":
        return _timeout_message(fleet, settings)
    return failure.message


def _engine_exit_message(row: EngineRow, status: StatusView) -> str | None:
    for process in row.processes:
        code = process.exit_code()
        if code is not None:
            status.update(row.id, "failed")
            return _exited_message(
                f"engine {process.name}",
                process.where,
                code,
                time.monotonic() - process.started_at,
                process.launch.display_command(),
                process.log_location,
                process.tail(15),
                reason=process.exit_reason(),
            )
    return None


def _spawn_message(row: EngineRow, error: str, status: StatusView) -> str:
    """A process of ``row`` could not be started (the command does not exist, no room on its node): the
    processes started before it are in the row, so it is the next of its launches."""
    status.update(row.id, "failed")
    launch = row.launches[min(len(row.processes), len(row.launches) - 1)]
    return f"engine {launch.name} could not be started: {error}\n  command: {launch.display_command()}"


def _timeout_message(fleet: Fleet, settings: SGLangDeployConf) -> str:
    timeout_s = settings.launch.startup_timeout_s
    lines = [f"the deployment was not ready after {timeout_s:g} s (sglang_deploy.launch.startup_timeout_s):"]
    for row in fleet.engines():
        if row.state is EngineState.STARTING and row.external:
            lines.append(
                f"  external engine {row.id} never answered {STARTUP_HEALTH_ENDPOINT} at {row.url} within "
                "the start-up deadline (it runs elsewhere: is it up, reachable from here, and answering?)"
            )
        elif row.state is EngineState.STARTING and row.processes:
            process = row.processes[0]
            lines.append(
                f"  engine {row.id} never answered {STARTUP_HEALTH_ENDPOINT} at {row.url} "
                f"({process.where}, still running); last log lines of {process.log_location}:"
            )
            lines += [f"    | {line}" for line in process.tail(10).splitlines()]
        elif row.state is not EngineState.SERVING:
            lines.append(f"  engine {row.id} at {row.url}: {row.state.value}")
    for router in fleet.routers():
        if router.state is not RouterState.READY:
            lines.append(f"  router of {router.model} at {router.url}: {router.state.value}")
    return "\n".join(lines)


def _router_exit_message(router: RouterRow) -> str:
    process = router.process
    return _exited_message(
        f"router {process.name}",
        f"pid {process.pid} on this machine",
        process.exit_code() or 0,
        time.monotonic() - process.started_at,
        process.display_command or " ".join(mask_argv(list(process.argv))),
        str(process.log_path),
        process.tail(15),
    )


def _exited_message(
    what: str,
    where: str,
    code: int,
    elapsed_s: float,
    command: str,
    log: str,
    tail: str,
    reason: str | None = None,
) -> str:
    why = f": {reason}" if reason else ""
    lines = [
        f"{what} exited with code {code} during start-up (after {elapsed_s:.1f} s){why}",
        f"  where: {where}",
        f"  command: {command}",
        f"  last log lines of {log}:",
        *(f"    | {line}" for line in tail.splitlines()),
        *([] if tail.strip() else ["    (none: it wrote nothing there)"]),
    ]
    return "\n".join(lines)
