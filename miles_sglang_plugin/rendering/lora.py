"""LoRA serving arguments of every engine, as Miles derives them (``_compute_server_args``, radixark/miles
``sglang_engine.py`` at 31f1ca961), from ``sglang_deploy.lora``:

- **multi-LoRA** (``multi_lora_n_adapters`` > 0, Miles' ``--multi-lora-n-adapters``; it wins over single-LoRA):
  ``enable_lora``, ``max_loras_per_batch`` = the number of adapter slots, ``max_lora_rank``,
  ``lora_target_modules`` (HF names); no ``lora_paths`` (Miles' controller loads adapters at run time);
- **single LoRA** (``enabled``): ``enable_lora``, ``max_loras_per_batch`` 1 (unless set), ``max_lora_rank``,
  ``lora_target_modules`` when given, ``lora_paths`` (``name=path``), and ``enable_weights_cpu_backup`` with
  ``base_cpu_backup`` when colocated (Miles' ``--lora-base-cpu-backup``).

Which adapters the engines preload (:func:`lora_preload`, decided once when the deployment is prepared, on
the machine that prepares it):

- Miles' adapter (``miles_lora``, its ``--lora-adapter-path``) only for a ``debug_rollout_only`` run, and only
  from a directory that holds ``adapter_config.json``. A training run leaves it to the first weight sync, which
  installs the trainer's adapter before the first rollout (a resumed checkpoint may hold only Megatron shards,
  on which SGLang aborts at start); a note says so. Rollout-only without ``adapter_config.json`` is refused:
  nothing would bring the adapter then.
- Any other adapter: always (no weight sync brings it); a local directory without ``adapter_config.json`` is
  refused (SGLang would abort at start), a path that is no local directory is passed as given (SGLang reads
  it as a Hugging Face repository id), with a note.
- Engines that load dummy weights (``load_format: dummy``) preload none, as in Miles.

The check is one ``stat`` of ``<path>/adapter_config.json`` (Miles: ``os.path.isfile``): nothing is read, the
path is taken as written (no ``~`` or variable expansion).

Target modules may be Megatron names (``linear_qkv``, ``layers.*.self_attention.linear_qkv``); like Miles, each
is reduced to its last dotted part and mapped to the HF names SGLang uses (``q_proj``, ``k_proj``, ``v_proj``);
other names pass through, duplicates are dropped, the order is kept.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from miles_sglang_plugin.config.schema import LoraConf
from miles_sglang_plugin.errors import Problem
from miles_sglang_plugin.rendering.deploy_checks import Bounds, bounds_problems

#: Megatron LoRA module names -> the HF names SGLang serves (Miles ``lora_utils.py``): standard LoRA (merged
#: q/k/v and gate/up), CanonicalLoRA (split), GDN linear attention, and MLA / the DSA indexer.
MEGATRON_TO_HF_MODULES: Mapping[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "linear_q": ("q_proj",),
    "linear_k": ("k_proj",),
    "linear_v": ("v_proj",),
    "linear_fc1_gate": ("gate_proj",),
    "linear_fc1_up": ("up_proj",),
    "in_proj": ("in_proj_qkvz", "in_proj_ba"),
    "linear_q_down_proj": ("q_a_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "linear_q_up_proj": ("q_b_proj",),
    "linear_kv_up_proj": ("kv_b_proj",),
    "linear_wq_b": ("wq_b",),
    "linear_wk": ("wk",),
    "linear_weights_proj": ("weights_proj",),
}

KEY = "sglang_deploy.lora"
#: The adapter name Miles gives ``--lora-adapter-path`` (``miles/utils/lora.py``): the one its weight sync loads.
MILES_LORA_ADAPTER_NAME = "miles_lora"
#: The file that makes a directory an adapter SGLang can load (HF PEFT form).
ADAPTER_CONFIG = "adapter_config.json"


def hf_target_modules(names: Iterable[str]) -> list[str]:
    """Miles' ``convert_target_modules_to_hf``: the last dotted part of each name, Megatron names mapped to HF
    ones, others as given; first occurrence kept."""
    out: list[str] = []
    for name in names:
        leaf = str(name).rsplit(".", 1)[-1]
        for hf in MEGATRON_TO_HF_MODULES.get(leaf, (leaf,)):
            if hf not in out:
                out.append(hf)
    return out


def lora_server_args(
    lora: LoraConf, *, colocate: bool, paths: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The ServerArgs values LoRA adds to every engine (empty without LoRA); ``paths``: the adapters to
    preload (None: ``lora.paths``, as given; :func:`lora_preload` decides it for a deployment)."""
    if lora.multi_lora_n_adapters:
        return {
            "enable_lora": True,
            "max_loras_per_batch": lora.multi_lora_n_adapters,
            "max_lora_rank": lora.max_lora_rank,
            "lora_target_modules": hf_target_modules(lora.target_modules),
        }
    if not lora.enabled:
        return {}
    values: dict[str, Any] = {
        "enable_lora": True,
        "max_loras_per_batch": lora.max_loras_per_batch if lora.max_loras_per_batch is not None else 1,
        "max_lora_rank": lora.max_lora_rank,
    }
    if lora.target_modules:
        values["lora_target_modules"] = hf_target_modules(lora.target_modules)
    preload = lora.paths if paths is None else paths
    if preload:
        values["lora_paths"] = [f"{name}={path}" for name, path in preload.items()]
    if lora.base_cpu_backup and colocate:
        values["enable_weights_cpu_backup"] = True
    return values


