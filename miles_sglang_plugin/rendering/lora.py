"""LoRA serving arguments of every engine, as Miles derives them (``_compute_server_args``, radixark/miles
``sglang_engine.py`` at 31f1ca961), from ``sglang_deploy.lora``:

- **multi-LoRA** (``multi_lora_n_adapters`` > 0, Miles' ``--multi-lora-n-adapters``; it wins over single-LoRA):
  ``enable_lora``, ``max_loras_per_batch`` = the number of adapter slots, ``max_lora_rank``,
  ``lora_target_modules`` (HF names); no ``lora_paths`` (Miles' controller loads adapters at run time);
- **single LoRA** (``enabled``): ``enable_lora``, ``max_loras_per_batch`` 1 (unless set), ``max_lora_rank``,
  ``lora_target_modules`` when given, ``lora_paths`` (``name=path``), and ``enable_weights_cpu_backup`` with
  ``base_cpu_backup`` when colocated (Miles' ``--lora-base-cpu-backup``).

Target modules may be Megatron names (``linear_qkv``, ``layers.*.self_attention.linear_qkv``); like Miles, each
is reduced to its last dotted part and mapped to the HF names SGLang uses (``q_proj``, ``k_proj``, ``v_proj``);
other names pass through, duplicates are dropped, the order is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


def lora_server_args(lora: LoraConf, *, colocate: bool) -> dict[str, Any]:
    """The ServerArgs values LoRA adds to every engine (empty without LoRA)."""
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
    if lora.paths:
        values["lora_paths"] = [f"{name}={path}" for name, path in lora.paths.items()]
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
