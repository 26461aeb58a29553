"""Where an engine step's time goes, per speculation method, on the offline engine (no HTTP).

Wraps the step's stages with timers and prints milliseconds per step for each: propose (drafting),
prepare (batch + attention metadata), forward (target trunk), logits (lm_head), sampler (rejection
sampling), observe (the drafters' catch-up on accepted tokens), emit (stop checks, detokenizing).
Runs the methods one after another on the same prompts, `none` first and last (the two `none` rows
show how much the machine drifted during the run).

    python -m loadtest.profile_step --methods eagle3,mtp,draft --k 2 --concurrency 16 --temperature 0.8
"""
from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

import torch

from loadtest.prompt_sets import load_prompt_set
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.speculators.base import SpecParams

STAGES = (("propose", "spec", "propose"), ("prepare", "runner", "prepare"), ("forward", "model", "forward_states"),
          ("logits", "model", "compute_logits"), ("observe", "spec", "observe"), ("emit", "engine", "_emit"))


class StageTimers:
    """Timers around the engine's stages; `totals` holds seconds per stage."""

    def __init__(self, eng: LLM) -> None:
        e = eng.engine
        owners = {"spec": e.spec, "runner": e.runner, "model": e.runner.model, "engine": e}
        self.totals: dict[str, float] = collections.defaultdict(float)
        for name, owner, attr in STAGES:
            setattr(owners[owner], attr, self._timed(name, getattr(owners[owner], attr)))
        e.sampler = self._timed("sampler", e.sampler)
        self.steps = 0
        step = e.step

        def counted():
            self.steps += 1
            return step()
        e.step = counted

    def _timed(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - start
        return timed


def profile(eng: LLM, timers: StageTimers, prompts: list[list[int]], spec: SpecParams,
            params: SamplingParams) -> dict:
    """One generate() over all prompts at once -> tokens/s, steps, ms per step and per stage."""
    timers.totals.clear()
    timers.steps = 0
    start = time.perf_counter()
    outs = eng.generate(prompts, params, spec)
    seconds = time.perf_counter() - start
    steps = max(timers.steps, 1)
    return {"method": spec.method, "tok_per_s": sum(len(o.token_ids) for o in outs) / seconds, "steps": steps,
            "ms_per_step": seconds / steps * 1e3,
            "stages": {k: v / steps * 1e3 for k, v in sorted(timers.totals.items(), key=lambda kv: -kv[1])}}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", default="eagle3,mtp,draft", help="comma list; none runs first and last")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (the engine's max_num_seqs)")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests in all (default: --concurrency); more keep the batch full as they finish")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-set", default="docstring_to_code")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action="store_true", help="torch.compile the layer stacks (specserve --compile)")
    ap.add_argument("--policy", default="fixed", choices=["fixed", "goodput"],
                    help="speculation policy: fixed (every request drafts its k) or goodput (the server's default)")
    args = ap.parse_args(argv)
    eng = LLM(config=EngineConfig(model=args.model, kv_cache_memory_gb=args.kv_cache_memory_gb,
                                                 speculation_policy=args.policy, dtype=args.dtype,
                                                 max_num_seqs=args.concurrency,
                                                 compile=args.compile))
    tok = eng.engine.tokenizer
    rows = load_prompt_set(args.prompt_set)
    prompts = [tok.encode(rows[i % len(rows)]["prompt"]) for i in range(args.requests or args.concurrency)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
    methods = [m for m in args.methods.split(",") if m and m != "none"]
    missing = [m for m in methods if m not in eng.engine.spec.speculators]
    if missing:
        raise SystemExit(f"not loaded: {missing}; loaded: {eng.engine.spec.methods}")
    eng.generate(prompts[:2], SamplingParams(temperature=args.temperature, max_tokens=4, ignore_eos=True))  # warm-up
    timers = StageTimers(eng)
    print(f"threads {torch.get_num_threads()}, {len(prompts)} requests x {args.max_tokens} tokens, "
          f"{args.concurrency} at once, "
          f"T = {args.temperature}, k = {args.k}, prompt set {args.prompt_set}; ms per engine step")
    results = []
    for method in ["none", *methods, "none"]:
        r = profile(eng, timers, prompts, SpecParams() if method == "none" else SpecParams(method, args.k), params)
        results.append(r)
        print(f"{method:8s} {r['tok_per_s']:7.1f} tok/s {r['steps']:4d} steps {r['ms_per_step']:7.1f} ms/step | "
              + " ".join(f"{k} {v:.1f}" for k, v in r["stages"].items()), flush=True)
    return results


if __name__ == "__main__":
    main()
