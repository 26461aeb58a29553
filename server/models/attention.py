"""Paged causal attention over a varlen batch: the two backends side by side, and the metadata entry point.

Every sequence i in a step contributes query_lens[i] consecutive tokens at positions
seq_lens[i] - query_lens[i] .. seq_lens[i] - 1 of its context, so a first prefill chunk, a later
chunk, a plain decode step (q = 1) and a verification of [last_token, *k drafts] (q = k + 1) are
all one case. Each layer first writes this step's K/V into the cache slots (slot_mapping); then
every query attends causally to its own sequence's cached context, this step's tokens included.

Backends (picked per device from what is importable; the choice is logged once at import):
- "triton": the CUDA default, triton_attention.py: reads the paged cache in place at any block size, with
  a fixed reduction order per query row (batch- and speculation-invariant in bf16 as on CPU).
- "flash": flash-attn varlen (`--attention-backend flash`, pip extra "gpu"). With block_size % 256 == 0 it
  reads the paged cache directly (block_table=); otherwise (upstream FA2 only pages in 256-token blocks)
  the context K/V are first gathered into one contiguous varlen buffer with slot indices precomputed in
  the metadata. Its split of the keys follows the batch, so its rounding of a row may too.
- "paged": the CPU kernel of paged_kernel.py, reading the paged cache in place (block table, no gather,
  no padding) in fp32, bf16 or fp16 storage with a fixed per-row reduction order; the CPU default when it
  builds (`--attention-backend auto`), else SDPA with the reason logged.
- "sdpa": torch scaled_dot_product_attention, the reference every test compares against. Short queries
  (q <= SHORT_QUERY_MAX: decode and verify) are padded into ONE batched call per layer (a few
  calls when context lengths differ wildly, see attention_metadata._bucket_short); long prefill
  chunks get one call each.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from specserve.server.models import paged_kernel, triton_attention
from specserve.server.models.attention_metadata import (
    FLASH_PAGED_BLOCK_MULTIPLE,
    SHORT_QUERY_MAX,
    AttentionMetadata,
    LongSeq,
    ShortGroup,
    build_metadata,
)
from specserve.server.models.backend_names import ATTENTION_BACKENDS, DEVICE_BACKENDS

__all__ = [
    "FLASH_ATTN_AVAILABLE",
    "FLASH_PAGED_BLOCK_MULTIPLE",
    "SHORT_QUERY_MAX",
    "AttentionMetadata",
    "ATTENTION_BACKENDS",
    "build_attention_metadata",
    "configure_backend",
    "cpu_backend",
    "default_backend",
    "paged_attention",
]

logger = logging.getLogger(__name__)

MIN_SDPA_ROWS = 4   # torch's CPU SDPA uses another kernel (different rounding) for fewer query rows

flash_attn_varlen_func = None
FLASH_ATTN_AVAILABLE = False
if torch.cuda.is_available():  # flash-attn is CUDA-only: never even imported on CPU machines
    try:
        from flash_attn import flash_attn_varlen_func
        FLASH_ATTN_AVAILABLE = True
    except ImportError as exc:  # pragma: no cover - depends on the machine
        logger.info("flash_attn is not importable (%s): the optional flash backend is off", exc)


_choice = {"requested": "auto"}     # set once at start-up by configure_backend (--attention-backend)


def configure_backend(name: str, device: torch.device | str = "cpu") -> str:
    """Pick this process's attention backend (--attention-backend) for `device`; returns what steps will use.
    auto: on CPU the paged kernel if it builds, else sdpa; on CUDA triton, else flash, else sdpa. A backend
    that does not run on the device, or cannot be loaded, is a start-up error."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    kind = torch.device(device).type
    allowed = DEVICE_BACKENDS.get(kind, ("sdpa",))
    if name != "auto" and name not in allowed:
        raise ValueError(f"--attention-backend {name} does not run on {kind}; choose auto or one of {allowed}")
    if name == "paged" and paged_kernel.load() is None:
        raise RuntimeError(f"--attention-backend paged: the kernel does not build: {paged_kernel.load_error()}")
    problem = triton_attention.self_check(device) if name == "triton" else None
    if problem is not None:
        raise RuntimeError(f"--attention-backend triton: {problem}")
    if name == "flash" and not FLASH_ATTN_AVAILABLE:
        raise RuntimeError("--attention-backend flash: flash_attn is not importable (pip install 'specserve[gpu]')")
    _choice["requested"] = name
    return default_backend(device)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def cpu_backend() -> str:
    """"paged" or "sdpa": what CPU steps run (auto resolves to paged when the kernel builds)."""
    if _choice["requested"] == "sdpa":
        return "sdpa"
    return "paged" if paged_kernel.load() is not None else "sdpa"


