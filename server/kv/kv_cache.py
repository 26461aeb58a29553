"""Paged KV cache tensors: sizing and allocation. Block bookkeeping lives in block_manager.py (no torch).

Layout per layer: k_cache, v_cache each [num_blocks, block_size, num_kv_heads, head_dim], i.e.
flash-attn's paged layout; token t of a sequence lives at slot block_table[t // block_size] *
block_size + t % block_size of the flattened [num_blocks * block_size, kv_heads, head_dim] view.
"""
from __future__ import annotations

import torch

from specserve.server.models.config import ModelConfig


def cache_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV cache (and attention) dtype of a model that runs in `dtype`.

    On CPU a bf16/fp16 model still keeps K/V and attends in fp32: CPU SDPA's reduced-precision kernels
    round each query row differently depending on how many keys and rows are in the call (padding of a
    batch, drafts in a verify step), so a token's attention would change with speculation and flip
    greedy choices often (tests/test_engine_speculative.py). In fp32 the difference stays at ~1e-7; the
    cast of the attention output back to bf16 still flips a rare near-tie, which is why `--dtype auto`
    stays fp32 on CPU (builder.pick_dtype). Costs 2x KV memory against a bf16 cache; the matmuls keep
    their bf16 speed.
    CUDA keeps the model dtype (flash-attn needs it).
    """
    return torch.float32 if torch.device(device).type == "cpu" else dtype


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers, K and V. Example: 8 layers, 2 kv heads x 64, block 16,
    fp32 -> 2 * 8 * 16 * 2 * 64 * 4 = 131072."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many whole blocks fit in budget_bytes (0 when not even one does)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes // kv_cache_bytes_per_block(cfg, block_size, dtype)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim] in `dtype`
    (for a model: cache_dtype(model dtype, device)).

    Zero-filled, not empty: the SDPA path gathers whole blocks and masks the unused slots, and a
    masked NaN still poisons a softmax (NaN * 0 = NaN). Every value written later is finite.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)]
