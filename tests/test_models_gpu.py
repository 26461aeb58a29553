"""CUDA attention backends == SDPA on the same model, cache layout and schedule (bf16), and the CUDA defaults.

Skipped only when CUDA is absent (`make gpu-check` runs them on a GPU machine). The Triton backend is the
CUDA default and ships with torch; flash-attn is the optional extra "gpu", so its comparisons run only
where it is installed.
"""
from __future__ import annotations

import pytest
import torch

from specserve.server.kv.kv_cache import allocate_kv_cache
from specserve.server.models import attention
from specserve.server.models.attention import build_attention_metadata
from specserve.server.models.config import ModelConfig
from specserve.server.models.loader import build_random_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPE = torch.bfloat16
# (seq_id, new tokens) per step: varlen prefill incl. a long prompt, decodes, a mixed verify, 2-chunk prefill
SCHEDULE = [[(0, 5), (1, 40), (2, 9)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)],
            [(0, 4), (1, 1), (2, 3)], [(3, 37), (0, 1)], [(1, 5), (3, 300), (2, 1)]]


def gpu_config(window: int | None) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["MistralForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "sliding_window": window})


def run_schedule(model, cfg: ModelConfig, backend: str, block_size: int, dtype: torch.dtype = DTYPE
                 ) -> list[torch.Tensor]:
    """Replays SCHEDULE through a fresh paged cache; returns the logits of every step [num_tokens, vocab]."""
    num_blocks = 4 * (-(-400 // block_size)) + 4
    kv = allocate_kv_cache(cfg, num_blocks, block_size, dtype, "cuda")
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    blocks: dict[int, list[int]] = {}
    done: dict[int, int] = {}
    gen = torch.Generator().manual_seed(1)
    tokens = {i: torch.randint(0, cfg.vocab_size, (400,), generator=gen).tolist() for i in range(4)}
    outs = []
    for step in SCHEDULE:
        seq_lens, ids = [], []
        for seq, q in step:
            start = done.get(seq, 0)
            ids += tokens[seq][start:start + q]
            seq_lens.append(start + q)
            while len(blocks.setdefault(seq, [])) * block_size < start + q:
                blocks[seq].append(free.pop())
        attn = build_attention_metadata([q for _, q in step], seq_lens, [blocks[s] for s, _ in step],
                                        block_size, "cuda", backend=backend)
        with torch.inference_mode():
            hidden, _ = model(torch.tensor(ids, device="cuda"), attn, kv)
            outs.append(model.compute_logits(hidden))
        for (seq, _), total in zip(step, seq_lens):
            done[seq] = total
    return outs


needs_flash = pytest.mark.skipif(not attention.FLASH_ATTN_AVAILABLE, reason="flash-attn (extra 'gpu') not installed")


def test_default_backend_on_cuda_is_triton_at_block_16():
    assert attention.triton_attention.available(), attention.triton_attention.IMPORT_ERROR
    assert attention.default_backend("cuda") == "triton" and attention.default_backend("cpu") in ("paged", "sdpa")
    block = attention.pick_block_size(0, "cuda")
    assert block == 16
    attn = build_attention_metadata([1, 5], [300, 40], [[b for b in range(19)], [19, 20, 21]], block, "cuda")
    assert attn.backend == "triton" and attn.flash_kv_slots is None and not attn.short_groups   # no gather plan


@needs_flash
def test_flash_block_size_reads_the_cache_in_place():
    attn = build_attention_metadata([1, 5], [300, 40], [[0, 1], [2]], 256, "cuda", backend="flash")
    assert attn.flash_kv_slots is None      # block_table path: no gather


def assert_close_to_sdpa(reference, got):
    for step, (ref, out) in enumerate(zip(reference, got)):
        # bf16 attention kernels differ in accumulation order; logits of this model are O(1).
        err = (out - ref).abs().max().item()
        scale = ref.abs().max().item()
        cos = torch.nn.functional.cosine_similarity(out.float(), ref.float(), dim=-1).min().item()
        assert err <= 0.03 * scale + 0.02, f"step {step}: max abs diff {err:.3g} (logit scale {scale:.3g})"
        assert cos > 0.999, f"step {step}: min row cosine similarity {cos:.5f}"


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("window", [None, 24])
def test_triton_matches_sdpa_bf16(block_size, window):
    cfg = gpu_config(window)
    model = build_random_model(cfg, seed=0, dtype=DTYPE, device="cuda")
    assert_close_to_sdpa(run_schedule(model, cfg, "sdpa", block_size), run_schedule(model, cfg, "triton", block_size))


@needs_flash
@pytest.mark.parametrize("block_size", [16, 256])    # 16: gathered varlen path; 256: paged block_table path
@pytest.mark.parametrize("window", [None, 24])
def test_flash_matches_sdpa_bf16(block_size, window):
    cfg = gpu_config(window)
    model = build_random_model(cfg, seed=0, dtype=DTYPE, device="cuda")
    reference = run_schedule(model, cfg, "sdpa", block_size)
    assert_close_to_sdpa(reference, run_schedule(model, cfg, "flash", block_size))


def test_sdpa_on_cuda_matches_cpu_fp32():
    cfg = gpu_config(None)
    cpu_model = build_random_model(cfg, seed=0, dtype=torch.float32, device="cpu")
    gpu_model = build_random_model(cfg, seed=0, dtype=torch.float32, device="cuda")
    attn = build_attention_metadata([7, 3], [7, 3], [[2, 0], [1]], 4, "cpu")
    ids = torch.arange(10) * 7 % cfg.vocab_size
    with torch.inference_mode():
        cpu_hidden, _ = cpu_model(ids, attn, allocate_kv_cache(cfg, 3, 4, torch.float32, "cpu"))
        attn_gpu = build_attention_metadata([7, 3], [7, 3], [[2, 0], [1]], 4, "cuda", backend="sdpa")
        gpu_hidden, _ = gpu_model(ids.cuda(), attn_gpu, allocate_kv_cache(cfg, 3, 4, torch.float32, "cuda"))
    # TF32 may be enabled for CUDA matmuls; 1e-2 still catches layout and masking bugs.
    assert (gpu_hidden.cpu() - cpu_hidden).abs().max().item() < 1e-2


def test_triton_matches_sdpa_fp32():
    """The whole-model schedule in fp32: Triton (full fp32 dots, no TF32) against CUDA SDPA."""
    cfg = gpu_config(24)
    model = build_random_model(cfg, seed=0, dtype=torch.float32, device="cuda")
    ref = run_schedule(model, cfg, "sdpa", 16, torch.float32)
    got = run_schedule(model, cfg, "triton", 16, torch.float32)
    for step, (r, g) in enumerate(zip(ref, got)):
        assert (r - g).abs().max().item() < 1e-2, f"step {step}"
