"""Reading a composed Hydra config into the resolver's inputs (the Hydra edge, inbound).

Nothing past this module sees OmegaConf: it turns the ``sglang`` node into a
:class:`~miles_sglang_plugin.config.deployment_spec.DeploymentSpec`, the root into
:class:`~miles_sglang_plugin.config.trainer_inputs.TrainerInputs`, and ``sglang_deploy`` into plain dataclasses.

A field that still holds its schema's default interpolation (``${..num_gpus_per_engine}``,
``${oc.select:hf_checkpoint,null}``) is passed on as "not given", so the resolver applies Miles' fallback chain
in one place; the interpolation itself shows the same value in ``--cfg job --resolve`` (the one difference: the
``eval`` model's groups fall back to ``eval_num_gpus_per_engine``, as in Miles).
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from miles_sglang_plugin.config.deployment_spec import (
    DeploymentSpec,
    ExternalEngineSpec,
    GroupSpec,
    ModelSpec,
    WorkerType,
)
from miles_sglang_plugin.config.schema import (
    EXTRA_GROUP_GPUS_PER_ENGINE_DEFAULT,
    GROUP_GPUS_PER_ENGINE_DEFAULT,
    GROUP_SLOTS,
    MODEL_GPUS_PER_ENGINE_DEFAULT,
    MODEL_PATH_DEFAULT,
    ExtraServerGroupConf,
    ModelConf,
    SGLangDeployConf,
)
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import ProblemCollector, first_line

SGLANG_KEY = "sglang"
#: Where the API key of engines and routers comes from when sglang_deploy.api_key is null.
API_KEY_ENV = "SGLANG_API_KEY"
DEPLOY_KEY = "sglang_deploy"


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
        problems.add(f"{key}.{field}", first_line(exc))
        return None


def _container(node: Any, key: str, problems: ProblemCollector) -> Any:
    if node is None:
        return {}
    try:
        return OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as exc:
        problems.add(key, first_line(exc))
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
        problems.add(key, f"{first_line(exc)} (add models with +sglang_model@{key}=base)")
        return None


def _group(
    name: str,
    worker_type: Any,
    node: DictConfig,
    default_gpus_per_engine: str,
    key: str,
    problems: ProblemCollector,
) -> GroupSpec:
    return GroupSpec(
        name=name,
        worker_type=worker_type,
        num_gpus=_value(node, "num_gpus", "", key, problems),
        num_gpus_per_engine=_value(node, "num_gpus_per_engine", default_gpus_per_engine, key, problems),
        overrides=_container(node.get("overrides"), f"{key}.overrides", problems),
        key=key,
    )


def _extra_groups(
    node: DictConfig, key: str, known: list[str], problems: ProblemCollector
) -> dict[str, GroupSpec]:
    """The enabled groups under ``extra_groups`` by name; appends every extra group's name to ``known``."""
    enabled: dict[str, GroupSpec] = {}
    extras = node.get("extra_groups") or {}
    for extra_name in extras:
        group_key = f"{key}.extra_groups.{extra_name}"
        if extra_name in GROUP_SLOTS:
            problems.add(
                group_key,
                f"{extra_name!r} is already a group slot of the model; give the extra group another name",
            )
            continue
        extra = _typed(extras[extra_name], ExtraServerGroupConf, group_key, problems)
        if extra is None:
            continue
        known.append(str(extra_name))
        worker_type = _value(extra, "worker_type", "", group_key, problems)
        group = _group(
            str(extra_name), worker_type, extra, EXTRA_GROUP_GPUS_PER_ENGINE_DEFAULT, group_key, problems
        )
        if group.num_gpus != 0:
            enabled[str(extra_name)] = group
    return enabled


