"""Human-readable views of a plan (rich tables): per model, per group, and per node which GPU runs what."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from miles_sglang_plugin.planning.plan import DeploymentPlan


def _cells(*values: Any) -> list[Text]:
    """Table cells that render any value as its text: never as rich markup, never refused for its type."""
    return [value if isinstance(value, Text) else Text(str(value)) for value in values]


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


def node_tables(plan: DeploymentPlan) -> list[Table]:
    """One table per node: each engine process (or placeholder range) with its local GPU ids."""
    rows: dict[int, list[tuple[int, list[str]]]] = defaultdict(list)
    gpus_per_node = plan.num_gpus_per_node
    for model, group in plan.groups():
        if not group.engines:
            start = plan.rollout_offset + group.gpu_offset
            by_node: dict[int, list[int]] = defaultdict(list)
            for slot in range(start, start + group.num_gpus):
                by_node[slot // gpus_per_node].append(slot % gpus_per_node)
            for node, ids in by_node.items():
                rows[node].append(
                    (
                        ids[0],
                        [
                            _gpu_ids_text(tuple(ids)),
                            model.name,
                            group.name,
                            group.worker_type.value,
                            "-",
                            "-",
                            "",
                        ],
                    )
                )
            continue
        for engine in group.engines:
            for process in engine.processes:
                rank = f"{process.node_rank}/{engine.nnodes}" if engine.nnodes > 1 else ""
                rows[process.node].append(
                    (
                        process.local_gpu_ids[0],
                        [
                            _gpu_ids_text(process.local_gpu_ids),
                            model.name,
                            group.name,
                            group.worker_type.value,
                            engine.id,
                            "yes" if group.needs_offload else "no",
                            rank,
                        ],
                    )
                )
    tables = []
    for node in sorted(rows):
        table = Table(title=f"Node {node}", title_justify="left")
        for col in ("local GPUs", "model", "group", "type", "engine", "offload", "node rank"):
            table.add_column(col)
        for _, row in sorted(rows[node], key=lambda entry: entry[0]):
            table.add_row(*_cells(*row))
        tables.append(table)
    return tables


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
    console.print(Group(Text(summary), models_table(plan), groups_table(plan), *node_tables(plan)))
    for note in plan.notes:
        console.print(f"note: {note}", markup=False)
