"""The plan's GPU placement as a picture (``miles-sglang plan --picture out.svg``): one row per node, one cell
per GPU, coloured by model and group and labelled with the engine that runs there.

Plain SVG text (no dependency): each GPU is a ``<rect>`` whose ``<title>`` says what it holds (``node 1 GPU 3:
actor.decode.1, offloads``), so a viewer shows it on hover and a test reads it; each engine process gets one
label across its GPUs. The trainer's GPUs (Megatron's: slots below ``megatron_num_gpus``) are grey cells of
their own, or carry a dark bar where rollout is colocated on them; a placeholder group's GPUs are outlined
and dashed; GPUs nothing uses are white. The nodes drawn are those the plan uses, or the whole cluster where
``num_nodes`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from miles_sglang_plugin.planning.plan import DeploymentPlan

#: Fill colours of the groups, in the plan's order (light, so that black text reads on them).
PALETTE = (
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
    "#fdd0a2",
    "#c7e9c0",
    "#dadaeb",
)
TRAINER_FILL = "#bdbdbd"
FREE_FILL = "#ffffff"
CELL_W, CELL_H, GAP = 112, 46, 4
LEFT, TOP = 72, 58
FONT = "DejaVu Sans, Verdana, sans-serif"


@dataclass(frozen=True)
class GpuCell:
    """What one GPU of one node holds in the plan."""

    node: int
    gpu: int
    #: ``model.group`` of the group using it, "" for none.
    group: str = ""
    #: The engine whose process runs there ("" for a placeholder group's GPU or a free one).
    engine: str = ""
    offload: bool = False
    placeholder: bool = False
    #: A GPU the trainer trains on (below Megatron's GPUs).
    trainer: bool = False

    def title(self) -> str:
        held = self.engine or (f"{self.group} (placeholder, no engine)" if self.placeholder else "")
        parts = [held] if held else []
        if self.offload:
            parts.append("offloads")
        if self.trainer:
            parts.append("trainer's GPU")
        return f"node {self.node} GPU {self.gpu}: {', '.join(parts) or 'free'}"


@dataclass(frozen=True)
class EngineLabel:
    """One engine process's label across its GPUs of one node."""

    node: int
    first_gpu: int
    num_gpus: int
    text: str
    offload: bool = False


