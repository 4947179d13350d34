"""SGLang's own request types of the control routes a trainer calls on its engines, and a check of a JSON
body against them.

SGLang's HTTP server parses each control route's body into a request class of
``sglang/srt/managers/io_struct.py`` (``ReleaseMemoryOccupationReqInput``, ``UpdateWeightFromDiskReqInput``,
...; the route -> class map is :data:`ROUTE_REQUESTS`, read from ``sglang/srt/entrypoints/http_server.py``).
That module cannot be imported on a machine without a GPU stack (it pulls in ``transformers`` and
``torchvision`` through ``schedule_batch``), so the classes are read from its **source**: the field names,
their annotations and whether each has a default, for the named classes and the bases they inherit from in the
same file. Nothing of SGLang is imported, so this is cheap and safe in any process (the stand-in engine uses
it too). Where SGLang is not installed, the same description of sglang 0.5.23, shipped with the package
(``data/sglang_control_requests.json``), is used instead, and says so.

A body is checked the way SGLang's parser would take it, a little stricter: every required field present, no
unknown field (SGLang ignores unknown fields, which hides a misspelt one), each value of its field's type
(``str``, ``int``, ``float``, ``bool``, ``Optional``, ``List``, ``Dict``, ``Literal``; ``bool`` is not an
``int`` here; other named types are not checked).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ROUTE_REQUESTS",
    "RequestField",
    "RequestSchema",
    "RequestSchemas",
    "load_request_schemas",
    "schemas_from_source",
]

#: Control route -> the io_struct class SGLang parses its body into (http_server.py of sglang 0.5.23).
ROUTE_REQUESTS: Mapping[str, str] = {
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}

IO_STRUCT = Path("srt") / "managers" / "io_struct.py"
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "sglang_control_requests.json"
SHIPPED_VERSION = "0.5.23"


@dataclass(frozen=True)
class RequestField:
    name: str
    #: The annotation as written in io_struct.py, e.g. ``Optional[List[str]]``.
    annotation: str
    required: bool


@dataclass(frozen=True)
class RequestSchema:
    """One request class: its fields in declaration order (inherited ones first)."""

    class_name: str
    fields: tuple[RequestField, ...]

    def field(self, name: str) -> RequestField | None:
        return next((f for f in self.fields if f.name == name), None)

    def problems(self, body: Any) -> list[str]:
        """What SGLang's parser (or a careful reader of it) would object to in ``body``; empty when fine."""
        if not isinstance(body, Mapping):
            return [f"the body of a {self.class_name} must be a JSON object, got {type(body).__name__}"]
        names = [f.name for f in self.fields]
        out = [
            f"{key!r} is not a field of {self.class_name} (fields: {', '.join(names)})"
            for key in body
            if key not in names
        ]
        for item in self.fields:
            if item.name not in body:
                if item.required:
                    out.append(f"{self.class_name} needs {item.name!r} ({item.annotation})")
                continue
            if not value_matches(body[item.name], _type_tree(item.annotation)):
                out.append(
                    f"{self.class_name}.{item.name} must be {item.annotation}, got {body[item.name]!r}"
                )
        return out


@dataclass(frozen=True)
class RequestSchemas:
    """The request classes of :data:`ROUTE_REQUESTS`, and where they were read (``source``)."""

    classes: Mapping[str, RequestSchema]
    source: str

    def for_route(self, route: str) -> RequestSchema | None:
        name = ROUTE_REQUESTS.get(route)
        return self.classes.get(name) if name else None

    def problems(self, route: str, body: Any) -> list[str]:
        schema = self.for_route(route)
        return schema.problems(body) if schema is not None else []

    def to_json(self) -> str:
        """The shipped file's form: class name -> ``[field, annotation, required]`` rows, one per line."""
        blocks = []
        for name, schema in sorted(self.classes.items()):
            rows = ",\n".join(f"    {json.dumps([f.name, f.annotation, f.required])}" for f in schema.fields)
            blocks.append(f"  {json.dumps(name)}: [\n{rows}\n  ]")
        return "{\n" + ",\n".join(blocks) + "\n}\n"


# ---------------------------------------------------------------------------------------------- reading
def _class_fields(node: ast.ClassDef) -> list[RequestField]:
    fields = []
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            annotation = ast.unparse(statement.annotation)
            if annotation.startswith("ClassVar"):
                continue
            fields.append(RequestField(statement.target.id, annotation, statement.value is None))
    return fields


