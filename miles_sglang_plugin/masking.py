"""Secrets never shown: API keys in command lines and environments are replaced by ``***`` wherever a
command, a plan or a log line is printed.

* Command lines: the value of a secret flag (``--api-key``, ``--admin-api-key``, any spelling) is masked by its
  position, the token after the flag (or after ``=``), whatever it looks like, ``--``-prefixed included.
* Environments: every value is masked unless its name is on a short allow-list of variables known to hold no
  secret (the GPU pinning, NCCL/Gloo network settings, the SGLang switches Miles sets); the caller adds the
  names of variables it sets itself. A variable from ``sglang_deploy.env`` such as ``DATABASE_URL`` or
  ``HF_TOKEN`` is therefore never printed, whatever its name.
* Hydra overrides (a sweep's parameters, as metrics, reports and launcher logs show them): the value of a
  secret field (``sglang_deploy.api_key=...``) and of an environment variable not on the allow-list
  (``sglang_deploy.env.HF_TOKEN=...``) is masked; so is a mapping given whole to a key that holds either.
* Log excerpts (the tail of an engine's or router's log in an error): a real SGLang engine logs its whole
  ``server_args``, API key included; every secret a process was given (its secret flags' values, its
  environment's values off the allow-list of at least :data:`MIN_MASKED_ENV_CHARS` characters) is replaced in
  the excerpt. The log files themselves hold what the process wrote.
* A secret's value itself must be printable ASCII (:func:`secret_value_problem`): a newline or control character
  in an API key would split the HTTP header it travels in.
"""

from __future__ import annotations

import re
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


#: The lengths of the secret fields' names: a flag of another length is none of them (a quick test first).
_SECRET_NAME_LENGTHS = frozenset(len(name) for name in SECRET_FIELDS)


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
            if len(name.lstrip("-")) in _SECRET_NAME_LENGTHS and _field(name) in SECRET_FIELDS:
                if eq:
                    out.append(f"{name}={MASK}")
                    continue
                mask_next = True
        out.append(token)
    return out


def mask_env(env: Mapping[str, str], shown: Collection[str] = ()) -> dict[str, str]:
    """``env`` with every value masked except those of :data:`SAFE_ENV_NAMES` and of ``shown``."""
    return {k: (v if k in SAFE_ENV_NAMES or k in shown else MASK) for k, v in env.items()}


_ENV_WORD = re.compile(r"(?<![a-z0-9_])env(?![a-z0-9_])")


def _secret_path(components: Sequence[str], value: str) -> bool:
    """Whether an override of the key ``components`` (its dotted parts) to ``value`` may carry a secret. Field
    names in any spelling (``api-key``, ``API_KEY``); environment variable names as written."""
    fields = [_field(part) for part in components]
    if fields and fields[-1] in SECRET_FIELDS:
        return True
    if "env" in fields[:-1]:
        return components[fields.index("env") + 1] not in SAFE_ENV_NAMES
    if not value.lstrip().startswith(("{", "[")):
        return False
    text = value.lower().replace("-", "_")
    return (
        fields[-1:] == ["env"] or bool(_ENV_WORD.search(text)) or any(name in text for name in SECRET_FIELDS)
    )


def mask_override(override: str) -> str:
    """A Hydra override (``key=value``, ``+key=``, ``++key=``, ``key@pkg=``; ``~key`` as given) with a secret
    value masked: that of ``api_key``/``admin_api_key`` at any depth, of ``...env.NAME`` unless ``NAME`` is on
    the allow-list, and a mapping given whole to an ``env`` key or holding a secret field."""
    key, eq, value = override.partition("=")
    if not eq:
        return override
    components = key.lstrip("+~").partition("@")[0].split(".")
    return f"{key}={MASK}" if _secret_path(components, value) else override


def _longest_first(value: str) -> tuple[int, str]:
    """Sort key: longer values first (a secret that holds another is masked whole), then by text (stable)."""
    return (-len(value), value)


_SCALAR = r"""\s*(?:'([^']*)'|"([^"]*)"|([^\s\[\]{}:,'"]+))"""
#: The values of a mapping (after ``key:``) and the elements of a list (after ``[`` or ``,``), quoted or not.
_MAPPING_VALUE = re.compile(":" + _SCALAR)
_LIST_ELEMENT = re.compile("[\\[,]" + _SCALAR)


def override_secret_values(overrides: Sequence[str]) -> tuple[str, ...]:
    """The secret values that ``overrides`` give (those :func:`mask_override` masks): each whole value, and the
    elements of a list or mapping, unquoted; longest first. For masking what quotes them (Hydra's errors)."""
    found: set[str] = set()
    for override in overrides:
        text = str(override)
        if mask_override(text) == text:
            continue
        value = text.partition("=")[2].strip()
        found.add(value)
        found.add(value.strip("'\""))
        if value.startswith(("{", "[")):
            pattern = _MAPPING_VALUE if value.startswith("{") else _LIST_ELEMENT
            found.update(
                next(g for g in match.groups() if g is not None) for match in pattern.finditer(value)
            )
    return tuple(sorted((v for v in found if len(v) >= 2), key=_longest_first))


def mask_overrides(overrides: Sequence[str]) -> list[str]:
    """Each of ``overrides`` through :func:`mask_override`."""
    return [mask_override(str(override)) for override in overrides]


def secret_value_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a secret (an API key), without showing it; None when it is fine: a
    non-empty string of printable ASCII without surrounding blanks."""
    if value is None:
        return None
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__} (its value is not shown)"
    if not value or value.strip() != value:
        return "must be a non-empty string without surrounding blanks (its value is not shown)"
    if not all(" " <= ch <= "~" for ch in value):
        return (
            "must be printable ASCII: it holds a control character (a newline, tab or NUL) or a non-ASCII "
            "one, which would break the HTTP header it travels in (its value is not shown)"
        )
    return None


#: The shortest value of an environment variable off the allow-list that a log excerpt masks: shorter ones
#: ("1", "true") are no secret and would mask every such word of the log.
MIN_MASKED_ENV_CHARS = 6


def secret_values(
    argv: Sequence[str], env: Mapping[str, str] | None = None, shown: Collection[str] = ()
) -> tuple[str, ...]:
    """The secrets a process was given: the values of its secret flags (as :func:`mask_argv` finds them) and
    of its environment's variables off the allow-list and ``shown``, of at least
    :data:`MIN_MASKED_ENV_CHARS` characters; longest first (a secret holding another is masked whole)."""
    found: set[str] = set()
    for token, shown_as in zip(argv, mask_argv(argv), strict=True):  # one rule for what a secret flag holds
        if shown_as == MASK:
            found.add(token)
        elif shown_as != token:  # --api-key=VALUE
            found.add(token.partition("=")[2])
    found.discard("")
    for name, value in (env or {}).items():
        if name not in SAFE_ENV_NAMES and name not in shown and len(str(value)) >= MIN_MASKED_ENV_CHARS:
            found.add(str(value))
    return tuple(sorted(found, key=_longest_first))


def mask_text(text: str, secrets: Sequence[str]) -> str:
    """``text`` with each of ``secrets`` replaced by ``***`` wherever it stands whole (not inside a longer word:
    a short value such as ``ab`` leaves ``tab`` alone), longest first."""
    for secret in sorted((s for s in secrets if s), key=_longest_first):
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", MASK, text)
    return text
