"""Speculative benchmark: tokens/s per method vs none, batch 1, greedy, side by side in one run.

Workloads: (a) code editing (output mostly repeats the input) with ngram, with an exact prediction
(the model's own greedy output) and with the user's expected edit as prediction; (b) free completion.
Also the verification cost v(k) = target forward over k+1 tokens / over 1 token at the same context,
and for model-based methods (draft, eagle3, mtp, when loaded) the cost ratio c = one draft step /
one target decode step, with the speedup the model predicts: E[tokens/step] / (k*c + v(k)).

Run: python -m loadtest.bench_spec_core [--model DIR] [--dtype bfloat16] [--k 4]
With no --model it uses the embedded target if present, else a random ~30M Llama (acceptance on a
random model only reflects its loops; the ratios mostly show the cost side).
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

from loadtest.prompt_sets import load_prompt_set
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.engine.spec_policy import GoodputPolicy, calibrated_policy
from specserve.speculators.base import SpecParams


def run(eng: LLM, prompts, spec: SpecParams, new: int, preds=None,
        temperature: float = 0.0) -> tuple[float, list]:
    total_tokens, total_time, outs = 0, 0.0, []
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=new, seed=1000 + i if temperature else None)
        t = time.perf_counter()
        out = eng.generate([p], params, spec, [preds[i]] if preds else None)[0]
        total_time += time.perf_counter() - t
        total_tokens += len(out.token_ids)
        outs.append(out)
    return total_tokens / total_time, outs


class ProposeTimer:
    """Wraps a speculator's propose() to measure seconds per draft step (k steps per call)."""

    def __init__(self, spec) -> None:
        self.spec, self.inner = spec, spec.propose
        self.seconds, self.steps = 0.0, 0
        spec.propose = self

    def __call__(self, requests, ks):
        t = time.perf_counter()
        out = self.inner(requests, ks)
        self.seconds += time.perf_counter() - t
        self.steps += max(ks)
        return out

    def restore(self) -> float:
        self.spec.propose = self.inner
        return self.seconds / self.steps if self.steps else float("nan")


def mean_acceptance(outs) -> float:
    drafts = sum(o.spec_stats.num_drafts for o in outs)
    acc = sum(o.spec_stats.num_accepted_tokens for o in outs)
    return 1.0 + acc / drafts if drafts else 1.0


def verify_costs(eng: LLM, context: int, ks: list[int], reps: int = 20) -> dict[int, float]:
    """v(k): seconds of one target forward verifying k drafts / seconds with k = 0, at `context` tokens.
    Uses ModelRunner.time_verify_step's scratch blocks, so it runs before any request."""
    runner = eng.engine.runner
    plain = runner.time_verify_step(1, 1, context, reps)
    return {k: runner.time_verify_step(1, k + 1, context, reps) / plain for k in ks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--ks", type=lambda x: [int(v) for v in x.split(",")], default=[1, 2, 4, 6],
                    help="k values for the model-based methods")
    ap.add_argument("--temperatures", type=lambda x: [float(v) for v in x.split(",")], default=[0.0, 0.8],
                    help="sampling temperatures for the model-based table (seeded per prompt when > 0)")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--eagle3", default=None)
    ap.add_argument("--compile", action="store_true", help="torch.compile the layer stacks (specserve --compile)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    eng = LLM(config=EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_gb=0.5,
                                                 draft_model=args.draft_model, eagle3=args.eagle3,
                                                 speculation_policy="fixed", compile=args.compile))  # k means k
    # both before any request: they time forwards on scratch KV blocks
    calibration = calibrated_policy(eng.engine.runner, 64).calibration
    vk = verify_costs(eng, context=256, ks=sorted({1, 2, 4, 8, args.k, *args.ks}))
    tok = eng.engine.tokenizer
    edits = load_prompt_set("code_editing", args.num_prompts)
    edit_prompts = [tok.encode(r["prompt"]) for r in edits]
    user_preds = [tok.encode(r["prediction"]) for r in edits]
    free = [tok.encode(r["prompt"]) for r in load_prompt_set("code_completion", args.num_prompts)]
    k = args.k
    print(f"model: {args.model or 'default'}  dtype: {eng.engine.runner.dtype}  k={k}  "
          f"threads={torch.get_num_threads()}  new tokens={args.new_tokens}")
    print(f"{'workload':14} {'method':22} {'tok/s':>8} {'vs none':>8} {'accept len':>10}")
    for name, prompts in (("code editing", edit_prompts), ("free completion", free)):
        base, base_outs = run(eng, prompts, SpecParams(), args.new_tokens)
        rows = [("none", base, base_outs)]
        tps, outs = run(eng, prompts, SpecParams("ngram", k), args.new_tokens)
        rows.append((f"ngram k={k}", tps, outs))
        exact = [o.token_ids for o in base_outs]
        tps, outs = run(eng, prompts, SpecParams("prediction", k), args.new_tokens, exact)
        rows.append((f"prediction exact k={k}", tps, outs))
        if name == "code editing":
            tps, outs = run(eng, prompts, SpecParams("prediction", k), args.new_tokens, user_preds)
            rows.append((f"prediction user k={k}", tps, outs))
        for method, tps, outs in rows:
            assert [o.token_ids for o in outs] == exact, f"{method} changed greedy output"
            print(f"{name:14} {method:22} {tps:8.1f} {tps / base:8.2f} {mean_acceptance(outs):10.2f}")
    print("verification cost v(k) at context 256: " + "  ".join(f"v({k})={v:.2f}" for k, v in vk.items()))
    model_based(eng, free, args, vk, calibration)


