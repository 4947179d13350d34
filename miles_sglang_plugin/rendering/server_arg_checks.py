"""ServerArgs values checked before anything starts, so that a value SGLang would refuse (``mem_fraction_static=abc``,
``context_length=[1,2]``, ``chunked_prefill_size={a: 1}``) is an error naming its config key, not an engine that
dies at start.

Three checks, on what each engine process is given (its ServerArgs values as rendered onto its command line):

* **the type table** (:func:`type_table_problems`): each value against the type, number of values and choices
  of its flag in SGLang's parser, from the table of SGLang 0.5.23 shipped with the package
  (``data/sglang_server_args_types.json``, written by ``scripts/generate-server-args-types.py``). It needs no
  SGLang and runs wherever a deployment is rendered (``plan``, ``export``, a launch), unless an SGLang of
  another version is installed, whose own parser then decides;
* **SGLang's own parser** (:func:`sglang_parser_problems`): every rendered engine command line through the
  installed SGLang's ``prepare_server_args`` (nothing resolved, no GPU touched). It runs where SGLang is
  installed, for a launch of real engines and for any rendering when the installed SGLang is not the version
  of the table; importing SGLang takes seconds, so a ``plan`` with the table's version installed does not;
* **the documented ranges** (:func:`range_problems`, always): values SGLang's parser takes but SGLang or the GPU
  would refuse at start (``mem_fraction_static=1.5``, ``page_size=0``), for the fields whose range SGLang
  documents or which only make sense in one (:data:`VALUE_RANGES`).

A secret (the API key) is never shown: its value is masked in every message.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import resources
from typing import Any

from miles_sglang_plugin.config.schema import SGLangDeployConf
from miles_sglang_plugin.errors import Problem
from miles_sglang_plugin.masking import MASK, SECRET_FIELDS
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch, server_args_to_argv
from miles_sglang_plugin.rendering.server_arg_fields import installed_sglang

#: SGLang's ``human_readable_int``: an integer, or a number with an SI (decimals allowed) or IEC suffix.
_SIZE_RE = re.compile(r"^\s*(\d+|\d+(\.\d+)?[kMGT]|\d+(Ki|Mi|Gi|Ti))\s*$")
_KIND_NAMES = {
    "int": "an integer",
    "float": "a number",
    "size": "an integer (or with a suffix: 32k, 4Ki)",
    "json": "JSON text (or a mapping)",
    "str": "text",
}


def _fraction(number: float) -> str | None:
    return None if 0 < number <= 1 else "must be a fraction: more than 0 and at most 1"


def _positive(number: float) -> str | None:
    return None if number > 0 else "must be more than 0"


def _positive_or_off(number: float) -> str | None:
    return None if number > 0 or number == -1 else "must be more than 0, or -1 (chunked prefill off)"


#: ServerArgs fields whose values SGLang's parser takes but SGLang or the GPU would refuse outside a range (SGLang
#: 0.5.23's help texts): fractions of memory or tokens in (0, 1], sizes and counts > 0.
VALUE_RANGES: dict[str, Callable[[float], str | None]] = {
    "mem_fraction_static": _fraction,  # "the fraction of the memory used for static allocation"
    "hicache_host_memory_fraction": _fraction,  # "fraction of the available host memory"
    "swa_full_tokens_ratio": _fraction,  # "It should be between 0 and 1"
    "context_length": _positive,
    "max_running_requests": _positive,
    "max_total_tokens": _positive,
    "max_prefill_tokens": _positive,
    "page_size": _positive,  # "the number of tokens in a page"
    "chunked_prefill_size": _positive_or_off,  # "Setting this to -1 means disabling chunked prefill"
}


@functools.cache
def shipped_server_arg_types() -> dict[str, Any]:
    """The shipped table: ``{"sglang_version": ..., "fields": {field: {"kind", "nargs", "choices", "flag"}}}``."""
    text = resources.files("miles_sglang_plugin.data").joinpath("sglang_server_args_types.json").read_text()
    return dict(json.loads(text))


def _converts(token: str, kind: str) -> bool:
    """Whether SGLang's parser converts ``token`` for a flag of ``kind`` (as argparse's ``type`` would)."""
    converters: dict[str, Any] = {"int": int, "float": float, "json": json.loads}
    if kind == "size":
        return bool(_SIZE_RE.match(token))
    if kind in converters:
        try:
            converters[kind](token)
        except ValueError:
            return False
    return True


def _tokens(value: Any) -> list[str]:
    """The values ``value`` puts on the command line (as :func:`server_args_to_argv` renders it)."""
    rendered = server_args_to_argv({"x": value})
    if rendered and rendered[0].startswith("--x="):
        return [rendered[0][len("--x=") :]]
    return rendered[1:]


def _count_problem(value: Any, tokens: list[str], nargs: Any) -> str | None:
    if nargs is None and len(tokens) != 1:
        return f"takes one value, got {len(tokens)} ({value!r})" if tokens else "takes a value, got true"
    if nargs == "?" and len(tokens) > 1:
        return f"takes at most one value, got {len(tokens)}"
    if nargs == "+" and not tokens:
        return "takes one or more values, got none"
    if len(tokens) > 1 and any(token.startswith("-") for token in tokens):
        return "a list item cannot start with '-' (SGLang's parser would read it as a flag)"
    return None


def value_problem(value: Any, spec: Mapping[str, Any]) -> str | None:
    """What SGLang's parser would refuse in ``value`` for a flag described by ``spec`` (None: nothing)."""
    kind = spec["kind"]
    if kind == "switch":
        return (
            None if value is None or isinstance(value, bool) else f"is a switch: true or false, got {value!r}"
        )
    if value is None or value is False:  # left off the command line: SGLang's default
        return None
    tokens = _tokens(value)
    problem = _count_problem(value, tokens, spec.get("nargs"))
    if problem:
        return problem
    bad = [token for token in tokens if not _converts(token, kind)]
    if bad:
        return f"must be {_KIND_NAMES[kind]}, got {bad[0]!r}" + (
            f" (in {value!r})" if len(tokens) > 1 else ""
        )
    choices = spec.get("choices")
    if choices is not None:
        allowed = {str(choice) for choice in choices}
        outside = [token for token in tokens if token not in allowed]
        if outside:
            return f"{outside[0]!r} is not one of {', '.join(map(str, choices))}"
    return None


