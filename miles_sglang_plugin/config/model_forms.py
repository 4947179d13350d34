"""The forms a Hydra user tries first to add a model, answered with the one that works.

The group maps model names to a typed schema (``ModelConf``), so a new model is added with that schema:
``+sglang_model@sglang.reward=base``, then its keys (``sglang.reward.model_path=/rm``). The forms tried first
fail inside Hydra with messages that do not say so:

- ``+sglang.reward={model_path: /rm, ...}`` and ``+sglang.reward.model_path=/rm``: ``Invalid type assigned: dict
  is not a subclass of ModelConf``;
- ``sglang.reward.model_path=/rm``: ``Key 'reward' is not in struct``, with Hydra's hint to add a ``+`` (the form
  above).

Hydra has no hook for an override that fails; :func:`install_model_form_messages` wraps the one function that
applies overrides to the composed config (``ConfigLoaderImpl._apply_overrides_to_config``) once, from the
plugin's search-path module (every Hydra app, the compose API, ``miles-sglang``). An override that fails there
on a model the group does not have becomes one message naming the supported form, with the user's own values
carried over: in a running app it is printed and the app exits with status 2; elsewhere it is raised as Hydra's
composition error with that message. Every other failure is Hydra's own.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping
from typing import Any

from miles_sglang_plugin.errors import Problem

#: The helper group that adds a model, and its option.
MODEL_GROUP = "sglang_model"
_PLAIN = re.compile(r"[\w./:@+-]+")


def _text(value: Any) -> str:
    """``value`` as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(_text(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_text(v)}" for k, v in value.items()) + "}"
    text = str(value)
    return text if _PLAIN.fullmatch(text) else "'" + text.replace("'", "\\'") + "'"


def _flattened(prefix: str, value: Mapping[str, Any]) -> list[str]:
    """``{a: {b: 1}, c: x}`` under ``prefix`` as ``prefix.a.b=1 prefix.c=x``."""
    out = []
    for key, item in value.items():
        if isinstance(item, Mapping) and item:
            out.extend(_flattened(f"{prefix}.{key}", item))
        else:
            out.append(f"{prefix}.{key}={_text(item)}")
    return out


def _models_node(cfg: Any, parts: list[str]) -> int | None:
    """The position in ``parts`` of a model name the group at ``parts[:i]`` does not have, or None."""
    from omegaconf import DictConfig, OmegaConf

    from miles_sglang_plugin.config.schema import ModelConf

    for i in range(1, len(parts)):
        try:
            node = OmegaConf.select(cfg, ".".join(parts[:i]), throw_on_missing=False)
        except Exception:  # an interpolation that does not resolve: not this case
            return None
        if not isinstance(node, DictConfig):
            return None
        if node._metadata.element_type is ModelConf:
            return i if parts[i] not in node else None
    return None


def model_form_problem(override: Any, cfg: Any) -> Problem | None:
    """The message for ``override`` (a parsed Hydra override that failed on ``cfg``) when it names a model the
    group does not have; None for every other failure."""
    if override.is_delete() or override.is_sweep_override() or override.package is not None:
        return None
    parts = str(override.key_or_group).split(".")
    at = _models_node(cfg, parts)
    if at is None:
        return None
    package, name, rest = ".".join(parts[:at]), parts[at], parts[at + 1 :]
    key = f"{package}.{name}"
    line = str(override.input_line or "")
    if rest:
        follow = [f"{key}.{'.'.join(rest)}={line.split('=', 1)[1]}" if "=" in line else ""]
    else:
        value = override.value()
        follow = _flattened(key, value) if isinstance(value, Mapping) else []
    models = ", ".join(str(k) for k in _model_names(cfg, package)) or "none"
    form = " ".join(filter(None, [f"+{MODEL_GROUP}@{key}=base", *follow]))
    return Problem(
        line,
        f"{package} has no model {name!r} (its models: {models}); a model is added with its schema, then its "
        f"keys are set: {form} (docs/compose.md: add a model)",
    )


def _model_names(cfg: Any, package: str) -> list[str]:
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, package, throw_on_missing=False)
    return [str(k) for k in node] if node is not None else []


def install_model_form_messages() -> None:
    """Make an override on a model the group lacks name the supported form (idempotent)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException

    original = ConfigLoaderImpl._apply_overrides_to_config
    if getattr(original, "_msp_model_forms", False):
        return

    @functools.wraps(original)
    def apply_overrides(overrides: list[Any], cfg: Any) -> None:
        for override in overrides:  # one at a time, in order, as Hydra applies them
            try:
                original([override], cfg)
            except ConfigCompositionException:
                problem = model_form_problem(override, cfg)
                if problem is None:
                    raise
                _refuse(problem, ConfigCompositionException)

    apply_overrides._msp_model_forms = True  # type: ignore[attr-defined]
    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply_overrides)  # type: ignore[method-assign]  # wrapping a private Hydra function on purpose


def _refuse(problem: Problem, error: type[Exception]) -> None:
    from miles_sglang_plugin.config.overrides import EXIT_USER_ERROR, _running_app_arguments, render

    message = render([problem])
    if _running_app_arguments() is not None:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)
    raise error(message) from None
