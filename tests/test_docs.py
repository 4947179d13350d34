"""Issue 25: the README stays a short front page and the docs site stays true to the code.

The generated pages (the config reference, from the schema's field docstrings; the demo plan's placement
picture) must equal what ``scripts/generate-docs.py`` writes now, so that a field changed without its docs
fails here. The strict build itself (broken links, missing anchors, pages left out of the nav) is
``make docs``, which CI runs; the checks below need no mkdocs.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("generate_docs", REPO / "scripts" / "generate-docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _generator()


@pytest.mark.parametrize("name", sorted(GENERATOR.GENERATED))
def test_the_generated_pages_are_what_the_code_gives(name: str) -> None:
    committed = (REPO / name).read_text()
    assert committed == GENERATOR.GENERATED[name](), (
        f"{name} drifted from the code: run scripts/generate-docs.py"
    )


def test_the_config_reference_documents_every_key_with_its_type_and_default() -> None:
    text = (DOCS / "reference" / "config.md").read_text()
    row = "| `sglang.<model>.decode.num_gpus` | `int` | `0` | GPUs of the group, in GPUs; 0 turns the group off. |"
    assert row in text.splitlines()
    # `|` of a type stays inside its code span; `<model>` in a description is text, not an HTML tag.
    assert "| `sglang_deploy.launch.backend` | `local | ray` | `local` |" in text
    assert "## `sglang_deploy.launch.ray`" in text
    from miles_sglang_plugin.config.field_docs import schema_fields
    from miles_sglang_plugin.config.schema import MilesTrainerArgs

    for row in schema_fields(MilesTrainerArgs):
        assert f"`{row.key}`" in text, row.key


def test_the_docs_show_the_command_that_draws_the_placement_picture() -> None:
    command = " ".join(GENERATOR.PLACEMENT_OVERRIDES)
    plan_page = " ".join((DOCS / "plan.md").read_text().split())
    assert f"miles-sglang plan --picture placement.svg {command}" in plan_page
    assert "img/placement_agentic_32gpu.svg" in plan_page


def _nav_pages(entries: list) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert len(nav) == len(set(nav))
    assert config["strict"] is True


README = (REPO / "README.md").read_text()


def test_the_readme_is_a_front_page_of_at_most_200_lines() -> None:
    assert len(README.splitlines()) <= 200


def test_the_readme_gives_exactly_the_two_set_up_commands() -> None:
    setup = README.split("## Set-up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in setup.splitlines() if line.startswith("| ") and "|---" not in line][1:]
    assert [re.findall(r"`(make [\w-]+)`", row.split("|")[2]) for row in rows] == [
        ["make demo"],
        ["make test"],
    ]
    # Nowhere else does the README ask the reader to run another make target.
    assert set(re.findall(r"`(make [\w-]+)`", README)) == {"make demo", "make test", "make docs"}


def test_the_readmes_links_reach_files_of_the_repository() -> None:
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert targets, "no links"
    missing = [target for target in targets if not (REPO / target).is_file()]
    assert missing == []
    # Every page of a stage and every trainer guide is linked from the front page.
    for page in ("compose", "plan", "render", "backends", "serve", "sweeps", "miles-formats"):
        assert f"(docs/{page}.md)" in README, page
    for guide in ("hydra-app", "verl", "skyrl", "miles"):
        assert f"(docs/trainers/{guide}.md)" in README, guide
