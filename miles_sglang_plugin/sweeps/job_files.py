"""Reading a sweep job's files for the report, within bounds, and checking what the report takes from them.

A job's files are written by this package (``metrics.json``, ``job_status.json``) and by Hydra
(``.hydra/overrides.yaml``, ``.hydra/hydra.yaml``), but a sweep directory is only files: a job killed while
writing, a file edited by hand or by another tool, or one that is not what its name says must give a row that
says what is wrong with it, never a traceback. So each file is read as a regular file of at most a few MiB
(a FIFO, a device or a directory is refused without blocking), as UTF-8, parsed with its nesting bounded
(JSON and YAML, :data:`MAX_DEPTH` levels; YAML also at most :data:`MAX_YAML_NODES` nodes), and then checked
against what the report reads from it (:func:`metrics_problems`, :func:`status_problems`,
:func:`overrides_problem`).
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

#: The largest ``metrics.json`` read (a real one is a few KB per model).
MAX_METRICS_BYTES = 4 * 2**20
#: The largest ``job_status.json`` read (status and a one-line error of at most 1,000 characters).
MAX_STATUS_BYTES = 64 * 2**10
#: The largest Hydra file read (``overrides.yaml``, ``hydra.yaml``).
MAX_YAML_BYTES = 2**20
#: The deepest nesting of lists and mappings read, in JSON and YAML (the report's files nest 4 levels).
MAX_DEPTH = 64
#: The most YAML nodes read (keys, values, list items; an alias counts once, and is never expanded here).
MAX_YAML_NODES = 20_000
#: The most overrides a job may have, the most models its metrics may hold, the longest error kept.
MAX_OVERRIDES, MAX_MODELS, MAX_ERROR_CHARS = 1_000, 256, 1_000
#: Checking a list stops after this many problems (a row shows the first three).
MAX_LISTED = 10

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a pipe",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _repr() -> reprlib.Repr:
    """A value shown short (a few items, 40 characters of text), however large or deep it is."""
    shown = reprlib.Repr()  # (Python 3.11 takes no settings as arguments)
    shown.maxlevel, shown.maxstring, shown.maxother, shown.maxlist, shown.maxdict = 2, 40, 40, 4, 4
    return shown


_short = _repr().repr


class JobFileError(ValueError):
    """A job's file that cannot be used; ``str()`` says why (without the file's name)."""


def _size(limit: int) -> str:
    return f"{limit // 2**20} MiB" if limit >= 2**20 else f"{limit // 2**10} KiB"


def read_text(path: Path, limit: int) -> str | None:
    """The text of ``path``, a regular file of at most ``limit`` bytes of UTF-8; None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO without writer: no wait
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JobFileError(f"cannot be read ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        kind = _KINDS.get(stat.S_IFMT(info.st_mode))
        if kind is not None or not stat.S_ISREG(info.st_mode):
            raise JobFileError(f"is {kind or 'not a regular file'}, not a file")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise JobFileError(f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if size > limit:
        raise JobFileError(f"is larger than {_size(limit)}, the most the report reads of it")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JobFileError(f"is not UTF-8 text (byte {exc.start})") from None


def _too_deep() -> JobFileError:
    return JobFileError(f"is nested deeper than {MAX_DEPTH} levels, the most the report reads")


def printable(text: str) -> str:
    """``text`` that can be written as UTF-8: a lone surrogate (an undecodable byte of a file name, a ``\\ud800``
    escape in JSON or YAML) shown as its escape."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _check_tree(data: Any) -> None:
    """Raise :class:`JobFileError` when ``data`` nests deeper than :data:`MAX_DEPTH` or holds text that is not
    valid Unicode (a lone surrogate). Iterative, each list or mapping visited once (YAML aliases share them)."""
    stack, seen = [(data, 0)], set()
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if printable(value) != value:
                raise JobFileError(f"holds text that is not valid Unicode ({_short(printable(value))})")
            continue
        if not isinstance(value, dict | list) or id(value) in seen:
            continue
        if depth >= MAX_DEPTH:
            raise _too_deep()
        seen.add(id(value))
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        stack.extend((item, depth + 1) for item in items)


def load_json(path: Path, limit: int) -> Any:
    """The JSON value of ``path`` (None when there is no such file); :class:`JobFileError` when it cannot be
    read, is not JSON or nests too deeply. (Python's parser stops at its recursion limit, which is then
    reported as the depth bound; a document within it is measured after parsing.)"""
    text = read_text(path, limit)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise JobFileError(f"is not valid JSON ({exc})") from None
    _check_tree(data)
    return data


def _check_yaml_events(text: str) -> None:
    """Nesting and node count of ``text``, from the parser's events (which never recurse)."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep()
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_YAML_NODES:
                raise JobFileError(
                    f"holds more than {MAX_YAML_NODES:,} YAML nodes, the most the report reads"
                )


def load_yaml(path: Path, limit: int = MAX_YAML_BYTES) -> Any:
    """The YAML value of ``path`` (None when there is no such file, or it is empty); :class:`JobFileError` when
    it cannot be read, is not YAML (of the safe kind) or passes a bound."""
    text = read_text(path, limit)
    if text is None:
        return None
    try:
        _check_yaml_events(text)
        data = yaml.safe_load(text)
    except JobFileError:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise JobFileError(f"is not valid YAML{where} ({exc.problem or exc.context})") from None
    except (yaml.YAMLError, ValueError, TypeError) as exc:  # e.g. `!!int abc`: the constructor's ValueError
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise JobFileError(f"is not valid YAML ({first})") from None
    _check_tree(data)
    return data


# --------------------------------------------------------------------------------------------------------
# What the report takes from each file


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_amount(value: Any) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    )


def _is_text(value: Any) -> bool:
    return value is None or isinstance(value, str)


COUNT, AMOUNT, TEXT = "an integer >= 0", "a finite number >= 0", "null or a string"
_CHECKS: dict[str, Callable[[Any], bool]] = {COUNT: _is_count, AMOUNT: _is_amount, TEXT: _is_text}
#: A model's fields the report reads: required ones, and optional ones checked where present.
MODEL_FIELDS = {
    "requests": COUNT,
    "succeeded": COUNT,
    "failed": COUNT,
    "requests_per_s": AMOUNT,
    "output_tokens_per_s": AMOUNT,
}
OPTIONAL_MODEL_FIELDS = {"ttft_source": TEXT, "latency_source": TEXT}


def _fields(
    value: Mapping[str, Any], where: str, required: Mapping[str, str], optional: Mapping[str, str]
) -> list[str]:
    """The missing ones of ``required`` (in one problem) and every present field that is not of its kind."""
    missing = [name for name in required if name not in value]
    problems = [f"{where}: missing {', '.join(missing)}"] if missing else []
    return problems + [
        f"{where}.{name}: must be {kind}, got {_short(value[name])}"
        for name, kind in {**required, **optional}.items()
        if name in value and not _CHECKS[kind](value[name])
    ]


def _mapping(value: Any, where: str, *, optional: bool = False) -> tuple[Mapping[str, Any], list[str]]:
    """(``value`` as a mapping, problems): an empty mapping with a problem when it is none."""
    if isinstance(value, dict):
        return value, []
    if optional and value is None:
        return {}, []
    return {}, [f"{where}: must be a mapping{' or null' if optional else ''}, got {_short(value)}"]


def _stats_problems(value: Any, where: str) -> list[str]:
    """``ttft_s`` / ``latency_s``: null, or a mapping whose percentiles (where present) are amounts."""
    stats, problems = _mapping(value, where, optional=True)
    return problems or _fields(stats, where, {}, {"p50": AMOUNT, "p99": AMOUNT})


def _errors_problems(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        return [f"{where}: must be a list, got {_short(value)}"]
    problems: list[str] = []
    for i, item in enumerate(value):
        entry, found = _mapping(item, f"{where}[{i}]")
        problems += found or _fields(entry, f"{where}[{i}]", {"count": COUNT, "sample": TEXT}, {})
        if len(problems) >= MAX_LISTED:
            break  # enough to say what is wrong
    return problems


def _model_problems(value: Any, where: str) -> list[str]:
    model, problems = _mapping(value, where)
    if problems:
        return problems
    problems += _fields(model, where, MODEL_FIELDS, OPTIONAL_MODEL_FIELDS)
    for name in ("ttft_s", "latency_s"):
        problems += _stats_problems(model.get(name), f"{where}.{name}")
    return problems + _errors_problems(model.get("errors"), f"{where}.errors")


def _shape_problems(value: Any, where: str) -> list[str]:
    """``deployment.models.<name>``: GPUs, engines, and per group its engines and TP."""
    shape, problems = _mapping(value, where)
    if problems:
        return problems
    problems += _fields(shape, where, {"gpus": COUNT, "engines": COUNT}, {})
    groups, found = _mapping(shape.get("groups"), f"{where}.groups", optional=True)
    problems += found
    for name, group in groups.items():
        entry, found = _mapping(group, f"{where}.groups.{name}")
        problems += found or _fields(entry, f"{where}.groups.{name}", {"engines": COUNT, "tp": COUNT}, {})
        if len(problems) >= MAX_LISTED:
            break
    return problems


def _sized(value: Mapping[str, Any], where: str) -> list[str]:
    return [f"{where}: holds {len(value)} models, more than {MAX_MODELS}"] if len(value) > MAX_MODELS else []


def _deployment_problems(value: Any) -> list[str]:
    deployment, problems = _mapping(value, "deployment", optional=True)
    shapes, found = _mapping(deployment.get("models"), "deployment.models", optional=True)
    problems += found + _sized(shapes, "deployment.models")
    for name, shape in list(shapes.items())[:MAX_MODELS]:
        problems += _shape_problems(shape, f"deployment.models.{name}")
    return problems


def metrics_problems(document: Any) -> list[str]:
    """What keeps ``document`` (a parsed ``metrics.json``) from being reported: each problem with the path of
    its key (``models.actor.requests: missing (must be an integer >= 0)``); none for a good one."""
    if not isinstance(document, dict):
        return [f"must be a JSON object (a mapping), got {_short(document)}"]
    if "models" not in document:
        return ["models: missing (each benchmarked model's numbers)"]
    models, problems = _mapping(document.get("models"), "models")
    problems += _sized(models, "models")
    for name, model in list(models.items())[:MAX_MODELS]:
        problems += _model_problems(model, f"models.{name}")
    problems += _deployment_problems(document.get("deployment"))
    if document.get("simulated") is not None and not isinstance(document.get("simulated"), bool):
        problems.append(f"simulated: must be true or false, got {_short(document['simulated'])}")
    speed, found = _mapping(document.get("speed_model"), "speed_model", optional=True)
    problems += found + [
        f"speed_model.{key}: must be a number, got {_short(value)}"
        for key, value in speed.items()
        if isinstance(value, bool) or not isinstance(value, int | float)
    ]
    return problems


def status_problems(document: Any) -> list[str]:
    """What is wrong with a parsed ``job_status.json``: a mapping with ``status`` COMPLETED or FAILED and
    ``error`` null or a string."""
    if not isinstance(document, dict):
        return [f"must be a JSON object (a mapping), got {_short(document)}"]
    problems = []
    if document.get("status") not in ("COMPLETED", "FAILED"):
        problems.append(f"status: must be COMPLETED or FAILED, got {_short(document.get('status'))}")
    if not _is_text(document.get("error")):
        problems.append(f"error: must be null or a string, got {_short(document.get('error'))}")
    return problems


def overrides_problem(data: Any) -> str | None:
    """What is wrong with a parsed ``.hydra/overrides.yaml`` (Hydra's list of override strings), if anything."""
    if not isinstance(data, list):
        return f"must be a list of overrides, got {_short(data)}"
    if len(data) > MAX_OVERRIDES:
        return f"holds {len(data)} overrides, more than {MAX_OVERRIDES}"
    bad = next((i for i, item in enumerate(data) if not isinstance(item, str)), None)
    if bad is not None:
        return f"item {bad + 1} must be an override (a string), got {_short(data[bad])}"
    return None


def one_line(problems: list[str], limit: int = MAX_ERROR_CHARS) -> str:
    """Problems joined into one line of at most ``limit`` characters (the first three, the rest counted)."""
    text = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
