"""Stand-in for SGLang's CPU kernel package ``sgl_kernel`` (engine kind ``cpu_sglang`` only; see ../README.md).

SGLang 0.5.23 imports these names at start-up when ``SGLANG_USE_CPU_ENGINE=1``. Only
:func:`assign_req_to_token_pool_cpu` runs on the path a plain (non-speculative) engine takes; it is written
here in torch after the Triton kernel it replaces (``sglang/srt/mem_cache/allocation.py``). The others raise
``NotImplementedError`` if they are ever called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+miles-sglang-plugin-cpu-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request ``i`` of the batch: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` =
    its slice of ``out_cache_loc``, the slices of the requests one after another in batch order."""
    del pool_len  # the row length of req_to_token; the torch indexing knows it
    position = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[position : position + length]
        position += length


def _unavailable(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is miles_sglang_plugin's CPU shim (engine kind "
            "cpu_sglang), which implements only assign_req_to_token_pool_cpu"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


#: Imported by SGLang 0.5.23 at start-up on a CPU, used only by speculative decoding and KV-cache moves.
UNAVAILABLE = (
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)

copy_all_layer_kv_cache_cpu = _unavailable("copy_all_layer_kv_cache_cpu")
build_tree_kernel_efficient_cpu = _unavailable("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unavailable("verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = _unavailable("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unavailable("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _unavailable("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unavailable("fill_bonus_tokens_cpu")
