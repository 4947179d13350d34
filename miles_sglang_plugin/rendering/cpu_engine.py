"""The ``cpu_sglang`` engine kind: the real SGLang 0.5.23 server on a machine without a GPU (pure data).

Each engine gets the command line the plan renders for the ``sglang`` kind, with these substitutions (the
plan's notes list them):

* added, over every other value: ``--device cpu``, ``--attention-backend torch_native`` (the only attention
  backend without GPU or AMX kernels), ``--disable-overlap-schedule`` and ``--disable-cuda-graph``;
* added as a default (``server_defaults`` and group overrides win): ``--max-total-tokens 8192``. Without it
  SGLang sizes its KV cache from the machine's free memory (reported as 13 GB and 140 s to start on a 24 GB
  machine);
* left out: ``--enable-memory-saver`` (it cannot start: torch_memory_saver is CUDA only; on a CPU an offload
  releases nothing, and the engine keeps serving) and every CUDA-graph setting (``cuda_graph_*``);
* environment: ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU code paths) and ``PYTHONPATH`` = the package's
  ``cpu_engine_shim`` directory, then ``sglang_deploy.env.PYTHONPATH`` if set. The shim provides the few
  functions of SGLang's unpublished CPU kernel package that SGLang imports at start-up (one implemented in
  torch) and makes ``torch.get_device_module()`` answer ``torch.cpu`` where a CUDA build of torch has no device
  (``cpu_engine_shim/README.md``). It is on no other engine's path.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_sglang_plugin.engine_env import CPU_ENGINE_ENV

#: The directory put first on a ``cpu_sglang`` engine's PYTHONPATH (a data directory, not a Python package).
CPU_SHIM_DIR = Path(__file__).resolve().parent.parent / "cpu_engine_shim"

#: Set on every ``cpu_sglang`` engine, over anything else.
CPU_ENGINE_ARGS: Mapping[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "disable_overlap_schedule": True,
    "disable_cuda_graph": True,
}

#: Defaults of a ``cpu_sglang`` engine, below ``server_defaults`` and group overrides.
CPU_ENGINE_DEFAULTS: Mapping[str, Any] = {"max_total_tokens": 8192}

#: Why a field is left out on a CPU.
MEMORY_SAVER_REASON = "torch_memory_saver needs CUDA (libcuda.so.1); on a CPU offload releases nothing"
CUDA_GRAPH_REASON = "CUDA graphs need a GPU (--disable-cuda-graph instead)"


def cpu_dropped_reason(key: str) -> str | None:
    """Why ServerArgs field ``key`` is left out of a ``cpu_sglang`` engine's command line (None: it is kept)."""
    if key == "enable_memory_saver":
        return MEMORY_SAVER_REASON
    if "cuda_graph" in key and key not in CPU_ENGINE_ARGS:
        return CUDA_GRAPH_REASON
    return None


def cpu_server_args(values: Mapping[str, Any], dropped: dict[str, str]) -> dict[str, Any]:
    """``values`` (a ``sglang`` engine's ServerArgs values, highest precedence last applied) as a
    ``cpu_sglang`` engine's: the CPU defaults under them, the CPU flags over them, the fields a CPU cannot
    run left out. A left-out field that was set (not None or False) is added to ``dropped`` with its reason."""
    out: dict[str, Any] = {**CPU_ENGINE_DEFAULTS, **values}
    for key in list(out):
        reason = cpu_dropped_reason(key)
        if reason is not None:
            if out[key] not in (None, False):
                dropped[key] = reason
            del out[key]
    out.update(CPU_ENGINE_ARGS)
    return out


def cpu_engine_env(user_pythonpath: str | None) -> dict[str, str]:
    """The variables a ``cpu_sglang`` engine gets on top of the others: the shim first on PYTHONPATH."""
    path = str(CPU_SHIM_DIR) if not user_pythonpath else f"{CPU_SHIM_DIR}:{user_pythonpath}"
    return {**CPU_ENGINE_ENV, "PYTHONPATH": path}


def cpu_notes(dropped: Mapping[str, str]) -> tuple[str, ...]:
    """The plan's notes of a ``cpu_sglang`` rendering."""
    added = " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in CPU_ENGINE_ARGS.items()
    )
    notes = [
        f"cpu_sglang: real SGLang on the CPU: every engine gets {added} (and --max-total-tokens "
        f"{CPU_ENGINE_DEFAULTS['max_total_tokens']} unless set), SGLANG_USE_CPU_ENGINE=1 and the CPU shim "
        f"first on PYTHONPATH ({CPU_SHIM_DIR})"
    ]
    notes += [f"cpu_sglang: left out {key}: {reason}" for key, reason in sorted(dropped.items())]
    return tuple(notes)
