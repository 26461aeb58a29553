"""The in-place paged attention kernel (server/models/paged_kernel.py) against torch SDPA, and the
batch- and speculation-independence of its rows in fp32, bf16 and fp16 K/V storage."""
from __future__ import annotations

import pytest
import torch

from specserve.server.models import attention, native_build, paged_kernel
from specserve.server.models.attention import build_attention_metadata, paged_attention

BLOCK = 16
HEADS, KV_HEADS, D = 8, 2, 32
# the kernel has code of its own for head dims 64 and 128 (fixed trip counts) and one for any other
HEAD_DIMS = (D, 64, 128)


def random_cache(num_blocks: int, dtype: torch.dtype, gen: torch.Generator, kv_heads: int = KV_HEADS, d: int = D):
    shape = (num_blocks, BLOCK, kv_heads, d)
    return (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))


def tables_for(seq_lens: list[int], num_blocks: int, gen: torch.Generator, shared_prefix_blocks: int = 0):
    """Random disjoint block tables; the first `shared_prefix_blocks` blocks are the same for every sequence
    that is long enough (a cached common prefix)."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shared = [free.pop() for _ in range(shared_prefix_blocks)]
    out = []
    for s in seq_lens:
        n = -(-s // BLOCK)
        own = shared[:n] if n <= len(shared) else shared + [free.pop() for _ in range(n - len(shared))]
        out.append(own)
    return out


def run(backend: str, q_lens, seq_lens, tables, cache, q, window=None):
    """One attention call reading `cache` (this step's K/V already in it: k/v are re-written unchanged)."""
    attn = build_attention_metadata(q_lens, seq_lens, tables, BLOCK, "cpu", backend=backend)
    k_cache, v_cache = cache
    kv, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.view(-1, kv, d)[attn.slot_mapping].clone()
    v = v_cache.view(-1, kv, d)[attn.slot_mapping].clone()
    if backend == "sdpa":      # the reference attends in fp32 over an fp32 copy of the same stored values
        cache, k, v = (k_cache.float(), v_cache.float()), k.float(), v.float()
    return paged_attention(q, k, v, cache, attn, d**-0.5, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("kv_heads", [KV_HEADS, 1, HEADS])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_random_ragged_batches_match_sdpa(dtype, window, kv_heads, d):
    gen = torch.Generator().manual_seed(hash((str(dtype), window, kv_heads, d)) % 1000)
    for trial in range(3):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        seq_lens = torch.randint(1, 2049, (n,), generator=gen).tolist()
        seq_lens[0] = 2048 if trial == 0 else seq_lens[0]
        q_lens = [min(s, int(torch.randint(1, 10, (1,), generator=gen))) for s in seq_lens]
        if trial == 2:                       # a prefill chunk after a cached prefix, beside decodes
            q_lens[0] = min(seq_lens[0], 40)
        num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 8
        tables = tables_for(seq_lens, num_blocks, gen, shared_prefix_blocks=2 if trial else 0)
        cache = random_cache(num_blocks, dtype, gen, kv_heads, d)
        q = torch.randn(sum(q_lens), HEADS, d, generator=gen)
        got = run("paged", q_lens, seq_lens, tables, cache, q, window)
        ref = run("sdpa", q_lens, seq_lens, tables, cache, q, window)
        err = (got - ref).abs().max().item()
        assert err < 2e-5, f"trial {trial} seq_lens {seq_lens} q_lens {q_lens}: max err {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_row_is_bit_identical_alone_in_a_batch_of_8_and_with_drafts(dtype, window, d):
    """Sequence 0's token at position 300: decoded alone, decoded in a batch of 8 other lengths, verified
    first of 5 (4 drafts after it), and verified in a batch of 8 verifying sequences: the same bits."""
    gen = torch.Generator().manual_seed(3)
    lens = [305, 7, 1500, 64, 1, 930, 33, 16]            # room for 4 drafts after position 300 in sequence 0
    num_blocks = sum(-(-s // BLOCK) for s in lens) + 8
    tables = tables_for(lens, num_blocks, gen)
    cache = random_cache(num_blocks, dtype, gen, d=d)
    q = torch.randn(8 * 5, HEADS, d, generator=gen)     # [8 sequences x 5 queries, heads, d]
    decode_lens = [301] + lens[1:]
    alone = run("paged", [1], [301], tables[:1], cache, q[:1], window)
    batch = run("paged", [1] * 8, decode_lens, tables, cache, torch.cat([q[:1], q[5::5]]), window)
    verify = run("paged", [5], [305], tables[:1], cache, q[:5], window)
    verify_lens = [305] + [max(s, 5) for s in lens[1:]]
    verify_batch = run("paged", [5] * 8, verify_lens, tables, cache, q, window)   # 16-token blocks hold 5
    assert torch.equal(alone[0], batch[0])
    assert torch.equal(alone[0], verify[0])
    assert torch.equal(alone[0], verify_batch[0])
    assert not torch.equal(alone[0], verify[1])     # the rows are real, different queries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_one_call_step_equals_cache_write_kernel_and_cast(dtype, d):
    """attention_step (new K/V written by the kernel, queries and output in the model's dtype) gives the bits
    of index_copy_ into the cache, the fp32 kernel call and a cast, and leaves the same cache."""
    gen = torch.Generator().manual_seed(7)
    lens, q_lens = [40, 3, 97], [1, 3, 5]
    num_blocks = sum(-(-s // BLOCK) for s in lens) + 4
    tables = tables_for(lens, num_blocks, gen)
    cache = random_cache(num_blocks, dtype, gen, d=d)
    attn = build_attention_metadata(q_lens, lens, tables, BLOCK, "cpu", backend="paged")
    n = sum(q_lens)
    q = torch.randn(n, HEADS, d, generator=gen).to(dtype)
    k, v = (torch.randn(n, KV_HEADS, d, generator=gen).to(dtype) for _ in range(2))
    ref_cache = tuple(c.clone() for c in cache)
    for c, new in zip(ref_cache, (k, v)):
        c.view(-1, KV_HEADS, d).index_copy_(0, attn.slot_mapping, new)
    ref = paged_kernel.paged_attention_cpu(q, *ref_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                           d ** -0.5, None).to(dtype)
    got = paged_kernel.attention_step(q, k, v, *cache, attn.slot_mapping, attn.block_tables, attn.seq_lens,
                                      attn.query_start_loc, d ** -0.5, None)
    assert got.dtype == dtype and torch.equal(got, ref)
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])
    # what it does not take, it leaves to the caller: k in another dtype than the cache
    assert paged_kernel.attention_step(q, k.double(), v, *cache, attn.slot_mapping, attn.block_tables,
                                       attn.seq_lens, attn.query_start_loc, d ** -0.5, None) is None


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_peaked_scores_whose_weights_underflow_match_sdpa_and_leave_the_callers_float_modes(d):
    """Queries 40x larger: most keys score hundreds below the row's best, so their softmax weights underflow
    (denormals, which the kernel flushes to zero). The rows still match SDPA, and the caller's thread keeps
    its own float modes (a denormal survives a multiply by one after the call)."""
    gen = torch.Generator().manual_seed(5)
    seq_lens, q_lens = [300, 41, 1000], [1, 3, 1]
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 4
    tables = tables_for(seq_lens, num_blocks, gen)
    cache = random_cache(num_blocks, torch.float32, gen, d=d)
    q = torch.randn(sum(q_lens), HEADS, d, generator=gen) * 40
    got = run("paged", q_lens, seq_lens, tables, cache, q)
    ref = run("sdpa", q_lens, seq_lens, tables, cache, q)
    assert (got - ref).abs().max().item() < 1e-4       # scores in the hundreds: their own rounding is ~1e-5
    tiny = torch.tensor([1e-40])
    assert tiny.item() != 0.0 and (tiny * 1.0).item() == tiny.item()


def test_failed_build_falls_back_to_sdpa(monkeypatch):
    monkeypatch.setattr(paged_kernel, "_state", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(native_build, "cache_dir", lambda: paged_kernel.Path("/nonexistent-cache"))
    monkeypatch.setattr(attention, "_choice", {"requested": "auto"})
    assert attention.configure_backend("auto") == "sdpa"
    assert paged_kernel.load_error()
    with pytest.raises(RuntimeError, match="does not build"):
        attention.configure_backend("paged")
    with pytest.raises(ValueError, match="must be one of"):
        attention.configure_backend("fast")


def test_kv_cache_dtype_follows_the_model_under_the_paged_kernel_and_holds_twice(monkeypatch):
    from specserve.server.kv import kv_cache
    from specserve.server.models.config import ModelConfig
    monkeypatch.setattr(kv_cache, "_requested", {"kv_cache_dtype": "auto"})
    monkeypatch.setattr(attention, "_choice", {"requested": "auto"})
    assert attention.configure_backend("paged") == "paged"
    assert kv_cache.cache_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert kv_cache.cache_dtype(torch.float32, "cpu") == torch.float32
    attention.configure_backend("sdpa")      # SDPA is not row-stable in bf16: the cache stays fp32
    assert kv_cache.cache_dtype(torch.bfloat16, "cpu") == torch.float32
    kv_cache.configure_kv_cache_dtype("bfloat16")
    assert kv_cache.cache_dtype(torch.float32, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="must be one of"):
        kv_cache.configure_kv_cache_dtype("int8")
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 16})
    fp32 = kv_cache.num_blocks_for_budget(cfg, 16, torch.float32, 1 << 30)
    assert kv_cache.num_blocks_for_budget(cfg, 16, torch.bfloat16, 1 << 30) == 2 * fp32


def test_block_size_auto_is_flash_attns_page_on_cuda_and_16_elsewhere(monkeypatch, caplog):
    assert attention.pick_block_size(0, "cpu") == 16
    assert attention.pick_block_size(64, "cpu") == 64
    monkeypatch.setattr(attention, "_choice", {"requested": "auto"})
    monkeypatch.setattr(attention.triton_attention, "available", lambda: False)
    monkeypatch.setattr(attention, "FLASH_ATTN_AVAILABLE", True)       # a CUDA machine with flash-attn, no triton
    assert attention.default_backend("cuda") == "flash"
    assert attention.pick_block_size(0, "cuda") == 256
    with caplog.at_level("WARNING"):
        assert attention.pick_block_size(16, "cuda") == 16                # kept, but said: flash gathers then
    assert "gathers" in caplog.text
    monkeypatch.setattr(attention, "FLASH_ATTN_AVAILABLE", False)      # CUDA SDPA reads any block size
    assert attention.pick_block_size(0, "cuda") == 16
