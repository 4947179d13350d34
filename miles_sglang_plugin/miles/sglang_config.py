"""Miles/slime ``--sglang-config`` YAML files, in both directions.

- :func:`load_miles_config`: a Miles/slime file (or Miles' inline ``base64:`` form) → :class:`DeploymentSpec`.
  The file is checked as strictly as Miles checks it (unknown keys, both spellings of a key, worker types,
  GPU counts), and every problem is reported at once, each under a key that names the file, the model (by
  index and name) and the field, e.g. ``sglang_agent.yaml: sglang[1] (ref).server_groups[0].num_gpus``. The
  spec's model and group keys carry the same locations, so resolution errors also point into the file.
- :func:`spec_to_preset`: a spec → a preset of the ``sglang`` Hydra config group (``conf/sglang/<name>.yaml``).
- :func:`spec_to_miles_yaml` / :func:`miles_trainer_args`: a resolved plan → the file and the command-line
  arguments with which Miles' own launcher resolves the same deployment.

Group names in a spec loaded from a file: the worker type for the first group of each type (``prefill``,
``decode``, ``regular``, ``placeholder``: the preset's fixed slots) and ``<type>_2``, ``<type>_3``… for further
groups of that type (the preset's ``extra_groups``).
"""

from __future__ import annotations

import base64
import binascii
import difflib
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from miles_sglang_plugin.config.deployment_spec import (
    NAME_RE,
    WORKER_TYPES,
    DeploymentSpec,
    GroupSpec,
    ModelSpec,
    WorkerType,
    is_int,
    thaw,
)
from miles_sglang_plugin.config.schema import GROUP_SLOTS
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError, ProblemCollector
from miles_sglang_plugin.miles.bounded_yaml import (
    MAX_CONFIG_BYTES,
    ConfigSourceError,
    parse_yaml,
    read_bytes_bounded,
    too_big_message,
)
from miles_sglang_plugin.planning.plan import DeploymentPlan, ModelPlan
from miles_sglang_plugin.planning.resolution import eval_fleet_alone, legacy_spec, normalise_overrides

#: Miles' inline form of ``--sglang-config``: ``base64:<base64 of the YAML text>``.
BASE64_PREFIX = "base64:"
#: How a ``base64:`` source is named in messages.
BASE64_LABEL = "<base64 --sglang-config>"

TOP_LEVEL_KEYS = ("sglang", "models")
MODEL_KEYS = ("name", "model_path", "num_gpus_per_engine", "update_weights", "server_groups", "engine_groups")
GROUP_KEYS = ("worker_type", "num_gpus", "num_gpus_per_engine", "overrides")

#: A model name that can be a key of the ``sglang`` node and a package in a defaults list.
HYDRA_KEY_RE = NAME_RE
#: Names a model of a preset cannot have: they collide with the preset's own keys or Hydra's keywords.
RESERVED_MODEL_NAMES = frozenset({"sglang_deploy", "defaults", "_self_", "_global_", "_group_", "_name_"})


# ================================================================================================== loading
def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    return f"a {type(value).__name__}"


