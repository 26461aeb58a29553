"""The Triton paged-attention kernel (server/models/triton_attention.py) against torch SDPA.

Runs natively on CUDA (`make gpu-check`) and, on CPU, under Triton's interpreter: tests/test_triton_attention.py
runs this file in a subprocess with TRITON_INTERPRET=1 and the interpreter's own copy of triton (the CPU
torch build ships none). Named so that a plain `pytest` does not collect it in-process.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from specserve.server.models import triton_attention
from specserve.server.models.attention import build_attention_metadata, paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_CPU = DEVICE == "cpu"
if ON_CPU and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("on CPU these cases run under Triton's interpreter: set TRITON_INTERPRET=1")
MAX_CONTEXT = 300 if ON_CPU else 2048     # the interpreter walks every program in numpy


def _dot_row_by_row() -> None:
    """Under the interpreter, `tl.dot` is numpy's matmul of the whole tile, and the BLAS under it may round a
    row by its place in the tile: with OpenBLAS's AVX2 kernels, row 2 of a 5-row verify tile differed in its
    last bits from the same row decoded alone in row 0. A GPU's MMA makes each output element from its own
    row and column, which is what the kernel's batch invariance rests on; so the interpreter's dot here
    multiplies one row at a time, every row in a product of the same shape. What reaches each row (tiles,
    masks, windows, the online softmax across KV chunks) is still the kernel's."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    whole = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        rows = [whole(self, TensorHandle(a.data[..., i:i + 1, :], a.dtype.scalar), b,
                      TensorHandle(d.data[..., i:i + 1, :], d.dtype.scalar), *args).data
                for i in range(a.data.shape[-2])]
        return TensorHandle(np.concatenate(rows, axis=-2), d.dtype.scalar)
    InterpreterBuilder.create_dot = create_dot


if ON_CPU:
    _dot_row_by_row()