def schemas_from_source(text: str, class_names: tuple[str, ...] | None = None) -> dict[str, RequestSchema]:
    """The request classes ``class_names`` (default: those of :data:`ROUTE_REQUESTS`) from the source of an
    io_struct.py, each with the fields of its bases defined in the same file."""
    wanted = class_names if class_names is not None else tuple(ROUTE_REQUESTS.values())
    classes = {node.name: node for node in ast.parse(text).body if isinstance(node, ast.ClassDef)}

    def fields_of(name: str, seen: frozenset[str] = frozenset()) -> list[RequestField]:
        node = classes[name]
        inherited: list[RequestField] = []
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes and base.id not in seen:
                inherited += fields_of(base.id, seen | {name})
        own = _class_fields(node)
        own_names = {f.name for f in own}
        return [f for f in inherited if f.name not in own_names] + own

    return {name: RequestSchema(name, tuple(fields_of(name))) for name in wanted if name in classes}


def _installed_io_struct() -> tuple[Path, str] | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / IO_STRUCT
    if not path.is_file():
        return None
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    return path, version


def _shipped() -> RequestSchemas:
    data = json.loads(SHIPPED.read_text())
    classes = {
        name: RequestSchema(name, tuple(RequestField(*entry) for entry in fields))
        for name, fields in data.items()
    }
    return RequestSchemas(
        classes, f"sglang {SHIPPED_VERSION}'s request classes shipped with miles_sglang_plugin"
    )


@functools.cache
def load_request_schemas() -> RequestSchemas:
    """The installed SGLang's request classes (read from its io_struct.py), else the shipped 0.5.23 ones."""
    found = _installed_io_struct()
    if found is not None:
        path, version = found
        try:
            classes = schemas_from_source(path.read_text())
        except (OSError, SyntaxError, ValueError):
            classes = {}
        if len(classes) == len(set(ROUTE_REQUESTS.values())):
            return RequestSchemas(classes, f"sglang {version} ({path})")
    return _shipped()


# ---------------------------------------------------------------------------------------------- types
#: A parsed annotation: ("any",), ("name", "int"), ("optional", t), ("list", t), ("dict", k, v),
#: ("literal", values), ("union", types).
TypeTree = tuple[Any, ...]
_PLAIN = {"str": str, "int": int, "float": float, "bool": bool, "bytes": str}


def _subscript_args(node: ast.Subscript) -> list[ast.expr]:
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


def _tree(node: ast.expr) -> TypeTree:
    if isinstance(node, ast.Constant) and node.value is None:
        return ("none",)
    if isinstance(node, ast.Name):
        if node.id in _PLAIN:
            return ("name", node.id)
        return {"list": ("list", ("any",)), "dict": ("dict", ("any",), ("any",))}.get(node.id, ("any",))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return ("union", (_tree(node.left), _tree(node.right)))
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return _subscript_tree(node.value.id, _subscript_args(node))
    return ("any",)


def _subscript_tree(kind: str, args: list[ast.expr]) -> TypeTree:
    if kind == "Optional":
        return ("union", (_tree(args[0]), ("none",)))
    if kind == "Union":
        return ("union", tuple(_tree(arg) for arg in args))
    if kind in ("List", "list", "Sequence"):
        return ("list", _tree(args[0]))
    if kind in ("Dict", "dict", "Mapping"):
        return ("dict", _tree(args[0]), _tree(args[1]))
    if kind == "Literal":
        return ("literal", tuple(arg.value for arg in args if isinstance(arg, ast.Constant)))
    if kind == "Annotated":
        return _tree(args[0])
    return ("any",)


@functools.cache
def _type_tree(annotation: str) -> TypeTree:
    try:
        return _tree(ast.parse(annotation, mode="eval").body)
    except SyntaxError:
        return ("any",)


def _plain_matches(value: Any, name: str) -> bool:
    if name == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON's true is not a number here
        return False
    if name == "float":
        return isinstance(value, int | float)
    return isinstance(value, _PLAIN[name])


def value_matches(value: Any, tree: TypeTree) -> bool:
    """Whether a JSON value fits a parsed annotation (named types other than the plain ones always fit)."""
    kind = tree[0]
    if kind == "none":
        return value is None
    if kind == "name":
        return _plain_matches(value, tree[1])
    if kind == "union":
        return any(value_matches(value, option) for option in tree[1])
    if kind == "list":
        return isinstance(value, list) and all(value_matches(item, tree[1]) for item in value)
    if kind == "dict":
        return isinstance(value, dict) and all(
            value_matches(k, tree[1]) and value_matches(v, tree[2]) for k, v in value.items()
        )
    if kind == "literal":
        return any(value == option and type(value) is type(option) for option in tree[1])
    return True  # "any"
