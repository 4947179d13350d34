"""Command-line parsing for the stand-in engine.

The stand-in takes the argv of ``python -m sglang.launch_server`` and checks every flag against the
``ServerArgs`` field names of sglang 0.5.23 (shipped as ``data/sglang_server_args_fields.txt``).
A handful of fields get typed values because the stand-in uses them; every other known flag is kept raw.

Spellings accepted: ``--tp-size 2``, ``--tp_size 2``, ``--tp-size=2``, boolean flags without a value
(``--enable-memory-saver``), and the aliases of ``launch_server`` (``--model``, ``--tensor-parallel-size``,
``--data-parallel-size``, ``--pipeline-parallel-size``, ``--expert-parallel-size``, ``--ep``,
``--nccl-init-addr``). A flag takes the following tokens up to the next one starting with ``--``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles_sglang_plugin.masking import SECRET_FIELDS, mask_argv
from miles_sglang_plugin.rendering.server_arg_fields import shipped_server_arg_fields

ALIASES: dict[str, str] = {
    "model": "model_path",
    "tensor_parallel_size": "tp_size",
    "data_parallel_size": "dp_size",
    "pipeline_parallel_size": "pp_size",
    "expert_parallel_size": "ep_size",
    "ep": "ep_size",
    "nccl_init_addr": "dist_init_addr",
}

DISAGGREGATION_MODES: tuple[str, ...] = ("null", "prefill", "decode")
#: SGLang's default ``--disaggregation-bootstrap-port``.
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998

_BOOL_WORDS = {"true": True, "false": False}


class StandInFlagError(ValueError):
    """A launch_server argv the stand-in (and therefore the real engine) would not accept."""


def server_args_fields() -> frozenset[str]:
    """The ServerArgs field names of sglang 0.5.23, read from the shipped list."""
    return shipped_server_arg_fields()


def flag_spelling(field: str) -> str:
    """``tp_size`` -> ``--tp-size``."""
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class StandInArgs:
    """The parsed launch_server argv: typed values the stand-in uses, raw values for the rest."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    base_gpu_id: int = 0
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = SGLANG_DEFAULT_BOOTSTRAP_PORT
    enable_memory_saver: bool = False
    api_key: str | None = None
    served_model_name: str | None = None
    random_seed: int | None = None
    enable_lora: bool | None = None
    lora_paths: tuple[str, ...] | None = None
    skip_server_warmup: bool = False
    enable_metrics: bool = False
    # Every other ServerArgs flag given, in order: (field name, raw values); () for a bare flag.
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # The argv as given (may contain the API key: use masked_argv() for anything shown).
    argv: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        """GPUs of the whole engine (tp * pp; dp attention and ep live inside tp)."""
        return self.tp_size * self.pp_size

    @property
    def model_name(self) -> str:
        """What the engine calls itself: served_model_name, else model_path (as sglang does)."""
        return self.served_model_name or self.model_path

    def extra_dict(self) -> dict[str, tuple[str, ...]]:
        return dict(self.extra)

    def masked_argv(self) -> list[str]:
        return mask_argv(self.argv)


def _canonical(name: str) -> str | None:
    key = name.replace("-", "_")
    if key in ALIASES:
        return ALIASES[key]
    if key in server_args_fields():
        return key
    return None