def _did_you_mean(name: Any, candidates: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(name).replace("-", "_"), candidates, n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _read_source(source: str | os.PathLike[str], problems: ProblemCollector) -> tuple[str, str, str | None]:
    """(label for keys, source for the error head, YAML text or None when unreadable)."""
    if isinstance(source, str) and source.startswith(BASE64_PREFIX):
        payload = source[len(BASE64_PREFIX) :].strip()
        if len(payload) > (MAX_CONFIG_BYTES + 2) // 3 * 4:
            problems.add(BASE64_LABEL, too_big_message())
            return BASE64_LABEL, BASE64_LABEL, None
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            problems.add(
                BASE64_LABEL,
                f"is not valid base64 ({exc}); Miles' inline form is base64:<base64 of the YAML>",
            )
            return BASE64_LABEL, BASE64_LABEL, None
        try:
            return BASE64_LABEL, BASE64_LABEL, raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.add(BASE64_LABEL, f"does not decode to UTF-8 text ({exc})")
            return BASE64_LABEL, BASE64_LABEL, None
    path = Path(os.fspath(source))
    label = path.name or str(path)
    try:
        return label, str(path), read_bytes_bounded(path).decode("utf-8")
    except FileNotFoundError:
        problems.add(label, f"no such file: {str(path)!r}")
    except ConfigSourceError as exc:
        problems.add(label, f"{str(path)!r} {exc}")
    except UnicodeDecodeError as exc:
        problems.add(label, f"is not UTF-8 text ({exc})")
    except OSError as exc:
        problems.add(label, f"cannot be read: {exc.strerror or exc}")
    return label, str(path), None


def _check_keys(
    mapping: Mapping[Any, Any], allowed: tuple[str, ...], where: str, what: str, problems: ProblemCollector
) -> None:
    for key in mapping:
        if key not in allowed:
            problems.add(
                f"{where}.{key}" if where else str(key),
                f"unknown {what} key{_did_you_mean(key, allowed)} (valid: {', '.join(allowed)})",
            )


def _worker_type_ok(raw_group: Mapping[Any, Any], group_key: str, problems: ProblemCollector) -> bool:
    key = f"{group_key}.worker_type"
    valid = ", ".join(WORKER_TYPES)
    if "worker_type" not in raw_group:
        problems.add(key, f"is required ({valid})")
        return False
    worker_type = raw_group["worker_type"]
    if worker_type == "encoder":
        problems.add(
            key,
            "'encoder' (slime's encoder/EPD worker) is not supported: slime starts its encoder engines first "
            "and hands their URLs to the model's prefill and regular engines (encoder_urls, language_only), "
            f"outside the router; Miles and this plugin have no encoder worker type; valid: {valid}",
        )
        return False
    if not isinstance(worker_type, str) or worker_type not in WORKER_TYPES:
        hint = _did_you_mean(worker_type, WORKER_TYPES) if isinstance(worker_type, str) else ""
        problems.add(key, f"{worker_type!r} is not a worker type{hint} (valid: {valid})")
        return False
    return True


def _group_num_gpus_ok(raw_group: Mapping[Any, Any], group_key: str, problems: ProblemCollector) -> bool:
    num_gpus = raw_group.get("num_gpus")
    if "num_gpus" not in raw_group:
        problems.add(f"{group_key}.num_gpus", "is required: the group's total GPU count, an integer > 0")
        return False
    if not is_int(num_gpus) or num_gpus < 1:
        problems.add(f"{group_key}.num_gpus", f"must be an integer > 0, got {num_gpus!r}")
        return False
    return True


def _group_gpus_per_engine_ok(
    raw_group: Mapping[Any, Any], group_key: str, model_gpus_per_engine_key: str, problems: ProblemCollector
) -> bool:
    gpus_per_engine = raw_group.get("num_gpus_per_engine")
    if gpus_per_engine is not None and (not is_int(gpus_per_engine) or gpus_per_engine < 1):
        problems.add(
            f"{group_key}.num_gpus_per_engine",
            f"must be an integer > 0 (or left out to inherit {model_gpus_per_engine_key}), "
            f"got {gpus_per_engine!r}",
        )
        return False
    return True


def _group_overrides_ok(raw_group: Mapping[Any, Any], group_key: str, problems: ProblemCollector) -> bool:
    overrides = raw_group.get("overrides")
    if overrides is None:
        return True
    if not isinstance(overrides, Mapping):
        problems.add(
            f"{group_key}.overrides",
            f"must be a mapping of SGLang ServerArgs field -> value, got {_type_name(overrides)} ({overrides!r})",
        )
        return False
    ok = True
    for key in overrides:
        if not isinstance(key, str):
            problems.add(
                f"{group_key}.overrides.{key}",
                f"override keys are ServerArgs field names (strings), got {key!r}",
            )
            ok = False
    return ok


def _load_group(
    raw_group: Any,
    group_key: str,
    model_gpus_per_engine_key: str,
    counts: dict[str, int],
    problems: ProblemCollector,
) -> GroupSpec | None:
    if not isinstance(raw_group, Mapping):
        problems.add(
            group_key,
            "a server group must be a mapping with worker_type and num_gpus, got "
            f"{_type_name(raw_group)} ({raw_group!r})",
        )
        return None
    _check_keys(raw_group, GROUP_KEYS, group_key, "server group", problems)
    checks = (
        _worker_type_ok(raw_group, group_key, problems),
        _group_num_gpus_ok(raw_group, group_key, problems),
        _group_gpus_per_engine_ok(raw_group, group_key, model_gpus_per_engine_key, problems),
        _group_overrides_ok(raw_group, group_key, problems),
    )
    if not all(checks):
        return None
    worker_type = raw_group["worker_type"]
    counts[worker_type] = counts.get(worker_type, 0) + 1
    name = worker_type if counts[worker_type] == 1 else f"{worker_type}_{counts[worker_type]}"
    return GroupSpec(
        name=name,
        worker_type=WorkerType(worker_type),
        num_gpus=raw_group["num_gpus"],
        num_gpus_per_engine=raw_group.get("num_gpus_per_engine"),
        overrides=dict(raw_group.get("overrides") or {}),
        key=group_key,
    )


def _model_name_ok(raw_model: Mapping[Any, Any], model_key: str, problems: ProblemCollector) -> bool:
    name = raw_model.get("name")
    if "name" not in raw_model:
        problems.add(f"{model_key}.name", "is required: a unique model name (e.g. actor, ref, reward)")
        return False
    if not isinstance(name, str) or not name:
        problems.add(f"{model_key}.name", f"must be a non-empty string, got {name!r}")
        return False
    return True


def _model_values_ok(raw_model: Mapping[Any, Any], model_key: str, problems: ProblemCollector) -> bool:
    """``model_path``, ``update_weights`` and ``num_gpus_per_engine``, each optional."""
    ok = True
    model_path = raw_model.get("model_path")
    if model_path is not None and not isinstance(model_path, str):
        problems.add(
            f"{model_key}.model_path",
            f"must be a string (a checkpoint path), got {_type_name(model_path)} ({model_path!r})",
        )
        ok = False
    update_weights = raw_model.get("update_weights")
    if update_weights is not None and not isinstance(update_weights, bool):
        problems.add(
            f"{model_key}.update_weights",
            f"must be true, false or left out (inferred), got {update_weights!r}",
        )
        ok = False
    gpus_per_engine = raw_model.get("num_gpus_per_engine")
    if gpus_per_engine is not None and (not is_int(gpus_per_engine) or gpus_per_engine < 1):
        problems.add(f"{model_key}.num_gpus_per_engine", f"must be an integer > 0, got {gpus_per_engine!r}")
        ok = False
    return ok


def _raw_server_groups(
    raw_model: Mapping[Any, Any], model_key: str, problems: ProblemCollector
) -> tuple[str, list[Any]] | None:
    """(the spelling used: ``server_groups`` or its alias ``engine_groups``, the list of groups). A model without
    groups (the key left out or an empty list) is read as Miles' ``from_yaml`` and slime read it
    (``m.get("server_groups") or m.get("engine_groups") or []``): a router whose engines are external, which
    resolution accepts only when the model is given external engines."""
    if "server_groups" in raw_model and "engine_groups" in raw_model:
        problems.add(
            f"{model_key}.engine_groups",
            "both server_groups and its legacy alias engine_groups are given; keep only server_groups",
        )
        return None
    spelling = "engine_groups" if "engine_groups" in raw_model else "server_groups"
    raw_groups = raw_model.get(spelling)
    if raw_groups is None:
        return spelling, []
    if not isinstance(raw_groups, list):
        hint = (
            " (write each group as a list item: '- worker_type: ...')"
            if isinstance(raw_groups, Mapping)
            else ""
        )
        problems.add(
            f"{model_key}.{spelling}", f"must be a list of server groups, got {_type_name(raw_groups)}{hint}"
        )
        return None
    return spelling, raw_groups


def _load_model(raw_model: Any, model_key: str, problems: ProblemCollector) -> ModelSpec | None:
    if not isinstance(raw_model, Mapping):
        problems.add(
            model_key,
            f"a model must be a mapping (name, server_groups, ...), "
            f"got {_type_name(raw_model)} ({raw_model!r})",
        )
        return None
    _check_keys(raw_model, MODEL_KEYS, model_key, "model", problems)
    checks = (
        _model_name_ok(raw_model, model_key, problems),
        _model_values_ok(raw_model, model_key, problems),
    )
    found = _raw_server_groups(raw_model, model_key, problems)
    if found is None:
        return None
    spelling, raw_groups = found
    counts: dict[str, int] = {}
    groups = [
        _load_group(
            raw_group, f"{model_key}.{spelling}[{j}]", f"{model_key}.num_gpus_per_engine", counts, problems
        )
        for j, raw_group in enumerate(raw_groups)
    ]
    if not all(checks) or any(group is None for group in groups):
        return None
    return ModelSpec(
        name=raw_model["name"],
        groups=tuple(group for group in groups if group is not None),
        model_path=raw_model.get("model_path"),
        update_weights=raw_model.get("update_weights"),
        num_gpus_per_engine=raw_model.get("num_gpus_per_engine"),
        key=model_key,
    )


def _misplaced_top_level_key(key: Any) -> str:
    """What to say about a top-level key that is neither ``sglang`` nor ``models``."""
    if key in ("server_groups", "engine_groups"):
        return (
            "belongs to a model: wrap your server_groups inside a model entry under 'sglang', e.g. "
            "'sglang: [{name: actor, server_groups: [...]}]'"
        )
    if key in MODEL_KEYS:
        return "is a model key: put the model as a list item under 'sglang'"
    return f"unknown top-level key{_did_you_mean(key, TOP_LEVEL_KEYS)} (valid: sglang, or its alias models)"


def _check_top_level_mapping(data: Any, label: str, problems: ProblemCollector) -> None:
    """Raise unless the file's top level is a mapping."""
    if data is None:
        problems.add(label, "is empty; expected a top-level 'sglang' key holding a list of models")
        problems.raise_if_any()
    if not isinstance(data, Mapping):
        hint = ""
        if isinstance(data, list):
            hint = "; put the list of models under a top-level key: 'sglang:'"
        problems.add(
            label,
            f"the top level must be a mapping with key 'sglang' (a list of models), got {_type_name(data)}{hint}",
        )
        problems.raise_if_any()


def _check_models_list(raw_models: Any, where: str, problems: ProblemCollector) -> None:
    """Raise unless the models are a non-empty list."""
    if not isinstance(raw_models, list):
        hint = ""
        if isinstance(raw_models, Mapping):
            hint = " (write each model as a list item with a name: '- name: actor')"
        problems.add(where, f"must be a list of models, got {_type_name(raw_models)}{hint}")
        problems.raise_if_any()
    if not raw_models:
        problems.add(where, "is empty; give at least one model")
        problems.raise_if_any()


def _top_level_models(data: Any, label: str, problems: ProblemCollector) -> tuple[str, list[Any]]:
    """(the top-level key used: ``sglang`` or its alias ``models``, the list of models); raises when the file
    has no usable list of models."""
    _check_top_level_mapping(data, label, problems)
    spellings = [key for key in TOP_LEVEL_KEYS if key in data]
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            problems.add(f"{label}: {key}", _misplaced_top_level_key(key))
    if not spellings:
        problems.add(
            f"{label}: sglang",
            "is missing: the top-level key 'sglang' (or 'models') must hold the list of models",
        )
        problems.raise_if_any()
    if len(spellings) > 1:
        problems.add(f"{label}: models", "both 'sglang' and its alias 'models' are given; keep only 'sglang'")
        problems.raise_if_any()
    top = spellings[0]
    raw_models = data[top]
    _check_models_list(raw_models, f"{label}: {top}", problems)
    return top, raw_models


def _load_models(
    raw_models: list[Any], label: str, top: str, problems: ProblemCollector
) -> list[ModelSpec | None]:
    """Every model of the list (None where it does not load); model names must be unique."""
    models: list[ModelSpec | None] = []
    first_index: dict[str, int] = {}
    for i, raw_model in enumerate(raw_models):
        written = raw_model.get("name") if isinstance(raw_model, Mapping) else None
        name = written if isinstance(written, str) and written else None
        model_key = f"{label}: {top}[{i}]" + (f" ({name})" if name is not None else "")
        if name is not None and name in first_index:
            problems.add(
                f"{model_key}.name",
                f"model name {name!r} is already used by {top}[{first_index[name]}]; model names must be "
                "unique (each model gets its own router)",
            )
        elif name is not None:
            first_index[name] = i
        models.append(_load_model(raw_model, model_key, problems))
    return models


def load_miles_config(source: str | os.PathLike[str]) -> DeploymentSpec:
    """Read a Miles/slime ``--sglang-config`` (a file path, or ``base64:<base64 of the YAML>``).

    Raises one :class:`DeploymentConfigError` listing every problem found in the file.
    """
    problems = ProblemCollector()
    label, origin, text = _read_source(source, problems)
    problems.source = origin
    if text is None:
        problems.raise_if_any()
    assert text is not None
    parsed, data = parse_yaml(text, label, problems)
    if not parsed:
        problems.raise_if_any()
    top, raw_models = _top_level_models(data, label, problems)
    models = _load_models(raw_models, label, top, problems)
    problems.raise_if_any()
    return DeploymentSpec(
        models=tuple(model for model in models if model is not None),
        source=origin,
        drops_unknown_override_keys=True,
    )


# ============================================================================================ Hydra preset
def _yaml_implicit_tag(value: str) -> str:
    """The tag OmegaConf's (Hydra's) YAML loader gives ``value`` written as a plain scalar."""
    from omegaconf._utils import get_yaml_loader

    loader = get_yaml_loader()("")
    try:
        tag: str = loader.resolve(yaml.ScalarNode, value, (True, False))
        return tag
    finally:
        loader.dispose()


class _MilesDumper(yaml.SafeDumper):
    """Block lists indented under their key."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


class _PresetDumper(_MilesDumper):
    """Also quotes strings wherever Hydra's YAML loader would read them as something else (``1e3`` is a float
    to Hydra, a string to PyYAML)."""


def _represent_preset_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    node = dumper.represent_scalar("tag:yaml.org,2002:str", data)
    if "\n" not in data and _yaml_implicit_tag(data) != "tag:yaml.org,2002:str":
        node.style = "'"
    return node


_PresetDumper.add_representer(str, _represent_preset_str)


_INTERPOLATION_RE = re.compile(r"(\\*)\$\{")


def _escape_interpolations(value: Any) -> Any:
    """Strings as OmegaConf literals: ``${`` (preceded by k backslashes) becomes 2k+1 backslashes + ``${``."""
    if isinstance(value, str):
        return _INTERPOLATION_RE.sub(lambda match: match.group(1) * 2 + "\\${", value)
    if isinstance(value, Mapping):
        return {k: _escape_interpolations(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_interpolations(v) for v in value]
    return value


_PLAIN_TYPES = (str, int, float, bool, type(None))


def _unrepresentable(value: Any, key: str) -> list[tuple[str, str]]:
    """(key, type) of every value a Hydra config cannot hold."""
    if isinstance(value, Mapping):
        out = []
        for name, item in value.items():
            if not isinstance(name, str):
                out.append((f"{key}.{name}", f"key of type {type(name).__name__}"))
            out.extend(_unrepresentable(item, f"{key}.{name}"))
        return out
    if isinstance(value, list | tuple):
        return [x for i, v in enumerate(value) for x in _unrepresentable(v, f"{key}[{i}]")]
    if not isinstance(value, _PLAIN_TYPES):
        return [(key, f"value {value!r} of type {type(value).__name__}")]
    return []


def _first_difference(expected: Any, actual: Any, key: str) -> str | None:
    """Where ``actual`` differs from ``expected``, types included (``1``, ``1.0`` and ``True`` differ)."""
    if isinstance(expected, Mapping):
        return _first_mapping_difference(expected, actual, key)
    if isinstance(expected, list):
        return _first_list_difference(expected, actual, key)
    if type(expected) is not type(actual):
        return key
    if isinstance(expected, float) and math.isnan(expected) and math.isnan(actual):
        return None
    return None if expected == actual else key


def _first_mapping_difference(expected: Mapping[Any, Any], actual: Any, key: str) -> str | None:
    if not isinstance(actual, Mapping) or list(expected) != list(actual):
        return key
    for name in expected:
        difference = _first_difference(expected[name], actual[name], f"{key}.{name}")
        if difference:
            return difference
    return None


def _first_list_difference(expected: list[Any], actual: Any, key: str) -> str | None:
    if not isinstance(actual, list) or len(expected) != len(actual):
        return key
    for i, (expected_item, actual_item) in enumerate(zip(expected, actual, strict=True)):
        difference = _first_difference(expected_item, actual_item, f"{key}[{i}]")
        if difference:
            return difference
    return None


def _group_location(group: GroupSpec, model: ModelSpec) -> str:
    return group.key or f"sglang.{model.name}.{group.name}"


def _preset_model_name_ok(
    model: ModelSpec, written: Mapping[str, Any], model_key: str, problems: ProblemCollector
) -> bool:
    """Whether the model's name can be a key of the preset (valid, not reserved, not written already)."""
    if not isinstance(model.name, str) or not HYDRA_KEY_RE.match(model.name):
        problems.add(
            f"{model_key}.name",
            f"model name {model.name!r} cannot be a key of the Hydra 'sglang' node: it must start with a letter or "
            "'_' and hold only letters, digits, '_' or '-'; rename the model",
        )
        return False
    if model.name in RESERVED_MODEL_NAMES:
        problems.add(
            f"{model_key}.name", f"model name {model.name!r} is reserved in a preset; rename the model"
        )
        return False
    if model.name in written:
        problems.add(f"{model_key}.name", f"model name {model.name!r} is used more than once")
        return False
    return True


def _preset_model_values(model: ModelSpec, model_key: str, problems: ProblemCollector) -> dict[str, Any]:
    """The model's optional values, only where the spec gives them (the others keep inheriting)."""
    node: dict[str, Any] = {}
    if model.model_path is not None:
        if not isinstance(model.model_path, str):
            problems.add(f"{model_key}.model_path", f"must be a string, got {model.model_path!r}")
        node["model_path"] = model.model_path
    if model.update_weights is not None:
        if not isinstance(model.update_weights, bool):
            problems.add(
                f"{model_key}.update_weights", f"must be true or false, got {model.update_weights!r}"
            )
        node["update_weights"] = model.update_weights
    if model.num_gpus_per_engine is not None:
        if not is_int(model.num_gpus_per_engine) or model.num_gpus_per_engine < 1:
            problems.add(
                f"{model_key}.num_gpus_per_engine",
                f"must be an integer > 0, got {model.num_gpus_per_engine!r}",
            )
        node["num_gpus_per_engine"] = model.num_gpus_per_engine
    return node


def _preset_group(
    group: GroupSpec, group_key: str, problems: ProblemCollector
) -> tuple[WorkerType, dict[str, Any]] | None:
    """(the group's worker type, its body in a preset), or None when the group cannot be written."""
    try:
        worker_type = WorkerType(str(group.worker_type))
    except ValueError:
        problems.add(
            f"{group_key}.worker_type",
            f"{group.worker_type!r} is not a worker type ({', '.join(WORKER_TYPES)})",
        )
        return None
    if not is_int(group.num_gpus) or group.num_gpus < 1:
        problems.add(
            f"{group_key}.num_gpus",
            f"must be an integer > 0 (a preset's num_gpus: 0 means the group is off), got {group.num_gpus!r}",
        )
        return None
    body: dict[str, Any] = {"num_gpus": group.num_gpus}
    if group.num_gpus_per_engine is not None:
        if not is_int(group.num_gpus_per_engine) or group.num_gpus_per_engine < 1:
            problems.add(
                f"{group_key}.num_gpus_per_engine",
                f"must be an integer > 0, got {group.num_gpus_per_engine!r}",
            )
        body["num_gpus_per_engine"] = group.num_gpus_per_engine
    overrides = thaw(group.overrides)
    for where, what in _unrepresentable(overrides, f"{group_key}.overrides"):
        problems.add(where, f"a Hydra config cannot hold this {what}; write it as a string or a number")
    if overrides:
        body["overrides"] = overrides
    return worker_type, body


def _extra_group_name_ok(
    group: GroupSpec,
    model: ModelSpec,
    extras: Mapping[str, Any],
    group_key: str,
    problems: ProblemCollector,
) -> bool:
    if group.name in GROUP_SLOTS or group.name in extras or not HYDRA_KEY_RE.match(str(group.name)):
        problems.add(
            group_key,
            f"group name {group.name!r} cannot name an extra group of model {model.name!r} (it must be a valid "
            "key, unique, and not one of the slots " + ", ".join(GROUP_SLOTS) + ")",
        )
        return False
    return True


def _preset_groups(model: ModelSpec, problems: ProblemCollector) -> dict[str, Any]:
    """The model's groups in a preset: the slots, ``extra_groups``, and ``group_order`` where the spec's order
    differs from the canonical one."""
    slots: dict[str, dict[str, Any]] = {}
    extras: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    for group in model.groups:
        group_key = _group_location(group, model)
        written = _preset_group(group, group_key, problems)
        if written is None:
            continue
        worker_type, body = written
        if group.name == worker_type.value and worker_type.value not in slots:
            slots[worker_type.value] = body
            order.append(worker_type.value)
        elif _extra_group_name_ok(group, model, extras, group_key, problems):
            extras[group.name] = {"worker_type": worker_type.value, **body}
            order.append(group.name)
    node: dict[str, Any] = {slot: slots[slot] for slot in GROUP_SLOTS if slot in slots}
    if extras:
        node["extra_groups"] = extras
    canonical = [slot for slot in GROUP_SLOTS if slot in slots] + list(extras)
    if order != canonical:
        node["group_order"] = order
    return node


def _preset_models(spec: DeploymentSpec, problems: ProblemCollector) -> dict[str, Any]:
    """The ``sglang`` node of the preset: model name -> model."""
    data: dict[str, Any] = {}
    if not spec.models:
        problems.add("sglang", "no models to write")
    for model in spec.models:
        model_key = model.key or f"sglang.{model.name}"
        if not _preset_model_name_ok(model, data, model_key, problems):
            continue
        node = _preset_model_values(model, model_key, problems)
        node.update(_preset_groups(model, problems))
        data[model.name] = node
    return data


def _preset_text(data: dict[str, Any], source: str | None, notes: tuple[str, ...] = ()) -> str:
    defaults: list[Any] = [{f"/sglang_model@{name}": "base"} for name in data]
    defaults += [{"/sglang_deploy@_global_.sglang_deploy": "default"}, "_self_"]
    head = yaml.dump({"defaults": defaults}, Dumper=_PresetDumper, sort_keys=False, default_flow_style=False)
    body = yaml.dump(
        _escape_interpolations(data),
        Dumper=_PresetDumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
    )
    origin = os.path.basename(source) if source else "a Miles --sglang-config file"
    said = "".join(f"# {' '.join(note.splitlines())}\n" for note in notes)
    return f"# SGLang deployment imported from {origin} (Miles/slime --sglang-config).\n{said}{head}\n{body}"


def spec_to_preset(spec: DeploymentSpec, *, notes: tuple[str, ...] = ()) -> str:
    """A preset of the ``sglang`` config group (a file for ``conf/sglang/<name>.yaml``) describing ``spec``.

    The first group of each worker type goes to the model's slot of that type, further groups to
    ``extra_groups`` (under their spec names); ``group_order`` is written only where the spec's order differs
    from the canonical one. Optional values are written only where the spec gives them, so that the others
    keep inheriting. Anything the preset schema cannot hold is an error, never silently dropped; the text is
    read back with Hydra's YAML loader and compared before it is returned. ``notes`` (e.g. what the import
    left out) become comment lines at its top.
    """
    problems = ProblemCollector(spec.source)
    data = _preset_models(spec, problems)
    problems.raise_if_any()
    text = _preset_text(data, spec.source, notes)
    _verify_preset(text, data, problems)
    return text


def _verify_preset(text: str, data: dict[str, Any], problems: ProblemCollector) -> None:
    """Read ``text`` back the way Hydra does and compare it with ``data``: no silent change of any value."""
    from omegaconf import OmegaConf
    from omegaconf._utils import get_yaml_loader
    from omegaconf.errors import OmegaConfBaseException

    try:
        loaded = yaml.load(text, Loader=get_yaml_loader())
        loaded.pop("defaults", None)
        back = OmegaConf.to_container(OmegaConf.create(loaded), resolve=True)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        problems.add("sglang", f"the preset does not read back as a Hydra config: {str(exc).splitlines()[0]}")
        problems.raise_if_any()
        return
    diff = _first_difference(data, back, "sglang")
    if diff:
        problems.add(
            diff, "a Hydra config cannot hold this value unchanged; write it differently in the source file"
        )
    problems.raise_if_any()


# ============================================================================================== Miles YAML
def _legacy_or_given(spec: DeploymentSpec | None, plan: DeploymentPlan) -> DeploymentSpec:
    if spec is not None:
        return spec
    problems = ProblemCollector("trainer arguments")
    legacy = legacy_spec(plan.trainer, problems)
    problems.raise_if_any()
    return legacy


def _miles_server_groups(
    model_spec: ModelSpec, model_plan: ModelPlan, trainer: TrainerInputs, problems: ProblemCollector
) -> list[dict[str, Any]]:
    """The model's ``server_groups`` for Miles: the plan's groups, with the user's own overrides."""
    model_key = model_spec.key or f"sglang.{model_spec.name}"
    spec_groups = {group.name: group for group in model_spec.groups}
    groups_out: list[dict[str, Any]] = []
    for group_plan in model_plan.groups:
        group_spec = spec_groups.get(group_plan.name)
        if group_spec is None:
            problems.add(f"{model_key}.{group_plan.name}", "is in the plan but not in the spec")
            continue
        user = normalise_overrides(
            group_spec.overrides, f"{_group_location(group_spec, model_spec)}.overrides", problems
        )
        if model_plan.is_eval:
            eval_overrides = normalise_overrides(
                trainer.eval_sglang_overrides, "eval_sglang_overrides", problems
            )
            user = {**eval_overrides, **user}
        group: dict[str, Any] = {"worker_type": group_plan.worker_type.value, "num_gpus": group_plan.num_gpus}
        if group_plan.worker_type is not WorkerType.placeholder or group_spec.num_gpus_per_engine is not None:
            group["num_gpus_per_engine"] = group_plan.num_gpus_per_engine
        if user:
            group["overrides"] = thaw(user)
        groups_out.append(group)
    return groups_out


def spec_to_miles_yaml(spec: DeploymentSpec | None, plan: DeploymentPlan) -> str:
    """The ``--sglang-config`` file with which Miles resolves the deployment of ``plan`` (resolved from
    ``spec``; None: the legacy deployment of the trainer arguments), whatever Miles' own defaults.

    Explicit per model: ``model_path`` (the model-level path the resolver injected into every group),
    ``update_weights``; per serving group: ``num_gpus_per_engine``. Group ``overrides`` are the user's own
    (underscore spelling), not the values the resolver injects (``model_path``, ``enable_memory_saver``, the
    eval defaults), which Miles injects itself from the same trainer arguments (:func:`miles_trainer_args`).
    The eval model's groups also carry the trainer's ``eval_sglang_overrides`` (Miles' ``--eval-sglang-*``),
    below the group's own values, as in Miles' layering.
    """
    trainer = plan.trainer
    problems = ProblemCollector(plan.source)
    if not plan.models:
        problems.add(
            "sglang", "the plan has no models (debug_train_only?): there is nothing to write for Miles"
        )
        problems.raise_if_any()
    spec = _legacy_or_given(spec, plan)
    if trainer.debug_train_only:
        spec = eval_fleet_alone(spec)[0]  # what started, as Miles wants the file then: the eval model alone
    if [model.name for model in spec.models] != [model.name for model in plan.models]:
        problems.add(
            "sglang",
            "the spec and the plan describe different models; pass the spec the plan was resolved from",
        )
        problems.raise_if_any()

    models_out: list[dict[str, Any]] = []
    for model_spec, model_plan in zip(spec.models, plan.models, strict=True):
        if model_plan.external:
            problems.add(
                f"{model_spec.key or 'sglang.' + model_plan.name}.external",
                "external engines are not part of a Miles --sglang-config (Miles takes them as "
                "--rollout-external-engine-addrs, and refuses them together with a config)",
            )
        entry: dict[str, Any] = {"name": model_plan.name}
        model_level_path = model_spec.model_path or trainer.hf_checkpoint
        if model_level_path:
            entry["model_path"] = model_level_path
        entry["update_weights"] = model_plan.update_weights
        entry["server_groups"] = _miles_server_groups(model_spec, model_plan, trainer, problems)
        models_out.append(entry)
    problems.raise_if_any()
    return yaml.dump(
        {"sglang": models_out},
        Dumper=_MilesDumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
    )


#: Trainer inputs that change the deployment (placement, offload, engine arguments), as Miles flags; written
#: when they differ from Miles' defaults. Inputs this version of TrainerInputs lacks are skipped.
_TRAINER_FLAGS: tuple[tuple[str, str], ...] = (
    ("num_gpus_per_node", "--num-gpus-per-node"),
    ("actor_num_nodes", "--actor-num-nodes"),
    ("actor_num_gpus_per_node", "--actor-num-gpus-per-node"),
    ("colocate", "--colocate"),
    ("offload_rollout", "--offload-rollout"),
    ("use_critic", "--use-critic"),
    ("critic_num_nodes", "--critic-num-nodes"),
    ("critic_num_gpus_per_node", "--critic-num-gpus-per-node"),
    ("critic_train_only", "--critic-train-only"),
    ("debug_rollout_only", "--debug-rollout-only"),
    ("debug_train_only", "--debug-train-only"),
    ("use_rollout_routing_replay", "--use-rollout-routing-replay"),
    ("use_rollout_indexer_replay", "--use-rollout-indexer-replay"),
    ("fp16", "--fp16"),
)


def miles_trainer_args(plan: DeploymentPlan, *, sglang_config: str | None = None) -> list[str]:
    """Miles' command-line arguments that go with :func:`spec_to_miles_yaml`'s file: ``--rollout-num-gpus``
    (eval excluded, as Miles counts it), ``--rollout-num-gpus-per-engine``, ``--hf-checkpoint`` when set, the
    eval fleet's ``--eval-num-gpus`` (and ``--eval-num-gpus-per-engine`` when set), and the inputs that differ
    from Miles' defaults and change the deployment (placement, hence ``rollout_offset`` and ``needs_offload``;
    routing replay, fp16), except those Miles derives itself from the others (``plan.derived``: e.g.
    ``--offload-rollout`` under ``--colocate``)."""
    trainer = plan.trainer
    args: list[str] = []
    if sglang_config is not None:
        args += ["--sglang-config", sglang_config]
    args += ["--rollout-num-gpus", str(plan.rollout_num_gpus)]
    args += ["--rollout-num-gpus-per-engine", str(trainer.rollout_num_gpus_per_engine)]
    if trainer.hf_checkpoint:
        args += ["--hf-checkpoint", trainer.hf_checkpoint]
    defaults = TrainerInputs()
    for name, flag in _TRAINER_FLAGS:
        value = getattr(trainer, name, None)
        if value is None or value == getattr(defaults, name, None) or name in plan.derived:
            continue  # Miles' default, or a value Miles derives from the other arguments itself
        if isinstance(value, bool):
            if value:
                args.append(flag)
            elif name == "offload_rollout" and trainer.colocate:
                args.append("--no-offload-rollout")  # Miles would turn it on with --colocate
        else:
            args += [flag, str(value)]
    if trainer.eval_num_gpus > 0:
        args += ["--eval-num-gpus", str(trainer.eval_num_gpus)]
        args += ["--eval-num-gpus-per-engine", str(trainer.eval_num_gpus_per_engine)]
    return args


__all__ = [
    "BASE64_PREFIX",
    "DeploymentConfigError",
    "load_miles_config",
    "miles_trainer_args",
    "spec_to_miles_yaml",
    "spec_to_preset",
]
