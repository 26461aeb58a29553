"""CPU paged attention that reads the KV cache in place: a small C++ kernel built on the machine that runs it.

Why a hand-written kernel: the SDPA path (attention.py) gathers every sequence's K/V blocks into a padded
buffer per layer per step, and torch's CPU SDPA rounds a query row differently with the number of keys and
rows in the call in bf16, which is why a bf16 model kept an fp32 cache. This kernel walks each sequence's
block table directly (no gather, no padding to the longest context) and reads fp32, bf16 or fp16 K/V,
accumulating in fp32 in one FIXED order per query row: a dot product split over 16 fixed lanes, the softmax
sum over 16 lanes by key position from the row's first visible key, the weighted value sum in position
order. The work is split over (sequence, tile of 16 queries) and kv heads (one per item at small batches,
all of a tile's at large ones), and the split only picks the thread, never the arithmetic, so a row is
bit-identical alone or in any batch, with any number of drafts beside it.

Considered instead: FlexAttention (CPU inductor code generation compiles per block-mask shape and takes
tens of seconds per graph on 2 cores, and its reduction tiling follows the key count, so the fixed-order
guarantee would have to be re-proved per torch release). This source includes only the C++ standard
library, builds in about two seconds with g++ and is called through ctypes (a torch operator, as
bf16_gemm_op.cpp makes of the linear kernel, would save the Python around each call).

Build: at first use, through native_build.py (g++ -O3 -march=native -fopenmp, cached per source, compiler
and CPU). If no compiler works, `load()` returns None with the reason logged, and attention.py falls back
to SDPA.

Two entry points: `paged_attention_cpu` (fp32 queries and output: the reference the tests and the A/B harness
call) and `attention_step`, the one call per layer the model makes: it also writes the step's K/V into the
cache and takes and returns the model's dtype, where five torch calls around the kernel cost ~12 µs a layer.
"""
from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from pathlib import Path

import torch

from specserve.server.models import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_kernel.cpp")
HEADERS = (Path(__file__).with_name("paged_kernel_avx512.h"),)      # included by SOURCE
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_state: dict[str, object] = {}      # "lib": ctypes.CDLL | None, "error": str


def load() -> ctypes.CDLL | None:
    """The built kernel, or None (the reason is logged once and kept in `load_error()`)."""
    return native_build.load_once(_state, _lock, _open)


def _open() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(native_build.build(SOURCE, HEADERS)))
        fn = lib.specserve_paged_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64,
                       ctypes.c_float, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        step = lib.specserve_paged_attention_step
        step.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, i64, i64,
                         i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
        step.restype = ctypes.c_int
        return lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _state["error"] = str(exc)
        logger.warning("paged attention kernel unavailable, torch SDPA serves attention instead: %s", exc)
        return None


def load_error() -> str | None:
    return _state.get("error")


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float, window: int | None) -> torch.Tensor:
    """q: [num_tokens, heads, d] (any float dtype); k_cache, v_cache: [num_blocks, block_size, kv_heads, d]
    in fp32/bf16/fp16; block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32;
    query_start_loc [num_seqs + 1] int32. Returns fp32 [num_tokens, heads, d].
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"paged attention kernel unavailable: {load_error()}")
    if not all(t.device.type == "cpu" for t in (q, k_cache, v_cache, block_tables)):
        raise ValueError("the paged kernel runs on CPU tensors only")
    if k_cache.dtype not in KV_DTYPE_CODES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"KV cache dtype must be one of {list(KV_DTYPE_CODES)}, got {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    qf = q.to(torch.float32).contiguous()                                     # [num_tokens, heads, d]
    tables = block_tables.to(torch.int32).contiguous()                        # [num_seqs, max_blocks]
    lens = seq_lens.to(torch.int32).contiguous()                              # [num_seqs]
    qsl = query_start_loc.to(torch.int32).contiguous()                        # [num_seqs + 1]
    out = torch.empty_like(qf)                                                # [num_tokens, heads, d]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    rc = lib.specserve_paged_attention(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KV_DTYPE_CODES[k_cache.dtype],
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), qsl.data_ptr(), lens.shape[0],
        q.shape[1], num_kv_heads, head_dim, block_size, window or 0, scale, out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged attention: {q.shape[1]} heads do not group over {num_kv_heads} kv heads")
    return out


def attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                   window: int | None) -> torch.Tensor | None:
    """One layer's step in one kernel call: k, v [num_tokens, kv_heads, d] written at slot_mapping (int64),
    then attention; returns [num_tokens, heads, d] in q's dtype, the same values as writing the cache with
    index_copy_ and `paged_attention_cpu(...).to(q.dtype)`. None where this call does not apply (q not fp32 or
    bf16, k/v not in the cache's dtype, a tensor not contiguous, metadata not int32/int64): use those instead.
    """
    lib = load()          # plain `and`s, no generator: this runs once per layer of every step
    code = KV_DTYPE_CODES.get(k_cache.dtype)
    if not (lib is not None and code is not None and q.device.type == "cpu"
            and (q.dtype == torch.float32 or q.dtype == torch.bfloat16)
            and k.dtype == k_cache.dtype and v.dtype == k_cache.dtype and v_cache.dtype == k_cache.dtype
            and slot_mapping.dtype == torch.int64 and block_tables.dtype == torch.int32
            and seq_lens.dtype == torch.int32 and query_start_loc.dtype == torch.int32
            and q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and k_cache.is_contiguous()
            and v_cache.is_contiguous() and slot_mapping.is_contiguous() and block_tables.is_contiguous()):
        return None
    out = torch.empty_like(q)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    rc = lib.specserve_paged_attention_step(
        q.data_ptr(), q.dtype == torch.bfloat16, k.data_ptr(), v.data_ptr(), slot_mapping.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), code, block_tables.data_ptr(),
        block_tables.shape[1], seq_lens.data_ptr(), query_start_loc.data_ptr(), seq_lens.shape[0], q.shape[1],
        num_kv_heads, head_dim, block_size, window or 0, scale, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged attention: {q.shape[1]} heads do not group over {num_kv_heads} kv heads")
    return out