def make_batch(query_lens, seq_lens, *, heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
               shared_prefix_blocks=0, seed=0):
    """Random caches and queries for one step. Sequences get disjoint random blocks, except that with
    shared_prefix_blocks every sequence's table starts with the same blocks (a cached prompt prefix)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shared = [free.pop() for _ in range(shared_prefix_blocks)]
    tables = [shared[:n] + [free.pop() for _ in range(max(0, n - len(shared)))] for n in blocks_per_seq]
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)
    caches = (rand(num_blocks, block_size, kv_heads, head_dim), rand(num_blocks, block_size, kv_heads, head_dim))
    tokens = sum(query_lens)
    return (rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim),
            caches, tables)


def attend(backend, query_lens, seq_lens, batch, block_size=16, window=None, dtype=None):
    q, k, v, (k_cache, v_cache), tables = batch
    if dtype is not None:
        q, k, v, k_cache, v_cache = (t.to(dtype) for t in (q, k, v, k_cache, v_cache))
    attn = build_attention_metadata(query_lens, seq_lens, tables, block_size, DEVICE, backend=backend)
    return paged_attention(q, k, v, (k_cache.clone(), v_cache.clone()), attn, q.shape[-1] ** -0.5, window)


def random_step(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 6, (1,), generator=gen))
    seq_lens = torch.randint(1, MAX_CONTEXT + 1, (n,), generator=gen).tolist()
    query_lens = [min(s, int(torch.randint(1, 10, (1,), generator=gen))) for s in seq_lens]
    if n > 1:                       # one prefill chunk of a longer prompt among the decodes and verifies
        query_lens[-1] = min(seq_lens[-1], 40)
    return query_lens, seq_lens


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 24])
def test_matches_sdpa_on_random_ragged_batches(seed, window):
    query_lens, seq_lens = random_step(seed)
    batch = make_batch(query_lens, seq_lens, seed=seed)
    got = attend("triton", query_lens, seq_lens, batch, window=window)
    ref = attend("sdpa", query_lens, seq_lens, batch, window=window)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 4, 32, 16), (8, 1, 128, 32), (6, 2, 80, 16),
                                                                 (8, 2, 64, 256)])
def test_matches_sdpa_across_shapes(heads, kv_heads, head_dim, block_size):
    query_lens, seq_lens = [1, 5, 33], [200, 77, 33]
    batch = make_batch(query_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, seed=3)
    got = attend("triton", query_lens, seq_lens, batch, block_size=block_size)
    ref = attend("sdpa", query_lens, seq_lens, batch, block_size=block_size)
    assert (got - ref).abs().max().item() < 1e-4


def test_prefix_shared_blocks():
    query_lens, seq_lens = [1, 4, 1], [90, 70, 40]
    batch = make_batch(query_lens, seq_lens, shared_prefix_blocks=2, seed=5)
    got = attend("triton", query_lens, seq_lens, batch)
    assert (got - attend("sdpa", query_lens, seq_lens, batch)).abs().max().item() < 1e-4


def test_bf16_cache_matches_fp32_reference():
    query_lens, seq_lens = [1, 5, 1, 30], [250, 64, 3, 120]
    batch = make_batch(query_lens, seq_lens, dtype=torch.bfloat16, seed=7)
    got = attend("triton", query_lens, seq_lens, batch)
    assert got.dtype == torch.bfloat16
    ref = attend("sdpa", query_lens, seq_lens, batch, dtype=torch.float32)
    assert (got.float() - ref).abs().max().item() < 3e-2


def written(caches, table, first_pos, k, v, block_size=16):
    """Copies of the caches with k/v rows stored at positions first_pos, first_pos + 1, ... of one sequence."""
    k_cache, v_cache = (c.clone() for c in caches)
    for i in range(k.shape[0]):
        pos = first_pos + i
        k_cache[table[pos // block_size], pos % block_size] = k[i]
        v_cache[table[pos // block_size], pos % block_size] = v[i]
    return k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
def test_rows_are_bit_identical_alone_in_a_batch_and_among_drafts(dtype, window):
    """A verify step of sequence 0 (its last context token and 4 drafts, q = 5): every row has the same bits
    as that position decoded alone (q = 1), and as the same verify inside a batch of 8 sequences with other
    lengths and query counts. Rows 1-3 share a tile with row 0, so their window's first chunk is not theirs."""
    seq_len = 150
    others_q, others_s = [1, 3, 1, 5, 1, 2, 9], [20, 260, 7, 140, 300, 64, 90]
    batch = make_batch([5] + others_q, [seq_len + 4] + others_s, dtype=dtype, seed=11)
    q, k, v, caches, tables = batch
    verify = attend("triton", [5], [seq_len + 4], (q[:5], k[:5], v[:5], caches, tables[:1]), window=window)
    in_batch = attend("triton", [5] + others_q, [seq_len + 4] + others_s, batch, window=window)
    assert torch.equal(verify, in_batch[:5])
    for j in range(5):
        before = written(caches, tables[0], seq_len - 1, k[:j], v[:j])      # the rows decoded before j
        alone = attend("triton", [1], [seq_len + j], (q[j:j + 1], k[j:j + 1], v[j:j + 1], before, tables[:1]),
                       window=window)
        assert torch.equal(alone[0], verify[j]), f"row {j}"


def test_self_check_passes_and_catches_a_wrong_kernel(monkeypatch):
    monkeypatch.setattr(triton_attention, "_checked", {})
    assert triton_attention.self_check(DEVICE) is None
    monkeypatch.setattr(triton_attention, "_checked", {})
    real = triton_attention.paged_attention_triton
    monkeypatch.setattr(triton_attention, "paged_attention_triton", lambda *a: real(*a) * 1.01)
    assert "differs from the reference" in triton_attention.self_check(DEVICE)
    monkeypatch.setattr(triton_attention, "_checked", {})
    monkeypatch.setattr(triton_attention, "paged_attention_triton", lambda *a: 1 / 0)
    assert "ZeroDivisionError" in triton_attention.self_check(DEVICE)
