"""The Hydra edge: from a composed config to the resolver's inputs, and back to one call.

Nothing past this module sees OmegaConf: it turns the ``sglang`` node into a
:class:`~miles_sglang_plugin.deployment_spec.DeploymentSpec`, the root into
:class:`~miles_sglang_plugin.trainer_inputs.TrainerInputs`, and ``sglang_deploy`` into plain dataclasses.

A field that still holds its schema's default interpolation (``${..num_gpus_per_engine}``,
``${oc.select:hf_checkpoint,null}``) is passed on as "not given", so the resolver applies Miles' fallback chain
in one place; the interpolation itself shows the same value in ``--cfg job --resolve`` (the one difference: the
``eval`` model's groups fall back to ``eval_num_gpus_per_engine``, as in Miles).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from miles_sglang_plugin.deployment_spec import DeploymentSpec, GroupSpec, ModelSpec, WorkerType
from miles_sglang_plugin.errors import ProblemCollector
from miles_sglang_plugin.plan import DeploymentPlan
from miles_sglang_plugin.resolution import resolve_deployment
from miles_sglang_plugin.schema import (
    EXTRA_GROUP_GPE_DEFAULT,
    GROUP_GPE_DEFAULT,
    GROUP_SLOTS,
    MODEL_GPE_DEFAULT,
    MODEL_PATH_DEFAULT,
    ExtraServerGroupConf,
    ModelConf,
    SGLangDeployConf,
)
from miles_sglang_plugin.trainer_inputs import TrainerInputs

if TYPE_CHECKING:
    from miles_sglang_plugin.launcher import LocalLauncher
    from miles_sglang_plugin.ports import PortClaims
    from miles_sglang_plugin.prepared import PreparedDeployment

SGLANG_KEY = "sglang"
#: Where the API key of engines and routers comes from when sglang_deploy.api_key is null.
API_KEY_ENV = "SGLANG_API_KEY"
DEPLOY_KEY = "sglang_deploy"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _value(
    node: DictConfig, field: str, default_interpolation: str, key: str, problems: ProblemCollector
) -> Any:
    """The resolved value of ``node.field``, or None when it is the untouched default interpolation."""
    if field not in node:
        return None
    if OmegaConf.is_interpolation(node, field):
        raw = OmegaConf.to_container(node, resolve=False)[field]  # the "${...}" text itself
        if raw == default_interpolation:
            return None
    try:
        return node[field]
    except OmegaConfBaseException as exc:
        problems.add(f"{key}.{field}", _first_line(exc))
        return None


def _container(node: Any, key: str, problems: ProblemCollector) -> Any:
    if node is None:
        return {}
    try:
        return OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as exc:
        problems.add(key, _first_line(exc))
        return {}


def _typed(node: Any, schema: type, key: str, problems: ProblemCollector) -> DictConfig | None:
    """``node`` checked against ``schema``: models added without their schema (``+sglang.x={...}``) are
    validated here instead of at composition."""
    if not isinstance(node, DictConfig):
        problems.add(key, f"must be a mapping (a {schema.__name__}), got {node!r}")
        return None
    if OmegaConf.get_type(node) is schema:
        return node
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as exc:
        problems.add(key, f"{_first_line(exc)} (add models with +sglang_model@{key}=base)")
        return None


def _group(
    name: str, wt: Any, node: DictConfig, default_gpe: str, key: str, p: ProblemCollector
) -> GroupSpec:
    return GroupSpec(
        name=name,
        worker_type=wt,
        num_gpus=_value(node, "num_gpus", "", key, p),
        num_gpus_per_engine=_value(node, "num_gpus_per_engine", default_gpe, key, p),
        overrides=_container(node.get("overrides"), f"{key}.overrides", p),
        key=key,
    )


def _model(name: str, node: DictConfig, key: str, p: ProblemCollector) -> ModelSpec:
    enabled: dict[str, GroupSpec] = {}
    known: list[str] = list(GROUP_SLOTS)
    for slot in GROUP_SLOTS:
        g = _group(slot, WorkerType(slot), node[slot], GROUP_GPE_DEFAULT, f"{key}.{slot}", p)
        if g.num_gpus != 0:
            enabled[slot] = g
    extras = node.get("extra_groups") or {}
    for extra_name in extras:
        gkey = f"{key}.extra_groups.{extra_name}"
        if extra_name in GROUP_SLOTS:
            p.add(
                gkey,
                f"{extra_name!r} is already a group slot of the model; give the extra group another name",
            )
            continue
        extra = _typed(extras[extra_name], ExtraServerGroupConf, gkey, p)
        if extra is None:
            continue
        known.append(str(extra_name))
        wt = _value(extra, "worker_type", "", gkey, p)
        g = _group(str(extra_name), wt, extra, EXTRA_GROUP_GPE_DEFAULT, gkey, p)
        if g.num_gpus != 0:
            enabled[str(extra_name)] = g

    order = [str(x) for x in (node.get("group_order") or [])]
    groups = list(enabled.values())
    if order:
        unknown = [n for n in order if n not in known]
        if unknown:
            p.add(f"{key}.group_order", f"names groups that do not exist: {unknown}; groups: {known}")
        missing = [n for n in enabled if n not in order]
        if missing:
            p.add(
                f"{key}.group_order",
                f"must list every enabled group; missing: {missing} (order given: {order})",
            )
        repeated = sorted({n for n in order if order.count(n) > 1})
        if repeated:
            p.add(f"{key}.group_order", f"lists {repeated} more than once")
        if not (unknown or missing or repeated):
            groups = [enabled[n] for n in order if n in enabled]

    return ModelSpec(
        name=name,
        groups=tuple(groups),
        model_path=_value(node, "model_path", MODEL_PATH_DEFAULT, key, p),
        update_weights=_value(node, "update_weights", "", key, p),
        num_gpus_per_engine=_value(node, "num_gpus_per_engine", MODEL_GPE_DEFAULT, key, p),
        key=key,
    )


def spec_from_config(cfg: DictConfig, problems: ProblemCollector | None = None) -> DeploymentSpec | None:
    """The deployment described under ``cfg.sglang`` (None when the app has no ``sglang`` node)."""
    own = problems is None
    p = problems if problems is not None else ProblemCollector("the Hydra config")
    node = OmegaConf.select(cfg, SGLANG_KEY, default=None)
    if node is None:
        return None
    if not isinstance(node, DictConfig):
        p.add(SGLANG_KEY, f"must map model names to models, got {node!r}")
        p.raise_if_any()
    models = []
    for name in node:
        key = f"{SGLANG_KEY}.{name}"
        typed = _typed(node[name], ModelConf, key, p)
        if typed is not None:
            models.append(_model(str(name), typed, key, p))
    if own:
        p.raise_if_any()
    return DeploymentSpec(models=tuple(models), source="the Hydra config")


def deploy_settings_from_config(cfg: DictConfig) -> SGLangDeployConf:
    """``cfg.sglang_deploy`` as a plain :class:`SGLangDeployConf` (defaults if the app has none). The API key
    comes from the environment (``SGLANG_API_KEY``) unless the config sets one, so that it stays out of the
    config Hydra prints and saves; an IPv6 ``launch.host`` is kept without brackets."""
    node = OmegaConf.select(cfg, DEPLOY_KEY, default=None)
    merged = OmegaConf.merge(OmegaConf.structured(SGLangDeployConf), node if node is not None else {})
    settings: SGLangDeployConf = OmegaConf.to_object(merged)  # type: ignore[assignment]
    if settings.api_key is None:
        settings.api_key = os.environ.get(API_KEY_ENV) or None
    settings.launch.host = settings.launch.host.strip().strip("[]")
    return settings


def trainer_from_config(cfg: DictConfig) -> TrainerInputs:
    """The trainer's inputs from the root of the composed config (Miles' names; absent keys take defaults)."""
    values = {name: OmegaConf.select(cfg, name, default=None) for name in TrainerInputs.field_names()}
    if isinstance(values.get("eval_sglang_overrides"), DictConfig):
        values["eval_sglang_overrides"] = OmegaConf.to_container(
            values["eval_sglang_overrides"], resolve=True
        )
    return TrainerInputs.from_mapping(values)


def resolve_config(cfg: DictConfig, *, server_arg_fields: Collection[str] | None = None) -> DeploymentPlan:
    """Compose-time config → frozen plan: the one call a Hydra app needs. Raises
    :class:`~miles_sglang_plugin.errors.DeploymentConfigError` listing every problem."""
    problems = ProblemCollector("the Hydra config")
    try:
        trainer = trainer_from_config(cfg)
        server_defaults = deploy_settings_from_config(cfg).server_defaults
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        problems.add("", f"the trainer's arguments or sglang_deploy do not read: {_first_line(exc)}")
        problems.raise_if_any()
    spec = spec_from_config(cfg, problems)
    problems.raise_if_any()
    return resolve_deployment(
        spec, trainer, server_arg_fields=server_arg_fields, server_defaults=server_defaults
    )


def prepare_from_config(
    cfg: DictConfig, *, probe: bool = False, claims: PortClaims | None = None
) -> PreparedDeployment:
    """Resolve and render ``cfg`` with every check on: override keys against the installed SGLang's fields,
    the deployment-wide settings, ports (probed and claimed on this machine when ``probe``)."""
    from miles_sglang_plugin.prepared import prepare_deployment
    from miles_sglang_plugin.server_arg_fields import known_server_arg_fields

    fields = known_server_arg_fields().fields
    plan = resolve_config(cfg, server_arg_fields=fields)
    return prepare_deployment(
        plan, deploy_settings_from_config(cfg), server_arg_fields=fields, probe=probe, claims=claims
    )


def resolve_config_or_exit(
    cfg: DictConfig, *, server_arg_fields: Collection[str] | None = None
) -> DeploymentPlan:
    """:func:`resolve_config` for an app's entry point: a user error is printed (every problem, no traceback)
    and the process exits with status 2 before anything starts. In a multirun the error is re-raised instead,
    so that Hydra goes on with the other jobs and the sweep still ends with a non-zero status."""
    import sys

    from miles_sglang_plugin.errors import DeploymentConfigError

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
def launch_from_config(cfg: DictConfig, *, log_dir: Path | None = None) -> Iterator[LocalLauncher]:
    """Resolve, render and start the deployment of ``cfg``; stop everything when the block ends.

    Every check (deployment, overrides against the installed SGLang's fields, deployment-wide settings, what
    this backend supports) runs before the first process starts. Engine and router logs go to
    ``sglang_deploy.launch.log_dir``, else ``sglang_logs/`` in the Hydra run directory."""
    from miles_sglang_plugin.launcher import LocalLauncher
    from miles_sglang_plugin.ports import claimed_ports

    with claimed_ports() as claims:
        prepared = prepare_from_config(cfg, probe=True, claims=claims)
        target = Path(log_dir or prepared.settings.launch.log_dir or _default_log_dir())
        with LocalLauncher(prepared, log_dir=target, claims=claims) as launcher:
            yield launcher
