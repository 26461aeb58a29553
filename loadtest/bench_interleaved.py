"""Speculation speedup at batch 1, measured by interleaved A/B: robust on a VM whose speed drifts.

bench_spec_core measures a plain baseline just before each row; on this project's VMs the speed still
drifts by tens of percent between two rows a minute apart. Here every prompt is decoded plain and with
the method back to back (the order alternating per round), and the speedup is the ratio of the summed
times, so a slow minute slows both arms alike. Per-round ratios are printed as a spread.

    python -m loadtest.bench_interleaved --dtype bfloat16 --compile --methods eagle3,mtp,draft --ks 1,2,4,6

Columns: tok/s of each arm (summed tokens / summed seconds), speedup = none time / method time over the
same tokens, its min-max over rounds, and the mean acceptance length (pooled 1 + accepted / drafts).
Greedy output is checked equal to plain in every pair (T = 0; reported, not asserted).
"""
from __future__ import annotations

import argparse
import time

from loadtest.bench_spec_core import mean_acceptance
from loadtest.prompt_sets import load_prompt_set
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.speculators.base import SpecParams


def timed(eng: LLM, prompt: list[int], params: SamplingParams, spec: SpecParams):
    start = time.perf_counter()
    out = eng.generate([prompt], params, spec)[0]
    return time.perf_counter() - start, out


def ab(eng: LLM, prompts: list[list[int]], spec: SpecParams, temperature: float, new_tokens: int,
       rounds: int) -> dict:
    """Interleaved rounds of (none, method) per prompt -> summed times, per-round ratios, acceptance."""
    plain_s = spec_s = 0.0
    tokens = mismatches = 0
    ratios, outs = [], []
    for r in range(rounds):
        round_plain = round_spec = 0.0
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=temperature, seed=1000 * r + i, max_tokens=new_tokens,
                                    ignore_eos=True)
            arms = [SpecParams(), spec] if (r + i) % 2 == 0 else [spec, SpecParams()]
            results = {}
            for arm in arms:
                results[arm.method] = timed(eng, prompt, params, arm)
            (tp, plain), (ts, out) = results["none"], results[spec.method]
            round_plain += tp
            round_spec += ts
            tokens += len(out.token_ids)
            outs.append(out)
            mismatches += temperature == 0 and out.token_ids != plain.token_ids
        plain_s += round_plain
        spec_s += round_spec
        ratios.append(round_plain / round_spec)
    return {"none_tok_s": tokens / plain_s, "tok_s": tokens / spec_s, "speedup": plain_s / spec_s,
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "tau": mean_acceptance(outs), "greedy_mismatches": mismatches}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action="store_true", help="torch.compile the layer stacks (specserve --compile)")
    ap.add_argument("--methods", default="eagle3,mtp,draft")
    ap.add_argument("--ks", default="1,2,4,6")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--prompt-set", default="code_completion")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    eng = LLM(config=EngineConfig(model=args.model, dtype=args.dtype, compile=args.compile,
                                                 speculation_policy="fixed", kv_cache_memory_gb=0.5))
    tok = eng.engine.tokenizer
    prompts = [tok.encode(row["prompt"]) for row in load_prompt_set(args.prompt_set)[:args.num_prompts]]
    eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))                       # warm-up
    print(f"{args.prompt_set}, {len(prompts)} prompts x {args.new_tokens} tokens, batch 1, dtype {args.dtype}"
          f"{', --compile' if args.compile else ''}, {args.rounds} interleaved rounds")
    print(f"{'T':>4} {'method':8s} {'k':>2} {'none tok/s':>10} {'tok/s':>7} {'speedup':>8} {'rounds':>11} {'tau':>5}")
    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for method in args.methods.split(","):
            for k in [int(k) for k in args.ks.split(",")]:
                r = ab(eng, prompts, SpecParams(method, k), temperature, args.new_tokens, args.rounds)
                rows.append({"temperature": temperature, "method": method, "k": k, **r})
                note = (
                    f"  greedy output differs from plain in {r['greedy_mismatches']}" if r["greedy_mismatches"] else ""
                )
                print(
                    f"{temperature:4.1f} {method:8s} {k:2d} {r['none_tok_s']:10.1f} {r['tok_s']:7.1f} "
                    f"{r['speedup']:7.2f}x {r['ratio_min']:5.2f}-{r['ratio_max']:4.2f} {r['tau']:5.2f}{note}",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main()
