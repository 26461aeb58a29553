"""suffix and auto against the fixed methods, interleaved per prompt (robust to a VM's drifting speed).

    python -m loadtest.bench_auto --num-prompts 4 --new-tokens 96 [--rounds 2] [--extra-methods eagle3,mtp]

Workloads (loadtest/prompt_sets.py): `repeated` (code-completion prompts answered once, untimed, then
sent again and timed), `agentic` (turn 2 of a code-editing conversation whose turn 1 was answered
untimed), `mixed` (repeated and fresh requests alternating) and the fresh `code_completion` and `prose`
sets. Each prompt runs every arm back to back in a rotating order; an arm's speedup is none's summed
seconds / its summed seconds over the same prompts. A fresh request gets a cache scope of its own
(SpecParams.cache_scope), so no arm drafts from another arm's answer; the repeated ones share one.
Batch 1 at T = 0 and T = 0.8 (seeded), then none, hybrid and auto at a concurrency of 16: the engine
runs at most --concurrency requests at once (max_num_seqs) and is given --concurrent-requests of them
(the set's prompts repeated), so a finished request's place is taken at once as a client at that
concurrency would take it; --concurrent-requests 16 is one batch of 16 drained to its last request
(its tail runs a few requests a step, which a speculating arm reaches sooner and sits in longer).
Last: suffix's propose cost with a 1M-token cross-request cache and its bytes per cached token.
Greedy output is compared with plain in every pair (reported, not asserted). auto/best divides by the
fastest fixed method of the run; held-out (--rounds >= 2) by the one fastest in the other rounds, round by
round (held_out_ratio), which the luck of one arm's quick run does not pick.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from loadtest.prompt_sets import load_prompt_set, mixed, next_turn
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.speculators.base import SpecParams
from specserve.speculators.suffix_index import SuffixIndex

CACHE_READERS = ("suffix", "auto")      # the arms that read the cross-request cache


class Warm:
    """Answers a group's earlier requests, untimed, once per cache scope: every arm that reads the cache
    gets its own scope, so no arm drafts from another arm's answer to the same prompt."""

    def __init__(self, eng: LLM, groups: dict[str, list[list[int]]], new: int) -> None:
        self.eng, self.groups, self.done = eng, groups, set()
        self.params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)

    def scope(self, group: str, arm: str, tag: str) -> str:
        name = f"{group}-{arm}-{tag}"
        if arm in CACHE_READERS and name not in self.done:
            self.done.add(name)
            self.eng.generate(self.groups[group], self.params, scoped(SpecParams("suffix", 8), name))
        return name


def arms(k: int, extra: list[str] | None = None) -> dict[str, SpecParams]:
    """The compared arms; `extra`: more single methods at k (e.g. the drafters auto chooses among)."""
    out = {"none": SpecParams(), "ngram": SpecParams("ngram", k), "hybrid k=4": SpecParams("hybrid", 4),
           "suffix": SpecParams("suffix", k)}
    out.update({m: SpecParams(m, k) for m in extra or [] if m not in out})
    return {**out, "auto": SpecParams("auto", k)}


def scoped(spec: SpecParams, scope: str) -> SpecParams:
    return replace(spec, cache_scope=scope)


