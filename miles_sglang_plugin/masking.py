"""Secrets never shown: API keys in command lines and environments are replaced by ``***`` wherever a
command, a plan or a log line is printed.

* Command lines: the value of a secret flag (``--api-key``, ``--admin-api-key``, any spelling) is masked by its
  position, the token after the flag (or after ``=``), whatever it looks like, ``--``-prefixed included.
* Environments: every value is masked unless its name is on a short allow-list of variables known to hold no
  secret (the GPU pinning, NCCL/Gloo network settings, the SGLang switches Miles sets); the caller adds the
  names of variables it sets itself. A variable from ``sglang_deploy.env`` such as ``DATABASE_URL`` or
  ``HF_TOKEN`` is therefore never printed, whatever its name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

MASK = "***"
#: ServerArgs fields that hold secrets.
SECRET_FIELDS: frozenset[str] = frozenset({"api_key", "admin_api_key"})
#: Environment variables whose values are shown in printed plans: names known to hold no secret.
SAFE_ENV_NAMES: frozenset[str] = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "NCCL_DEBUG",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_DISABLE",
        "NCCL_IB_HCA",
        "NCCL_P2P_DISABLE",
        "NCCL_NVLS_ENABLE",
        "NCCL_CUMEM_ENABLE",
        "GLOO_SOCKET_IFNAME",
        "NVSHMEM_DISABLE_NCCL",
        "TORCH_NCCL_AVOID_RECORD_STREAMS",
        "PYTORCH_CUDA_ALLOC_CONF",
    }
)


def _field(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").lower()


def mask_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of ``--api-key`` / ``--admin-api-key`` (any spelling, ``=`` form too) masked:
    the token after such a flag is its value, whatever its shape."""
    out: list[str] = []
    mask_next = False
    for token in argv:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        if token.startswith("--"):
            name, eq, _ = token.partition("=")
            if _field(name) in SECRET_FIELDS:
                if eq:
                    out.append(f"{name}={MASK}")
                    continue
                mask_next = True
        out.append(token)
    return out


def mask_env(env: Mapping[str, str], shown: Collection[str] = ()) -> dict[str, str]:
    """``env`` with every value masked except those of :data:`SAFE_ENV_NAMES` and of ``shown``."""
    return {k: (v if k in SAFE_ENV_NAMES or k in shown else MASK) for k, v in env.items()}