def lora_problems(lora: LoraConf, *, colocate: bool) -> list[Problem]:
    """Values that are not whole numbers where they must be, and what Miles' multi-LoRA refuses
    (``validate_multi_lora_args``): no target modules, colocated engines; also what it would silently ignore."""
    out: list[Problem] = []
    for name, minimum in (("multi_lora_n_adapters", 0), ("max_lora_rank", 1), ("max_loras_per_batch", 1)):
        value = getattr(lora, name)
        if value is not None or name != "max_loras_per_batch":
            out += bounds_problems(f"{KEY}.{name}", value, Bounds(minimum, integer=True))
    if out or not lora.multi_lora_n_adapters:
        return out
    n = lora.multi_lora_n_adapters
    if not lora.target_modules:
        out.append(
            Problem(f"{KEY}.target_modules", f"multi-LoRA ({n} adapter slots) needs the target modules")
        )
    if colocate:
        out.append(
            Problem(
                f"{KEY}.multi_lora_n_adapters",
                f"{n}: multi-LoRA needs engines apart from training (Miles syncs its adapters only that way); "
                "turn colocate off",
            )
        )
    if lora.paths:
        out.append(
            Problem(
                f"{KEY}.paths",
                f"{sorted(lora.paths)}: multi-LoRA engines start without adapters (they are loaded while running); "
                "remove the paths, or use single LoRA (multi_lora_n_adapters: 0)",
            )
        )
    if lora.max_loras_per_batch is not None and lora.max_loras_per_batch != n:
        out.append(
            Problem(
                f"{KEY}.max_loras_per_batch",
                f"{lora.max_loras_per_batch}: with multi-LoRA it is the number of adapter slots, "
                f"multi_lora_n_adapters={n}; leave it null",
            )
        )
    return out


@dataclass(frozen=True)
class LoraPreload:
    """Which adapters the engines load at start, and why the others are not (notes) or cannot be (problems)."""

    paths: Mapping[str, str]
    notes: tuple[str, ...] = ()
    problems: tuple[Problem, ...] = ()


def _kind(path: str) -> str:
    """What ``path/adapter_config.json`` and ``path`` are here: ``adapter`` (the file is a regular file, through
    links as ``os.path.isfile`` follows them), ``directory`` (a directory without it), ``missing`` (no
    directory). One ``stat`` each; nothing is opened or read, the path is not expanded."""
    try:
        if stat.S_ISREG(os.stat(os.path.join(path, ADAPTER_CONFIG)).st_mode):
            return "adapter"
    except (OSError, ValueError):  # ValueError: a NUL in the path
        pass
    try:
        return "directory" if stat.S_ISDIR(os.stat(path).st_mode) else "missing"
    except (OSError, ValueError):
        return "missing"


def lora_preload(lora: LoraConf, *, rollout_only: bool) -> LoraPreload:
    """The adapters of ``lora.paths`` the engines preload (see the module's notes): Miles' rules for its
    adapter, ``radixark/miles`` ``sglang_engine.py`` (b53603cff: only a directory holding
    ``adapter_config.json``) and its PR #2708 (only a rollout-only run, which has no weight sync)."""
    if not lora.enabled or lora.multi_lora_n_adapters or not lora.paths:
        return LoraPreload(paths=dict(lora.paths))
    paths: dict[str, str] = {}
    notes: list[str] = []
    problems: list[Problem] = []
    for name, path in lora.paths.items():
        kind = _kind(path)
        key = f"{KEY}.paths.{name}"
        if name == MILES_LORA_ADAPTER_NAME:
            if not rollout_only:
                held = (
                    ""
                    if kind == "adapter"
                    else f"; it holds no {ADAPTER_CONFIG}, which SGLang would need"
                    if kind == "directory"
                    else "; it is no directory here"
                )
                notes.append(
                    f"LoRA adapter {name} ({path}) is not preloaded: as in Miles, the first weight sync installs "
                    f"the trainer's adapter before the first rollout (a preload is for debug_rollout_only runs){held}"
                )
            elif kind == "adapter":
                paths[name] = path
            else:
                what = "is no directory here" if kind == "missing" else f"holds no {ADAPTER_CONFIG}"
                problems.append(
                    Problem(
                        key,
                        f"{path!r} {what}: debug_rollout_only runs no weight sync, so the engines must load the "
                        f"adapter at start, and SGLang reads one only from a directory with {ADAPTER_CONFIG} "
                        "(HF PEFT form); export the adapter in that form, or remove the path",
                    )
                )
        elif kind == "adapter":
            paths[name] = path
        elif kind == "directory":
            problems.append(
                Problem(
                    key,
                    f"{path!r} holds no {ADAPTER_CONFIG}: SGLang would abort at start (it loads an adapter in HF "
                    "PEFT form); point it at such a directory, or remove the path",
                )
            )
        else:
            paths[name] = path
            notes.append(
                f"LoRA adapter {name} ({path}) is no directory here: the engines get it as given (SGLang loads "
                "a path that is no directory on its machine as a Hugging Face repository id)"
            )
    return LoraPreload(paths=paths, notes=tuple(notes), problems=tuple(problems))
