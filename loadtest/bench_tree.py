"""Draft trees vs chains at equal verified tokens N, interleaved in one run (embedded family; eagle3 unless
--method names another tree-drafting method, e.g. draft: the embedded draft model).

  make bench-tree                                  # the grid below, ~6 minutes on 2 CPU cores
  python -m loadtest.bench_tree --max-tokens 32 --trees 2x4   # a smoke run
  python -m loadtest.bench_tree --method draft     # the draft model's trees vs its chain

For every cell (concurrency, temperature, prompt set) every configuration runs once per round, the order
reversed every other round, so drift on a shared machine hits all of them alike. Reported per
configuration: mean tokens per step (1 + accepted / verification steps), tokens/s, and for trees the
time spent building them per step (µs, drafter forwards included; 0 for the lookups) beside the drafter's time per step
(chains too) and the mean step time. Policy: fixed (every step verifies N
nodes), so the ratios compare shapes, not the goodput policy's cuts.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

from loadtest.prompt_sets import load_prompt_set
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.speculators.base import DraftTree, SpecParams
from specserve.speculators.tree_shape import TREE_METHODS


def configs(n: int, trees: list[tuple[int, int]], method: str = "eagle3") -> list[tuple[str, SpecParams]]:
    out = [(f"chain k={n}", SpecParams(method, n))]
    out += [(f"tree {k}x{d}", SpecParams(method, n, draft_tree=DraftTree(k, d))) for k, d in trees]
    return out


class _NoBuilder:
    """The lookups' trees cost no drafter forward: nothing to time."""
    build_seconds = 0.0
    num_calls = 0


def run_config(llm: LLM, prompts: list[str], conc: int, params: SamplingParams, spec: SpecParams) -> dict:
    """The prompts in batches of `conc` -> tokens, seconds, steps, accepted, verification steps, build s."""
    speculator = llm.engine.spec.speculators[spec.method]
    # the heads' tree builder sits on their drafter, the draft model's on the speculator itself
    builder = getattr(getattr(speculator, "drafter", speculator), "trees", _NoBuilder())
    built0, calls0 = builder.build_seconds, builder.num_calls
    tokens = steps = accepted = drafts = 0
    drafting = [0.0, 0]                      # seconds in the drafter's propose (chain or tree), calls
    propose = speculator.propose

    def timed(requests, ks):
        t = time.perf_counter()
        try:
            return propose(requests, ks)
        finally:
            drafting[0] += time.perf_counter() - t
            drafting[1] += 1
    speculator.propose = timed
    t0 = time.perf_counter()
    try:
        for i in range(0, len(prompts), conc):
            outs = llm.generate(prompts[i:i + conc], params, spec)
            tokens += sum(len(o.token_ids) for o in outs)
            steps += max(o.num_steps for o in outs)
            accepted += sum(o.spec_stats.num_accepted_tokens for o in outs)
            drafts += sum(o.spec_stats.num_drafts for o in outs)
    finally:
        del speculator.propose
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "accepted": accepted, "drafts": drafts,
            "build_s": builder.build_seconds - built0, "build_calls": builder.num_calls - calls0,
            "draft_s": drafting[0], "draft_calls": drafting[1]}


def summarise(row: dict) -> dict:
    return {"tokens_per_step": 1 + row["accepted"] / max(row["drafts"], 1),
            "tok_s": row["tokens"] / row["seconds"],
            "step_us": 1e6 * row["seconds"] / max(row["steps"], 1),
            "draft_us": 1e6 * row["draft_s"] / max(row["draft_calls"], 1),
            "build_us": 1e6 * row["build_s"] / row["build_calls"] if row["build_calls"] else 0.0}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="eagle3", choices=TREE_METHODS)
    ap.add_argument("--n", type=int, default=8, help="verified nodes per step (the chain's k)")
    ap.add_argument("--trees", default="2x4,3x4,4x5", help="KxD list")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--prompt-sets", default="prose,code_completion")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per cell at concurrency > 1")
    ap.add_argument("--prompts-batch1", type=int, default=4, help="prompts per cell at concurrency 1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    trees = [tuple(int(x) for x in t.split("x")) for t in args.trees.split(",") if t]
    # every arm drafts with its own method at a fixed k: no start-up probe (it rates drafters for `auto`)
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory_gb=0.2, speculation_policy="fixed", num_threads=1,
              speculation_probe_tokens=0)
    rows: list[dict] = []
    for pset in args.prompt_sets.split(","):
        every = [p["prompt"] for p in load_prompt_set(pset, args.prompts)]
        for conc in (int(c) for c in args.concurrency.split(",")):
            prompts = every[:args.prompts_batch1] if conc == 1 else every
            for temp in (float(t) for t in args.temperatures.split(",")):
                params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True)
                pooled: dict[str, dict] = {}
                order = configs(args.n, trees, args.method)
                for r in range(args.rounds):
                    for name, spec in (order if r % 2 == 0 else order[::-1]):
                        got = run_config(llm, prompts, conc, params, spec)
                        acc = pooled.setdefault(name, dict.fromkeys(got, 0))
                        for key, value in got.items():
                            acc[key] += value
                for name, row in pooled.items():
                    rows.append({"method": args.method, "prompt_set": pset, "concurrency": conc,
                                 "temperature": temp, "config": name, **summarise(row)})
                    print(json.dumps(rows[-1]), flush=True)
    print(f"# {platform.processor() or platform.machine()}, one torch thread, {time.strftime('%Y-%m-%d')}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
