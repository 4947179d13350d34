"""Reading a composed Hydra config into the resolver's inputs (the Hydra edge, inbound).

Nothing past this module sees OmegaConf: :func:`read_config` turns the group's node into a
:class:`~miles_sglang_plugin.config.deployment_spec.DeploymentSpec`, the trainer's inputs into
:class:`~miles_sglang_plugin.config.trainer_inputs.TrainerInputs`, and ``sglang_deploy`` into plain dataclasses,
and reports every problem it finds in one error: keys a typed node does not know (``+`` adds any key to a
structured node, and Hydra would carry it silently), helper groups used outside their packages, names too long,
values that do not read. Where the group and the trainer's inputs are: :mod:`miles_sglang_plugin.config.locating`.

A field that still holds its schema's default interpolation (``${..num_gpus_per_engine}``,
``${msp.trainer:hf_checkpoint,null}``) is passed on as "not given", so the resolver applies Miles' fallback chain
in one place; the interpolation itself shows the same value in ``--cfg job --resolve`` (the one difference: the
``eval`` model's groups fall back to ``eval_num_gpus_per_engine``, as in Miles).

Every value is read in place, in the composed config, so that interpolations reach any node of it
(``sglang_deploy.launch.port_base: ${seed}``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from miles_sglang_plugin.config.deployment_spec import (
    DeploymentSpec,
    ExternalEngineSpec,
    GroupSpec,
    ModelSpec,
    WorkerType,
)
from miles_sglang_plugin.config.locating import (
    DEFAULT_SGLANG_KEY,
    enclosing_nodes,
    find_trainer_value,
    hydra_choices,
    register_resolvers,
    sglang_keys,
)
from miles_sglang_plugin.config.overrides import HELPER_GROUPS
from miles_sglang_plugin.config.schema import (
    EXTRA_GROUP_GPUS_PER_ENGINE_DEFAULT,
    GROUP_GPUS_PER_ENGINE_DEFAULT,
    GROUP_SLOTS,
    MODEL_GPUS_PER_ENGINE_DEFAULT,
    MODEL_PATH_DEFAULT,
    ExtraServerGroupConf,
    ModelConf,
    ServerGroupConf,
    SGLangDeployConf,
)
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.config.trainer_mappings import TrainerKind, TrainerMapping, trainer_mapping
from miles_sglang_plugin.errors import ProblemCollector, first_line
from miles_sglang_plugin.masking import secret_value_problem

SGLANG_KEY = DEFAULT_SGLANG_KEY
#: Where the API key of engines and routers comes from when sglang_deploy.api_key is null.
API_KEY_ENV = "SGLANG_API_KEY"
#: The deployment-wide settings: one node at the root (the presets place it with ``_global_``).
DEPLOY_KEY = "sglang_deploy"
#: Longest model or group name: names become engine ids and log file names (``<model>.<group>.<i>.log``).
MAX_NAME_LENGTH = 64


@dataclass(frozen=True)
class ConfigReading:
    """What a composed config says: the deployment (None: no group node), the trainer, the settings."""

    spec: DeploymentSpec | None
    trainer: TrainerInputs
    settings: SGLangDeployConf
    sglang_key: str
    #: The trainer's own keys as trainer inputs (``sglang_trainer=verl``); None without one.
    mapping: TrainerMapping | None = None


# ------------------------------------------------------------------------------------------------- values
def _value(
    node: DictConfig, field: str, default_interpolation: str, key: str, problems: ProblemCollector
) -> Any:
    """The resolved value of ``node.field``, or None when it is absent, missing (``???``) or the untouched
    default interpolation. Resolved once: ``field in node`` resolves an interpolation as well (a grammar parse,
    about 0.2 ms each), so presence is asked of the field's node and a default interpolation is never
    resolved."""
    child = node._get_node(field, validate_access=False)
    if child is None:
        return None
    if child._is_interpolation() and child._value() == default_interpolation:
        return None
    try:
        return node[field]
    except MissingMandatoryValue:  # ``???``, or an interpolation of one: what ``field in node`` calls absent
        return None
    except OmegaConfBaseException as exc:
        problems.add(f"{key}.{field}", first_line(exc))
        return None


#: What :func:`_child` gives for a value whose interpolation does not resolve (reported already).
_UNREADABLE = object()


def _child(node: DictConfig, name: Any, key: str, problems: ProblemCollector) -> Any:
    """``node[name]`` (None when absent), or :data:`_UNREADABLE`, reported, when it does not resolve."""
    try:
        return node.get(name)
    except OmegaConfBaseException as exc:
        problems.add(key, first_line(exc))
        return _UNREADABLE


def _resolved(node: Any, key: str, problems: ProblemCollector) -> Any:
    """``node`` as plain containers, interpolations resolved where it is; None (reported) when one fails."""
    if node is _UNREADABLE:
        return None
    if not OmegaConf.is_config(node):
        return node
    try:
        return OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as exc:
        where = getattr(exc, "full_key", None) or key
        problems.add(str(where), first_line(exc))
        return None


def _typed(node: Any, schema: type, key: str, problems: ProblemCollector) -> DictConfig | None:
    """``node`` checked against ``schema``: models and groups written without their schema (``+sglang.x={...}``)
    are validated here instead of at composition."""
    if node is _UNREADABLE:
        return None
    if not isinstance(node, DictConfig):
        problems.add(key, f"must be a mapping (a {schema.__name__}), got {node!r}")
        return None
    if OmegaConf.get_type(node) is schema:
        return node
    values = _resolved(node, key, problems)
    if values is None:
        return None
    try:
        # Merged into a structured config: a DictConfig (OmegaConf's return type also names ListConfig).
        return cast(DictConfig, OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as exc:
        hint = "+sglang_model@{key}=base" if schema is ModelConf else f"+sglang_group@{key}=<worker type>"
        problems.add(key, f"{first_line(exc)} (add it with {hint.format(key=key)})")
        return None


# --------------------------------------------------------------------------------------- unknown keys
def _dataclass_of(node: DictConfig) -> type | None:
    object_type = OmegaConf.get_type(node)
    return object_type if isinstance(object_type, type) and dataclasses.is_dataclass(object_type) else None


def _unknown_key_message(name: str, schema: type) -> str:
    fields = [f.name for f in dataclasses.fields(schema)]
    close = difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
    if close:
        hint = f"did you mean {', '.join(close)}?"
    elif len(fields) <= 8:
        hint = f"its fields: {', '.join(fields)}"
    else:
        hint = "miles-sglang fields lists its fields"
    return f"is not a field of {schema.__name__} (a '+' override adds any key; this one would be ignored); {hint}"


def unknown_keys(node: DictConfig, key: str, problems: ProblemCollector, *, recurse: bool = True) -> None:
    """Report every key of a typed node (at ``key``, and below it with ``recurse``) that its schema does not
    declare. Untyped maps (``overrides``, ``server_defaults``, ``env``, ...) hold any key; typed nodes inside
    them are still checked."""
    schema = _dataclass_of(node)
    names = {f.name for f in dataclasses.fields(schema)} if schema is not None else set()
    for child_key in node:
        child_path = f"{key}.{child_key!s}" if key else str(child_key)
        if schema is not None and child_key not in names and child_key != "hydra":
            problems.add(child_path, _unknown_key_message(str(child_key), schema))
            continue
        child = node._get_node(child_key)
        if (
            recurse
            and isinstance(child, DictConfig)
            and not child._is_none()
            and not child._is_interpolation()
        ):
            unknown_keys(child, child_path, problems)


def _helper_group_problems(cfg: DictConfig, key: str, problems: ProblemCollector) -> None:
    """``+sglang_model=base`` adds a stray ``sglang_model`` node; a helper group belongs under the group."""
    reported = set()
    for choice in hydra_choices(cfg):
        group, _, package = str(choice).partition("@")
        if group not in HELPER_GROUPS:
            continue
        inside = package.startswith(f"{key}.") and (group == "sglang_model" or ".extra_groups." in package)
        if not inside:
            where = f"at {package}" if package else "without a package"
            problems.add(group, f"is a helper group, used {where}; {HELPER_GROUPS[group].format(key=key)}")
            reported.add(group)
    for group, hint in HELPER_GROUPS.items():
        if group in cfg and group not in reported:
            problems.add(group, f"is a helper group, not a setting of the app; {hint.format(key=key)}")


# ---------------------------------------------------------------------------------------------- groups
def _group(
    name: str,
    worker_type: Any,
    node: DictConfig,
    default_gpus_per_engine: str,
    key: str,
    problems: ProblemCollector,
) -> GroupSpec:
    overrides = _resolved(
        _child(node, "overrides", f"{key}.overrides", problems), f"{key}.overrides", problems
    )
    if overrides is not None and not isinstance(overrides, dict):
        problems.add(f"{key}.overrides", f"must map ServerArgs fields to values, got {overrides!r}")
        overrides = None
    return GroupSpec(
        name=name,
        worker_type=worker_type,
        num_gpus=_value(node, "num_gpus", "", key, problems),
        num_gpus_per_engine=_value(node, "num_gpus_per_engine", default_gpus_per_engine, key, problems),
        overrides=overrides or {},
        key=key,
    )


def _name_ok(name: str, parent_key: str, what: str, problems: ProblemCollector) -> bool:
    if len(name) > MAX_NAME_LENGTH:
        problems.add(
            f"{parent_key}.{name[:24]}…",
            f"the {what} name is {len(name)} characters long; at most {MAX_NAME_LENGTH} (names become engine "
            "ids and log file names)",
        )
        return False
    return True


def _extra_groups(
    node: DictConfig, key: str, known: list[str], problems: ProblemCollector
) -> dict[str, GroupSpec]:
    """The enabled groups under ``extra_groups`` by name; appends every extra group's name to ``known``."""
    enabled: dict[str, GroupSpec] = {}
    extras = _child(node, "extra_groups", f"{key}.extra_groups", problems)
    if not isinstance(extras, DictConfig):
        return enabled
    for extra_name in extras:
        group_key = f"{key}.extra_groups.{extra_name!s}"
        if extra_name in GROUP_SLOTS:
            problems.add(
                group_key,
                f"{extra_name!r} is already a group slot of the model; give the extra group another name",
            )
            continue
        if not _name_ok(str(extra_name), f"{key}.extra_groups", "group", problems):
            continue
        extra = _typed(
            _child(extras, extra_name, group_key, problems), ExtraServerGroupConf, group_key, problems
        )
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
    given = _child(node, "group_order", f"{key}.group_order", problems)
    order = [str(x) for x in given] if OmegaConf.is_list(given) else []
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
    entries = _resolved(node.get("external"), f"{key}.external", problems)
    if entries is None:
        return ()
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
        slot_node = _typed(
            _child(node, slot, f"{key}.{slot}", problems), ServerGroupConf, f"{key}.{slot}", problems
        )
        if slot_node is None:
            continue
        group = _group(
            slot, WorkerType(slot), slot_node, GROUP_GPUS_PER_ENGINE_DEFAULT, f"{key}.{slot}", problems
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
        external=_external(node, key, problems),
        key=key,
    )


