"""The keys a group's ``overrides`` (and ``sglang_deploy.server_defaults``) accept, documented for
``miles-sglang fields --overrides``: the ``ServerArgs`` fields of the installed SGLang (else of the field list
shipped with the package), less those the plan decides itself, each with its kind (from the shipped types of
SGLang 0.5.23) and SGLang's own help text where SGLang can be imported here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from miles_sglang_plugin.config.field_docs import FieldDoc
from miles_sglang_plugin.planning.resolution import PLAN_OWNED_OVERRIDES
from miles_sglang_plugin.rendering.launch_specs import PLAN_OWNED_DEFAULTS
from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields
from miles_sglang_plugin.rendering.sglang_server_args import server_args_help

#: SGLang's page of server arguments (what each flag does, by flag name).
SGLANG_SERVER_ARGS_DOCS = "https://docs.sglang.ai/advanced_features/server_arguments.html"
_KINDS = {"switch": "bool", "json": "JSON mapping", "size": "size"}


@dataclass(frozen=True)
class OverrideKeys:
    rows: list[FieldDoc]
    #: Where the field list came from ("SGLang 0.5.23 (installed)", ...).
    source: str
    #: Whether SGLang's own help text was there to show.
    have_help: bool
    #: Fields the plan decides: field -> why (refused in overrides).
    plan_owned: dict[str, str]
    #: Further fields ``sglang_deploy.server_defaults`` refuses (each group decides them).
    group_owned: dict[str, str]


def _shipped_types() -> dict[str, Any]:
    text = resources.files("miles_sglang_plugin.data").joinpath("sglang_server_args_types.json").read_text()
    fields: dict[str, Any] = json.loads(text)["fields"]
    return fields


def _type_text(info: dict[str, Any] | None) -> str:
    if info is None:
        return "SGLang's type"
    kind = _KINDS.get(str(info.get("kind")), str(info.get("kind")))
    if info.get("nargs") in ("+", "*"):
        kind = f"list of {kind}"
    choices = info.get("choices")
    if choices:
        shown = ", ".join(map(str, choices[:8])) + (", …" if len(choices) > 8 else "")
        kind = f"{kind}, one of: {shown}"
    return kind


def override_keys(contains: str | None = None) -> OverrideKeys:
    """The accepted keys (those whose name holds ``contains``, ``-`` read as ``_``, when given), sorted."""
    known = known_server_arg_fields()
    types = _shipped_types()
    texts = server_args_help()
    wanted = contains.replace("-", "_").lower() if contains else None
    rows = []
    for name in sorted(known.fields):
        if (
            name.startswith("_")
            or name in PLAN_OWNED_OVERRIDES
            or (wanted is not None and wanted not in name)
        ):
            continue
        doc = (texts or {}).get(name) or (
            ""
            if texts is not None
            else f"(SGLang's help text: SGLang is not installed here; {SGLANG_SERVER_ARGS_DOCS})"
        )
        rows.append(FieldDoc(name, _type_text(types.get(name)), "SGLang's", doc))
    group_owned = {k: v for k, v in PLAN_OWNED_DEFAULTS.items() if k not in PLAN_OWNED_OVERRIDES}
    return OverrideKeys(rows, known.source, texts is not None, dict(PLAN_OWNED_OVERRIDES), group_owned)
