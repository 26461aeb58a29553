"""CUDA paged attention that reads the KV cache in place: a Triton kernel over the block table.

Why Triton: every CUDA build of torch ships it, so the GPU path needs nothing beyond torch, pages at any
block size (flash-attn 2 pages only in 256-token blocks and gathers the context into a buffer otherwise),
and its arithmetic is fixed by this file. flash-attn picks a split of the keys from the batch's size and
shape, so a row's rounding could change with what else is in the step; here it cannot:

- the work is split over (sequence, kv head, tile of BLOCK_M query rows); a row's score is one dot product
  over the head dim, and the keys are visited in chunks of BLOCK_N that always start at a multiple of
  BLOCK_N in the sequence's key order. A chunk with no visible key for a row leaves that row's running max,
  sum and weighted values exactly as they were (the running max starts finite, so exp(-inf - m) = 0 and
  the rescale factor is exp(0) = 1), so a row's result is the same bits alone or in any batch, with or
  without draft rows beside it and whatever the other rows of its tile need;
- one launch configuration (BLOCK_M, BLOCK_N, num_warps) per head dim, never chosen from the batch.

Queries of a sequence are consecutive rows at positions seq_len - query_len .. seq_len - 1 (decode, verify
and prefill chunks alike); the GQA heads sharing a KV head are folded into the row axis of a tile (row
i * group + g is query i, head kv_head * group + g), so one tile reads each key once for all its heads.
K/V are fp32, bf16 or fp16; scores, softmax and the value sums accumulate in fp32 (on CUDA a bf16/fp16 cache
multiplies in its own dtype on the tensor cores, the probabilities rounded to it for the value sum, as
flash-attn does; an fp32 cache multiplies in full fp32, not TF32).

Tests run the same kernel on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1) against SDPA, and
natively on CUDA in `make gpu-check`.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:     # CPU-only torch builds do not ship triton
    triton = None
    IMPORT_ERROR: str | None = str(exc)
else:
    IMPORT_ERROR = None

BLOCK_M = 16      # query rows (query x head-in-group) per tile
BLOCK_N = 64      # keys per chunk; chunks start at multiples of this in every call
NUM_WARPS = 4


def available() -> bool:
    return triton is not None


def _interpreted() -> bool:
    """Under TRITON_INTERPRET=1 (CPU tests) every dot runs in fp32: the interpreter's bf16/fp16 dot is wrong."""
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _paged_attention_kernel(
            q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_kslot, stride_kh, stride_bt,
            scale_log2, window, block_size,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
            IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        if tile * BM < q_len * GROUP:
            rows = tile * BM + tl.arange(0, BM)                      # [BM] flat (query, head-in-group)
            row_ok = rows < q_len * GROUP
            query = rows // GROUP
            head = kv_head * GROUP + rows % GROUP
            pos = seq_len - q_len + query                            # [BM] position of each row's query
            dims = tl.arange(0, D_PAD)
            dim_ok = dims < HEAD_DIM
            q = tl.load(q_ptr + (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                        mask=row_ok[:, None] & dim_ok[None, :], other=0.0)          # [BM, D]
            q = q.to(tl.float32 if IEEE else k_ptr.dtype.element_ty)           # the dots' input dtype, once
            last = seq_len - q_len + tl.minimum((tile * BM + BM - 1) // GROUP, q_len - 1)
            hi = last + 1                                            # keys past the tile's last row are unseen
            lo = seq_len * 0
            if HAS_WINDOW:
                first = seq_len - q_len + (tile * BM) // GROUP
                lo = tl.maximum(first - window + 1, 0) // BN * BN
            m_i = tl.full([BM], -1.0e30, tl.float32)
            l_i = tl.zeros([BM], tl.float32)
            acc = tl.zeros([BM, D_PAD], tl.float32)
            start = lo
            while start < hi:    # (a while loop: Triton's interpreter cannot range() over loaded bounds)
                keys = start + tl.arange(0, BN)                      # [BN] key index in the sequence
                key_ok = keys < seq_len
                block = tl.load(block_tables_ptr + seq * stride_bt + keys // block_size, mask=key_ok, other=0)
                slot = block.to(tl.int64) * block_size + keys % block_size
                kv_off = slot[:, None] * stride_kslot + kv_head * stride_kh + dims[None, :]
                kv_mask = key_ok[:, None] & dim_ok[None, :]
                k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)                # [BN, D]
                if IEEE:
                    s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))                                       # [BM, BN] fp32
                s = s * scale_log2
                visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
                if HAS_WINDOW:
                    visible = visible & (keys[None, :] > pos[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)                # [BN, D]
                if IEEE:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
                start += BN
            out = acc / l_i[:, None]
            tl.store(out_ptr + (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           max_query_len: int, scale: float, window: int | None) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim];
    block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs]; query_start_loc [num_seqs + 1].
    Returns [num_tokens, heads, head_dim] in q's dtype."""
    if triton is None:
        raise RuntimeError(f"the triton attention backend needs triton: {IMPORT_ERROR}")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.dtype != v_cache.dtype:
        raise ValueError("the K and V caches must share one layout and dtype with contiguous head dims")
    q = q.contiguous()
    out = torch.empty_like(q)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len * group, BLOCK_M))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        scale * 1.4426950408889634, window or 0, block_size,
        GROUP=group, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        HAS_WINDOW=window is not None, IEEE=k_cache.dtype == torch.float32 or _interpreted(),
        BM=BLOCK_M, BN=BLOCK_N, num_warps=NUM_WARPS)
    return out


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: list[list[int]],
                        query_lens: list[int], seq_lens: list[int], scale: float) -> torch.Tensor:
    """Plain fp32 gather-and-softmax over each sequence's blocks (for the self-check)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out, start = [], 0
    for table, q_len, seq_len in zip(tables, query_lens, seq_lens):
        keys = k_cache[table].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)    # [L, heads, d]
        values = v_cache[table].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len].float(), keys) * scale
        pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        scores = scores.masked_fill(torch.arange(seq_len, device=q.device)[None, :] > pos[:, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += q_len
    return torch.cat(out)


_checked: dict[str, str | None] = {}


def self_check(device: torch.device | str) -> str | None:
    """Runs the kernel once per process and device on a small fp32 and bf16 batch against
    reference_attention: None when it compiles and agrees, else the reason (the caller falls back)."""
    key = str(torch.device(device))
    if key not in _checked:
        _checked[key] = _self_check(torch.device(device))
    return _checked[key]


def _self_check(device: torch.device) -> str | None:
    if triton is None:
        return f"triton is not importable: {IMPORT_ERROR}"
    gen = torch.Generator().manual_seed(0)
    query_lens, seq_lens, tables = [1, 5, 3], [20, 40, 3], [[3, 0], [1, 4, 5], [2]]
    try:
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)
            k_cache, v_cache = rand(6, 16, 2, 64), rand(6, 16, 2, 64)
            q = rand(sum(query_lens), 8, 64)
            meta = [torch.tensor(t, dtype=torch.int32, device=device) for t in (
                [t + [0] * (3 - len(t)) for t in tables], seq_lens, [0, 1, 6, 9])]
            got = paged_attention_triton(q, k_cache, v_cache, *meta, max(query_lens), 0.125, None)
            err = (got.float() - reference_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, 0.125)
                   ).abs().max().item()
            if not err <= tol:
                return f"the Triton kernel differs from the reference by {err:.3g} in {dtype}"
    except Exception as exc:    # a compiler or driver that cannot build it: the caller logs this and falls back
        return f"the Triton kernel failed on {device}: {type(exc).__name__}: {exc}"
    return None
