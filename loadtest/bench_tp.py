"""Tensor parallelism on CPU: TP = 2 (gloo, one torch thread per rank) against TP = 1 (the same threads in
one process), interleaved in one run, on the embedded target and on a wider random Llama.

Prints per model: aggregate decode tokens/s of each (best of rounds), their ratio, and the share of rank 0's
step time spent inside the collectives (all-reduce of o_proj/down_proj/embedding, all-gather of the logits:
timed around each call, so it includes waiting for the slower rank). On a machine with as many cores as
ranks this measures the cost of sharding, not a speed-up: both arms use the same cores.

Run: make bench-tp   (or python -m loadtest.bench_tp --rounds 3 --batch 4 --max-tokens 32)
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.models.config import ModelConfig
from specserve.server.models.embedded import require as embedded_family
from specserve.server.models.loader import build_random_model
from specserve.server.models.parallel_layers import TPGroup
from specserve.server.models.shard_loader import hf_tensors
from specserve.speculators.base import SpecParams

WIDE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=5632,
            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
PROMPTS = ["def fibonacci(n):\n", "The quick brown fox", "for i in range(10):\n    print(i)\n",
           "import numpy as np\n", "class Stack:\n    def __init__(self):\n", "SELECT name FROM users WHERE",
           "Once upon a time", "x = [1, 2, 3]\n"]


class CollectiveTimer:
    """Seconds spent inside TPGroup's collectives in this process (rank 0)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("all_reduce", "all_gather_last"):
            original = getattr(TPGroup, name)
            setattr(TPGroup, name, self._timed(original))

    def _timed(self, fn):
        def wrapper(group, x):
            start = time.perf_counter()
            try:
                return fn(group, x)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def write_wide(path: Path) -> Path:
    tokenizer_dir = embedded_family().tokenizer
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    raw = {**WIDE, "vocab_size": len(tokenizer)}
    cfg = ModelConfig.from_dict(raw)
    tensors = hf_tensors(build_random_model(cfg, seed=0), cfg)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    tokenizer.save_pretrained(str(path))
    return path


def timed_generate(llm: LLM, prompts: list[str], new: int, threads: int) -> tuple[float, float]:
    """(decode tokens/s, seconds inside runner.execute) for one batch; `threads`: this process's torch threads
    (a process-wide setting, so each arm sets its own before it runs)."""
    torch.set_num_threads(threads)
    runner = llm.engine.runner
    spent = [0.0]
    original = runner.execute

    def execute(batch):
        start = time.perf_counter()
        try:
            return original(batch)
        finally:
            spent[0] += time.perf_counter() - start
    runner.execute = execute
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, SpecParams("none", 0))
    elapsed = time.perf_counter() - start
    runner.execute = original
    return sum(len(o.token_ids) for o in outs) / elapsed, spent[0]


def bench_model(label: str, model: str | None, args: argparse.Namespace, timer: CollectiveTimer) -> dict:
    threads = os.cpu_count() or 2
    # plain decoding only: no start-up probe of the drafters (spec_probe.py), whose ratings only `auto` reads
    common = dict(model=model, dtype="float32", device="cpu", kv_cache_memory_gb=0.25, speculation_policy="fixed",
                  speculation_probe_tokens=0)
    one = LLM(num_threads=threads, **common)
    two = LLM(tensor_parallel_size=2, num_threads=max(1, threads // 2), **common)
    prompts = PROMPTS[:args.batch]
    arms = {"tp1": (one, threads), "tp2": (two, max(1, threads // 2))}
    for llm, n in arms.values():                              # warm-up: first-touch, packing, caches
        timed_generate(llm, prompts, 4, n)
    best = {"tp1": 0.0, "tp2": 0.0}
    shares = []
    try:
        for _ in range(args.rounds):                          # interleaved: drift hits both arms alike
            best["tp1"] = max(best["tp1"], timed_generate(one, prompts, args.max_tokens,
                                                          arms["tp1"][1])[0])
            before = timer.seconds
            tps, execute_s = timed_generate(two, prompts, args.max_tokens, arms["tp2"][1])
            best["tp2"] = max(best["tp2"], tps)
            shares.append((timer.seconds - before) / execute_s)
    finally:
        two.engine.runner.close()
    return {"model": label, "tp1_tok_s": best["tp1"], "tp2_tok_s": best["tp2"],
            "ratio": best["tp2"] / best["tp1"], "collective_share": sorted(shares)[len(shares) // 2]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--models", nargs="+", default=["embedded", "wide"], choices=["embedded", "wide"])
    args = p.parse_args(argv)
    torch.manual_seed(0)
    timer = CollectiveTimer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in args.models:
            model = None if label == "embedded" else str(write_wide(Path(tmp) / "wide"))
            rows.append(bench_model(label, model, args, timer))
    print(f"batch {args.batch}, {args.max_tokens} new tokens, best of {args.rounds} interleaved rounds, "
          f"{os.cpu_count()} cores")
    print("| model | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 | collectives / step (rank 0) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tp1_tok_s']:.1f} | {r['tp2_tok_s']:.1f} | {r['ratio']:.2f}x | "
              f"{100 * r['collective_share']:.0f}% |")
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