def batch1(eng: LLM, warm: Warm, work: list[tuple[list[int], str | None]], specs: dict[str, SpecParams],
           temperature: float, new: int, tag: str, rounds: int = 1) -> dict[str, dict]:
    """work: (prompt ids, warm group or None = fresh). Every prompt runs every arm, order rotating. Each
    round has cache scopes of its own: a later round must not find an earlier round's answer."""
    names = list(specs)
    secs, toks, acc, drafts, diff = ({n: 0.0 for n in names}, {n: 0 for n in names}, {n: 0 for n in names},
                                     {n: 0 for n in names}, {n: 0 for n in names})
    mix: dict[str, int] = {}                     # auto: steps per method it chose
    per_round = [({n: 0.0 for n in names}, {n: 0 for n in names}) for _ in range(rounds)]   # (secs, tokens)
    for i, (prompt, scope) in enumerate(work * rounds):
        round_tag = f"{tag}-r{i // len(work)}"
        params = SamplingParams(temperature=temperature, max_tokens=new, ignore_eos=True,
                                seed=1000 + i if temperature else None)
        order = names[i % len(names):] + names[:i % len(names)]
        ref = None
        outs = {}
        for name in order:
            spec = scoped(specs[name], warm.scope(scope, name, round_tag) if scope else f"{tag}-{name}-{i}")
            start = time.perf_counter()
            outs[name] = out = eng.generate([prompt], params, spec)[0]
            elapsed = time.perf_counter() - start
            secs[name] += elapsed
            toks[name] += len(out.token_ids)
            per_round[i // len(work)][0][name] += elapsed
            per_round[i // len(work)][1][name] += len(out.token_ids)
            acc[name] += out.spec_stats.num_accepted_tokens
            drafts[name] += out.spec_stats.num_drafts
            if name == "auto":
                for method, row in out.spec_stats.by_method.items():
                    mix[method] = mix.get(method, 0) + row[0]
        ref = outs["none"].token_ids
        for name in names:
            diff[name] += temperature == 0 and outs[name].token_ids != ref
    base = secs["none"] / max(toks["none"], 1)
    res = {n: {"tok_s": toks[n] / secs[n], "speedup": base / (secs[n] / max(toks[n], 1)),
               "tau": 1 + acc[n] / drafts[n] if drafts[n] else 1.0, "greedy_diff": diff[n]} for n in names}
    res["auto"]["mix"] = mix
    res["auto"]["held_out"] = held_out_ratio(per_round, [n for n in names if n not in ("none", "auto")])
    return res


def held_out_ratio(per_round: list[tuple[dict[str, float], dict[str, int]]], fixed: list[str],
                   arm: str = "auto") -> float | None:
    """`arm`'s tokens/s over the best fixed method's, the best picked on the other rounds: each round is
    compared with the method that was fastest in the rest, pooled over rounds. Picked and compared on the
    same noisy seconds, the best of several near-equal methods is the one whose run happened to be quick,
    and a ratio to it reads low by that luck. None with one round."""
    if len(per_round) < 2:
        return None
    mine = [0.0, 0]
    best = [0.0, 0]
    for r, (secs, toks) in enumerate(per_round):
        rest = [other for j, other in enumerate(per_round) if j != r]
        pick = max(fixed, key=lambda n: sum(t[n] for _, t in rest) / max(sum(s[n] for s, _ in rest), 1e-9))
        mine[0] += secs[arm]
        mine[1] += toks[arm]
        best[0] += secs[pick]
        best[1] += toks[pick]
    return (mine[1] / mine[0]) / (best[1] / best[0])


def concurrent(eng: LLM, warm: Warm, work: list[tuple[list[int], str | None]], specs: dict[str, SpecParams],
               new: int, tag: str, rounds: int = 2) -> dict[str, float]:
    """All prompts at once per arm, arms alternating over rounds: tokens/s ratio to none."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    secs = {n: 0.0 for n in specs}
    toks = {n: 0 for n in specs}
    for r in range(rounds):
        for name in (list(specs) if r % 2 == 0 else list(specs)[::-1]):
            batch = [scoped(specs[name], warm.scope(scope, name, tag) if scope else f"{tag}-{name}-{r}-{i}")
                     for i, (_, scope) in enumerate(work)]
            start = time.perf_counter()
            outs = eng.generate([p for p, _ in work], params, batch)
            secs[name] += time.perf_counter() - start
            toks[name] += sum(len(o.token_ids) for o in outs)
    return {n: (toks[n] / secs[n]) / (toks["none"] / secs["none"]) for n in specs}


def propose_cost(cache_tokens: int = 1_000_000, reps: int = 300) -> tuple[float, float, float]:
    """(µs per lookup that hits, µs per lookup that misses, bytes per cached token) at a full cache."""
    rng = np.random.default_rng(0)
    index = SuffixIndex(cache_tokens)
    while index.end < cache_tokens:
        index.extend([*rng.integers(0, 32000, 2000).tolist(), -1], scope=1)
    doc = rng.integers(0, 32000, 300).tolist()
    index.extend([*doc, -1], scope=1)
    tail, miss = np.asarray(doc[:150]), rng.integers(0, 32000, 64)
    index.draft(tail, 1, 8, 1.0, 0.1)                   # compiled or loaded from the cache: not timed
    start = time.perf_counter()
    for _ in range(reps):
        index.draft(tail, 1, 8, 1.0, 0.1)               # as suffix drafts k = 8 (its engine path)
    hit = (time.perf_counter() - start) / reps * 1e6
    start = time.perf_counter()
    for _ in range(reps):
        index.draft(miss, 1, 8, 1.0, 0.1)
    return hit, (time.perf_counter() - start) / reps * 1e6, index.nbytes() / index.capacity


def workloads(eng: LLM, n: int, new: int) -> tuple[dict[str, list[tuple[list[int], str | None]]], Warm]:
    """The sets, and the earlier requests of the repeated and agentic ones (answered per scope by Warm)."""
    tok = eng.engine.tokenizer
    plain = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    completion = [tok.encode(r["prompt"]) for r in load_prompt_set("code_completion")]
    repeats, fresh = completion[:n], completion[n:2 * n]
    edits = [r["prompt"] for r in load_prompt_set("code_editing")[:n]]
    first = eng.generate([tok.encode(p) for p in edits], plain)           # agentic turn 1
    turn2 = [tok.encode(next_turn(p, o.text, 0)) for p, o in zip(edits, first)]
    prose = [tok.encode(r["prompt"]) for r in load_prompt_set("prose")[:n]]
    warm = Warm(eng, {"repeated": repeats, "agentic": [tok.encode(p) for p in edits]}, new)
    sets = {"repeated": [(p, "repeated") for p in repeats], "agentic": [(p, "agentic") for p in turn2],
            "mixed": mixed([(p, "repeated") for p in repeats], [(p, None) for p in fresh]),
            "code_completion": [(p, None) for p in fresh], "prose": [(p, None) for p in prose]}
    return sets, warm


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1,
                    help="batch-1 passes over each set, pooled (each pass starts the arm rotation elsewhere)")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--extra-methods", default="",
                    help="more single methods to compare at batch 1, comma-separated (e.g. eagle3,mtp)")
    ap.add_argument("--sets", default="repeated,agentic,mixed,code_completion,prose")
    ap.add_argument("--concurrent-sets", default="repeated,code_completion")
    ap.add_argument("--concurrent-rounds", type=int, default=2,
                    help="passes of every arm over each concurrent set, arm order alternating")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight in the concurrent sets")
    ap.add_argument("--concurrent-requests", type=int, default=64,
                    help="requests per arm and pass in the concurrent sets (at most --concurrency at once)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    eng = LLM(config=EngineConfig(model=args.model, kv_cache_memory_gb=0.5, suffix_scope="user",
                                  max_num_seqs=args.concurrency))
    sets, warm = workloads(eng, args.num_prompts, args.new_tokens)
    specs = arms(args.k, [m for m in args.extra_methods.split(",") if m])
    print(f"{args.num_prompts} prompts x {args.new_tokens} tokens, k = {args.k}, loaded: {eng.methods}")
    header = " ".join(f"{n:>11}" for n in specs)
    print(f"{'set':16} {'T':>4} {'none/s':>6} {header}   auto/best held-out  (speedup vs none / tau)")
    for temperature in [float(t) for t in args.temperatures.split(",") if t]:
        for name in [n for n in args.sets.split(",") if n]:
            res = batch1(eng, warm, sets[name], specs, temperature, args.new_tokens, f"{name}-{temperature}",
                         args.rounds)
            best = max((n for n in specs if n not in ("none", "auto")), key=lambda n: res[n]["speedup"])
            cells = " ".join(f"{res[n]['speedup']:5.2f}x/{res[n]['tau']:4.2f}" for n in specs)
            diffs = {n: r["greedy_diff"] for n, r in res.items() if r["greedy_diff"]}
            rel = res["auto"]["speedup"] / res[best]["speedup"]
            held = res["auto"]["held_out"]
            mix = " ".join(f"{m} {n}" for m, n in sorted(res["auto"]["mix"].items(), key=lambda x: -x[1]))
            print(f"{name:16} {temperature:4.1f} {res['none']['tok_s']:6.1f} {cells}   {rel:5.2f} "
                  f"{'  -  ' if held is None else f'{held:5.2f}'} "
                  f"({best}){'  greedy differs: ' + str(diffs) if diffs else ''}  [auto's steps: {mix}]",
                  flush=True)
    for name in [n for n in args.concurrent_sets.split(",") if n]:
        work = (sets[name] * args.concurrent_requests)[:max(args.concurrent_requests, 1)]
        ratio = concurrent(eng, warm, work, {"none": specs["none"], "hybrid k=4": specs["hybrid k=4"],
                                       "auto": specs["auto"]}, args.new_tokens, f"c-{name}",
                           args.concurrent_rounds)
        cells = ", ".join(f"{n} {v:.2f}x" for n, v in ratio.items())
        print(f"concurrency {min(args.concurrency, len(work))} ({len(work)} requests) {name}: {cells}", flush=True)
    hit, miss, per_token = propose_cost()
    print(f"suffix lookup at a 1M-token cache: {hit:.0f} µs (match + 8-token draft), {miss:.0f} µs (no match); "
          f"{per_token:.0f} bytes per cached token")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
