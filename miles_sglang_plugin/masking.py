"""Secrets never shown: API keys in command lines and environments are replaced by ``***`` wherever a
command, a plan or a log line is printed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MASK = "***"
#: ServerArgs fields that hold secrets.
SECRET_FIELDS: frozenset[str] = frozenset({"api_key", "admin_api_key"})
#: Environment variable names containing one of these words are masked.
SECRET_ENV_WORDS: tuple[str, ...] = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")


def _field(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").lower()


def mask_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of ``--api-key`` / ``--admin-api-key`` (any spelling, ``=`` form too) masked."""
    out: list[str] = []
    mask_next = False
    for token in argv:
        if mask_next and not token.startswith("--"):
            out.append(MASK)
            mask_next = False
            continue
        mask_next = False
        if token.startswith("--"):
            name, eq, _ = token.partition("=")
            if _field(name) in SECRET_FIELDS:
                if eq:
                    out.append(f"{name}={MASK}")
                    continue
                mask_next = True
        out.append(token)
    return out


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the values of secret-looking variables masked."""
    return {k: (MASK if any(w in k.upper() for w in SECRET_ENV_WORDS) else v) for k, v in env.items()}