def _plainly_fine(value: Any, spec: Mapping[str, Any]) -> bool:
    """Whether ``value`` is one integer for a number flag, or one text for a text flag, without choices: what
    :func:`value_problem` would pass, decided without rendering it (the plan's ports, seeds and addresses of
    every engine process are such values, each one of its own)."""
    if spec.get("choices") is not None or spec.get("nargs") not in (None, "?", "+"):
        return False
    kind = spec["kind"]
    if type(value) is int:
        return kind in ("int", "float") or (kind == "size" and value >= 0)
    return type(value) is str and kind == "str"


def _problem_of(
    field: str, value: Any, spec: Mapping[str, Any], seen: dict[tuple[str, type, Any], str | None]
) -> str | None:
    """:func:`value_problem`, once per distinct field and value (``seen``: what was found for each)."""
    if _plainly_fine(value, spec):
        return None
    try:
        key = (field, type(value), value)  # the type too: 1, 1.0 and True are equal keys
        return seen[key]
    except KeyError:
        problem = seen[key] = value_problem(value, spec)
        return problem
    except TypeError:  # a list or a mapping: checked as it is
        return value_problem(value, spec)


def _where(field: str, process: EngineProcessLaunch, plan: DeploymentPlan, settings: SGLangDeployConf) -> str:
    """The config key a value of ``process`` came from: its group's overrides, the server defaults, or the plan."""
    for model in plan.models:
        for group in model.groups:
            if model.name == process.model and group.name == process.group and field in group.overrides:
                return f"{group.key}.overrides.{field}"
    for typed in settings.server_defaults:  # as typed: mem-fraction-static or mem_fraction_static
        if str(typed).replace("-", "_") == field:
            return f"sglang_deploy.server_defaults.{typed}"
    if field.startswith(("lora_", "max_lora", "enable_lora")):
        return "sglang_deploy.lora"
    return f"engine {process.name} --{field.replace('_', '-')}"


def _values_to_check(
    processes: Iterable[EngineProcessLaunch], table: Mapping[str, Mapping[str, Any]]
) -> Iterator[tuple[EngineProcessLaunch, str, Any]]:
    """Each process's ServerArgs values: all of them for the first process of a group; for the others, whose
    other values are the first one's (their template's), their own ones (seed, addresses, ports, rank), but
    for a number >= 0 of a field whose flag takes any such number (decided once per template)."""
    numbers_pass: dict[int, frozenset[str]] = {}
    for process in processes:
        template = process.template
        passing = numbers_pass.get(id(template))
        if passing is not None:
            for field, value in zip(template.own_keys, process.own, strict=True):
                if not (type(value) is int and value >= 0 and field in passing):
                    yield process, field, value
            continue
        numbers_pass[id(template)] = frozenset(
            k for k in template.own_keys if (spec := table.get(k)) is None or _plainly_fine(0, spec)
        )
        for field, value in process.server_args.items():
            yield process, field, value


