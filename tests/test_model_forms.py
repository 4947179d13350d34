"""The forms a Hydra user tries first to add a model end in one message naming the supported form
(``+sglang_model@sglang.<name>=base``, docs/compose.md), with the user's own values carried over; exit 2, no
traceback, in an app (the example trainer) and in ``miles-sglang`` alike. Overrides on a model the group has
keep Hydra's behaviour."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_sglang_plugin.cli import main

REPO = Path(__file__).resolve().parent.parent

#: override -> what the message must say after "<override>: " (the default preset has the actor alone).
FORMS = {
    "+sglang.reward={model_path:/rm,regular:{num_gpus:4}}": "sglang has no model 'reward' (its models: actor); a "
    "model is added with its schema, then its keys are set: +sglang_model@sglang.reward=base "
    "sglang.reward.model_path=/rm sglang.reward.regular.num_gpus=4 (docs/compose.md: add a model)",
    "+sglang.reward.model_path=/rm": "sglang has no model 'reward' (its models: actor); a model is added with its "
    "schema, then its keys are set: +sglang_model@sglang.reward=base sglang.reward.model_path=/rm",
    "sglang.judge.regular.num_gpus=2": "sglang has no model 'judge' (its models: actor); a model is added with its "
    "schema, then its keys are set: +sglang_model@sglang.judge=base sglang.judge.regular.num_gpus=2",
    "+sglang.reward=base": "sglang has no model 'reward' (its models: actor); a model is added with its schema, "
    "then its keys are set: +sglang_model@sglang.reward=base (docs",
}


@pytest.mark.parametrize("override", sorted(FORMS))
def test_the_command_names_the_supported_form(capsys, override: str):
    assert main(["plan", "hf_checkpoint=/c", override]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"error: 1 bad override: - {override}: {FORMS[override]}" in err
    assert "ModelConf" not in err and "Traceback" not in err


def test_the_app_names_the_supported_form(tmp_path: Path):
    override = "+sglang.reward={model_path:/rm,regular:{num_gpus:4}}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "train.py", override, "plan_only=true", f"hydra.run.dir={tmp_path}/run"],
        capture_output=True, text=True, timeout=180, cwd=REPO / "examples", env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    err = " ".join(proc.stderr.split())
    assert f"{override}: {FORMS[override]}" in err
    assert "Traceback" not in err and "ModelConf" not in err and proc.stdout == ""


def test_the_preset_models_and_other_failures_keep_hydras_behaviour(capsys):
    # A model the preset has: a mapping merges into it (Hydra), a '+' on a key it has is Hydra's own message.
    assert main(["plan", "--json", "hf_checkpoint=/c", "+sglang.actor={update_weights:false}"]) == 0
    capsys.readouterr()
    assert main(["plan", "hf_checkpoint=/c", "+sglang.actor.regular.num_gpus=4"]) == 2
    err = capsys.readouterr().err
    assert "Could not append to config. An item is already at 'sglang.actor.regular.num_gpus'" in err
    assert "sglang_model@" not in err
