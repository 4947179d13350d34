"""What a Hydra app calls: its composed config to a plan, to launch specs, to a running deployment.

Each call reads the config once at the edge (:mod:`miles_sglang_plugin.config.reading`) and hands plain values
to the later stages; the backend is picked by ``sglang_deploy.launch.backend`` and is otherwise opaque here.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from miles_sglang_plugin.backends import Backend, get_backend
from miles_sglang_plugin.config.reading import (
    deploy_settings_from_config,
    spec_from_config,
    trainer_from_config,
)
from miles_sglang_plugin.config.schema import BackendKind, EngineKind, SGLangDeployConf
from miles_sglang_plugin.errors import DeploymentConfigError, Problem, ProblemCollector, first_line
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
    installed SGLang's fields, the deployment-wide settings), ports the plain sequence from ``port_base``
    (per node). Where the addresses are only known at launch (the ray backend, or real engines on several
    nodes), they are shown as ``<node N address>`` and ``<driver address>`` (:data:`NODE_ADDRESS`)."""
    fields = known_server_arg_fields().fields
    plan = resolve_config(cfg, server_arg_fields=fields)
    settings = deploy_settings_from_config(cfg)
    if not addresses_known_before_launch(plan, settings):
        return prepare_deployment(
            plan,
            settings,
            server_arg_fields=fields,
            host_of_node=NODE_ADDRESS.format,
            router_host=DRIVER_ADDRESS,
        )
    return prepare_deployment(plan, settings, server_arg_fields=fields)


#: How a printed plan shows an address that the launch decides (each node's, the routers' node).
NODE_ADDRESS = "<node {} address>"
DRIVER_ADDRESS = "<driver address>"


def addresses_known_before_launch(plan: DeploymentPlan, settings: SGLangDeployConf) -> bool:
    """True where every process runs at ``sglang_deploy.launch.host`` (the local backend on one node, or its
    stand-ins side by side); False where each node's address comes from the cluster at launch."""
    if BackendKind(settings.launch.backend) is not BackendKind.local:
        return False
    spread = len(plan.nodes) > 1 or any(e.nnodes > 1 for e in plan.engines)
    return not (spread and EngineKind(settings.launch.engine) is not EngineKind.simulated)


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


def _placement_options(
    settings: SGLangDeployConf, placement_group: Any, bundle_indices: Sequence[int] | None
) -> dict[str, Any]:
    if placement_group is None and bundle_indices is None:
        return {}
    if BackendKind(settings.launch.backend) is not BackendKind.ray:
        raise DeploymentConfigError(
            [
                Problem(
                    "sglang_deploy.launch.backend",
                    f"a placement group was handed over, which only the ray backend uses, but the backend is "
                    f"{BackendKind(settings.launch.backend).value!r}: set sglang_deploy.launch.backend=ray",
                )
            ]
        )
    if placement_group is None:
        raise DeploymentConfigError([Problem("", "bundle_indices was given without a placement_group")])
    return {"placement_group": placement_group, "bundle_indices": bundle_indices}


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
    cfg: DictConfig,
    *,
    log_dir: Path | None = None,
    placement_group: Any = None,
    bundle_indices: Sequence[int] | None = None,
    backend: Backend | None = None,
) -> Iterator[Deployment]:
    """Resolve, render and start the deployment of ``cfg``; stop everything when the block ends.

    Every check (deployment, overrides against the installed SGLang's fields, deployment-wide settings, what
    the backend supports and what its machines can give) runs before the first engine starts. Engine and
    router logs go to ``sglang_deploy.launch.log_dir``, else ``sglang_logs/`` in the Hydra run directory.

    ``placement_group`` (and ``bundle_indices``, GPU slot -> bundle): the trainer's Ray placement group to
    place the engines in, for ``sglang_deploy.launch.backend=ray`` (Miles: its placement group and
    ``reordered_bundle_indices``). ``backend``: a backend instance to use instead of the configured one."""
    fields = known_server_arg_fields().fields
    plan = resolve_config(cfg, server_arg_fields=fields)
    settings = deploy_settings_from_config(cfg)
    target = Path(log_dir or settings.launch.log_dir or _default_log_dir())
    if backend is None:
        backend = get_backend(
            settings.launch.backend, **_placement_options(settings, placement_group, bundle_indices)
        )
    try:
        prepared = backend.prepare(plan, settings, server_arg_fields=fields)
        deployment = Deployment(prepared, backend, log_dir=target)
    except BaseException:
        backend.close()
        raise
    with deployment:
        yield deployment