def _spec(node: Any, key: str, problems: ProblemCollector) -> DeploymentSpec | None:
    if node is None:
        return None
    if not isinstance(node, DictConfig):
        problems.add(key, f"must map model names to models, got {node!r}")
        return None
    models = []
    for name in node:
        model_key = f"{key}.{name!s}"
        if not _name_ok(str(name), key, "model", problems):
            continue
        typed = _typed(_child(node, name, model_key, problems), ModelConf, model_key, problems)
        if typed is not None:
            models.append(_model(str(name), typed, model_key, problems))
    return DeploymentSpec(models=tuple(models), source="the Hydra config")


# ------------------------------------------------------------------------------------ trainer, settings
def _trainer(
    cfg: DictConfig, group_node: Any, mapping: TrainerMapping | None, problems: ProblemCollector
) -> TrainerInputs:
    """The trainer's inputs, found from the group outwards (the root when there is no group node); where none
    holds one (or it is null), the trainer mapping's value (``sglang_trainer=verl``)."""
    nodes = list(enclosing_nodes(group_node)) if isinstance(group_node, DictConfig) else [cfg]
    mapped = mapping.values if mapping is not None else {}
    values: dict[str, Any] = {}
    for name in TrainerInputs.field_names():
        try:
            found, value = find_trainer_value(iter(nodes), name)
        except OmegaConfBaseException as exc:
            problems.add(name, first_line(exc))
            continue
        if (not found or value is None) and name in mapped:
            values[name] = mapped[name]
        elif found:
            values[name] = _resolved(value, name, problems) if OmegaConf.is_config(value) else value
    try:
        return TrainerInputs.from_mapping(values)
    except (TypeError, ValueError) as exc:
        problems.add("", f"the trainer's arguments do not read: {first_line(exc)}")
        return TrainerInputs()