def _ordered_groups(
    node: DictConfig,
    enabled: dict[str, GroupSpec],
    known: list[str],
    key: str,
    problems: ProblemCollector,
) -> list[GroupSpec]:
    """The enabled groups in ``group_order`` (checked: known names, every enabled group, once each), or in
    their default order when it is empty or wrong."""
    order = [str(x) for x in (node.get("group_order") or [])]
    if not order:
        return list(enabled.values())
    unknown = [name for name in order if name not in known]
    if unknown:
        problems.add(f"{key}.group_order", f"names groups that do not exist: {unknown}; groups: {known}")
    missing = [name for name in enabled if name not in order]
    if missing:
        problems.add(
            f"{key}.group_order",
            f"must list every enabled group; missing: {missing} (order given: {order})",
        )
    repeated = sorted({name for name in order if order.count(name) > 1})
    if repeated:
        problems.add(f"{key}.group_order", f"lists {repeated} more than once")
    if unknown or missing or repeated:
        return list(enabled.values())
    return [enabled[name] for name in order if name in enabled]


#: What an entry of ``sglang.<model>.external`` may hold when it is a mapping.
EXTERNAL_KEYS = ("url", "worker_type", "bootstrap_port")


def _external(node: DictConfig, key: str, problems: ProblemCollector) -> tuple[ExternalEngineSpec, ...]:
    """The model's external engines: each a URL, or a mapping of :data:`EXTERNAL_KEYS` (values checked at
    resolution)."""
    entries = _container(node.get("external"), f"{key}.external", problems)
    if not isinstance(entries, list):
        problems.add(f"{key}.external", f"must be a list of engine URLs, got {entries!r}")
        return ()
    out = []
    for i, entry in enumerate(entries):
        entry_key = f"{key}.external[{i}]"
        if isinstance(entry, dict):
            unknown = sorted(str(k) for k in entry if k not in EXTERNAL_KEYS)
            if unknown:
                problems.add(
                    entry_key, f"unknown key(s) {unknown}; an external engine has {list(EXTERNAL_KEYS)}"
                )
                continue
            if "url" not in entry:
                problems.add(entry_key, "needs a url")
                continue
            out.append(
                ExternalEngineSpec(
                    url=entry["url"],
                    worker_type=entry.get("worker_type", "regular"),
                    bootstrap_port=entry.get("bootstrap_port"),
                    key=entry_key,
                )
            )
        else:
            out.append(ExternalEngineSpec(url=entry, key=entry_key))
    return tuple(out)


def _model(name: str, node: DictConfig, key: str, problems: ProblemCollector) -> ModelSpec:
    enabled: dict[str, GroupSpec] = {}
    known: list[str] = list(GROUP_SLOTS)
    for slot in GROUP_SLOTS:
        group = _group(
            slot, WorkerType(slot), node[slot], GROUP_GPUS_PER_ENGINE_DEFAULT, f"{key}.{slot}", problems
        )
        if group.num_gpus != 0:
            enabled[slot] = group
    enabled.update(_extra_groups(node, key, known, problems))
    return ModelSpec(
        name=name,
        groups=tuple(_ordered_groups(node, enabled, known, key, problems)),
        model_path=_value(node, "model_path", MODEL_PATH_DEFAULT, key, problems),
        update_weights=_value(node, "update_weights", "", key, problems),
        num_gpus_per_engine=_value(node, "num_gpus_per_engine", MODEL_GPUS_PER_ENGINE_DEFAULT, key, problems),
        key=key,
        external=_external(node, key, problems),
    )


def spec_from_config(cfg: DictConfig, problems: ProblemCollector | None = None) -> DeploymentSpec | None:
    """The deployment described under ``cfg.sglang`` (None when the app has no ``sglang`` node)."""
    own = problems is None
    collector = problems if problems is not None else ProblemCollector("the Hydra config")
    node = OmegaConf.select(cfg, SGLANG_KEY, default=None)
    if node is None:
        return None
    if not isinstance(node, DictConfig):
        collector.add(SGLANG_KEY, f"must map model names to models, got {node!r}")
        collector.raise_if_any()
    models = []
    for name in node:
        key = f"{SGLANG_KEY}.{name}"
        typed = _typed(node[name], ModelConf, key, collector)
        if typed is not None:
            models.append(_model(str(name), typed, key, collector))
    if own:
        collector.raise_if_any()
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