def _node_count(plan: DeploymentPlan) -> int:
    per_node = plan.num_gpus_per_node
    used_slots = max(plan.rollout_offset + plan.total_gpus, plan.megatron_num_gpus, 1)
    used = -(-used_slots // per_node)
    return max(used, plan.trainer.num_nodes or 0)


def gpu_cells(plan: DeploymentPlan) -> tuple[list[GpuCell], list[EngineLabel], list[str]]:
    """Every GPU of the nodes drawn (node by node, GPU by GPU), the engines' labels, and the groups in plan
    order (``model.group``, which is also the order of their colours)."""
    per_node = plan.num_gpus_per_node
    held: dict[int, GpuCell] = {}
    labels: list[EngineLabel] = []
    groups: list[str] = []
    for model, group in plan.groups():
        name = f"{model.name}.{group.name}"
        groups.append(name)
        offload = group.needs_offload
        if not group.engines:  # a placeholder group: GPUs reserved, no engine
            start = plan.rollout_offset + group.gpu_offset
            for slot in range(start, start + group.num_gpus):
                held[slot] = GpuCell(slot // per_node, slot % per_node, name, placeholder=True)
        for engine in group.engines:
            for process in engine.processes:
                for slot, gpu in zip(process.gpu_slots, process.local_gpu_ids, strict=True):
                    held[slot] = GpuCell(process.node, gpu, name, engine.id, offload)
                ids = process.local_gpu_ids
                labels.append(EngineLabel(process.node, min(ids), len(ids), engine.id, offload))
    cells = []
    for slot in range(_node_count(plan) * per_node):
        cell = held.get(slot, GpuCell(slot // per_node, slot % per_node))
        if slot < plan.megatron_num_gpus:
            cell = GpuCell(cell.node, cell.gpu, cell.group, cell.engine, cell.offload, cell.placeholder, True)
        cells.append(cell)
    return cells, labels, groups


def _x(gpu: int) -> int:
    return LEFT + gpu * (CELL_W + GAP)


def _y(node: int) -> int:
    return TOP + node * (CELL_H + GAP)


def _text(x: float, y: float, text: str, size: float = 11, anchor: str = "start", extra: str = "") -> str:
    return (
        f'<text x="{x:g}" y="{y:g}" font-size="{size:g}" text-anchor="{anchor}"{extra}>{escape(text)}</text>'
    )


def _cell_svg(cell: GpuCell, colours: dict[str, str]) -> list[str]:
    x, y = _x(cell.gpu), _y(cell.node)
    fill = colours.get(cell.group) if cell.group and not cell.placeholder else None
    fill = fill or (TRAINER_FILL if cell.trainer and not cell.group else FREE_FILL)
    stroke = (
        f'stroke="{colours[cell.group]}" stroke-width="3" stroke-dasharray="6 3"'
        if cell.placeholder
        else 'stroke="#757575" stroke-width="1"'
    )
    out = [
        f'<rect class="gpu" x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" rx="4" fill="{fill}" {stroke}>'
        f"<title>{escape(cell.title())}</title></rect>"
    ]
    if cell.trainer and cell.group:  # rollout colocated on a training GPU
        out.append(f'<rect x="{x}" y="{y + CELL_H - 6}" width="{CELL_W}" height="6" fill="#424242"/>')
    if cell.placeholder:
        out.append(_text(x + CELL_W / 2, y + CELL_H / 2 + 4, "placeholder", 10, "middle", ' fill="#616161"'))
    elif cell.trainer and not cell.group:
        out.append(_text(x + CELL_W / 2, y + CELL_H / 2 + 4, "trainer", 10, "middle"))
    return out


def _label_svg(label: EngineLabel) -> str:
    x, y = _x(label.first_gpu), _y(label.node)
    width = label.num_gpus * CELL_W + (label.num_gpus - 1) * GAP
    size = max(6.0, min(11.0, (width - 8) / (0.62 * max(len(label.text), 1))))
    outline = (
        f'<rect x="{x}" y="{y}" width="{width}" height="{CELL_H}" rx="4" fill="none" stroke="#212121" '
        'stroke-width="1.5"/>'
    )
    middle = y + CELL_H / 2 + (0 if label.offload else 4)
    text = _text(x + width / 2, middle, label.text, size, "middle", ' font-weight="bold"')
    if label.offload:
        text += _text(x + width / 2, middle + 12, "offloads", 9, "middle", ' fill="#424242"')
    return outline + text


def _legend_svg(groups: list[str], placeholders: set[str], colours: dict[str, str], top: int) -> list[str]:
    entries = [(name, colours[name]) for name in groups]
    entries += [
        ("trainer's GPU", TRAINER_FILL),
        ("trainer's GPU, rollout colocated", ""),
        ("free", FREE_FILL),
    ]
    out = []
    for index, (name, fill) in enumerate(entries):
        x, y = LEFT + (index % 4) * 220, top + (index // 4) * 20
        if name in placeholders:
            out.append(
                f'<rect x="{x}" y="{y}" width="14" height="14" fill="{FREE_FILL}" stroke="{fill}" '
                'stroke-width="3" stroke-dasharray="4 2"/>'
            )
        elif fill:
            out.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="{fill}" stroke="#757575"/>')
        else:  # the bar a colocated training GPU carries
            out.append(f'<rect x="{x}" y="{y + 9}" width="14" height="5" fill="#424242"/>')
        out.append(_text(x + 20, y + 11, name))
    return out


def placement_svg(plan: DeploymentPlan, title: str = "") -> str:
    """The picture of ``plan`` as SVG text."""
    cells, labels, groups = gpu_cells(plan)
    colours = {name: PALETTE[index % len(PALETTE)] for index, name in enumerate(groups)}
    per_node, nodes = plan.num_gpus_per_node, _node_count(plan)
    legend_top = _y(nodes) + 16
    width = max(_x(per_node) + 8, LEFT + 4 * 220)
    height = legend_top + 20 * -(-(len(groups) + 3) // 4) + 8
    caption = title or (
        f"{plan.total_gpus} GPUs in {len(plan.models)} model(s), {len(plan.engines)} engine(s); "
        f"rollout_offset={plan.rollout_offset}, trainer GPUs={plan.megatron_num_gpus}"
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family={quoteattr(FONT)}>',
        f'<rect width="{width}" height="{height}" fill="#fafafa"/>',
        _text(LEFT, 20, caption, 13, extra=' font-weight="bold"'),
    ]
    out += [_text(_x(gpu) + CELL_W / 2, TOP - 8, f"GPU {gpu}", 10, "middle") for gpu in range(per_node)]
    out += [_text(LEFT - 10, _y(node) + CELL_H / 2 + 4, f"node {node}", 11, "end") for node in range(nodes)]
    for cell in cells:
        out += _cell_svg(cell, colours)
    out += [_label_svg(label) for label in labels]
    placeholders = {cell.group for cell in cells if cell.placeholder}
    out += _legend_svg(groups, placeholders, colours, legend_top)
    out.append("</svg>")
    return "\n".join(out) + "\n"
