"""What a Hydra app calls: its composed config to a plan, to launch specs, to a running deployment.

Each call reads the config once at the edge (:mod:`miles_sglang_plugin.config.reading`) and hands plain values
to the later stages; the backend is picked by ``sglang_deploy.launch.backend`` and is otherwise opaque here.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from hydra.errors import CompactHydraException
from omegaconf import DictConfig

from miles_sglang_plugin.app import quiet_http
from miles_sglang_plugin.backends import get_backend
from miles_sglang_plugin.config.reading import read_config
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.rendering.prepared import PreparedDeployment, prepare_deployment
from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields
from miles_sglang_plugin.serving.deployment import Deployment

quiet_http.install()  # the launcher's health polls and registrations stay out of the app's log


class SweepJobConfigError(DeploymentConfigError, CompactHydraException):
    """A job's :class:`DeploymentConfigError` in a multirun: Hydra reports it at the end of the sweep as its
    message alone (a compact Hydra error), not as a chained traceback."""


def prepare_from_config(
    cfg: DictConfig, *, sglang_key: str | None = None, server_arg_fields: Collection[str] | None = None
) -> PreparedDeployment:
    """The one check of a composed config, shared by ``resolve_config``, ``miles-sglang plan`` and
    ``launch_from_config``: read it (unknown keys, helper groups, values), resolve it (override keys against
    the installed SGLang's fields, or ``server_arg_fields``), render every engine's command line and the
    deployment-wide settings (router policies, ports: the plain sequence from ``port_base``). Raises
    :class:`~miles_sglang_plugin.errors.DeploymentConfigError` listing every problem.

    ``sglang_key``: where the group is (default: where Hydra placed it, else ``sglang``); the trainer's inputs
    are found next to it, then outwards up to the root."""
    fields = server_arg_fields if server_arg_fields is not None else known_server_arg_fields().fields
    reading = read_config(cfg, sglang_key=sglang_key)
    plan = resolve_deployment(
        reading.spec,
        reading.trainer,
        server_arg_fields=fields,
        server_defaults=reading.settings.server_defaults,
    )
    return prepare_deployment(plan, reading.settings, server_arg_fields=fields)


def resolve_config(
    cfg: DictConfig, *, sglang_key: str | None = None, server_arg_fields: Collection[str] | None = None
) -> DeploymentPlan:
    """Compose-time config → frozen plan: the one call a Hydra app needs. It makes every check a launch makes
    before starting anything (:func:`prepare_from_config`). Raises
    :class:`~miles_sglang_plugin.errors.DeploymentConfigError` listing every problem."""
    return prepare_from_config(cfg, sglang_key=sglang_key, server_arg_fields=server_arg_fields).plan


def resolve_config_or_exit(
    cfg: DictConfig, *, sglang_key: str | None = None, server_arg_fields: Collection[str] | None = None
) -> DeploymentPlan:
    """:func:`resolve_config` for an app's entry point: a user error is printed (every problem, no traceback)
    and the process exits with status 2 before anything starts. In a multirun the error is raised instead (as
    a compact Hydra error: its message, no traceback), so that Hydra goes on with the other jobs and the sweep
    still ends with a non-zero status."""
    try:
        return resolve_config(cfg, sglang_key=sglang_key, server_arg_fields=server_arg_fields)
    except DeploymentConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if _in_multirun():
            raise SweepJobConfigError(exc.problems, source=exc.source) from None
        raise SystemExit(2) from None


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _default_log_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir) / "sglang_logs"
    return Path.cwd() / "sglang_logs" / time.strftime("%Y-%m-%d_%H-%M-%S")


@contextlib.contextmanager
def launch_from_config(
    cfg: DictConfig, *, log_dir: Path | None = None, sglang_key: str | None = None
) -> Iterator[Deployment]:
    """Resolve, render and start the deployment of ``cfg``; stop everything when the block ends.

    Every check (:func:`prepare_from_config`, then what the backend supports and the ports free on the
    machine) runs before the first process starts. Engine and router logs go to ``log_dir``, else
    ``sglang_deploy.launch.log_dir``, else ``sglang_logs/`` in the Hydra run directory."""
    fields = known_server_arg_fields().fields
    checked = prepare_from_config(cfg, sglang_key=sglang_key, server_arg_fields=fields)
    settings = checked.settings
    target = Path(log_dir or settings.launch.log_dir or _default_log_dir())
    backend = get_backend(settings.launch.backend)
    try:
        prepared = backend.prepare(checked.plan, settings, server_arg_fields=fields)
        deployment = Deployment(prepared, backend, log_dir=target)
    except BaseException:
        backend.close()
        raise
    with deployment:
        yield deployment
