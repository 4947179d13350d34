"""Write the docs' generated pages: the config reference (``docs/reference/config.md``, from the schema's field
docstrings: the text ``miles-sglang fields`` prints, as tables) and the GPU placement picture of the demo's
plan (``docs/img/placement_agentic_32gpu.svg``, what ``miles-sglang plan --picture`` draws).

    .venv/bin/python scripts/generate-docs.py [--check]

Run it after changing a field of ``miles_sglang_plugin/config/schema.py`` (or of a dataclass its fields come
from), or the picture; ``--check`` only compares the committed files with what it would write (exit 1 if one
differs). ``tests/test_docs.py`` makes the same comparison, so docs that drift from the code fail the tests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GENERATOR = "scripts/generate-docs.py"
#: The demo's deployment (``make demo``: the 32-GPU agentic preset colocated with a 4-node actor, TP 2), as
#: ``miles-sglang plan --picture`` takes it; docs/plan.md shows this command.
PLACEMENT_OVERRIDES = (
    "sglang=agentic_32gpu",
    "colocate=true",
    "actor_num_nodes=4",
    "num_nodes=4",
    "rollout_num_gpus_per_engine=2",
    "hf_checkpoint=/models/Qwen3-8B",
)


def config_reference() -> str:
    """The config reference as this checkout's schema documents it."""
    from miles_sglang_plugin.config.field_docs import markdown_reference, schema_fields
    from miles_sglang_plugin.config.schema import MilesTrainerArgs

    return markdown_reference(schema_fields(MilesTrainerArgs), GENERATOR)


def placement_picture() -> str:
    """The demo plan's GPU placement, as ``miles-sglang plan --picture`` draws it."""
    from miles_sglang_plugin.app.hydra_edge import prepare_from_config
    from miles_sglang_plugin.config.compose import compose_config
    from miles_sglang_plugin.planning.picture import placement_svg

    cfg = compose_config(list(PLACEMENT_OVERRIDES), return_hydra_config=True)
    return placement_svg(prepare_from_config(cfg).plan)


#: Each generated file (relative to the repository) and what writes it.
GENERATED: dict[str, Callable[[], str]] = {
    "docs/reference/config.md": config_reference,
    "docs/img/placement_agentic_32gpu.svg": placement_picture,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only (exit 1 if a file differs)")
    args = parser.parse_args(argv)
    status = 0
    for name, generate in GENERATED.items():
        target, text = REPO / name, generate()
        if args.check:
            if not target.is_file() or target.read_text() != text:
                sys.stderr.write(f"{name} differs from what the code gives: run {GENERATOR}\n")
                status = 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        sys.stdout.write(f"wrote {name}\n")
    return status


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
