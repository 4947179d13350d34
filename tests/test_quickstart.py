"""The README's first commands on one machine, and the quickstarts (docs/quickstart.md) in their smoke form.

A plan the local backend cannot run on this machine (engines on several nodes; real SGLang engines without the
GPUs they need) ends in one message and exit status 2 before anything starts, naming what to change. The
machine's GPUs are set through CUDA_VISIBLE_DEVICES (empty: none; 0..7: a node of 8), so that the tests mean
the same on any machine. The one-node presets are planned and placed as worked out by hand, and launched
with stand-in engines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles_sglang_plugin import compose_config, resolve_config
from miles_sglang_plugin.app.machine_fit import MachineGpus, machine_fit_problems, machine_gpus
from miles_sglang_plugin.config.reading import deploy_settings_from_config

REPO = Path(__file__).resolve().parent.parent
NO_GPU = ""
EIGHT_GPUS = "0,1,2,3,4,5,6,7"
#: The README card's own command, and its "GPU node" command.
CARD = ("sglang=pd_actor_ref", "sglang.actor.decode.num_gpus=12")
GPU_NODE = ("sglang=agentic_32gpu",)


def train(*args: str, tmp_path: Path, visible: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python train.py ARGS`` from examples/, as the README runs it (the run directory under tmp_path)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path}/run"],
        capture_output=True, text=True, timeout=180, cwd=REPO / "examples", env=env,
    )  # fmt: skip


def refusal(proc: subprocess.CompletedProcess[str], tmp_path: Path) -> str:
    """The one message of a refused launch (stderr, blanks joined); nothing was started."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "sglang_logs").exists()  # no engine or router got as far as a log file
    err = " ".join(proc.stderr.split())
    assert err.count("error:") == 1, err
    return err


# ------------------------------------------------------------------------------ the README's commands here
def test_the_card_command_without_a_gpu_says_so_and_names_the_ray_backend_and_the_cpu_kinds(tmp_path):
    # pd_actor_ref with decode 12: actor 8 + 12 = 20, ref 4: 24 rollout GPUs after the actor's 8 (slots 8-31):
    # nodes 1, 2 and 3 of 8 GPUs, a cluster of 4 nodes with the trainer's node 0.
    err = refusal(train(*CARD, tmp_path=tmp_path, visible=NO_GPU), tmp_path)
    assert "the plan places engines on nodes 1, 2, 3" in err
    assert "the rollout GPUs start at slot 8, after the actor's 1 x 8 training GPUs" in err
    assert "the groups hold 24 GPUs (actor=20, ref=4)" in err
    assert "a cluster of 4 nodes of 8 GPUs" in err
    assert "which has no GPU (CUDA_VISIBLE_DEVICES='')" in err
    assert "a Ray cluster of 4 nodes: sglang_deploy.launch.backend=ray" in err
    # 24 GPUs cannot share one node of 8: colocate=true would not help, so it is not offered
    assert "groups of at most 8 GPUs in all (now 24)" in err and "sglang=pd_actor_ref_1node" in err
    assert "colocate=true" not in err
    assert "sglang_deploy=simulated" in err and "sglang_deploy=cpu_sglang" in err


def test_the_card_command_on_one_node_of_eight_gpus(tmp_path):
    err = refusal(train(*CARD, tmp_path=tmp_path, visible=EIGHT_GPUS), tmp_path)
    assert "which has 8 GPUs (CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7')" in err
    assert "sglang_deploy.launch.backend=ray" in err and "sglang=pd_actor_ref_1node" in err
    assert "cpu_sglang" not in err  # there are GPUs: the CPU engine is no fix here
    assert "with stand-in engines: sglang_deploy=simulated" in err


def test_the_gpu_node_command_without_a_gpu(tmp_path):
    # agentic_32gpu: actor 4 + 12, ref 8, reward 8 = 32 GPUs after the actor's 8: slots 8-39, nodes 1-4 of 8.
    err = refusal(train(*GPU_NODE, tmp_path=tmp_path, visible=NO_GPU), tmp_path)
    assert "the plan places engines on nodes 1, 2, 3, 4" in err
    assert "the groups hold 32 GPUs (actor=16, ref=8, reward=8)" in err
    assert "a Ray cluster of 5 nodes: sglang_deploy.launch.backend=ray" in err
    assert "which has no GPU" in err and "sglang_deploy=cpu_sglang" in err


def test_a_hint_already_set_is_not_given_again(tmp_path):
    # The demo's deployment with real engines: colocated with a 4 x 8-GPU actor, 32 GPUs from slot 0 (nodes
    # 0-3). colocate=true is set already and would not fit 32 GPUs on a node anyway.
    err = refusal(
        train(*GPU_NODE, "colocate=true", "actor_num_nodes=4", tmp_path=tmp_path, visible=EIGHT_GPUS),
        tmp_path,
    )
    assert "the plan places engines on nodes 0, 1, 2, 3" in err and "a cluster of 4 nodes of 8 GPUs" in err
    assert "after the actor's" not in err  # colocated: rollout starts at slot 0
    assert "colocate=true" not in err and "debug_rollout_only" not in err


