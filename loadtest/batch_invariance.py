"""Is greedy text independent of batching and speculation in this dtype and attention backend?

    python -m loadtest.batch_invariance --dtype bfloat16 [--attention-backend paged|sdpa] [--kv-cache-dtype auto]
        [--device cuda --attention-backend triton|sdpa]

Each prompt (8 per set: code_editing, code_completion, prose) is decoded alone without speculation; then
all of them at once, once per method (k = 4, the goodput policy off so every draft is verified). Prints,
per method, the prompts whose tokens differ from their lone plain decoding. With the paged kernel none
should; with bf16 K/V under SDPA, rows change with the batch even without drafts.
"""
from __future__ import annotations

import argparse
import time

from loadtest.prompt_sets import load_prompt_set
from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.speculators.base import SpecParams

METHODS = ("none", "ngram", "draft", "eagle3", "eagle", "mtp", "suffix", "hybrid")


def differing(eng: LLM, prompts: list[list[int]], methods: list[str], new: int) -> dict[str, list[int]]:
    """method -> indices of the prompts whose batched output differs from the prompt decoded alone."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    alone = [eng.generate([p], params, SpecParams())[0].token_ids for p in prompts]
    out = {}
    for m in methods:
        spec = SpecParams() if m == "none" else SpecParams(method=m, num_speculative_tokens=4, adaptive=False)
        outs = eng.generate(prompts, params, [spec] * len(prompts))
        out[m] = [i for i, o in enumerate(outs) if o.token_ids != alone[i]]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--per-set", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args(argv)
    start = time.perf_counter()
    eng = LLM(config=EngineConfig(dtype=args.dtype, device=args.device, kv_cache_memory_gb=0.3, seed=0,
                                  attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype))
    tok = eng.engine.tokenizer
    prompts = [tok.encode(r["prompt"]) for s in ("code_editing", "code_completion", "prose")
               for r in load_prompt_set(s)[:args.per_set]]
    methods = [m for m in args.methods.split(",") if m in eng.methods]
    kv = eng.engine.runner.kv_caches[0][0].dtype
    print(f"{len(prompts)} prompts x {args.new_tokens} tokens, dtype {args.dtype}, K/V {kv}, "
          f"attention {args.attention_backend}")
    result = differing(eng, prompts, methods, args.new_tokens)
    for m, idx in result.items():
        print(f"{m:8} batch {len(prompts)}: {len(idx)} differ from alone {idx if idx else ''}")
    print(f"differing: {sum(map(len, result.values()))} of {len(prompts) * len(methods)} "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
