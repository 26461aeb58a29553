"""Decode step time: the in-place paged attention kernel vs the SDPA gather path, side by side.

Same random ~30M Llama (loadtest/bench_decode.CONFIG_30M, --dtype weights, fp32 by default; bf16 where the CPU
has it, with --compile as served), prompts of --prompt-len random
tokens, greedy plain decoding at batch 1, 8 and 16. Step time = (time for n2 new tokens - time for n1) /
(n2 - n1), each engine's prompts cached first (one warm call), so both runs prefill only the prompt's
last block and the difference is decode steps; the median over rounds counts. Engines: sdpa + fp32 KV, paged + fp32 KV,
paged + bf16 KV; rounds are interleaved. Roofline = (weight bytes + KV bytes read per
step) / copy bandwidth (a 256 MiB torch copy, read + write counted).

Run: python -m loadtest.bench_paged [--dtype bfloat16 --compile]  (about 3-5 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch

from loadtest.bench_decode import make_checkpoint
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.kv.kv_cache import kv_cache_bytes_per_block
from specserve.server.models import attention
from specserve.server.models.config import load_config
from specserve.speculators.base import SpecParams

ENGINES = (("sdpa", "float32"), ("paged", "float32"), ("paged", "bfloat16"))


def copy_bandwidth() -> float:
    src = torch.randn(64 << 20)            # 256 MiB fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = 5
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - t)


def step_seconds(eng: LLM, backend: str, prompts: list[list[int]], n1: int, n2: int) -> float:
    attention.configure_backend(backend)     # process-wide: set before each engine's steps
    times = []
    for n in (1, n1, n2):                    # the first call (re)fills the prefix cache: not timed
        t = time.perf_counter()
        eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), SpecParams("none", 0))
        times.append(time.perf_counter() - t)
    return (times[2] - times[1]) / (n2 - n1)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--n1", type=int, default=4)
    ap.add_argument("--n2", type=int, default=36)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights")
    ap.add_argument("--compile", action="store_true", help="torch.compile the target, as `serve --compile`")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from specserve.server.engine.tokenizer import Tokenizer
    from specserve.server.models.embedded import require as embedded_family
    vocab = Tokenizer(str(embedded_family().tokenizer)).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(max(args.batches))]
    bw = copy_bandwidth()
    rows = []
    with tempfile.TemporaryDirectory() as path:
        nparams = make_checkpoint(path, vocab)
        mcfg = load_config(path)
        engines = {}
        for backend, kv in ENGINES:
            attention.configure_backend(backend)
            engines[(backend, kv)] = LLM(config=EngineConfig(model=path, dtype=args.dtype, device="cpu",
                                                             kv_cache_memory_gb=0.5, kv_cache_dtype=kv,
                                                             enable_prefix_caching=True, attention_backend=backend,
                                                             compile=args.compile))
        weight_bytes = nparams * getattr(torch, args.dtype).itemsize
        print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, copy bandwidth {bw / 1e9:.1f} GB/s, "
              f"model {nparams / 1e6:.1f}M {args.dtype}{' compiled' if args.compile else ''}, "
              f"prompt {args.prompt_len}, steps {args.n1}..{args.n2}")
        print(f"KV tokens in 1 GiB: fp32 {(1 << 30) // (kv_cache_bytes_per_block(mcfg, 1, torch.float32))}, "
              f"bf16 {(1 << 30) // (kv_cache_bytes_per_block(mcfg, 1, torch.bfloat16))}")
        samples: dict = {}
        for _ in range(args.rounds):
            for b in args.batches:
                for key, eng in engines.items():
                    samples.setdefault((key, b), []).append(step_seconds(eng, key[0], prompts[:b], args.n1, args.n2))
        best = {key: statistics.median(v) for key, v in samples.items()}
        ctx = args.prompt_len + (args.n1 + args.n2) / 2
        print(f"{'batch':>5} {'backend':>7} {'KV':>8} {'step ms':>8} {'vs sdpa':>8} {'roofline ms':>11} {'ratio':>6}")
        for b in args.batches:
            for key in engines:
                kv_bytes = b * ctx * kv_cache_bytes_per_block(mcfg, 1, getattr(torch, key[1]))
                roof = (weight_bytes + kv_bytes) / bw
                s = best[(key, b)]
                row = dict(batch=b, backend=key[0], kv=key[1], step_ms=s * 1e3,
                           vs_sdpa=best[(ENGINES[0], b)] / s, roofline_ms=roof * 1e3, ratio=s / roof)
                rows.append(row)
                print(f"{b:5d} {key[0]:>7} {key[1]:>8} {s * 1e3:8.2f} {row['vs_sdpa']:8.2f} "
                      f"{roof * 1e3:11.2f} {s / roof:6.2f}")
    return rows


if __name__ == "__main__":
    main()
