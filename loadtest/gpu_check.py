"""GPU readiness in one run: the attention backends side by side, then the embedded family served on the GPU.

    python -m loadtest.gpu_check [--device cuda] [--dtype bfloat16] [--new-tokens 64]

1. Attention, one decode step of B sequences x C context tokens (q = 1) and a verify step (q = 5): each
   backend's time per layer call, the K/V bytes it must read ÷ that time (GB/s), and its max difference
   from SDPA. Backends: triton and sdpa (and flash when flash-attn is installed); on CPU paged and sdpa.
2. Engine, embedded family: tokens/s of plain decoding and of each loaded method (k = 4) at batch 1 and
   concurrency 16 per attention backend, and whether every batched greedy text equals its lone plain text.
Prints tables; asserts nothing (tests/test_models_gpu.py and tests/triton_cases.py do).
"""
from __future__ import annotations

import argparse
import time

import torch

from loadtest.prompt_sets import load_prompt_set
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.models import attention
from specserve.speculators.base import SpecParams

METHODS = ("none", "ngram", "eagle3", "eagle", "mtp", "draft", "hybrid")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def attention_table(device: str, dtype: torch.dtype, backends: list[str]) -> None:
    heads, kv_heads, head_dim, block = 32, 8, 128, 16          # an 8B-class layer's attention
    print(f"attention: {heads} heads / {kv_heads} KV heads x {head_dim}, {dtype}, block {block}")
    print(f"{'B x C, q':>16} " + " ".join(f"{b + ' us':>10} {b + ' GB/s':>10} {'err':>8}" for b in backends))
    for num_seqs, ctx, q in [(1, 2048, 1), (8, 2048, 1), (32, 2048, 1), (64, 1024, 1), (8, 2048, 5)]:
        gen = torch.Generator().manual_seed(0)
        nb = num_seqs * (ctx // block) + 1
        caches = tuple(torch.randn(nb, block, kv_heads, head_dim, generator=gen).to(dtype).to(device)
                       for _ in range(2))
        perm = torch.randperm(nb, generator=gen).tolist()
        tables = [perm[i * (ctx // block):(i + 1) * (ctx // block)] for i in range(num_seqs)]
        tokens = num_seqs * q
        qkv = [torch.randn(tokens, h, head_dim, generator=gen).to(dtype).to(device)
               for h in (heads, kv_heads, kv_heads)]
        kv_bytes = 2 * num_seqs * ctx * kv_heads * head_dim * caches[0].element_size()
        row, ref = [], None
        for backend in backends:
            attn = attention.build_attention_metadata([q] * num_seqs, [ctx] * num_seqs, tables, block, device,
                                                      backend=backend)
            call = lambda a=attn, x=qkv, c=caches: attention.paged_attention(*x, c, a, head_dim ** -0.5)
            out = call()
            sync(device)
            reps = 20
            start = time.perf_counter()
            for _ in range(reps):
                call()
            sync(device)
            sec = (time.perf_counter() - start) / reps
            ref = out.float() if ref is None else ref
            row.append(f"{sec * 1e6:10.1f} {kv_bytes / sec / 1e9:10.1f} {(out.float() - ref).abs().max().item():8.4f}")
        print(f"{f'{num_seqs} x {ctx}, {q}':>16} " + " ".join(row))


def engine_table(device: str, dtype: str, backends: list[str], new: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    print(f"\nengine: embedded family, {dtype}, {new} tokens per request, greedy, k = 4")
    print(f"{'attention':9} {'method':7} {'b1 tok/s':>9} {'c16 tok/s':>10} {'tau':>5} {'same as alone':>14}")
    for backend in backends:
        eng = LLM(config=EngineConfig(dtype=dtype, device=device, kv_cache_memory_gb=1.0, seed=0,
                                      attention_backend=backend))
        tok = eng.engine.tokenizer
        prompts = [tok.encode(r["prompt"]) for s in ("code_completion", "code_editing")
                   for r in load_prompt_set(s)[:8]]
        eng.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), SpecParams())
        alone = [eng.generate([p], params, SpecParams())[0].token_ids for p in prompts]
        for method in [m for m in METHODS if m in eng.methods]:
            spec = SpecParams() if method == "none" else SpecParams(method=method, num_speculative_tokens=4)
            sync(device)
            start = time.perf_counter()
            for p in prompts[:4]:
                eng.generate([p], params, spec)
            sync(device)
            b1 = 4 * new / (time.perf_counter() - start)
            start = time.perf_counter()
            outs = eng.generate(prompts, params, [spec] * len(prompts))
            sync(device)
            c16 = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
            steps = sum(o.num_steps for o in outs)
            same = sum(o.token_ids == a for o, a in zip(outs, alone))
            print(f"{backend:9} {method:7} {b1:9.1f} {c16:10.1f} {sum(len(o.token_ids) for o in outs) / steps:5.2f} "
                  f"{same:>8} / {len(outs)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    if on_cuda:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, triton "
              f"{attention.triton_attention.available()}, flash-attn {attention.FLASH_ATTN_AVAILABLE}")
        backends = ["sdpa", "triton"] + (["flash"] if attention.FLASH_ATTN_AVAILABLE else [])
    else:
        backends = ["sdpa", "paged"]
    attention_table(args.device, getattr(torch, args.dtype), backends)
    if not args.skip_engine:
        engine_table(args.device, args.dtype, [b for b in backends if b != "flash"] if on_cuda else backends,
                     args.new_tokens)


if __name__ == "__main__":
    main()