def type_table_problems(
    plan: DeploymentPlan, settings: SGLangDeployConf, processes: Iterable[EngineProcessLaunch]
) -> list[Problem]:
    """Every value that the shipped table says SGLang's parser would refuse, once per config key."""
    table = shipped_server_arg_types()["fields"]
    found: dict[tuple[str, str], Problem] = {}
    seen: dict[tuple[str, type, Any], str | None] = {}
    for process, field, value in _values_to_check(processes, table):
        spec = table.get(field)
        problem = _problem_of(field, value, spec, seen) if spec is not None else None
        if problem is None:
            continue
        if field in SECRET_FIELDS:
            problem = f"is not a value SGLang takes ({MASK})"
        key = _where(field, process, plan, settings)
        found.setdefault((key, problem), Problem(key, f"{problem} (SGLang's --{field.replace('_', '-')})"))
    return list(found.values())


def _number(value: Any) -> tuple[str, float] | None:
    """A value of one number as rendered (its text, the number), or None (not one number: the type table's)."""
    if value is None or isinstance(value, bool):
        return None
    tokens = _tokens(value)
    if len(tokens) != 1:
        return None
    try:
        return tokens[0], float(tokens[0])
    except ValueError:
        return None


def _ranged_values(process: EngineProcessLaunch, first: bool) -> Iterator[tuple[str, Any]]:
    """The values of ``process`` of the fields of :data:`VALUE_RANGES`: its own ones; the template's too for
    the ``first`` process of its template."""
    template = process.template
    for field in VALUE_RANGES:
        if field in template.own_keys:
            yield field, process.own[template.own_keys.index(field)]
        elif first and field in template.values:
            yield field, template.values[field]


def range_problems(
    plan: DeploymentPlan, settings: SGLangDeployConf, processes: Iterable[EngineProcessLaunch]
) -> list[Problem]:
    """Every value outside the range of its field (:data:`VALUE_RANGES`), once per config key."""
    found: dict[tuple[str, str], Problem] = {}
    templates: set[int] = set()
    for process in processes:
        first = id(process.template) not in templates
        templates.add(id(process.template))
        for field, value in _ranged_values(process, first):
            number = _number(value)
            problem = VALUE_RANGES[field](number[1]) if number is not None else None
            if number is None or problem is None:
                continue
            key = _where(field, process, plan, settings)
            message = f"{problem}, got {number[0]} (SGLang's --{field.replace('_', '-')})"
            found.setdefault((key, message), Problem(key, message))
    return list(found.values())


def sglang_parser_problems(
    processes: Iterable[EngineProcessLaunch], settings: SGLangDeployConf
) -> list[Problem]:
    """Every engine process whose command line the installed SGLang's own parser refuses (same message once)."""
    from miles_sglang_plugin.rendering.sglang_server_args import (
        SGLangArgvError,
        SGLangUnavailableError,
        parse_launch_argv,
    )

    found: dict[str, list[str]] = {}
    for process in processes:
        try:
            parse_launch_argv(server_args_to_argv(process.server_args))
        except SGLangUnavailableError as exc:
            return [Problem("", f"SGLang is installed but its parser cannot check the command lines: {exc}")]
        except SGLangArgvError as exc:
            message = str(exc)
            if settings.api_key:
                message = message.replace(settings.api_key, MASK)
            found.setdefault(message, []).append(process.name)
    return [
        Problem(f"engine {names[0]}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else ""), message)
        for message, names in found.items()
    ]


def server_arg_value_problems(
    plan: DeploymentPlan,
    settings: SGLangDeployConf,
    processes: tuple[EngineProcessLaunch, ...],
    *,
    launching_real_engines: bool,
) -> list[Problem]:
    """The checks that apply here (see the module docstring)."""
    sglang = installed_sglang()
    installed = sglang[0] if sglang else None
    table_version = shipped_server_arg_types()["sglang_version"]
    problems: list[Problem] = []
    if installed is None or installed == table_version:
        problems += type_table_problems(plan, settings, processes)
    typed = {problem.key for problem in problems}  # a value the type table refused is not checked again
    problems += [problem for problem in range_problems(plan, settings, processes) if problem.key not in typed]
    if installed is not None and not problems and (launching_real_engines or installed != table_version):
        problems += sglang_parser_problems(processes, settings)
    return problems


__all__ = [
    "VALUE_RANGES",
    "range_problems",
    "server_arg_value_problems",
    "sglang_parser_problems",
    "shipped_server_arg_types",
    "type_table_problems",
    "value_problem",
]
