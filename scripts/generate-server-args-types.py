"""Write the value types of SGLang's ``launch_server`` flags, read from the installed SGLang's own parser, to
``miles_sglang_plugin/data/sglang_server_args_types.json`` (next to the shipped field list).

    .venv/bin/python scripts/generate-server-args-types.py [--check]

Run it once per SGLang version the package ships a table for (now 0.5.23, installed by
``scripts/install-sglang-cpu.sh``); ``--check`` only compares the file with what it would write (exit 1 if
they differ). Per ``ServerArgs`` field, keyed by field name:

* ``kind``: ``switch`` (a flag without a value: true or false), ``int``, ``float``, ``size`` (an integer, or one
  with an SI/IEC suffix such as ``32k`` or ``4Ki``: SGLang's ``human_readable_int``), ``json`` (JSON text), or
  ``str`` (any text, including values SGLang's own functions parse further);
* ``nargs``: argparse's (``null`` for one value, ``"?"``, ``"*"``, ``"+"``);
* ``choices``: the values SGLang accepts, when it lists them;
* ``flag``: the spelling SGLang takes, when it is not ``--`` + the field name with ``-`` for ``_``.

Fields SGLang's parser has no flag for are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "miles_sglang_plugin" / "data" / "sglang_server_args_types.json"

_KIND_OF_TYPE = {
    "int": "int",
    "float": "float",
    "loads": "json",
    "json_list_type": "json",
    "human_readable_int": "size",
}


def _entry(action: argparse.Action) -> dict[str, Any]:
    if action.nargs == 0:
        entry: dict[str, Any] = {"kind": "switch"}
    else:
        entry = {
            "kind": _KIND_OF_TYPE.get(getattr(action.type, "__name__", ""), "str"),
            "nargs": action.nargs,
        }
    if action.choices is not None:
        choices = [c if isinstance(c, int | float | str) else str(c) for c in action.choices]
        # A set (SGLang builds some choices from one) has no stable order: sorted, so the file is reproducible.
        entry["choices"] = (
            sorted(choices, key=str) if isinstance(action.choices, set | frozenset) else choices
        )
    flag = "--" + action.dest.replace("_", "-")
    if flag not in action.option_strings:
        entry["flag"] = next(s for s in action.option_strings if s.startswith("--"))
    return entry


def build() -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from miles_sglang_plugin.rendering.sglang_server_args import (
        load_sglang_server_args_module,
        sglang_version,
    )

    module = load_sglang_server_args_module()
    if module is None:
        raise SystemExit("SGLang is not installed: run scripts/install-sglang-cpu.sh first")
    parser = argparse.ArgumentParser(add_help=False)
    module.ServerArgs.add_cli_args(parser)
    fields = set(module.ServerArgs.__struct_fields__)
    entries: dict[str, dict[str, Any]] = {}
    for action in parser._actions:
        if action.dest not in fields:
            continue
        # A field with two flags (a deprecated spelling): keep the one spelled like the field.
        if action.dest in entries and "--" + action.dest.replace("_", "-") not in action.option_strings:
            continue
        entries[action.dest] = _entry(action)
    return {
        "sglang_version": sglang_version(),
        "generated_by": "scripts/generate-server-args-types.py",
        "fields": dict(sorted(entries.items())),
    }


def main() -> int:
    check = "--check" in sys.argv[1:]
    text = json.dumps(build(), indent=1, sort_keys=False) + "\n"
    if check:
        same = TARGET.exists() and TARGET.read_text() == text
        print(f"{TARGET.relative_to(REPO)} is {'up to date' if same else 'out of date'}")
        return 0 if same else 1
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
