"""Acceptance per draft depth of each speculation method, given the earlier depths were accepted, at batch 1.

    python -m loadtest.depth_acceptance --methods eagle3,mtp,draft --sets code_completion,prose,agentic \
        --temperatures 0,0.8 --num-prompts 4 --rounds 2

Every request drafts its full k every step (adaptive off: the goodput policy cuts nothing), so each depth is
reached by every draft that was accepted up to it, not only by those the policy let draft deep (those are
the easier requests). A cell is accepted / reached at that depth; `n=` lists how many drafts reached each.
One acceptance a per position predicts a flat row (1 + a + ... + a^L tokens for L drafts); a copied
lookup draft, wrong from its first token or right for many, rises with depth. `--by-prompt` adds each prompt's
length and each method's acceptance per position on it (a draft model trained on shorter sequences than the
target serves falls apart on the long prompts only). The sets are bench_auto's
(loadtest/bench_auto.py `workloads`), a repeated group's earlier answers given to each method's cache scope
first (bench_auto.Warm); a request's seed is the same for every method.
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager

from loadtest.bench_auto import scoped, workloads
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.speculators import base
from specserve.speculators.base import SpecParams


@contextmanager
def recorded_steps():
    """Every verification step's (drafts, accepted) booked to any request while the block runs."""
    steps: list[tuple[int, int]] = []
    original = base.SpecStats.record

    def record(stats, num_draft: int, num_accepted: int) -> None:
        if num_draft:
            steps.append((num_draft, num_accepted))
        original(stats, num_draft, num_accepted)
    base.SpecStats.record = record
    try:
        yield steps
    finally:
        base.SpecStats.record = original


def depth_rows(steps: list[tuple[int, int]]) -> list[list[float]]:
    """[reached, accepted] per depth over the steps (base.count_depths)."""
    rows: list[list[float]] = [[], []]
    for num_draft, num_accepted in steps:
        base.count_depths(rows, num_draft, num_accepted)
    return rows


def per_position(steps: list[tuple[int, int]]) -> float:
    """Accepted drafts over attempted positions (the accepted ones plus the first rejected one)."""
    attempted = sum(base.attempted_positions(d, a) for d, a in steps)
    return sum(a for _, a in steps) / attempted if attempted else 0.0


def main(argv: list[str] | None = None) -> dict[tuple[str, float, str], list[list[float]]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--methods", default="eagle3,mtp,draft")
    p.add_argument("--sets", default="code_completion,prose,agentic")
    p.add_argument("--temperatures", default="0,0.8")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--speculation-probe-tokens", type=int, default=0,
                   help="the server's start-up probe (nothing here reads its ratings)")
    p.add_argument("--by-prompt", action="store_true", help="also each prompt's length and acceptance per position")
    args = p.parse_args(argv)
    eng = LLM(config=EngineConfig(model=args.model, kv_cache_memory_gb=0.5, suffix_scope="user",
                                  speculation_probe_tokens=args.speculation_probe_tokens))
    sets, warm = workloads(eng, args.num_prompts, args.new_tokens)
    methods = [m for m in args.methods.split(",") if m]
    results = {}
    print(f"{args.num_prompts} prompts x {args.rounds} rounds x {args.new_tokens} tokens, k = {args.k} untrimmed; "
          f"acceptance at depths 1..{args.k} given the earlier ones were accepted")
    for t in (float(x) for x in args.temperatures.split(",") if x):
        for name in (s for s in args.sets.split(",") if s):
            per_prompt: dict[tuple[str, int], list[tuple[int, int]]] = {}
            for method in methods:
                with recorded_steps() as steps:
                    for rnd in range(args.rounds):
                        for i, (prompt, group) in enumerate(sets[name]):
                            params = SamplingParams(temperature=t, max_tokens=args.new_tokens, ignore_eos=True,
                                                    seed=1000 + i + 17 * rnd)
                            scope = warm.scope(group, method, f"{name}-{t}") if group else f"{name}{rnd}{i}{method}"
                            spec = scoped(SpecParams(method, args.k, adaptive=False), scope)
                            start = len(steps)
                            eng.generate([prompt], params, spec)
                            per_prompt.setdefault((method, i), []).extend(steps[start:])
                reached, accepted = results[(name, t, method)] = depth_rows(steps)
                cells = " ".join(f"{a / r:.2f}" if r else "-" for a, r in zip(accepted, reached))
                print(f"T={t:<4} {name:16s} {method:8s} {cells}  n={','.join(str(int(r)) for r in reached)}",
                      flush=True)
            for i, (prompt, _) in enumerate(sets[name] if args.by_prompt else ()):
                cells = " ".join(f"{m} {per_position(per_prompt[(m, i)]):.2f}" for m in methods)
                print(f"    prompt {i} ({len(prompt)} tokens): {cells}", flush=True)
    return results


if __name__ == "__main__":
    main()
