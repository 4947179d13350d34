"""Helpers of the real-engine lane (``make test-real-engine``): SGLang 0.5.23's own server on the CPU, started
through the project's launch with the ``cpu_sglang`` engine kind, and a tiny Llama model made locally.

* :func:`require_real_sglang`: the lane's venv (``.venv-real``, ``scripts/install-sglang-real-cpu.sh``) has the
  torch build SGLang pins and transformers; elsewhere the lane's tests skip saying so, or fail with
  ``MSP_REQUIRE_REAL_ENGINE_TESTS=1`` (``.ci/run``): a lane that is skipped in CI is no test.
* :func:`make_tiny_model`: a ``LlamaConfig`` model (hidden 64, 2 layers) with random weights of a given seed and
  a byte-level BPE tokenizer trained on a few sentences, saved as a Hugging Face checkpoint. No download. The
  same sentences give the same tokenizer, so two seeds give two checkpoints of one model for weight updates.
* :func:`engine_processes` / :func:`engine_pid`: the engine processes this test process started (found by
  walking ``/proc`` from our own PID, matched by the ``--port`` the engine got; killed only by PID).
* :func:`process_tree_rss_mib`: what an engine holds in memory (its process and its children).
"""

from __future__ import annotations

import importlib.metadata
import os
import random
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.launch_helpers import _cmdline, process_alive

REQUIRE_ENV = "MSP_REQUIRE_REAL_ENGINE_TESTS"
SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.14.1"
HOST = "127.0.0.1"
ENGINE_MODULE = "sglang.launch_server"
#: SGLang names its child processes (``setproctitle``) ``sglang::scheduler`` and ``sglang::detokenizer``.
CHILD_MARKER = "sglang::"

#: The tokenizer's training text (a few sentences, repeated); its vocabulary is a few hundred tokens.
SENTENCES = (
    "the engine serves the rollout of the policy",
    "a tiny model runs on a cpu with two cores",
    "weights are updated from disk between two steps",
    "pause generation then continue it when the weights are back",
    "the router sends each request to one of the engines",
    "reward models score what the actor wrote",
)


def skip_or_fail(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"the real-engine tests must run here ({REQUIRE_ENV}=1), but: {reason}", pytrace=False)
    pytest.skip(reason)


def require_real_sglang() -> None:
    """Skip (or fail) unless this interpreter can run SGLang's server on the CPU: the lane's venv."""
    versions = {}
    for name in ("sglang", "torch", "transformers", "tokenizers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    hint = "run `make test-real-engine` (its venv: scripts/install-sglang-real-cpu.sh)"
    if versions["sglang"] != SGLANG_VERSION:
        skip_or_fail(f"SGLang {SGLANG_VERSION} is not installed here (found {versions['sglang']}); {hint}")
    if (versions["torch"] or "").split("+")[0] != TORCH_VERSION:
        skip_or_fail(
            f"torch {TORCH_VERSION} (the build SGLang {SGLANG_VERSION} pins) is not installed here "
            f"(found {versions['torch']}); {hint}"
        )
    if versions["transformers"] is None or versions["tokenizers"] is None:
        skip_or_fail(f"transformers and tokenizers are needed for the tiny model; {hint}")


# ------------------------------------------------------------------------------------------------ the model
def _train_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(SENTENCES) * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return fast


def make_tiny_model(path: Path, seed: int) -> Path:
    """A Llama checkpoint at ``path``: random weights of ``seed`` (float32), the locally trained tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------ processes
def random_port_base() -> int:
    return random.SystemRandom().randrange(20000, 29600)


def _children(ppid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == ppid:
            out.append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, parents before children."""
    found, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in _children(p)]
        found += children
        frontier = children
    return found


def engine_processes(root: int | None = None) -> dict[int, str]:
    """PID -> command line of every SGLang engine process (server, scheduler, detokenizer) below ``root``."""
    pids = descendants(os.getpid() if root is None else root)
    return {
        p: cmd
        for p in pids
        if (cmd := _cmdline(p)) and (ENGINE_MODULE in cmd or cmd.startswith(CHILD_MARKER))
    }


def engine_pid(port: int) -> int:
    """The PID of the ``sglang.launch_server`` process this test process started with ``--port port``."""
    matches = [
        pid
        for pid, cmd in engine_processes().items()
        if ENGINE_MODULE in cmd and f" --port {port} " in f"{cmd} "
    ]
    assert len(matches) == 1, f"engine processes with --port {port}: {matches} of {engine_processes()}"
    return matches[0]


def process_tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, in MiB (shared pages counted in each process)."""
    total_kib = 0
    for p in [pid, *descendants(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


def wait_until_gone(processes: Mapping[int, str], timeout_s: float) -> dict[int, str]:
    """Those of ``processes`` (PID -> command line) still running after up to ``timeout_s``: a zombie, or a PID
    that now runs another command line, counts as gone."""
    deadline = time.monotonic() + timeout_s
    alive = dict(processes)
    while True:
        alive = {p: cmd for p, cmd in alive.items() if process_alive(p, cmd[:60])}
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------ measurements
#: What the lane measured (label -> value), printed at the end of the run (``tests/conftest.py``).
MEASUREMENTS: dict[str, str] = {}


def record_measurement(label: str, value: str) -> None:
    MEASUREMENTS[label] = value