def _deploy_settings(
    cfg: DictConfig, problems: ProblemCollector, mapping: TrainerMapping | None = None
) -> SGLangDeployConf:
    """``sglang_deploy`` (resolved in place, then checked against the schema) as a plain dataclass; the
    defaults where the app has none, or where it does not read. The trainer mapping's ServerArgs values
    (``mem_fraction_static`` from the trainer's GPU memory share, ...) sit below ``server_defaults``."""
    node = OmegaConf.select(cfg, DEPLOY_KEY, default=None)
    if node is not None and not isinstance(node, DictConfig):
        problems.add(DEPLOY_KEY, f"must be a mapping (SGLangDeployConf), got {node!r}")
        node = None
    typed = _typed_settings(node) if not problems.problems else None
    if typed is not None:
        return _finished(typed, problems, mapping)
    values = _resolved(node, DEPLOY_KEY, problems) if node is not None else {}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(SGLangDeployConf), values or {})
        # The object of a node merged into SGLangDeployConf's structured config is an SGLangDeployConf.
        settings = cast(SGLangDeployConf, OmegaConf.to_object(merged))
    except OmegaConfBaseException as exc:
        where = getattr(exc, "full_key", None)
        key = f"{DEPLOY_KEY}.{where}" if where else DEPLOY_KEY
        if key not in {problem.key for problem in problems.problems}:  # an unknown key, reported already
            problems.add(key, first_line(exc))
        settings = SGLangDeployConf()
    return _finished(settings, problems, mapping)