def default_backend(device: torch.device | str) -> str:
    if torch.device(device).type == "cuda":
        if _choice["requested"] in DEVICE_BACKENDS["cuda"]:
            return _choice["requested"]
        problem = triton_attention.self_check(device) if triton_attention.available() else triton_attention.IMPORT_ERROR
        if problem is None:
            return "triton"
        _log_once(f"CUDA attention falls back to {'flash-attn' if FLASH_ATTN_AVAILABLE else 'SDPA'}: {problem}")
        return "flash" if FLASH_ATTN_AVAILABLE else "sdpa"
    return cpu_backend()


def pick_block_size(requested: int, device: torch.device | str) -> int:
    """The KV block size for --block-size `requested` (0: auto). CUDA with flash-attn: 256, the page size
    its paged kernel takes, so every step reads the cache in place; elsewhere 16 (the CPU and Triton kernels
    read any block size in place; small blocks share prompt prefixes at a finer grain). An explicit size
    that makes flash-attn gather the context every layer is kept, with a warning."""
    on_flash = default_backend(device) == "flash"
    if requested == 0:
        return FLASH_PAGED_BLOCK_MULTIPLE if on_flash else 16
    if on_flash and requested % FLASH_PAGED_BLOCK_MULTIPLE:
        logger.warning("--block-size %d: flash-attn pages only in blocks of %d, so every layer gathers the "
                       "context into a buffer first; --block-size 0 (auto) or %d reads the cache in place",
                       requested, FLASH_PAGED_BLOCK_MULTIPLE, FLASH_PAGED_BLOCK_MULTIPLE)
    return requested


def build_attention_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                             block_size: int, device: torch.device, backend: str | None = None
                             ) -> AttentionMetadata:
    """Once per forward. Example: query_lens [3, 1], seq_lens [3, 6], block_size 4,
    block_tables [[7], [2, 5]] -> positions [0 1 2 5], slot_mapping [28 29 30 21], query_start_loc [0 3 4].

    `backend` overrides the device default ("sdpa" | "paged" | "triton" | "flash"); tests compare them.
    """
    return build_metadata(query_lens, seq_lens, block_tables, block_size, torch.device(device),
                          backend or default_backend(device))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """Write this step's K/V to the cache, then attend.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    kv_cache: ([num_blocks, block_size, num_kv_heads, head_dim],) * 2.
    window: keys at positions (p - window, p] are visible to the query at position p (None: all).
    Returns [num_tokens, num_heads, head_dim].
    """
    k_cache, v_cache = kv_cache
    if attn.backend == "paged":      # the cache write, attention and casts in one kernel call where it applies
        out = paged_kernel.attention_step(q, k, v, k_cache, v_cache, attn.slot_mapping, attn.block_tables,
                                          attn.seq_lens, attn.query_start_loc, scale, window)
        if out is not None:
            return out
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    out_dtype = q.dtype
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)             # [num_slots, kv_heads, head_dim]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, attn.slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, attn.slot_mapping, v.to(k_cache.dtype))
    if attn.backend == "paged":   # fp32 accumulation whatever the cache holds
        return paged_kernel.paged_attention_cpu(q, k_cache, v_cache, attn.block_tables, attn.seq_lens,
                                                attn.query_start_loc, scale, window).to(out_dtype)
    if attn.backend == "triton":  # likewise
        return triton_attention.paged_attention_triton(q, k_cache, v_cache, attn.block_tables, attn.seq_lens,
                                                       attn.query_start_loc, attn.max_query_len, scale, window)
    if k_cache.dtype != q.dtype:     # SDPA attends in the cache dtype (fp32 for a bf16 model, kv_cache.cache_dtype)
        q, k, v = q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype)
    if attn.backend == "flash":
        return _flash(q, k_cache, v_cache, attn, scale, window)
    return _sdpa(q, k, v, k_cache, v_cache, attn, scale, window).to(out_dtype)