def _unknown_flag(name: str) -> StandInFlagError:
    spelled = "--" + name.replace("_", "-")
    candidates = [flag_spelling(f) for f in server_args_fields()] + [flag_spelling(a) for a in ALIASES]
    close = difflib.get_close_matches(spelled, candidates, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return StandInFlagError(
        f"unknown flag --{name}: not a ServerArgs field of sglang 0.5.23 (nor an alias){hint}"
    )


def _to_int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise StandInFlagError(f"{flag} expects an integer, got {value!r}") from None


def _to_str(flag: str, value: str) -> str:
    return value


def _to_mode(flag: str, value: str) -> str:
    if value not in DISAGGREGATION_MODES:
        raise StandInFlagError(f"{flag} must be one of {', '.join(DISAGGREGATION_MODES)}; got {value!r}")
    return value


def _to_bool(flag: str, value: str) -> bool:
    try:
        return _BOOL_WORDS[value.lower()]
    except KeyError:
        raise StandInFlagError(f"{flag} is a boolean flag; got the value {value!r}") from None


_SCALARS: dict[str, Callable[[str, str], Any]] = {
    "model_path": _to_str,
    "host": _to_str,
    "port": _to_int,
    "tp_size": _to_int,
    "dp_size": _to_int,
    "pp_size": _to_int,
    "ep_size": _to_int,
    "nnodes": _to_int,
    "node_rank": _to_int,
    "dist_init_addr": _to_str,
    "base_gpu_id": _to_int,
    "disaggregation_mode": _to_mode,
    "disaggregation_bootstrap_port": _to_int,
    "api_key": _to_str,
    "served_model_name": _to_str,
    "random_seed": _to_int,
}
_BOOLEANS = frozenset({"enable_memory_saver", "enable_lora", "skip_server_warmup", "enable_metrics"})
_LISTS = frozenset({"lora_paths"})


def _check(args: StandInArgs) -> None:
    if not args.model_path:
        raise StandInFlagError("--model-path is required (sglang.launch_server needs it too)")
    for name in ("port", "disaggregation_bootstrap_port"):
        value = getattr(args, name)
        if not 1 <= value <= 65535:
            raise StandInFlagError(f"{flag_spelling(name)} must be in 1..65535; got {value}")
    for name in ("tp_size", "dp_size", "pp_size", "ep_size", "nnodes"):
        if getattr(args, name) < 1:
            raise StandInFlagError(f"{flag_spelling(name)} must be >= 1; got {getattr(args, name)}")
    if not 0 <= args.node_rank < args.nnodes:
        raise StandInFlagError(f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.base_gpu_id < 0:
        raise StandInFlagError(f"--base-gpu-id must be >= 0; got {args.base_gpu_id}")


def _read_flag(argv: list[str], i: int) -> tuple[str, str, list[str], int]:
    """The flag at ``argv[i]``: (its field, its spelling, its values, the index after them)."""
    token = argv[i]
    if not token.startswith("--") or token == "--":
        raise StandInFlagError(f"unexpected argument {token!r}: launch_server takes only --flags")
    name, eq, inline = token[2:].partition("=")
    field = _canonical(name)
    if field is None:
        raise _unknown_flag(name)
    i += 1
    if eq:
        return field, "--" + name, [inline], i
    values = []
    while i < len(argv) and not argv[i].startswith("--"):
        values.append(argv[i])
        i += 1
    return field, "--" + name, values, i


def _store_flag(
    field: str,
    flag: str,
    values: list[str],
    typed: dict[str, Any],
    extra: dict[str, tuple[str, ...]],
) -> None:
    """Convert a flag's values: into ``typed`` for the fields the stand-in reads, else into ``extra``."""
    if field in _BOOLEANS:
        if len(values) > 1:
            raise StandInFlagError(f"{flag} is a boolean flag; unexpected values {values[1:]!r}")
        typed[field] = _to_bool(flag, values[0]) if values else True
    elif field in _LISTS:
        typed[field] = tuple(values)
    elif field in _SCALARS:
        if len(values) != 1:
            got = "none" if not values else f"{len(values)}"
            if values and field not in SECRET_FIELDS:
                got += f": {values!r}"
            raise StandInFlagError(f"{flag} expects exactly one value; got {got}")
        typed[field] = _SCALARS[field](flag, values[0])
    else:
        extra.pop(field, None)  # a repeated flag: the last one wins (as with argparse)
        extra[field] = tuple(values)


def parse_launch_argv(argv: Sequence[str]) -> StandInArgs:
    """Parse and check a ``sglang.launch_server`` argv; raise StandInFlagError if it is not valid."""
    argv = list(argv)
    typed: dict[str, Any] = {}
    extra: dict[str, tuple[str, ...]] = {}
    i = 0
    while i < len(argv):
        field, flag, values, i = _read_flag(argv, i)
        _store_flag(field, flag, values, typed, extra)
    if "model_path" not in typed:
        raise StandInFlagError("--model-path is required (sglang.launch_server needs it too)")
    args = StandInArgs(**typed, extra=tuple(extra.items()), argv=tuple(argv))
    _check(args)
    return args
