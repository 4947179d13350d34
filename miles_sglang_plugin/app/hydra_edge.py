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

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from miles_sglang_plugin.backends import get_backend
from miles_sglang_plugin.config.reading import (
    deploy_settings_from_config,
    spec_from_config,
    trainer_from_config,
)
from miles_sglang_plugin.errors import DeploymentConfigError, ProblemCollector, first_line
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.rendering.prepared import PreparedDeployment, prepare_deployment
from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields
from miles_sglang_plugin.serving.deployment import Deployment


def resolve_config(cfg: DictConfig, *, server_arg_fields: Collection[str] | None = None) -> DeploymentPlan:
    """Compose-time config → frozen plan: the one call a Hydra app needs. Raises
    :class:`~miles_sglang_plugin.errors.DeploymentConfigError` listing every problem."""
    problems = ProblemCollector("the Hydra config")
    try:
        trainer = trainer_from_config(cfg)
        server_defaults = deploy_settings_from_config(cfg).server_defaults
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        problems.add("", f"the trainer's arguments or sglang_deploy do not read: {first_line(exc)}")
        problems.raise_if_any()
    spec = spec_from_config(cfg, problems)
    problems.raise_if_any()
    return resolve_deployment(
        spec, trainer, server_arg_fields=server_arg_fields, server_defaults=server_defaults
    )


def prepare_from_config(cfg: DictConfig) -> PreparedDeployment:
    """Resolve and render ``cfg`` as ``miles-sglang plan`` shows it: every check on (override keys against the
    installed SGLang's fields, the deployment-wide settings), ports the plain sequence from ``port_base``."""
    fields = known_server_arg_fields().fields
    plan = resolve_config(cfg, server_arg_fields=fields)
    return prepare_deployment(plan, deploy_settings_from_config(cfg), server_arg_fields=fields)


def resolve_config_or_exit(
    cfg: DictConfig, *, server_arg_fields: Collection[str] | None = None
) -> DeploymentPlan:
    """:func:`resolve_config` for an app's entry point: a user error is printed (every problem, no traceback)
    and the process exits with status 2 before anything starts. In a multirun the error is re-raised instead,
    so that Hydra goes on with the other jobs and the sweep still ends with a non-zero status."""
    try:
        return resolve_config(cfg, server_arg_fields=server_arg_fields)
    except DeploymentConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if _in_multirun():
            raise
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
def launch_from_config(cfg: DictConfig, *, log_dir: Path | None = None) -> Iterator[Deployment]:
    """Resolve, render and start the deployment of ``cfg``; stop everything when the block ends.

    Every check (deployment, overrides against the installed SGLang's fields, deployment-wide settings, what
    the backend supports) runs before the first process starts. Engine and router logs go to
    ``sglang_deploy.launch.log_dir``, else ``sglang_logs/`` in the Hydra run directory."""
    fields = known_server_arg_fields().fields
    plan = resolve_config(cfg, server_arg_fields=fields)
    settings = deploy_settings_from_config(cfg)
    target = Path(log_dir or settings.launch.log_dir or _default_log_dir())
    backend = get_backend(settings.launch.backend)
    try:
        prepared = backend.prepare(plan, settings, server_arg_fields=fields)
        deployment = Deployment(prepared, backend, log_dir=target)
    except BaseException:
        backend.close()
        raise
    with deployment:
        yield deployment
