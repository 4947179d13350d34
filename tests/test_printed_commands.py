"""Printed command lines run as printed (``printable.py``): a value with control characters (CR, BEL, ESC, any C0
or C1 character, DEL) is written in bash's ``$'...'`` form, so that the line pasted into bash runs exactly the
argv, checked by running it through ``bash -c`` with a script that prints its argv as JSON; tables and notes
show control characters escaped, never raw (a value cannot recolour, retitle or clear the terminal)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sglang_plugin import cli
from miles_sglang_plugin.app.hydra_edge import prepare_from_config
from miles_sglang_plugin.config.compose import compose_config
from miles_sglang_plugin.printable import escape_controls, shell_join, shell_quote

BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="bash is not installed")
#: Prints its arguments as JSON (ASCII): what a pasted line runs.
PRINT_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"
#: A model path with a CR, a BEL, colour, a window title and a C1 character (NEL, U+0085).
HOSTILE_PATH = "/m\x1b[31m\rX\x07\x1b]0;TITLE\x07\x1b[2J\x85"
#: Control characters no printed line or table may hold raw.
RAW_CONTROLS = [chr(c) for c in (*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))]
#: Nor a printed command line a tab or a newline (it is one line, pasted whole).
RAW_IN_A_LINE = [*RAW_CONTROLS, "\t", "\n"]


def _run_as_bash_does(line: str) -> list[str]:
    """The argv that ``line``, pasted into bash, hands to the program it runs."""
    assert BASH is not None
    done = subprocess.run(
        [
            BASH,
            "--noprofile",
            "--norc",
            "-c",
            f"{shell_quote(sys.executable)} -c {shell_quote(PRINT_ARGV)} {line}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUTF8": "1", "LC_ALL": "C.UTF-8"},
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


@pytest.mark.parametrize(
    ("word", "quoted"),
    [
        ("plain/path-1.0", "plain/path-1.0"),
        ("", "''"),
        ("a b", "'a b'"),
        ("it's", "'it'\"'\"'s'"),
        ("a\rb", "$'a\\rb'"),
        ("bell\x07", "$'bell\\x07'"),
        ("\x1b[31mred", "$'\\x1b[31mred'"),
        ("it's\n", "$'it\\'s\\n'"),
        ("back\\slash\t", "$'back\\\\slash\\t'"),
        ("del\x7f", "$'del\\x7f'"),
        ("nel\x85", "$'nel\\xc2\\x85'"),  # a C1 character: its UTF-8 bytes
        ("caf\u00e9 x", "'caf\u00e9 x'"),  # printable beyond ASCII: as it is
        ("rlo\u202e", "$'rlo\\xe2\\x80\\xae'"),  # a bidi override does not print either
    ],
)
def test_shell_quote(word: str, quoted: str) -> None:
    assert shell_quote(word) == quoted


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("\x1b[31m", "\\x1b[31m"),
        ("\x1b]0;TITLE\x07", "\\x1b]0;TITLE\\x07"),
        ("\x1b[2J", "\\x1b[2J"),
        ("a\rb", "a\\rb"),
        ("nel\x85 del\x7f", "nel\\x85 del\\x7f"),
        ("rlo\u202e", "rlo\\u202e"),
        ("two\nlines", "two\\nlines"),
        ("caf\u00e9 a b", "caf\u00e9 a b"),
    ],
)
def test_escape_controls(text: str, shown: str) -> None:
    assert escape_controls(text) == shown
    assert escape_controls("two\nlines\x07", keep_newlines=True) == "two\nlines\\x07"


@needs_bash
def test_a_hostile_argv_runs_as_printed() -> None:
    argv = ["/bin/x", HOSTILE_PATH, "a\rb", "it's", "", "$HOME", "`id`", "\\", "\t \n", "del\x7f"]
    line = shell_join(argv)
    assert not any(ch in line for ch in RAW_IN_A_LINE)
    assert _run_as_bash_does(line) == argv


@needs_bash
@settings(max_examples=40, deadline=None)
@given(argv=st.lists(st.text(st.characters(blacklist_characters="\x00")), min_size=1, max_size=4))
def test_any_argv_runs_as_printed(argv: list[str]) -> None:
    """Arbitrary text (but NUL, which no argv can hold) round-trips through the printed line."""
    line = shell_join(argv)
    assert not any(ch in line for ch in RAW_IN_A_LINE)
    assert _run_as_bash_does(line) == argv


@needs_bash
def test_plan_commands_print_what_runs_and_the_table_shows_controls_escaped(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A model path from an environment variable (as from a Miles file): each printed engine command line,
    pasted, runs the engine's argv; no control character reaches the terminal raw."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOSTILE_PATH", HOSTILE_PATH)
    overrides = [
        "hf_checkpoint=${oc.env:HOSTILE_PATH}",
        "rollout_num_gpus=2",
        "rollout_num_gpus_per_engine=1",
    ]
    assert cli.main(["plan", "--commands", *overrides]) == 0
    out = capsys.readouterr().out
    assert [ch for ch in out if ch in RAW_CONTROLS] == []
    assert "/m\\x1b[31m\\rX\\x07\\x1b]0;TITLE\\x07\\x1b[2J\\x85" in out  # the models table's model_path cell
    printed = [line.strip() for line in out.splitlines() if "sglang.launch_server" in line]
    engines = prepare_from_config(compose_config(overrides)).launch.engines
    assert len(printed) == len(engines) == 2
    for line, engine in zip(printed, engines, strict=True):
        ran = _run_as_bash_does(line)
        assert ran == list(engine.argv)
        assert ran[ran.index("--model-path") + 1] == HOSTILE_PATH
