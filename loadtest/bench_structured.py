"""Structured outputs: the grammar's cost and what it does to speculation, measured side by side.

On the embedded family, the 16 JSON-schema tasks of loadtest/prompts/json_schema.jsonl, greedy:

  grammar overhead    tokens/s constrained / unconstrained, no speculation, at batch 1 and with all
                      16 tasks in one batch (concurrency 16); the unconstrained arm decodes exactly as
                      many tokens per task as the constrained one produced (ignore_eos)
  speculation         each method's speedup over no speculation, constrained and unconstrained, and
                      their ratio (constrained speedup / unconstrained speedup)
  validity            share of constrained outputs that parse and validate against their schema
  compile time        p50 / p99 of compiling each schema with an empty cache

Arms are interleaved per task (order alternating per round), so a slow minute slows every arm alike.

    python -m loadtest.bench_structured --methods eagle3,hybrid,draft --rounds 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from loadtest.prompt_sets import load_prompt_set
from specserve import LLM
from specserve.grammar.compiler import GrammarCompiler
from specserve.sampling.params import SamplingParams, StructuredSpec
from specserve.server.config import EngineConfig
from specserve.speculators.base import SpecParams

NONE = SpecParams()


def arms_for(tasks, lengths: list[int]) -> dict[str, list[SamplingParams]]:
    return {"json": [SamplingParams(temperature=0.0, max_tokens=256,
                                    structured=StructuredSpec("json", json.dumps(t["schema"])))
                     for t in tasks],
            "free": [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]}


def timed(eng: LLM, prompts, params, spec) -> tuple[float, int, list]:
    start = time.perf_counter()
    outs = eng.generate(prompts, params, spec)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs), outs


def measure(eng: LLM, prompts, arms, specs: list[SpecParams], rounds: int, batch: bool) -> dict:
    """(arm, method) -> [seconds, tokens]; every constrained output is kept for validation."""
    keys = [(arm, spec) for spec in specs for arm in arms]
    totals = {(arm, spec.method): [0.0, 0] for arm, spec in keys}
    outputs = []
    for r in range(rounds):
        groups = [list(range(len(prompts)))] if batch else [[i] for i in range(len(prompts))]
        for g, idx in enumerate(groups):
            order = keys if (r + g) % 2 == 0 else keys[::-1]
            for arm, spec in order:
                secs, toks, outs = timed(eng, [prompts[i] for i in idx], [arms[arm][i] for i in idx], spec)
                totals[(arm, spec.method)][0] += secs
                totals[(arm, spec.method)][1] += toks
                if arm == "json":
                    outputs += list(zip(idx, outs))
    return {"totals": totals, "outputs": outputs}


def tok_s(totals, arm, method) -> float:
    secs, toks = totals[(arm, method)]
    return toks / secs


def compile_times(eng: LLM, tasks) -> list[float]:
    fresh = GrammarCompiler(eng.engine.grammars.backend)
    for t in tasks:
        fresh.compile(StructuredSpec("json", json.dumps(t["schema"])))
    return fresh.compile_seconds


def report(name: str, result: dict, methods: list[str]) -> list[dict]:
    totals = result["totals"]
    free0, json0 = tok_s(totals, "free", "none"), tok_s(totals, "json", "none")
    print(f"{name}: none  free {free0:7.1f} tok/s  json {json0:7.1f} tok/s  overhead ratio {json0 / free0:5.3f}")
    rows = [{"batch": name, "method": "none", "free_tok_s": free0, "json_tok_s": json0, "ratio": json0 / free0}]
    for m in methods:
        sf, sj = tok_s(totals, "free", m) / free0, tok_s(totals, "json", m) / json0
        print(f"{name}: {m:7s} speedup free {sf:5.2f}x  json {sj:5.2f}x  json/free {sj / sf:5.3f}")
        rows.append({"batch": name, "method": m, "speedup_free": sf, "speedup_json": sj, "ratio": sj / sf})
    return rows


def validity(tasks, outputs) -> tuple[int, int]:
    ok = 0
    for i, out in outputs:
        try:
            jsonschema.validate(json.loads(out.text), tasks[i]["schema"])
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok, len(outputs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--methods", default="eagle3,hybrid,draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    eng = LLM(config=EngineConfig(dtype=args.dtype, speculation_policy="fixed", kv_cache_memory_gb=0.5))
    tasks = load_prompt_set("json_schema")
    tok = eng.engine.tokenizer
    prompts = [tok.encode(t["prompt"]) for t in tasks]
    methods = [m for m in args.methods.split(",") if m in eng.methods]
    specs = [NONE] + [SpecParams(m, 1 if m == "mtp" else args.k, adaptive=False) for m in methods]
    warm = eng.generate(prompts, arms_for(tasks, [1] * len(tasks))["json"])     # warm-up + lengths
    lengths = [len(o.token_ids) for o in warm]
    arms = arms_for(tasks, lengths)
    print(f"{len(tasks)} JSON-schema tasks, greedy, {sum(lengths)} constrained tokens per pass, dtype {args.dtype}, "
          f"{args.rounds} interleaved rounds, k = {args.k}")
    b1 = measure(eng, prompts, arms, specs, args.rounds, batch=False)
    c16 = measure(eng, prompts, arms, specs, args.rounds, batch=True)
    rows = report("batch 1", b1, methods) + report("concurrency 16", c16, methods)
    ok, total = validity(tasks, b1["outputs"] + c16["outputs"])
    secs = sorted(compile_times(eng, tasks))
    p99 = secs[min(len(secs) - 1, round(0.99 * (len(secs) - 1)))]
    print(f"valid: {ok}/{total} ({100 * ok / total:.1f} %)   compile p50 {1e3 * statistics.median(secs):.2f} ms, "
          f"p99 {1e3 * p99:.2f} ms")
    return {"rows": rows, "valid": ok, "total": total, "compile_s": secs}


if __name__ == "__main__":
    main()
