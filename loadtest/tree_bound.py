"""How much any draft tree of N nodes can gain over the chain, from a drafter's measured greedy accuracy.

    python -m loadtest.tree_bound --method eagle3 [--n 8 --prompts 8 --max-tokens 64]

Runs the chain (k = N, greedy, one request at a time, the goodput policy off) and records, at every draft
position the target reached, whether the drafter's first choice was the target's token and, where it was
not, whether its second choice was (the target's argmax is the token emitted there). Per depth d that gives

    reach(d)   the share of steps whose first d - 1 drafts were all accepted
    first(d)   P(first choice right | reached)
    second(d)  P(second choice right | reached, first choice wrong)

A node whose path takes the first choice at some depths and the second at others is on the accepted path
with probability prod over its depths of first(d) or (1 - first(d)) second(d) (the rates taken as
depending on the depth only). A greedy tree emits 1 + the number of its nodes on the accepted path, so the
best tree of N nodes built from first and second choices expects 1 + the N largest of those products (a
child's product never exceeds its parent's, so the N largest form a tree); the chain expects 1 + the
products of the first N all-first paths. Third and later choices are left out of that tree; the ceiling
printed beside it lets one sibling per node be right whenever the first choice is wrong (second = 1), which
no set of siblings can beat, since they are right together at most as often as the first choice is wrong.
Printed per prompt set: the per-depth rates, the chain's and the best tree's expected tokens per step, their
ratio, and the ceiling.
"""
from __future__ import annotations

import argparse
import heapq
from collections import Counter
from collections.abc import Sequence

import torch

from loadtest.prompt_sets import load_prompt_set
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.speculators import draft_model, hidden_drafter
from specserve.speculators.base import SpecParams

DRAFTERS = {"eagle3": hidden_drafter.HiddenStateDrafter, "eagle": hidden_drafter.HiddenStateDrafter,
            "mtp": hidden_drafter.HiddenStateDrafter, "draft": draft_model.DraftModelSpeculator}


def best_tree(first: Sequence[float], second: Sequence[float], n: int) -> tuple[float, float]:
    """(chain, best tree): expected tokens per step of the n-node chain and of the best n-node tree of first
    and second choices, with per-depth rates first[d], second[d] (d = 0: the first draft position).
    Example: first = [0.5, 0.5], second = [1, 1], n = 2 -> chain 1.75, tree 2.0 (both first-level siblings)."""
    depth = len(first)
    chain, p = 1.0, 1.0
    for d in range(min(n, depth)):
        p *= first[d]
        chain += p
    tree, heap = 1.0, [(-1.0, 0)]              # (-product, depth of its children); the root: product 1
    taken = -1
    while heap and taken < n:
        neg, d = heapq.heappop(heap)
        taken += 1
        if taken:
            tree += -neg
        if d < depth:
            heapq.heappush(heap, (neg * first[d], d + 1))
            heapq.heappush(heap, (neg * (1.0 - first[d]) * second[d], d + 1))
    return chain, tree


class ChoiceLog:
    """Wraps a drafter class's greedy draft step: logs each row's two best tokens and the first's probability."""

    def __init__(self, cls: type) -> None:
        self.cls, self.orig, self.rows = cls, cls.__dict__["_sample"], []
        self.confidence: list[float] = []      # each draft row's first-choice probability

    def __enter__(self) -> ChoiceLog:
        orig = self.orig.__func__

        def logged(items, logits):
            top = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1)
            self.rows.append(top.indices.tolist())
            self.confidence += top.values[:, 0].tolist()
            return orig(items, logits)
        self.cls._sample = staticmethod(logged)
        return self

    def __exit__(self, *exc) -> None:
        self.cls._sample = self.orig


def measure(eng: LLM, method: str, prompts: list[list[int]], n: int, max_tokens: int) -> dict[str, list[float]]:
    """Per depth: reach, first, second (see the module docstring) over the prompts' chain steps."""
    engine = eng.engine
    reached, first_ok, second_ok, steps = Counter(), Counter(), Counter(), 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with ChoiceLog(DRAFTERS[method]) as log:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"bound-{method}-{i}", prompt, params, SpecParams(method, n, adaptive=False))
            while engine.has_work:
                log.rows.clear()
                outputs, _ = engine.step()
                for out in outputs:
                    if len(log.rows) != n or not out.token_ids:
                        continue                  # a prefill step, or the request's last short step
                    choices = [row[0] for row in log.rows]          # [n][2]: depth j's two best
                    emitted, accepted = out.token_ids, len(out.token_ids) - 1
                    steps += 1
                    for d in range(min(accepted + 1, n)):
                        reached[d] += 1
                        if d < accepted:
                            first_ok[d] += 1
                        else:
                            second_ok[d] += choices[d][1] == emitted[d]
    reach = [reached[d] / max(steps, 1) for d in range(n)]
    first = [first_ok[d] / reached[d] if reached[d] else 0.0 for d in range(n)]
    second = [second_ok[d] / (reached[d] - first_ok[d]) if reached[d] > first_ok[d] else 0.0 for d in range(n)]
    confidence = sum(log.confidence) / max(len(log.confidence), 1)
    return {"reach": reach, "first": first, "second": second, "steps": [float(steps)], "confidence": [confidence]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--method", default="eagle3", choices=sorted(DRAFTERS))
    ap.add_argument("--n", type=int, default=8, help="verified nodes: the chain's k and the tree's size")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-sets", default="code_completion,prose")
    args = ap.parse_args(argv)
    eng = LLM(config=EngineConfig(model=args.model, kv_cache_memory_gb=0.5, speculation_probe_tokens=0,
                                  speculation_policy="fixed"))
    tok = eng.engine.tokenizer
    for name in args.prompt_sets.split(","):
        prompts = [tok.encode(r["prompt"]) for r in load_prompt_set(name)[:args.prompts]]
        got = measure(eng, args.method, prompts, args.n, args.max_tokens)
        chain, tree = best_tree(got["first"], got["second"], args.n)
        accepted = sum(got["reach"][1:]) / max(sum(got["reach"]), 1e-9)
        print(f"{name}: {args.method}, N = {args.n}, {int(got['steps'][0])} chain steps; mean first-choice draft "
              f"probability {got['confidence'][0]:.2f}, acceptance per position reached {accepted:.2f}")
        print("  depth  reach  first  second")
        for d in range(args.n):
            print(f"  {d + 1:5d}  {got['reach'][d]:5.2f}  {got['first'][d]:5.2f}  {got['second'][d]:6.2f}")
        _, ceiling = best_tree(got["first"], [1.0] * args.n, args.n)
        print(f"  expected tokens per step: chain {chain:.2f}, best tree of first and second choices {tree:.2f} "
              f"({tree / chain:.2f}x); any siblings, one of them right whenever the first choice is wrong: "
              f"{ceiling:.2f} ({ceiling / chain:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
