"""Environment variables set for the engine processes (a shared leaf: it imports nothing of the package): Miles' engine defaults and
every other variable this package sets (shown in a printed plan and in log tails, never masked as a secret),
and what a backend sets for the processes it starts (the stand-in engine reports it, so that tests can see
where each engine ran)."""

from __future__ import annotations

from collections.abc import Mapping

#: The node an engine process runs on, as its backend names it (the ray backend: the Ray node id).
NODE_ID_ENV = "MSP_ENGINE_NODE_ID"

#: Engine environment defaults (Miles: ``miles/ray/rollout/server_group.py`` at 31f1ca961, lines 99-115, and
#: ``SGLANG_EXPOSE_OWN_ENV_VARS`` from its refactor, ``miles/ray/specs/inference.py`` at 727f91769), below the
#: user's ``sglang_deploy.env``. Each is a default only: where the launcher's own environment has the variable,
#: its value is the one the engines get (:func:`engine_env_defaults`).
MILES_ENGINE_ENV: Mapping[str, str] = {
    "NVSHMEM_DISABLE_NCCL": "1",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_DG_CACHE_DIR_PER_PROCESS": "1",
    "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true",
    "SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_FALLBACK_VARIANT": "true",
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false",
    # SGLang then reports its own environment variables in /server_info (``internal_states[].env_vars``).
    "SGLANG_EXPOSE_OWN_ENV_VARS": "1",
}

#: Miles' custom all-reduce switch: its default depends on the engines (see ``rendering.launch_specs``), and
#: like the others it is a default only.
CUSTOM_ALL_REDUCE_ENV = "SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2"


def engine_env_defaults(defaults: Mapping[str, str], launcher_env: Mapping[str, str]) -> dict[str, str]:
    """Miles' rule for its engine defaults (``os.environ.get(key, default)``): the launcher's value wherever its
    environment has the variable (even empty), else the default."""
    return {name: launcher_env.get(name, value) for name, value in defaults.items()}


#: What a ``cpu_sglang`` engine needs on top (SGLang's CPU engine); its shim's PYTHONPATH is added where it
#: is rendered (:mod:`~miles_sglang_plugin.rendering.cpu_engine`).
CPU_ENGINE_ENV: Mapping[str, str] = {"SGLANG_USE_CPU_ENGINE": "1"}

#: Variables this package sets itself in an engine's environment (shown in a printed plan; every other value
#: from ``sglang_deploy.env`` is masked there, see :func:`~miles_sglang_plugin.masking.mask_env`).
PACKAGE_ENV_NAMES: frozenset[str] = frozenset(
    {
        *MILES_ENGINE_ENV,
        *CPU_ENGINE_ENV,
        CUSTOM_ALL_REDUCE_ENV,
        "CUDA_VISIBLE_DEVICES",
        "MSP_STANDIN_START_DELAY_S",
        "MSP_STANDIN_FAIL_AT_START",
        "MSP_STANDIN_NEVER_HEALTHY",
        "MSP_STANDIN_DIE_AFTER_S",
    }
)
