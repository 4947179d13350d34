"""Issue 25: ``miles-sglang plan --picture out.svg``, the plan's GPU placement drawn: one row per node, one cell
per GPU, each cell saying what runs there. Expected cells are worked out by hand from Miles' rules."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from miles_sglang_plugin.cli import main

SVG = "{http://www.w3.org/2000/svg}"


def cells(path: Path) -> list[str]:
    """The title of every GPU cell, in the order drawn (node by node, GPU by GPU)."""
    root = ET.parse(path).getroot()  # well-formed XML, or this raises
    assert root.tag == f"{SVG}svg"
    return [rect.find(f"{SVG}title").text for rect in root.iter(f"{SVG}rect") if rect.get("class") == "gpu"]


def labels(path: Path) -> list[str]:
    root = ET.parse(path).getroot()
    return [text.text for text in root.iter(f"{SVG}text") if text.get("font-weight") == "bold"]


def test_a_plan_after_the_trainer_with_a_placeholder_group(tmp_path: Path, capsys) -> None:
    # 4 GPUs per node, the actor trains on node 0 (4 GPUs), not colocated: rollout_offset 4. The preset's actor
    # has regular 6 (TP 2: 3 engines) then placeholder 2: slots 4-9 and 10-11, i.e. node 1 GPUs 0-3 and node
    # 2 GPUs 0-1 for the engines, node 2 GPUs 2-3 reserved. 12 slots: 3 nodes drawn.
    picture = tmp_path / "placement.svg"
    overrides = [
        "sglang=placeholder", "hf_checkpoint=/c", "num_gpus_per_node=4", "actor_num_gpus_per_node=4",
        "rollout_num_gpus_per_engine=2",
    ]  # fmt: skip
    assert main(["plan", "--picture", str(picture), *overrides]) == 0
    out = capsys.readouterr()
    assert "Node 1" in out.out  # the plan is printed as without --picture
    assert f"wrote the GPU placement picture to {picture}" in out.err
    assert cells(picture) == [
        "node 0 GPU 0: trainer's GPU",
        "node 0 GPU 1: trainer's GPU",
        "node 0 GPU 2: trainer's GPU",
        "node 0 GPU 3: trainer's GPU",
        "node 1 GPU 0: actor.regular.0",
        "node 1 GPU 1: actor.regular.0",
        "node 1 GPU 2: actor.regular.1",
        "node 1 GPU 3: actor.regular.1",
        "node 2 GPU 0: actor.regular.2",
        "node 2 GPU 1: actor.regular.2",
        "node 2 GPU 2: actor.placeholder (placeholder, no engine)",
        "node 2 GPU 3: actor.placeholder (placeholder, no engine)",
    ]
    # One label per engine (across its two GPUs), the caption first.
    assert labels(picture)[1:] == ["actor.regular.0", "actor.regular.1", "actor.regular.2"]


def test_colocated_engines_offload_on_the_trainers_gpus_and_free_nodes_are_drawn(tmp_path: Path) -> None:
    # Colocated with an actor of 1 node x 4 GPUs: Miles sizes rollout to the actor's 4 GPUs, from slot 0, and
    # turns offload on. num_nodes=2: the second node is drawn, free.
    picture = tmp_path / "colocated.svg"
    overrides = [
        "sglang=default", "hf_checkpoint=/c", "num_gpus_per_node=4", "actor_num_gpus_per_node=4",
        "colocate=true", "rollout_num_gpus_per_engine=2", "num_nodes=2",
    ]  # fmt: skip
    assert main(["plan", "--picture", str(picture), "--json", *overrides]) == 0
    assert cells(picture) == [
        "node 0 GPU 0: actor.regular.0, offloads, trainer's GPU",
        "node 0 GPU 1: actor.regular.0, offloads, trainer's GPU",
        "node 0 GPU 2: actor.regular.1, offloads, trainer's GPU",
        "node 0 GPU 3: actor.regular.1, offloads, trainer's GPU",
        "node 1 GPU 0: free",
        "node 1 GPU 1: free",
        "node 1 GPU 2: free",
        "node 1 GPU 3: free",
    ]
    assert re.search(r"4 GPUs in 1 model\(s\), 2 engine\(s\); rollout_offset=0", picture.read_text())


def test_a_picture_that_is_not_svg_or_cannot_be_written_is_refused(tmp_path: Path, capsys) -> None:
    overrides = ["sglang=default", "hf_checkpoint=/c"]
    assert main(["plan", "--picture", str(tmp_path / "out.png"), *overrides]) == 2
    assert "the picture is SVG; give a file name ending in .svg" in capsys.readouterr().err
    assert main(["plan", "--picture", str(tmp_path / "no" / "such" / "dir.svg"), *overrides]) == 2
    err = capsys.readouterr().err
    assert "cannot write it: No such file or directory" in " ".join(err.split())
    assert not (tmp_path / "out.png").exists()
