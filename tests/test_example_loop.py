"""The example trainer's step loop (``make demo``), end to end with stand-ins: what each engine did in each
step follows the plan, and an engine killed mid-loop is healed while the loop goes on."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.test_hydra_group import run_example


def rows(stdout: str, step: int) -> dict[str, list[str]]:
    """engine -> its cells in the table of ``step``."""
    table = stdout.split(f"step {step}: what each engine did", 1)[1].split("└", 1)[0]
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if cells and re.fullmatch(r"\w+\.\w+\.\d+", cells[0]):
            out[cells[0]] = cells[1:]
    return out


def test_the_demo_loop(tmp_path: Path) -> None:
    proc = run_example(
        "sglang=pd_actor_ref",
        "sglang_deploy=simulated",
        "colocate=true",
        "actor_num_nodes=3",
        "sglang.ref.regular.num_gpus=8",
        "num_rollout=2",
        "kill_engine_at_step=1",
        "train_step_s=0",
        f"sglang_deploy.launch.port_base={21000 + os.getpid() % 4000}",
        tmp_path=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # pd_actor_ref colocated with a 3 x 8-GPU actor (colocate: rollout_num_gpus = the actor's 24 GPUs, offload
    # on), every group at TP 2 (the preset leaves TP to the trainer: the example's rollout_num_gpus_per_engine):
    # actor prefill 8 GPUs at slot 0 (4 engines), decode 8 at slot 8 (4), ref 8 at slot 16 (4): every group
    # starts below Megatron's 24 GPUs, so every group needs offload; only the actor (its path is
    # hf_checkpoint) receives weights. The engine killed is the actor's last one.
    step0 = rows(out, 0)
    actor = [f"actor.{group}.{i}" for group in ("prefill", "decode") for i in range(4)]
    ref = [f"ref.regular.{i}" for i in range(4)]
    assert list(step0) == [*actor, *ref]
    did = {engine: [cell.split()[0] for cell in cells] for engine, cells in step0.items()}
    # columns: pause, offload, onload weights, update weights, onload kv, continue, weight version
    assert all(did[e] == ["ok", "ok", "ok", "ok", "ok", "ok", "1"] for e in actor), did
    assert all(did[e] == ["ok", "ok", "ok", "-", "ok", "ok", "default"] for e in ref), did
    assert "killed engine actor.decode.3" in out
    assert re.search(r"healed: engine actor\.decode\.3 serves again after [\d.]+ s", out)
    assert [rows(out, 1)[e][6] for e in step0] == ["2"] * 8 + ["default"] * 4
    assert "rollout 1: 4 samples" in out and "deployment stopped" in out


def test_the_loop_moves_gpus_from_prefill_to_decode_after_step_1(tmp_path: Path) -> None:
    """pd_actor_ref colocated with a 3 x 8-GPU actor at TP 2: prefill 8 GPUs (4 engines, slots 0-7), decode 8
    (4 engines, slots 8-15), ref 8. After step 1, 4 GPUs move to decode: prefill.0-1 and decode.0-3 keep
    running, prefill.2-3 stop, decode.4-5 start on the GPUs prefill gave up (slots 4-7: node 0, GPUs 4-7)
    and get the actor's weights of step 2 (the ledger's version 2); step 2 reaches all six decode engines."""
    proc = run_example(
        "sglang=pd_actor_ref",
        "sglang_deploy=simulated",
        "colocate=true",
        "actor_num_nodes=3",
        "sglang.ref.regular.num_gpus=8",
        "num_rollout=3",
        "rebalance_after_step=1",
        "train_step_s=0",
        f"sglang_deploy.launch.port_base={21000 + os.getpid() % 4000}",
        tmp_path=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "apply: 10 kept, 2 started, 2 stopped, 0 replaced" in out
    assert re.search(r"started\s+actor\.decode\.4\s+- -> node 0 GPUs 4,5", out)
    assert re.search(r"stopped\s+actor\.prefill\.2\s+node 0 GPUs 4,5 -> -", out)
    step2 = rows(out, 2)
    assert [e for e in step2 if e.startswith("actor.")] == [
        "actor.prefill.0",
        "actor.prefill.1",
        *(f"actor.decode.{i}" for i in range(6)),
    ]
    assert [step2[f"actor.decode.{i}"][6] for i in range(6)] == ["3"] * 6