def model_based(eng: LLM, prompts, args, vk: dict[int, float],
                calibration: list[tuple[int, float]]) -> None:
    """draft / eagle3 / mtp when loaded: speedup, acceptance, c, and the predicted speedup."""
    methods = [m for m in ("draft", "eagle3", "mtp") if m in eng.engine.spec.speculators]
    if not methods:
        print("model-based speculators: none loaded (serve the embedded family or pass flags)")
        return
    print("predicted = E[tokens/step] / (k*c + v(k)); c = one draft step (propose time / k) / one plain step")
    print("vs none: against plain decoding of the same prompts measured just before the row (this VM's speed")
    print("drifts by tens of percent within minutes, so each row gets its own baseline)")
    print(f"{'T':>4} {'method':10} {'k':>3} {'tok/s':>8} {'none':>7} {'vs none':>8} {'accept len':>10} {'c':>6} "
          f"{'predicted':>9} {'meas/pred':>9}")
    for temp in args.temperatures:
        base, base_outs = run(eng, prompts, SpecParams(), args.new_tokens, temperature=temp)   # 1/base = a step
        print(f"{temp:4.1f} {'none':10} {0:3d} {base:8.1f} {base:7.1f} {1.0:8.2f}")
        for m in methods:
            for k in args.ks:
                base, _ = run(eng, prompts, SpecParams(), args.new_tokens, temperature=temp)
                timer = ProposeTimer(eng.engine.spec.speculators[m])
                tps, outs = run(eng, prompts, SpecParams(m, k), args.new_tokens, temperature=temp)
                c = timer.restore() / (1.0 / base)
                same = "" if temp else ("  same as none" if [o.token_ids for o in outs] ==
                                        [o.token_ids for o in base_outs] else "  DIFFERS FROM none")
                tau = mean_acceptance(outs)
                pred = tau / (k * c + vk[k])
                print(f"{temp:4.1f} {m:10} {k:3d} {tps:8.1f} {base:7.1f} {tps / base:8.2f} {tau:10.2f} {c:6.3f} "
                      f"{pred:9.2f} {tps / base / pred:9.2f}{same}", flush=True)
            # --speculation-policy goodput: k as a ceiling, cut per step (calibrated at start, learns as it runs)
            kmax = max(args.ks)
            policy = GoodputPolicy()
            policy.calibrate(calibration)
            base, _ = run(eng, prompts, SpecParams(), args.new_tokens, temperature=temp)
            eng.engine.spec.policy = policy
            tps, outs = run(eng, prompts, SpecParams(m, kmax), args.new_tokens, temperature=temp)
            eng.engine.spec.policy = None
            cut = sum(o.spec_stats.num_steps_k_reduced for o in outs)
            print(f"{temp:4.1f} {m:10} {'<=' + str(kmax):>3} {tps:8.1f} {base:7.1f} {tps / base:8.2f} "
                  f"{mean_acceptance(outs):10.2f}  goodput policy, {cut} steps with k cut", flush=True)


if __name__ == "__main__":
    main()
