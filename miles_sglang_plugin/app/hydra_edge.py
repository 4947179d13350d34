"""What a Hydra app calls: its composed config to a plan, to launch specs, to a running deployment.

Each call reads the config once at the edge (:mod:`miles_sglang_plugin.config.reading`) and hands plain values
to the later stages; the backend is picked by ``sglang_deploy.launch.backend`` and is otherwise opaque here.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict

from miles_sglang_plugin.app.machine_fit import machine_fit_problems
from miles_sglang_plugin.config.reading import read_config
from miles_sglang_plugin.config.schema import BackendKind, EngineKind, SGLangDeployConf
from miles_sglang_plugin.config.trainer_mappings import name_the_trainer_keys
from miles_sglang_plugin.errors import DeploymentConfigError, Problem
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.rendering.prepared import PreparedDeployment, prepare_deployment
from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields

# A launch's stages load with the launch: planning alone (plan, resolve_config) needs neither.
if TYPE_CHECKING:
    from miles_sglang_plugin.backends import Backend
    from miles_sglang_plugin.serving.deployment import Deployment

#: How a printed plan shows an address that the launch decides (each node's, the routers' node).
NODE_ADDRESS = "<node {} address>"
DRIVER_ADDRESS = "<driver address>"


class SweepJobConfigError(DeploymentConfigError, CompactHydraException):
    """A job's :class:`DeploymentConfigError` in a multirun: Hydra reports it at the end of the sweep as its
    message alone (a compact Hydra error), not as a chained traceback."""


def prepare_from_config(
    cfg: DictConfig, *, sglang_key: str | None = None, server_arg_fields: Collection[str] | None = None
) -> PreparedDeployment:
    """The one check of a composed config, shared by ``resolve_config``, ``miles-sglang plan`` and
    ``launch_from_config``: read it (unknown keys, helper groups, values), resolve it (override keys against
    the installed SGLang's fields, or ``server_arg_fields``), render every engine's command line and the
    deployment-wide settings (router policies, ports: the plain sequence from ``port_base``, per node). Raises
    :class:`~miles_sglang_plugin.errors.DeploymentConfigError` listing every problem.

    ``sglang_key``: where the group is (default: where Hydra placed it, else ``sglang``); the trainer's inputs
    are found next to it, then outwards up to the root. Where the addresses are only known at launch (the ray
    backend, or real engines on several nodes), they are shown as ``<node N address>`` and
    ``<driver address>`` (:data:`NODE_ADDRESS`)."""
    fields = server_arg_fields if server_arg_fields is not None else known_server_arg_fields().fields
    reading = read_config(cfg, sglang_key=sglang_key)
    try:
        plan = resolve_deployment(
            reading.spec,
            reading.trainer,
            server_arg_fields=fields,
            server_defaults=reading.settings.server_defaults,
        )
        if not addresses_known_before_launch(plan, reading.settings):
            return prepare_deployment(
                plan,
                reading.settings,
                server_arg_fields=fields,
                host_of_node=NODE_ADDRESS.format,
                router_host=DRIVER_ADDRESS,
            )
        return prepare_deployment(plan, reading.settings, server_arg_fields=fields)
    except DeploymentConfigError as exc:
        if reading.mapping is None:
            raise
        named = name_the_trainer_keys(list(exc.problems), reading.mapping)
        raise DeploymentConfigError(named, source=exc.source) from None


def addresses_known_before_launch(plan: DeploymentPlan, settings: SGLangDeployConf) -> bool:
    """True where every process runs at ``sglang_deploy.launch.host`` (the local backend on one node, or its
    stand-ins side by side); False where each node's address comes from the cluster at launch."""
    if BackendKind(settings.launch.backend) is not BackendKind.local:
        return False
    spread = len(plan.nodes) > 1 or any(e.nnodes > 1 for e in plan.engines)
    return not (spread and EngineKind(settings.launch.engine) is not EngineKind.simulated)


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
    with exit_on_config_error():
        return resolve_config(cfg, sglang_key=sglang_key, server_arg_fields=server_arg_fields)


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
    """A :class:`DeploymentConfigError` raised in the block, for an app's entry point: printed (every problem,
    no traceback), then the process exits with status 2; in a multirun it is raised again as a compact Hydra
    error (:func:`resolve_config_or_exit`). An app wraps its launch in it, as the example trainer does:
    ``with exit_on_config_error(), launch_from_config(cfg) as deployment:``, so that a plan this machine cannot
    run (:mod:`miles_sglang_plugin.app.machine_fit`) ends in one message."""
    try:
        yield
    except DeploymentConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if _in_multirun():
            raise SweepJobConfigError(exc.problems, source=exc.source) from None
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


def get_backend(name: str, **options: Any) -> Backend:
    """The backend ``name`` (:func:`miles_sglang_plugin.backends.get_backend`), imported when a launch needs
    it."""
    from miles_sglang_plugin.backends import get_backend as backend_named

    return backend_named(name, **options)


@dataclasses.dataclass
class HydraConfigSource:
    """How a deployment launched from a composed config resolves its changes (``Deployment.apply(cfg)``,
    ``resize``, ``move_gpus``): with :func:`prepare_from_config`, every check of a launch."""

    config: DictConfig
    sglang_key: str | None = None
    server_arg_fields: Collection[str] | None = None

    def resolve(self, config: DictConfig) -> tuple[DeploymentPlan, SGLangDeployConf]:
        checked = prepare_from_config(
            config, sglang_key=self.sglang_key, server_arg_fields=self.server_arg_fields
        )
        return checked.plan, checked.settings

    def resized(self, sizes: Mapping[tuple[str, str], int]) -> DictConfig:
        """A copy of the current config with these groups' ``num_gpus`` (a group is found by the key it was
        written at: ``sglang.actor.decode``)."""
        plan, _settings = self.resolve(self.config)
        config = copy.deepcopy(self.config)
        problems = []
        for (model, group), num_gpus in sizes.items():
            try:
                key = plan.model(model).group(group).key
            except KeyError as exc:
                problems.append(Problem(f"{model}.{group}", str(exc).strip('"')))
                continue
            OmegaConf.update(config, f"{key}.num_gpus", num_gpus, merge=True)
        if problems:
            raise DeploymentConfigError(problems)
        return config


def with_weight_version(cfg: DictConfig, version: str | int) -> DictConfig:
    """A copy of ``cfg`` whose engines start with weight version ``version``
    (``sglang_deploy.server_defaults.weight_version``); ValueError for a version that is not a string or an
    integer."""
    if isinstance(version, bool) or not isinstance(version, str | int) or str(version) == "":
        raise ValueError(f"initial_weight_version must be a non-empty string or an integer, got {version!r}")
    copied = copy.deepcopy(cfg)
    with open_dict(copied):
        OmegaConf.update(copied, "sglang_deploy.server_defaults.weight_version", str(version), force_add=True)
    return copied


@contextlib.contextmanager
def launch_from_config(
    cfg: DictConfig,
    *,
    log_dir: Path | None = None,
    sglang_key: str | None = None,
    placement_group: Any = None,
    bundle_indices: Sequence[int] | None = None,
    backend: Backend | None = None,
    initial_weight_version: str | int | None = None,
) -> Iterator[Deployment]:
    """Resolve, render and start the deployment of ``cfg``; stop everything when the block ends.

    Every check (:func:`prepare_from_config`, then what the backend supports and what its machines can give:
    ports, GPUs, placement) runs before the first engine starts. Engine and router logs go to ``log_dir``,
    else ``sglang_deploy.launch.log_dir``, else ``sglang_logs/`` in the Hydra run directory.

    ``placement_group`` (and ``bundle_indices``, GPU slot -> bundle): the trainer's Ray placement group to
    place the engines in, for ``sglang_deploy.launch.backend=ray`` (Miles: its placement group and
    ``reordered_bundle_indices``). ``backend``: a backend instance to use instead of the configured one.

    ``initial_weight_version``: the weight version every engine starts with (SGLang's ``--weight-version``,
    ``default`` otherwise), e.g. the trainer's restored step, so that the version sequence goes on after a
    relaunch: as ``sglang_deploy.server_defaults.weight_version`` (a group's own override still wins); ``apply``
    keeps it.

    With the configured local backend, a plan this machine cannot run (engines on several nodes, or real
    SGLang engines on more GPUs than it has) is a :class:`DeploymentConfigError` saying what to change
    (:mod:`miles_sglang_plugin.app.machine_fit`)."""
    from miles_sglang_plugin.serving.deployment import Deployment

    if initial_weight_version is not None:
        cfg = with_weight_version(cfg, initial_weight_version)
    fields = known_server_arg_fields().fields
    checked = prepare_from_config(cfg, sglang_key=sglang_key, server_arg_fields=fields)
    settings = checked.settings
    if backend is None:  # the configured backend: a plan this machine cannot run is refused before it starts
        unfit = machine_fit_problems(checked.plan, settings)
        if unfit:
            raise DeploymentConfigError(unfit, source=checked.plan.source)
    target = Path(log_dir or settings.launch.log_dir or _default_log_dir())
    if backend is None:
        backend = get_backend(
            settings.launch.backend, **_placement_options(settings, placement_group, bundle_indices)
        )
    try:
        prepared = backend.prepare(checked.plan, settings, server_arg_fields=fields)
        source = HydraConfigSource(cfg, sglang_key=sglang_key, server_arg_fields=fields)
        deployment = Deployment(prepared, backend, log_dir=target, source=source)
    except BaseException:
        backend.close()
        raise
    with deployment:
        yield deployment
