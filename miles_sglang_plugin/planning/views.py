"""Human-readable views of a plan (rich tables): per model, per group, and per node which GPU runs what."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.printable import escape_controls


def _cells(*values: Any) -> list[Text]:
    """Table cells that render any value as its text: never as rich markup, never refused for its type, control
    characters escaped (a value cannot recolour, retitle or clear the terminal)."""
    return [value if isinstance(value, Text) else Text(escape_controls(str(value))) for value in values]


def _gpu_ids_text(ids: tuple[int, ...]) -> str:
    if len(ids) > 2 and ids == tuple(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(str(i) for i in ids)


def models_table(plan: DeploymentPlan) -> Table:
    table = Table(title="Models (one router each)", title_justify="left")
    for col in ("model", "router", "update_weights", "GPUs", "model_path", "external engines"):
        table.add_column(col)
    for model in plan.models:
        table.add_row(
            *_cells(
                model.name,
                "pd" if model.is_pd else "regular",
                model.update_weights,
                model.num_gpus,
                model.model_path,
                ", ".join(
                    e.url + ("" if e.worker_type.value == "regular" else f" ({e.worker_type.value})")
                    for e in model.external
                )
                or "-",
            )
        )
    return table


def groups_table(plan: DeploymentPlan) -> Table:
    table = Table(title="Server groups", title_justify="left")
    for col in ("model", "group", "type", "GPUs", "per engine", "engines", "gpu_offset", "offload"):
        table.add_column(col)
    for model, group in plan.groups():
        table.add_row(
            *_cells(
                model.name,
                group.name,
                group.worker_type.value,
                group.num_gpus,
                group.num_gpus_per_engine,
                len(group.engines),
                group.gpu_offset,
                "yes" if group.needs_offload else "no",
            )
        )
    return table


#: The columns of a node's table.
NODE_COLUMNS = ("local GPUs", "model", "group", "type", "engine", "offload", "node rank")


def node_rows(plan: DeploymentPlan) -> dict[int, list[list[str]]]:
    """Node -> its table's rows, by local GPU: each engine process (or placeholder range) with its local GPU
    ids."""
    rows: dict[int, list[tuple[int, list[str]]]] = defaultdict(list)
    gpus_per_node = plan.num_gpus_per_node
    for model, group in plan.groups():
        if not group.engines:
            start = plan.rollout_offset + group.gpu_offset
            by_node: dict[int, list[int]] = defaultdict(list)
            for slot in range(start, start + group.num_gpus):
                by_node[slot // gpus_per_node].append(slot % gpus_per_node)
            for node, ids in by_node.items():
                row = [
                    _gpu_ids_text(tuple(ids)),
                    model.name,
                    group.name,
                    group.worker_type.value,
                    "-",
                    "-",
                    "",
                ]
                rows[node].append((ids[0], row))
            continue
        offload = "yes" if group.needs_offload else "no"
        for engine in group.engines:
            engine_id = engine.id
            for process in engine.processes:
                rank = f"{process.node_rank}/{engine.nnodes}" if engine.nnodes > 1 else ""
                row = [_gpu_ids_text(process.local_gpu_ids), model.name, group.name, group.worker_type.value,
                       engine_id, offload, rank]  # fmt: skip
                rows[process.node].append((process.local_gpu_ids[0], row))
    return {node: [row for _, row in sorted(rows[node], key=lambda entry: entry[0])] for node in sorted(rows)}


def node_tables(plan: DeploymentPlan) -> list[Table]:
    """One table per node: each engine process (or placeholder range) with its local GPU ids."""
    tables = []
    for node, rows in node_rows(plan).items():
        table = Table(title=f"Node {node}", title_justify="left")
        for col in NODE_COLUMNS:
            table.add_column(col)
        for row in rows:
            table.add_row(*_cells(*row))
        tables.append(table)
    return tables


def boxed_table(title: str, columns: tuple[str, ...], rows: list[list[str]], max_width: int) -> str | None:
    """A table as rich draws a ``Table(title=title, title_justify="left")`` of plain text (its default box,
    heavy head, one space of padding) that fits in ``max_width``, character for character, without rich's
    layout work (a plan of 65,536 engines has 8,192 node tables: rich took seconds for them). None where
    rich would do more: text that is not printable ASCII (wide characters), or a table wider than
    ``max_width`` (rich wraps its cells)."""
    if not all(cell.isascii() and cell.isprintable() for row in rows for cell in row):
        return None
    widths = [max(len(col), *(len(row[i]) for row in rows)) for i, col in enumerate(columns)]
    total = sum(widths) + 3 * len(widths) + 1
    if total > max_width or len(title) > total or not (title.isascii() and title.isprintable()):
        return None

    def rule(left: str, fill: str, cross: str, right: str) -> str:
        return left + cross.join(fill * (width + 2) for width in widths) + right

    def line(values: Sequence[str], bar: str) -> str:
        return (
            bar
            + bar.join(f" {value.ljust(width)} " for value, width in zip(values, widths, strict=True))
            + bar
        )

    lines = [title.ljust(total), rule("┏", "━", "┳", "┓"), line(columns, "┃"), rule("┡", "━", "╇", "┩")]
    lines += [line(row, "│") for row in rows]
    lines.append(rule("└", "─", "┴", "┘"))
    return "\n".join(lines)


def _print_node_tables(plan: DeploymentPlan, console: Console) -> None:
    """The node tables, each drawn by :func:`boxed_table` where it can be and written to the console's file
    as it is (a recording console, as in a test, gets them through rich); the others through rich."""
    plain = not console.record and not console.is_jupyter
    for node, rows in node_rows(plan).items():
        text = boxed_table(f"Node {node}", NODE_COLUMNS, rows, console.width) if plain else None
        if text is not None:
            console.file.write(text + "\n")
            continue
        table = Table(title=f"Node {node}", title_justify="left")
        for col in NODE_COLUMNS:
            table.add_column(col)
        for row in rows:
            table.add_row(*_cells(*row))
        console.print(table)


def capacity_line(plan: DeploymentPlan) -> str:
    """The cluster the plan was checked against, or that it was not (``num_nodes`` unset)."""
    trainer = plan.trainer
    if trainer.num_nodes is None:
        return "cluster size unknown (num_nodes unset): capacity not checked"
    capacity = trainer.num_nodes * trainer.num_gpus_per_node
    used = max(plan.rollout_offset + plan.total_gpus, plan.megatron_num_gpus)
    return f"cluster: {trainer.num_nodes} node(s) x {trainer.num_gpus_per_node} GPUs = {capacity} GPU slots, {used} used"


def print_plan(plan: DeploymentPlan, console: Console | None = None) -> None:
    console = console or Console()
    summary = (
        f"{plan.total_gpus} GPUs in {len(plan.models)} model(s), {len(plan.engines)} engine(s); "
        f"rollout_offset={plan.rollout_offset}, megatron GPUs={plan.megatron_num_gpus}, "
        f"num_gpus_per_node={plan.num_gpus_per_node}, offload_rollout={plan.trainer.offload_rollout}\n"
        f"{capacity_line(plan)}"
    )
    console.print(Group(Text(summary), models_table(plan), groups_table(plan)))
    _print_node_tables(plan, console)
    for note in plan.notes:
        console.print(f"note: {escape_controls(note, keep_newlines=True)}", markup=False)