def _typed_settings(node: Any) -> SGLangDeployConf | None:
    """``node`` as a :class:`SGLangDeployConf` where it is one already (composed from the schema: typed and
    checked by Hydra) and reads whole: ``OmegaConf.to_object`` of it, 0.5 ms against the 15 ms of building the
    schema anew and merging the node's values into it. None where it is not, or does not read (the full path
    then says what is wrong, as before)."""
    if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is not SGLangDeployConf:
        return None
    try:
        settings = OmegaConf.to_object(node)
    except (OmegaConfBaseException, TypeError, ValueError):
        return None
    return settings if isinstance(settings, SGLangDeployConf) else None


def _finished(
    settings: SGLangDeployConf, problems: ProblemCollector, mapping: TrainerMapping | None = None
) -> SGLangDeployConf:
    if mapping is not None and mapping.server_defaults:  # below what the app set
        settings.server_defaults = {**mapping.server_defaults, **settings.server_defaults}
    if settings.api_key is None:
        settings.api_key = _api_key_from_env(problems)
    settings.launch.host = str(settings.launch.host).strip().strip("[]")
    return settings


def _api_key_from_env(problems: ProblemCollector) -> str | None:
    """``$SGLANG_API_KEY`` (None when unset or empty); a value that cannot be a key is a problem of that
    variable, not of ``sglang_deploy.api_key``."""
    key = os.environ.get(API_KEY_ENV) or None
    problem = secret_value_problem(key)
    if problem is not None:
        problems.add(f"{API_KEY_ENV} (environment variable)", problem)
        return None
    return key


def _group_key(cfg: DictConfig, sglang_key: str | None, problems: ProblemCollector) -> str:
    keys = sglang_keys(cfg, sglang_key)
    if len(keys) > 1:
        problems.add(
            SGLANG_KEY,
            f"the sglang group is placed at {len(keys)} keys ({', '.join(keys)}); one deployment per app: "
            "pass the one to use (sglang_key=...)",
        )
    return keys[0]


def _group_node(cfg: DictConfig, key: str, explicit: bool, problems: ProblemCollector) -> Any:
    try:
        node = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=True)
    except OmegaConfBaseException as exc:
        problems.add(key, first_line(exc))
        return None
    if node is None and explicit:
        problems.add(key, "no sglang group here (sglang_key points at a key the config does not have)")
    return node