def test_one_node_fixes_are_those_that_fit_it():
    """An actor of 1 x 6 GPUs and one group of 6 GPUs, not colocated: rollout on slots 6-11, nodes 0 and 1.
    Three settings put it on node 0: colocate=true (the groups hold the actor's 6 GPUs), an actor of 8 - 6 = 2
    GPUs (rollout on slots 2-7), or rollout alone; with colocate=true already given it fits, nothing to say."""
    base = ["hf_checkpoint=/c", "actor_num_gpus_per_node=6", "sglang.actor.regular.num_gpus=6"]
    cfg = compose_config(base)
    (problem,) = machine_fit_problems(
        resolve_config(cfg), deploy_settings_from_config(cfg), MachineGpus(("0", "1"), "test")
    )
    text = problem.message
    assert problem.key == "sglang_deploy.launch.backend"
    assert "colocate=true (the engines share the actor's 6 GPUs)" in text
    assert "actor_num_gpus_per_node=2 (the trainer on GPUs 0-1, the engines on 2-7)" in text
    assert "debug_rollout_only=true" in text
    assert "which has 2 GPUs (test)" in text
    cfg = compose_config([*base, "colocate=true"])
    eight = MachineGpus(tuple(EIGHT_GPUS.split(",")), "test")
    assert machine_fit_problems(resolve_config(cfg), deploy_settings_from_config(cfg), eight) == []


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (NO_GPU, "this machine has no GPU (CUDA_VISIBLE_DEVICES='') and the plan's engines need GPUs 0-5"),
        (
            "0,1,2,3",
            "the plan's engines need GPUs 0-5 of a node (6 GPUs: actor=6), but this machine has 4 GPUs",
        ),
    ],
)
def test_real_engines_need_the_gpus_of_their_node(visible: str, expected: str):
    cfg = compose_config(["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=6"])
    gpus = MachineGpus(tuple(filter(None, visible.split(","))), f"CUDA_VISIBLE_DEVICES={visible!r}")
    (problem,) = machine_fit_problems(resolve_config(cfg), deploy_settings_from_config(cfg), gpus)
    assert problem.key == "sglang_deploy.launch.engine"
    assert expected in problem.message


def test_other_engine_commands_and_kinds_are_not_held_to_the_gpus():
    one_node = ["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.regular.num_gpus=6"]
    for extra in (["sglang_deploy=simulated"], ["sglang_deploy=cpu_sglang"],
                  ["sglang_deploy.launch.command=['{python}',-m,my_engine]"]):  # fmt: skip
        cfg = compose_config([*one_node, *extra])
        assert (
            machine_fit_problems(resolve_config(cfg), deploy_settings_from_config(cfg), MachineGpus((), "t"))
            == []
        )


def test_machine_gpus_are_read_from_the_inherited_list_first(tmp_path):
    assert machine_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}).ids == ("2", "3")
    assert machine_gpus({"CUDA_VISIBLE_DEVICES": " "}).ids == ()


