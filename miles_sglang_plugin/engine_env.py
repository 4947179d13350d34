"""Environment variables set for the engine processes (a shared leaf: it imports nothing of the package): Miles' engine defaults and
every other variable this package sets (shown in a printed plan and in log tails, never masked as a secret),
and what a backend sets for the processes it starts (the stand-in engine reports it, so that tests can see
where each engine ran)."""

from __future__ import annotations

from collections.abc import Mapping

#: The node an engine process runs on, as its backend names it (the ray backend: the Ray node id).
NODE_ID_ENV = "MSP_ENGINE_NODE_ID"

#: Engine environment defaults (Miles), below the user's ``sglang_deploy.env``.
MILES_ENGINE_ENV: Mapping[str, str] = {
    "NVSHMEM_DISABLE_NCCL": "1",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_DG_CACHE_DIR_PER_PROCESS": "1",
    "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true",
    "SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_FALLBACK_VARIANT": "true",
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false",
}

#: What a ``cpu_sglang`` engine needs on top (SGLang's CPU engine); its shim's PYTHONPATH is added where it
#: is rendered (:mod:`~miles_sglang_plugin.rendering.cpu_engine`).
CPU_ENGINE_ENV: Mapping[str, str] = {"SGLANG_USE_CPU_ENGINE": "1"}

#: Variables this package sets itself in an engine's environment (shown in a printed plan; every other value
#: from ``sglang_deploy.env`` is masked there, see :func:`~miles_sglang_plugin.masking.mask_env`).
PACKAGE_ENV_NAMES: frozenset[str] = frozenset(
    {
        *MILES_ENGINE_ENV,
        *CPU_ENGINE_ENV,
        "SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2",
        "CUDA_VISIBLE_DEVICES",
        "MSP_STANDIN_START_DELAY_S",
        "MSP_STANDIN_FAIL_AT_START",
        "MSP_STANDIN_NEVER_HEALTHY",
        "MSP_STANDIN_DIE_AFTER_S",
    }
)