def read_config(cfg: DictConfig, *, sglang_key: str | None = None) -> ConfigReading:
    """Everything resolution needs from a composed config, every problem in one
    :class:`~miles_sglang_plugin.errors.DeploymentConfigError`. ``sglang_key``: where the group is (default:
    where Hydra placed it, else ``sglang``)."""
    register_resolvers()
    problems = ProblemCollector("the Hydra config")
    key = _group_key(cfg, sglang_key, problems)
    group_node = _group_node(cfg, key, sglang_key is not None, problems)
    if _dataclass_of(cfg) is not None:
        unknown_keys(cfg, "", problems, recurse=False)  # a typed root: +foo=1 is a vanishing key too
    for node, node_key in ((group_node, key), (OmegaConf.select(cfg, DEPLOY_KEY, default=None), DEPLOY_KEY)):
        if isinstance(node, DictConfig):
            unknown_keys(node, node_key, problems)
    _helper_group_problems(cfg, key, problems)
    mapping = trainer_mapping(cfg)
    if mapping is not None:
        problems.extend(mapping.problems)
    trainer = _trainer(cfg, group_node, mapping, problems)
    settings = _deploy_settings(cfg, problems, mapping)
    _skyrl_api_key_problem(cfg, mapping, settings, problems)
    spec = _spec(group_node, key, problems)
    _pd_shape_problems(spec, mapping, key, problems)
    problems.raise_if_any()
    return ConfigReading(spec=spec, trainer=trainer, settings=settings, sglang_key=key, mapping=mapping)


def _skyrl_api_key_problem(
    cfg: DictConfig, mapping: TrainerMapping | None, settings: SGLangDeployConf, problems: ProblemCollector
) -> None:
    """With ``sglang_trainer=skyrl`` SkyRL's own client talks to the engines (its remote engines, filled by
    ``fill_skyrl_engine_urls``). skyrl-train 0.3.1's client sends no API key and its config has no setting for
    one, so engines started with a key would refuse each of its requests (401): refused here, naming where the
    key came from."""
    if mapping is None or mapping.trainer != TrainerKind.skyrl or settings.api_key is None:
        return
    in_config = OmegaConf.select(
        cfg, f"{DEPLOY_KEY}.api_key", default=None, throw_on_resolution_failure=False
    )
    where = f"{DEPLOY_KEY}.api_key" if in_config is not None else f"{API_KEY_ENV} (environment variable)"
    problems.add(
        where,
        "is set, but with sglang_trainer=skyrl SkyRL's own client sends the rollout requests, and it sends no API "
        "key (skyrl-train has no setting for one): the engines would answer each request with 401 Unauthorized. "
        "Unset it for this deployment (keep the engines on a network only the trainer reaches; "
        "docs/trainers/skyrl.md)",
    )


def _pd_shape_problems(
    spec: DeploymentSpec | None, mapping: TrainerMapping | None, key: str, problems: ProblemCollector
) -> None:
    """The trainer turns PD on (verl's ``disaggregation.enabled``), but the deployment has no PD model: its
    prefill and decode sizes would go nowhere."""
    if mapping is None or mapping.pd_key is None or spec is None:
        return
    if not any(g.worker_type == WorkerType.prefill for m in spec.models for g in m.groups):
        problems.add(
            mapping.pd_key,
            f"is true, but the deployment at {key} has no prefill and decode groups: pick a PD preset "
            f"(sglang@{key}=pd), whose groups then follow the trainer's prefill and decode replicas",
        )


# ------------------------------------------------------------------------------- one part at a time
def spec_from_config(
    cfg: DictConfig, problems: ProblemCollector | None = None, *, sglang_key: str | None = None
) -> DeploymentSpec | None:
    """The deployment described at the group's node (None when the app has none)."""
    collector = problems if problems is not None else ProblemCollector("the Hydra config")
    key = _group_key(cfg, sglang_key, collector)
    spec = _spec(_group_node(cfg, key, sglang_key is not None, collector), key, collector)
    if problems is None:
        collector.raise_if_any()
    return spec


def deploy_settings_from_config(cfg: DictConfig) -> SGLangDeployConf:
    """``cfg.sglang_deploy`` as a plain :class:`SGLangDeployConf` (defaults if the app has none). The API key
    comes from the environment (``SGLANG_API_KEY``) unless the config sets one, so that it stays out of the
    config Hydra prints and saves; an IPv6 ``launch.host`` is kept without brackets."""
    problems = ProblemCollector("the Hydra config")
    settings = _deploy_settings(cfg, problems, trainer_mapping(cfg))
    problems.raise_if_any()
    return settings


def trainer_from_config(cfg: DictConfig, *, sglang_key: str | None = None) -> TrainerInputs:
    """The trainer's inputs (Miles' names), found from the group outwards; absent keys take defaults."""
    register_resolvers()
    problems = ProblemCollector("the Hydra config")
    key = _group_key(cfg, sglang_key, problems)
    trainer = _trainer(cfg, _group_node(cfg, key, False, problems), trainer_mapping(cfg), problems)
    problems.raise_if_any()
    return trainer
