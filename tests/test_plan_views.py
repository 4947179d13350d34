"""The plan's node tables drawn without rich's layout (``planning/views.py``): character for character what
rich draws for the same table (a property over random cells, widths and titles), and rich itself wherever it
would do more than that (wide characters, a table wider than the console)."""

from __future__ import annotations

import io

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table
from rich.text import Text

from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.planning.views import NODE_COLUMNS, boxed_table, print_plan
from tests.conftest import group, model, spec


def _rich(title: str, columns: tuple[str, ...], rows: list[list[str]], width: int) -> str:
    out = io.StringIO()
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    Console(file=out, width=width, color_system=None, highlight=False).print(table)
    return out.getvalue()


_CELL = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=24)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.lists(_CELL, min_size=len(NODE_COLUMNS), max_size=len(NODE_COLUMNS)), min_size=1, max_size=6
    ),
    width=st.integers(min_value=40, max_value=220),
    node=st.integers(min_value=0, max_value=99_999),
)
def test_a_boxed_table_is_what_rich_draws(rows: list[list[str]], width: int, node: int) -> None:
    drawn = boxed_table(f"Node {node}", NODE_COLUMNS, rows, width)
    if drawn is None:  # wider than the console: rich wraps, so rich draws it
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(NODE_COLUMNS)]
        assert sum(widths) + 3 * len(widths) + 1 > width
        return
    assert drawn + "\n" == _rich(f"Node {node}", NODE_COLUMNS, rows, width)


def test_text_that_is_not_plain_ascii_is_left_to_rich() -> None:
    rows = [["0", "アクター", "g", "regular", "e.0", "no", ""]]
    assert boxed_table("Node 0", NODE_COLUMNS, rows, 160) is None
    assert boxed_table("Node 0", NODE_COLUMNS, [["0", "a\tb", "g", "regular", "e", "no", ""]], 160) is None


def test_a_printed_plan_is_the_same_drawn_either_way() -> None:
    """The node tables written as drawn text (a console's file) and through rich (a recording console)."""
    plan = resolve_deployment(
        spec(
            model("actor", group("prefill", 4, 2), group("decode", 12, 4)),
            model("ref", group("regular", 8, 1), update=False),
        ),
        TrainerInputs(hf_checkpoint="/c", debug_rollout_only=True),
    )
    plain = io.StringIO()
    print_plan(plan, Console(file=plain, width=160, color_system=None))
    recording = Console(record=True, width=160, color_system=None, file=io.StringIO())
    print_plan(plan, recording)
    assert plain.getvalue() == recording.export_text()
    # decode (TP 4) from slot 4: engine 2 on slots 12-15, node 1's local GPUs 4-7
    node1 = plain.getvalue().split("Node 1", 1)[1].split("Node 2", 1)[0]
    assert "│ 4-7        │ actor │ decode │ decode │ actor.decode.2 │ no      │           │" in node1
