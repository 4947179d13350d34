"""Documentation of every config field, read from the structured configs themselves (``miles-sglang fields``).

Each field of a schema dataclass has a docstring: the string literal written under it (what it is and its
unit). This module reads those docstrings from the classes' source, and the types and defaults from the
dataclasses, so that what is printed cannot drift from what Hydra composes.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import functools
import inspect
import itertools
import json
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeGuard

#: Mapping fields whose values follow a schema although their declared value type is ``Any`` (so that a plain
#: mapping is accepted and checked when read): (class name, field) -> (value schema's name, key placeholder).
_MAPPING_VALUE_SCHEMAS: dict[tuple[str, str], tuple[str, str]] = {
    ("ModelConf", "extra_groups"): ("ExtraServerGroupConf", "<name>"),
}
#: Placeholders for the keys of mappings whose values are typed (``sglang: dict[str, ModelConf]``).
_PLACEHOLDERS: dict[str, str] = {"ModelConf": "<model>"}


@dataclass(frozen=True)
class FieldDoc:
    """One documented config key: ``key`` with ``<model>`` / ``<name>`` where the user picks the name."""

    key: str
    type: str
    default: str
    doc: str
    node: bool = False
    """Whether the key holds a schema node (its fields follow it) rather than a value."""


@functools.cache
def _docstrings_in_source(cls: type) -> dict[str, str]:
    """Field name -> the string literal written under the field in the class body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a class made at run time)
        return {}
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(inspect.cleandoc(following.value.value).split()).replace(
                "``", "`"
            )
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Every dataclass field of ``cls`` -> its docstring ("" where it has none): its own and its bases'."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_docstrings_in_source(klass))
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def _type_text(hint: Any) -> str:
    """``int``, ``str | None``, ``dict[str, ModelConf]``; an enum as its values (``sglang | simulated``)."""
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " | ".join(str(member.value) for member in hint)
    args = typing.get_args(hint)
    if not args:
        return getattr(hint, "__name__", str(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(arg) for arg in args)
    return f"{typing.get_origin(hint).__name__}[{', '.join(_type_text(arg) for arg in args)}]"


def _default_text(schema_field: dataclasses.Field[Any]) -> str:
    if schema_field.default is not dataclasses.MISSING:
        value = schema_field.default
    elif schema_field.default_factory is not dataclasses.MISSING:
        value = schema_field.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return ""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _is_schema(obj: object) -> TypeGuard[type]:
    """A dataclass (the class, not an instance of one)."""
    return isinstance(obj, type) and dataclasses.is_dataclass(obj)


def _nested_schema(cls: type, name: str, hint: Any, schemas: dict[str, type]) -> tuple[type, str] | None:
    """(schema, key placeholder or "") of a field that holds a schema node or a mapping of them."""
    if _is_schema(hint):
        return hint, ""
    mapped = _MAPPING_VALUE_SCHEMAS.get((cls.__name__, name))
    if mapped is not None:
        return schemas[mapped[0]], mapped[1]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is dict and len(args) == 2 and _is_schema(args[1]):
        return args[1], _PLACEHOLDERS.get(args[1].__name__, "<name>")
    return None


def schema_fields(cls: type, prefix: str = "") -> list[FieldDoc]:
    """Every key under ``cls`` (nested schemas included), in declaration order."""
    from miles_sglang_plugin.config import schema

    schemas = {name: obj for name, obj in vars(schema).items() if _is_schema(obj)}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows: list[FieldDoc] = []
    for schema_field in dataclasses.fields(cls):
        key = f"{prefix}{schema_field.name}"
        hint = hints[schema_field.name]
        rows.append(FieldDoc(key, _type_text(hint), _default_text(schema_field), docs[schema_field.name]))
        nested = _nested_schema(cls, schema_field.name, hint, schemas)
        if nested is None:
            continue
        node_schema, placeholder = nested
        if placeholder:
            doc = (inspect.getdoc(node_schema) or "").splitlines()[0].replace("``", "`")
            rows.append(FieldDoc(f"{key}.{placeholder}", node_schema.__name__, "", doc, node=True))
            key = f"{key}.{placeholder}"
        else:
            rows[-1] = dataclasses.replace(rows[-1], node=True)
        rows.extend(schema_fields(node_schema, f"{key}."))
    return rows


def _matches(key: str, path: list[str]) -> bool:
    parts = key.split(".")
    if len(parts) < len(path):
        return False
    return all(part == wanted or part.startswith("<") for part, wanted in zip(parts, path, strict=False))


def select_fields(rows: list[FieldDoc], path: str) -> list[FieldDoc]:
    """The rows at or under ``path`` (dotted; a model or group name matches ``<model>`` / ``<name>``)."""
    wanted = [part for part in path.split(".") if part]
    return [row for row in rows if _matches(row.key, wanted)]


def close_keys(rows: list[FieldDoc], path: str) -> list[str]:
    """Keys that look like ``path``, for the message when it matches none."""
    return difflib.get_close_matches(path, [row.key for row in rows], n=3, cutoff=0.6)


# ------------------------------------------------------------------------------------------ as text and pages
#: The columns ``miles-sglang fields`` fits its text to when the output is not a terminal.
TEXT_WIDTH = 100
#: How far a key's type, default and description are indented under it.
_INDENT = "    "


def _wrapped(text: str, width: int) -> list[str]:
    """``text`` wrapped at spaces only (a key or a path in it is never cut), indented under its key."""
    return textwrap.wrap(
        text,
        width=width,
        initial_indent=_INDENT,
        subsequent_indent=_INDENT,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _type_and_default(row: FieldDoc) -> str:
    if row.node:
        return f"({row.type})"
    default = "required" if row.default == "(required)" else f"default: {row.default}"
    return f"{row.type}  {default}"


def text_lines(rows: list[FieldDoc], width: int = TEXT_WIDTH) -> list[str]:
    """``rows`` as text for ``width`` columns: each key at the start of a line of its own (whole, however
    long), its type and default after it where they fit on that line, else indented under it, then what it
    is, wrapped at spaces. A blank line between keys."""
    lines: list[str] = []
    for row in rows:
        if lines:
            lines.append("")
        about = _type_and_default(row)
        if len(row.key) + 2 + len(about) <= width:
            lines.append(f"{row.key}  {about}")
        else:
            lines.extend([row.key, *_wrapped(about, width)])
        lines.extend(_wrapped(row.doc, width))
    return lines


def _markdown_text(text: str) -> str:
    """Docstring text for a Markdown table cell: code spans as written, the rest escaped (``<model>`` is no
    HTML tag, ``|`` no cell border, ``*`` no emphasis)."""
    parts = text.split("`")
    for index in range(0, len(parts), 2):  # outside code spans
        parts[index] = (
            parts[index].replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|").replace("*", "\\*")
        )
    return "`".join(parts)


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _sections(rows: list[FieldDoc]) -> list[tuple[FieldDoc | None, list[FieldDoc]]]:
    """(node, the value keys right under it) in order: the top-level keys first (node None), then each node."""
    nodes = [row for row in rows if row.node]
    sections: dict[str, list[FieldDoc]] = {"": [], **{node.key: [] for node in nodes}}
    for row in rows:
        if row.node:
            continue
        parent = max((key for key in sections if row.key.startswith(f"{key}.")), key=len, default="")
        sections[parent].append(row)
    by_key = {node.key: node for node in nodes}
    return [(by_key.get(key), members) for key, members in sections.items()]


def markdown_reference(rows: list[FieldDoc], generator: str) -> str:
    """The config reference page: one table per node (key, type, default, what it is), written by
    ``generator`` (named at the top, so that nobody edits the page by hand)."""
    out = [
        "# Config reference",
        "",
        f"<!-- Generated by {generator} from the schema's field docstrings: do not edit. -->",
        "",
        "Every key of the `sglang` group, of `sglang_deploy` and of the trainer inputs under Miles' names, as",
        "`miles-sglang fields` prints them: generated from the schema's dataclasses",
        "(`miles_sglang_plugin/config/schema.py`; each field's docstring, type and default), and checked by",
        "`tests/test_docs.py` against them. `<model>` and `<name>` stand for the names you choose",
        "(`sglang.actor.decode.num_gpus` is `sglang.<model>.decode.num_gpus`). The benchmark's and the packed",
        "launcher's settings are on the [Sweeps](../sweeps.md) page.",
    ]
    for node, members in _sections(rows):
        out += ["", f"## `{node.key}`" if node else "## Top-level keys", ""]
        if node is not None:
            out += [f"{_markdown_text(node.doc)} (`{node.type}`)", ""]
        if not members:
            continue
        out += ["| key | type | default | what (unit) |", "|---|---|---|---|"]
        out += [
            f"| {_code(row.key)} | {_code(row.type)} | {_code(row.default)} | {_markdown_text(row.doc)} |"
            for row in members
        ]
    return "\n".join(out) + "\n"
