"""What coupled sampling costs: seeded (coupled) against unseeded (rejection) sampled speculation, batch 1.

Every prompt is decoded with the same method, k and temperature twice back to back, once with a seed
(coupled sampling: the text is plain seeded decoding's) and once without (rejection sampling: the
target's distribution), the order alternating per prompt, so a drifting machine slows both arms alike.

    python -m loadtest.bench_coupled --methods draft,eagle3,mtp,ngram --temperatures 0.8,1.0

Columns per (prompt set, T, method): acceptance rate (accepted / draft tokens) and tok/s of each arm
(summed tokens / summed seconds), and the coupled / rejection ratios of both.
"""
from __future__ import annotations

import argparse
import time

import torch

from loadtest.prompt_sets import load_prompt_set
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.speculators.base import SpecParams

ARMS = ("coupled", "rejection")


def arm_params(arm: str, temperature: float, new_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True,
                          seed=seed if arm == "coupled" else None)


def pair(eng: LLM, prompts: list[list[int]], spec: SpecParams, temperature: float, new_tokens: int) -> dict:
    """Both arms on every prompt, interleaved -> per arm: seconds, tokens, draft and accepted tokens."""
    totals = {arm: {"s": 0.0, "tokens": 0, "drafted": 0, "accepted": 0} for arm in ARMS}
    for i, prompt in enumerate(prompts):
        for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
            torch.manual_seed(1000 + i)                    # the rejection arm's global RNG, per prompt
            params = arm_params(arm, temperature, new_tokens, seed=1000 + i)
            start = time.perf_counter()
            out = eng.generate([prompt], params, spec)[0]
            t = totals[arm]
            t["s"] += time.perf_counter() - start
            t["tokens"] += len(out.token_ids)
            t["drafted"] += out.spec_stats.num_draft_tokens
            t["accepted"] += out.spec_stats.num_accepted_tokens
    row = {}
    for arm, t in totals.items():
        row[f"{arm}_acceptance"] = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
        row[f"{arm}_tok_s"] = t["tokens"] / t["s"]
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--methods", default="draft,eagle3,mtp,ngram")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperatures", default="0.8,1.0")
    ap.add_argument("--prompt-sets", default="code_completion,prose")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    eng = LLM(config=EngineConfig(model=args.model, dtype=args.dtype, speculation_policy="fixed",
                                  kv_cache_memory_gb=0.5))
    tok = eng.engine.tokenizer
    eng.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8))                    # warm-up
    methods = [m for m in args.methods.split(",") if m in eng.methods]
    print(f"{args.num_prompts} prompts per set x {args.new_tokens} tokens, batch 1, k = {args.k}, "
          f"dtype {args.dtype}, arms interleaved per prompt; methods loaded: {methods}")
    print(f"{'set':16s} {'T':>4} {'method':7s} {'acc coupled':>11} {'acc rejection':>13} {'ratio':>6} "
          f"{'tok/s coupled':>13} {'tok/s rejection':>15} {'ratio':>6}")
    rows = []
    for prompt_set in args.prompt_sets.split(","):
        prompts = [tok.encode(r["prompt"]) for r in load_prompt_set(prompt_set)[:args.num_prompts]]
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            for method in methods:
                r = pair(eng, prompts, SpecParams(method, args.k), temperature, args.new_tokens)
                rows.append({"prompt_set": prompt_set, "temperature": temperature, "method": method, **r})
                acc_ratio = r["coupled_acceptance"] / r["rejection_acceptance"] if r["rejection_acceptance"] else 0.0
                print(f"{prompt_set:16s} {temperature:4.1f} {method:7s} {r['coupled_acceptance']:11.2f} "
                      f"{r['rejection_acceptance']:13.2f} {acc_ratio:6.2f} {r['coupled_tok_s']:13.1f} "
                      f"{r['rejection_tok_s']:15.1f} {r['coupled_tok_s'] / r['rejection_tok_s']:6.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
