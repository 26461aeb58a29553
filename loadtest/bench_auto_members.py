"""What `auto`'s model drafters add on each workload: `auto` with all its members against `auto` restricted
to the context lookups (suffix, n-gram), beside n-gram and suffix alone, at batch 1.

    python -m loadtest.bench_auto_members --sets prose,agentic,code_completion --temperatures 0 --rounds 2

The sets are bench_auto's (loadtest/bench_auto.py `workloads`, repeated and agentic ones warmed per arm and
round); every prompt runs every arm back to back in a rotating order, and an arm's ratio is its summed
tokens/s ÷ n-gram's over the same prompts. The restricted arm is the same speculator with its member table
cut to the lookups for its requests only (its model drafters still observe, as they do under `auto`).
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

from loadtest.bench_auto import Warm, scoped, workloads
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.speculators.auto import LOOKUPS
from specserve.speculators.base import SpecParams

ARMS = ("ngram", "suffix", "auto", "auto (lookups only)")


@contextmanager
def lookups_only(eng: LLM, on: bool):
    """`auto`'s members cut to the context lookups while the block runs (unchanged when not `on`)."""
    auto = eng.engine.spec.speculators["auto"]
    auto.lookups()                                   # members are current
    members = auto.members
    if on:
        auto.members = {m: s for m, s in members.items() if m in LOOKUPS}
    try:
        yield
    finally:
        auto.members = members


def run_set(eng: LLM, warm: Warm, work: list, temperature: float, new: int, rounds: int, tag: str) -> dict:
    """-> arm -> (tokens/s, ratio to n-gram, model-drafter steps per drafted step of auto's)."""
    secs, toks, model_steps, steps = ({a: 0.0 for a in ARMS}, {a: 0 for a in ARMS}, {a: 0 for a in ARMS},
                                      {a: 0 for a in ARMS})
    for i, (prompt, group) in enumerate(work * rounds):
        params = SamplingParams(temperature=temperature, max_tokens=new, ignore_eos=True,
                                seed=1000 + i % len(work) if temperature else None)
        for arm in ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]:
            method = "auto" if arm.startswith("auto") else arm
            reader = "auto" if method == "auto" else arm          # Warm answers the cache readers' scopes
            name = f"{tag}-{arm}-r{i // len(work)}"
            scope = warm.scope(group, reader, name) if group else f"{name}-{i}"
            with lookups_only(eng, arm != "auto" and method == "auto"):
                start = time.perf_counter()
                out = eng.generate([prompt], params, scoped(SpecParams(method, 8), scope))[0]
                secs[arm] += time.perf_counter() - start
            toks[arm] += len(out.token_ids)
            for m, row in out.spec_stats.by_method.items():
                steps[arm] += row[0] if m != "none" else 0
                model_steps[arm] += row[0] if m not in (*LOOKUPS, "none") else 0
    base = toks["ngram"] / secs["ngram"]
    return {a: (toks[a] / secs[a], toks[a] / secs[a] / base, model_steps[a] / max(steps[a], 1)) for a in ARMS}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--sets", default="prose,agentic,code_completion")
    ap.add_argument("--speculation-probe-tokens", type=int, default=EngineConfig.speculation_probe_tokens,
                    help="the start-up probe that rates auto's drafters (0: none, auto learns from traffic alone)")
    args = ap.parse_args(argv)
    eng = LLM(config=EngineConfig(model=args.model, kv_cache_memory_gb=0.5, suffix_scope="user",
                                  speculation_probe_tokens=args.speculation_probe_tokens))
    sets, warm = workloads(eng, args.num_prompts, args.new_tokens)
    print(f"{args.num_prompts} prompts x {args.new_tokens} tokens, k = 8, batch 1, {args.rounds} rounds; "
          "tokens/s (÷ n-gram) [auto: share of drafted steps on a model drafter]")
    results = {}
    for temperature in [float(t) for t in args.temperatures.split(",") if t]:
        for name in [n for n in args.sets.split(",") if n]:
            res = run_set(eng, warm, sets[name], temperature, args.new_tokens, args.rounds, f"{name}-{temperature}")
            results[(name, temperature)] = res
            cells = "  ".join(f"{a} {t:.1f} ({r:.3f})" + (f" [{s:.2f}]" if a == "auto" else "")
                              for a, (t, r, s) in res.items())
            print(f"{name:16} T {temperature:.1f}  {cells}", flush=True)
    return results


if __name__ == "__main__":
    main()