# ---------------------------------------------------------------------------------------------- flash-attn
def _flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
           scale: float, window: int | None) -> torch.Tensor:
    # flash-attn aligns the causal mask bottom-right, i.e. query j of a chunk of q sits at position
    # seq_len - q + j: exactly our convention. window_size=(left, right) counts keys to either side.
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"flash-attn runs in fp16/bf16 only, got {q.dtype}: load the model in bfloat16 on CUDA "
                         "or build the metadata with backend='sdpa'")
    window_size = (-1, -1) if window is None else (window - 1, 0)
    common = {"cu_seqlens_q": attn.query_start_loc, "cu_seqlens_k": attn.cu_seqlens_k,
              "max_seqlen_q": attn.max_query_len, "max_seqlen_k": attn.max_seq_len,
              "softmax_scale": scale, "causal": True, "window_size": window_size}
    q = q.contiguous()
    if attn.flash_kv_slots is None:  # block_size is a multiple of FLASH_PAGED_BLOCK_MULTIPLE
        return flash_attn_varlen_func(q, k_cache, v_cache, block_table=attn.block_tables, **common)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, attn.flash_kv_slots)  # [sum(seq_lens), kv, d]
    values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, attn.flash_kv_slots)
    return flash_attn_varlen_func(q, keys, values, **common)


# ---------------------------------------------------------------------------------------------- torch SDPA
def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          attn: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    groups = attn.short_groups
    if len(groups) == 1 and groups[0].token_index is None:   # the common decode/verify step: no scatter
        return _sdpa_short(q, k_cache, v_cache, groups[0], scale, window)
    out = torch.empty_like(q)                                     # [num_tokens, heads, head_dim]
    for group in groups:
        short_out = _sdpa_short(q, k_cache, v_cache, group, scale, window)   # [S * Q, heads, head_dim]
        out.index_copy_(0, group.valid_dst, short_out.index_select(0, group.valid_src))
    for seq in attn.long:
        out[seq.token_start:seq.token_end] = _sdpa_long(q, k, v, k_cache, v_cache, seq, scale, window)
    return out


def _sdpa_short(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: ShortGroup,
                scale: float, window: int | None) -> torch.Tensor:
    """One padded SDPA call for S sequences x Q queries -> [S * Q, heads, head_dim].

    GQA without copying K/V: the `rep` query heads that share a KV head are folded into the query
    axis, so SDPA sees [S, kv_heads, Q' * rep, head_dim] against [S, kv_heads, L, head_dim].
    Q' >= Q pads to at least MIN_SDPA_ROWS rows (repeating the last query): CPU SDPA switches kernels
    below 4 query rows, and a token must get bit-identical attention whether it is decoded alone
    (Q = 1) or verified among drafts, or greedy output would depend on speculation.
    """
    num_seqs, max_q = group.num_seqs, group.max_q
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    rep = num_heads // num_kv_heads
    rows = max(max_q, -(-MIN_SDPA_ROWS // rep))                              # Q'
    queries = q if group.token_index is None else q[group.token_index]      # [S * Q | S, Q, heads, d]
    queries = queries.reshape(num_seqs, max_q, num_heads, head_dim)
    if rows > max_q:
        queries = torch.cat([queries, queries[:, -1:].expand(-1, rows - max_q, -1, -1)], dim=1)
    queries = (queries.view(num_seqs, rows, num_kv_heads, rep, head_dim)
               .transpose(1, 2).reshape(num_seqs, num_kv_heads, rows * rep, head_dim))
    # Block-granular gather: each block is one contiguous memcpy, much cheaper than per-slot indexing.
    shape = (num_seqs, group.num_keys, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, group.block_ids).view(shape).transpose(1, 2)     # [S, kv, L, d]
    values = v_cache.index_select(0, group.block_ids).view(shape).transpose(1, 2)   # [S, kv, L, d]
    mask = group.mask(rep, rows, window, q.dtype)                                   # [S, 1, Q' * rep, L]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)  # [S, kv, Q' rep, d]
    out = out.view(num_seqs, num_kv_heads, rows, rep, head_dim)[:, :, :max_q]
    return out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)


def _sdpa_long(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               seq: LongSeq, scale: float, window: int | None) -> torch.Tensor:
    """One prefill chunk -> [q_len, heads, head_dim]. Without a cached prefix it uses the fresh K/V."""
    s, e = seq.token_start, seq.token_end
    if seq.kv_slots is None:
        keys, values = k[s:e], v[s:e]                                       # [q_len, kv, d]
    else:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, seq.kv_slots)    # [seq_len, kv, d]
        values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, seq.kv_slots)
    rep = q.shape[1] // keys.shape[1]
    if rep > 1:  # SDPA's enable_gqa falls back to a slow path on CPU; an explicit expand is cheaper here
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
    mask = seq.mask(window, q.dtype, q.device)                                     # [q_len, seq_len] | None
    out = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(0, 1)                                              # [q_len, heads, d]
