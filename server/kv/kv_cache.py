"""Paged KV cache tensors: sizing and allocation. Block bookkeeping lives in block_manager.py (no torch).

Layout per layer: k_cache, v_cache each [num_blocks, block_size, num_kv_heads, head_dim], i.e.
flash-attn's paged layout; token t of a sequence lives at slot block_table[t // block_size] *
block_size + t % block_size of the flattened [num_blocks * block_size, kv_heads, head_dim] view.
"""
from __future__ import annotations

import torch

from specserve.server.models.attention import cpu_backend
from specserve.server.models.config import ModelConfig

KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_requested = {"kv_cache_dtype": "auto"}     # set once at start-up (--kv-cache-dtype)


def configure_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {name!r}")
    _requested["kv_cache_dtype"] = name


def cache_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV cache dtype of a model that runs in `dtype` (`--kv-cache-dtype`; auto follows the model).

    auto on CPU follows the model only with the paged kernel (attention.cpu_backend() == "paged"): it
    reads bf16/fp16 K/V and accumulates in fp32 in a fixed order per row. Under the SDPA fallback a
    bf16/fp16 model keeps K/V and attends in fp32, because CPU SDPA's reduced-precision kernels round each
    query row differently with the number of keys and rows in the call (batch padding, drafts in a
    verify step), which flipped greedy tokens (tests/test_engine_speculative.py).
    CUDA keeps the model dtype (the Triton kernel accumulates in fp32; flash-attn needs it).
    """
    explicit = KV_CACHE_DTYPES[_requested["kv_cache_dtype"]]
    if explicit is not None:
        return explicit
    if torch.device(device).type == "cpu" and cpu_backend() != "paged":
        return torch.float32
    return dtype


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