# ------------------------------------------------------------------------------------ the quickstarts
def node_rows(stdout: str, node: int) -> list[tuple[str, str]]:
    """(local GPUs, engine) of each row of the plan's table of ``node``."""
    table = stdout.split(f"Node {node}", 1)[1].split("└", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if cells and re.fullmatch(r"[\d,]+", cells[0]):
            rows.append((cells[0], cells[4]))
    return rows


def test_one_node_colocated_plan(tmp_path):
    """pd_actor_ref_1node colocated with the actor's 8 GPUs, TP 2 (the example's rollout_num_gpus_per_engine):
    prefill 2 GPUs (1 engine) at slot 0, decode 4 (2 engines) at 2, ref 2 (1 engine) at 6; all on node 0,
    every engine offloaded while training (they share the actor's GPUs)."""
    proc = train("sglang=pd_actor_ref_1node", "colocate=true", "plan_only=true", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert node_rows(proc.stdout, 0) == [
        ("0,1", "actor.prefill.0"), ("2,3", "actor.decode.0"), ("4,5", "actor.decode.1"), ("6,7", "ref.regular.0")
    ]  # fmt: skip
    assert "Node 1" not in proc.stdout
    assert "8 GPUs in 2 model(s), 4 engine(s); rollout_offset=0" in proc.stdout
    assert "offload_rollout=True" in proc.stdout


def test_one_node_beside_the_trainer_plan(tmp_path):
    """actor_ref_1node beside a 4-GPU actor, not colocated: rollout starts at slot 4 (after the actor's GPUs),
    actor 2 GPUs (GPUs 4,5), ref 2 (6,7); no offload (the trainer has GPUs of its own)."""
    proc = train("sglang=actor_ref_1node", "actor_num_gpus_per_node=4", "plan_only=true", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert node_rows(proc.stdout, 0) == [("4,5", "actor.regular.0"), ("6,7", "ref.regular.0")]
    assert "rollout_offset=4" in proc.stdout and "offload_rollout=False" in proc.stdout


def test_one_node_quickstart_runs_with_stand_ins(tmp_path):
    proc = train(
        "sglang=pd_actor_ref_1node", "colocate=true", "sglang_deploy=simulated", "num_rollout=1", "train_step_s=0",
        f"sglang_deploy.launch.port_base={21000 + os.getpid() % 4000}", tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout 0: 4 samples" in proc.stdout and "deployment stopped" in proc.stdout
    engines = re.split(r"^engines\s*$", proc.stdout, flags=re.M)[1].split("└", 1)[0]
    visible = dict(re.findall(r"│ (\S+)\s+│ http://\S+\s+│ 0\s+│ ([\d,]+)", engines))
    assert visible == {
        "actor.prefill.0": "0,1",
        "actor.decode.0": "2,3",
        "actor.decode.1": "4,5",
        "ref.regular.0": "6,7",
    }


#: The CPU quickstart: one engine of one "GPU" slot (a CPU engine takes no GPU; the plan still places it).
CPU_ONE_ENGINE = (
    "sglang=default",
    "colocate=true",
    "actor_num_gpus_per_node=1",
    "rollout_num_gpus_per_engine=1",
)


def test_cpu_quickstart_plan(tmp_path):
    proc = train(*CPU_ONE_ENGINE, "sglang_deploy=cpu_sglang", "hf_checkpoint=/tmp/tiny-llama", "plan_only=true",
                 tmp_path=tmp_path, visible=NO_GPU)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert node_rows(proc.stdout, 0) == [("0", "actor.regular.0")]  # slot 0 of the 1-GPU actor, colocated
    assert "1 GPUs in 1 model(s), 1 engine(s); rollout_offset=0" in proc.stdout


def test_cpu_quickstart_without_sglang_runs_with_stand_ins(tmp_path):
    proc = train(*CPU_ONE_ENGINE, "sglang_deploy=simulated", "num_rollout=1", "train_step_s=0",
                 f"sglang_deploy.launch.port_base={21000 + os.getpid() % 4000}", tmp_path=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout 0: 4 samples" in proc.stdout and "deployment stopped" in proc.stdout


# ------------------------------------------------------------------------------------------- plan notes
def test_a_placeholder_path_of_a_preset_is_noted_with_the_key_to_set():
    plan = resolve_config(compose_config(["sglang=multi_model", "hf_checkpoint=/c"]))
    placeholder = [note for note in plan.notes if "placeholder" in note]
    assert placeholder == [
        "sglang.reward.model_path=/path/to/reward_model is a placeholder, not a checkpoint: set "
        "sglang.reward.model_path=<your reward checkpoint> before a launch (its engines would stop at start-up)"
    ]
    plan = resolve_config(
        compose_config(["sglang=multi_model", "hf_checkpoint=/c", "sglang.reward.model_path=/rm"])
    )
    assert not any("placeholder" in note for note in plan.notes)


def test_offload_with_nothing_to_offload_is_noted():
    # Not colocated, the actor's 8 GPUs first: the default group of 8 starts at slot 8, above the trainer's
    # slots 0-7, so Miles' needs_offload is false for it and offload_rollout=true releases nothing.
    plan = resolve_config(compose_config(["hf_checkpoint=/c", "offload_rollout=true"]))
    assert [note for note in plan.notes if note.startswith("offload_rollout=true, but")] == [
        "offload_rollout=true, but no engine group sits on the trainer's GPUs (rollout starts at slot 8, the "
        "trainer trains on slots 0-7): nothing is offloaded (Miles offloads only groups that start below the "
        "trainer's GPUs; colocate=true puts them there)"
    ]
    colocated = resolve_config(compose_config(["hf_checkpoint=/c", "colocate=true"]))  # offload on, and used
    assert not any(note.startswith("offload_rollout=true, but") for note in colocated.notes)


def test_the_command_refuses_it_too(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", NO_GPU)
    from miles_sglang_plugin.cli import main

    assert main(["launch", "--log-dir", str(tmp_path / "logs"), "hf_checkpoint=/c", *CARD]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "sglang_deploy.launch.backend: is local" in err and "a cluster of 4 nodes of 8 GPUs" in err
    assert not (tmp_path / "logs").exists()


def test_the_quickstart_page_shows_the_commands_tested_here():
    """docs/quickstart.md's console commands (``$ python train.py ...``) are those the tests above run."""
    text = (REPO / "docs" / "quickstart.md").read_text().replace("\\\n", " ")
    shown = [" ".join(line.split()[3:]) for line in text.splitlines() if line.startswith("$ python train.py")]
    assert shown == [
        "sglang=pd_actor_ref_1node colocate=true plan_only=true",
        "sglang=actor_ref_1node actor_num_gpus_per_node=4 plan_only=true",
        "sglang=pd_actor_ref_1node colocate=true sglang_deploy=simulated num_rollout=1",
        " ".join([*CPU_ONE_ENGINE, "sglang_deploy=simulated", "num_rollout=1"]),
        " ".join(CARD),
    ]
