"""Baselines side by side in one run: Hugging Face generate() on the same models vs our server, batch 1.

  make bench-baselines          # = python -m loadtest.bench_baselines (embedded family, greedy, fp32)
  python -m loadtest.bench_baselines --dtype bfloat16          # both sides in bf16 (CPUs with bf16 units)
  python -m loadtest.bench_baselines --prompts 4 --max-tokens 64 --prompt-sets code_completion   # quick

HF rows: plain generate(), assistant_model= (the draft model) and prompt_lookup_num_tokens= (n-gram), each
on the same prompts with the same new-token count (HF: min_new_tokens = max_new_tokens; ours: ignore_eos).
Our rows: a server this script starts (same dtype and thread count), driven by loadtest.serve's streaming
client at concurrency 1, one row per speculation method the server offers. HF runs in this process while
the server idles (its engine thread sleeps), so the two never compete for the CPU. With --rounds R (default
2) the whole comparison runs R times, in the order HF, ours, ours offline in odd rounds and reversed in even
ones, and each row pools
tokens and seconds over the rounds: on a VM whose speed drifts by tens of percent within minutes, a fixed
order alone moved the ratios by ~20 %. Printed: output tokens/s and the
ratios ours ÷ HF — plain vs none, draft vs assisted, ngram vs prompt lookup, and our best vs each.
"ours offline" rows: our engine in this process without HTTP (specserve.LLM; none and ngram by default, same
prompts, a third side of every round), so the cost of the serving path (engine thread hand-off, detokenizing,
SSE, the client on the same cores) shows as HTTP none ÷ offline none, and a second table compares the engine
alone with HF generate(), neither behind HTTP.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from loadtest.prompt_sets import load_prompt_set
from loadtest.serve import amain as serve_amain
from loadtest.server_proc import offered_methods, started_server

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
HF_VS_OURS = {"plain": "none", "assisted": "draft", "prompt_lookup": "ngram"}


def hf_models(models: Path, k: int, dtype: str):
    """(tokenizer, target, {mode: generate() kwargs}): plain, prompt lookup and, with a draft, assisted."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(str(models / "target"))
    target = LlamaForCausalLM.from_pretrained(str(models / "target"), torch_dtype=getattr(torch, dtype)).eval()
    modes = {"plain": {}, "prompt_lookup": {"prompt_lookup_num_tokens": k}}
    if (models / "draft" / "config.json").is_file():
        draft = LlamaForCausalLM.from_pretrained(str(models / "draft"), torch_dtype=getattr(torch, dtype)).eval()
        # HF's assisted decoding adapts k by default; fix it at ours
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        modes["assisted"] = {"assistant_model": draft}
    return tok, target, modes


def hf_generate(tok, target, prompt: str, max_tokens: int, kw: dict) -> tuple[int, float]:
    """One greedy generate() of exactly max_tokens new tokens -> (new tokens, seconds)."""
    ids = tok(prompt, return_tensors="pt").input_ids
    t0 = time.perf_counter()
    with torch.no_grad():
        out = target.generate(ids, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              pad_token_id=tok.pad_token_id, **kw)
    return out.shape[1] - ids.shape[1], time.perf_counter() - t0


def hf_rows(models: Path, sets: list[str], n: int, max_tokens: int, k: int, dtype: str) -> list[dict]:
    tok, target, modes = hf_models(models, k, dtype)
    rows = []
    for pset in sets:
        prompts = [r["prompt"] for r in load_prompt_set(pset, n, 0)]
        for mode, kw in modes.items():
            tokens, seconds = 0, 0.0
            for p in prompts:
                t, sec = hf_generate(tok, target, p, max_tokens, kw)
                tokens, seconds = tokens + t, seconds + sec
            rows.append({"who": "hf", "method": mode, "prompt_set": pset, "output_tokens": tokens,
                         "seconds": seconds, "tok_per_s": tokens / seconds})
            print(f"hf {mode:14s} {pset:18s} {tokens / seconds:7.1f} tok/s", flush=True)
    return rows


def offline_engine(models: Path, threads: int, dtype: str, compile_: bool = False):
    from specserve import LLM
    from specserve.server.config import EngineConfig
    return LLM(config=EngineConfig(model=str(models / "target"), dtype=dtype, num_threads=threads,
                                                  kv_cache_memory_gb=0.25, compile=compile_))


def offline_generate(eng, prompt: str, method: str, k: int, max_tokens: int) -> tuple[int, float]:
    """One greedy request of exactly max_tokens on the engine without HTTP -> (tokens, seconds)."""
    from specserve.sampling.params import SamplingParams
    from specserve.speculators.base import SpecParams
    ids = eng.engine.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = eng.generate([ids], params, SpecParams(method=method, num_speculative_tokens=0 if method == "none" else k))
    return len(out[0].token_ids), time.perf_counter() - t0


def offline_rows(eng, sets: list[str], n: int, max_tokens: int, k: int,
                 methods: tuple[str, ...] = ("none",)) -> list[dict]:
    """Our engine without the server, one prompt at a time as HF runs: greedy, each method at k."""
    rows = []
    for pset in sets:
        for method in methods:
            tokens, seconds = 0, 0.0
            for r in load_prompt_set(pset, n, 0):
                t, sec = offline_generate(eng, r["prompt"], method, k, max_tokens)
                tokens, seconds = tokens + t, seconds + sec
            rows.append({"who": "ours-offline", "method": method, "prompt_set": pset, "output_tokens": tokens,
                         "seconds": seconds, "tok_per_s": tokens / seconds})
            print(f"ours offline {method:7s} {pset:18s} {tokens / seconds:7.1f} tok/s", flush=True)
    return rows


def our_rows(url: str, sets: list[str], n: int, max_tokens: int, k: int, methods: list[str]) -> list[dict]:
    rows = []
    for pset in sets:
        for method in ["none", *methods]:
            ns = SimpleNamespace(url=url, model=None, api_key=None, method=method, k=k, concurrency=[1],
                                 num_prompts=n, request_rate=None, prompt_set=pset, max_tokens=max_tokens,
                                 temperature=0.0, ignore_eos=True, goodput={}, seed=0, timeout=900, quiet=True)
            res = asyncio.run(serve_amain(ns))[0]
            acc = res["speculation"].get(method, {}).get("mean_acceptance_length")
            rows.append({"who": "ours", "method": method, "prompt_set": pset, "tok_per_s": res["output_throughput"],
                         "output_tokens": res["total_output_tokens"], "seconds": res["duration_s"],
                         "mean_acceptance_length": acc, "failures": res.get("failed", 0)})
            print(f"ours {method:12s} {pset:18s} {res['output_throughput']:7.1f} tok/s"
                  + (f"  acceptance length {acc:.2f}" if acc else ""), flush=True)
    return rows


def pool_rounds(rows: list[dict]) -> list[dict]:
    """One row per (who, method, prompt set): tokens and seconds summed over the rounds, tok/s from the sums
    (acceptance length: the mean of the rounds'; failures: summed)."""
    pooled: dict[tuple, dict] = {}
    for r in rows:
        key = (r["who"], r["method"], r["prompt_set"])
        p = pooled.setdefault(key, {"who": r["who"], "method": r["method"], "prompt_set": r["prompt_set"],
                                    "output_tokens": 0, "seconds": 0.0, "rounds": 0})
        p["output_tokens"] += r["output_tokens"]
        p["seconds"] += r["seconds"]
        p["rounds"] += 1
        if r.get("mean_acceptance_length"):
            p.setdefault("_acc", []).append(r["mean_acceptance_length"])
        if "failures" in r:
            p["failures"] = p.get("failures", 0) + r["failures"]
    for p in pooled.values():
        p["tok_per_s"] = p["output_tokens"] / p["seconds"]
        if "_acc" in p:
            acc = p.pop("_acc")
            p["mean_acceptance_length"] = sum(acc) / len(acc)
    return list(pooled.values())


def ratios(rows: list[dict], who: str = "ours") -> list[dict]:
    """Per prompt set and HF mode: `who`'s same method and best method ÷ HF (who: "ours" through HTTP, or
    "ours-offline", the engine alone)."""
    out = []
    for pset in sorted({r["prompt_set"] for r in rows}):
        hf = {r["method"]: r["tok_per_s"] for r in rows if r["who"] == "hf" and r["prompt_set"] == pset}
        ours = {r["method"]: r["tok_per_s"] for r in rows if r["who"] == who and r["prompt_set"] == pset}
        if not ours:
            continue
        best = max(ours, key=ours.get)
        for hf_mode, tps in hf.items():
            same = HF_VS_OURS[hf_mode]
            out.append({"prompt_set": pset, "hf": hf_mode, "hf_tok_per_s": tps,
                        "ours_same": same, "ratio_same": ours.get(same, float("nan")) / tps,
                        "ours_best": best, "ratio_best": ours[best] / tps})
    return out


def serving_cost(rows: list[dict]) -> list[str]:
    """Per prompt set: our plain decoding through HTTP ÷ the same engine offline."""
    lines = []
    for pset in sorted({r["prompt_set"] for r in rows}):
        get = {(r["who"], r["method"]): r["tok_per_s"] for r in rows if r["prompt_set"] == pset}
        if ("ours", "none") in get and ("ours-offline", "none") in get:
            lines.append(f"{pset}: HTTP none {get[('ours', 'none')]:.1f} tok/s ÷ offline none "
                         f"{get[('ours-offline', 'none')]:.1f} = "
                         f"{get[('ours', 'none')] / get[('ours-offline', 'none')]:.2f}")
    return lines


def print_table(table: list[dict]) -> None:
    print(
        f"\n{'prompt set':18s} {'HF mode':14s} {'HF tok/s':>9s} {'ours (same)':>14s} {'ratio':>6s}"
        f" {'ours (best)':>14s} {'ratio':>6s}"
    )
    for r in table:
        print(
            f"{r['prompt_set']:18s} {r['hf']:14s} {r['hf_tok_per_s']:9.1f} {r['ours_same']:>14s}"
            f" {r['ratio_same']:6.2f} {r['ours_best']:>14s} {r['ratio_best']:6.2f}"
        )


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The options bench_baselines and bench_paired share (models, prompts, k, threads, dtype, methods)."""
    ap.add_argument("--models", type=Path, default=REPO / "models", help="the embedded family's directory")
    ap.add_argument("--prompt-sets", type=lambda s: s.split(","), default=["code_completion", "code_editing"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both sides, HF and ours")
    ap.add_argument("--methods", default=None, help="our methods besides none (default: all loaded but prediction)")
    ap.add_argument("--compile", action="store_true", help="ours with --compile (torch.compile'd layer stacks)")
    ap.add_argument(
        "--server-args",
        default="",
        help="extra flags for our server, after the ones that match HF's "
        "setup (they win where they repeat one, e.g. --num-threads)",
    )
    ap.add_argument(
        "--offline-methods",
        default="none,ngram",
        help="methods the engine runs without HTTP (none is needed for the serving-path cost)",
    )


def our_server_args(args) -> list[str]:
    """Our server on the same target, dtype and threads, with every drafter the models directory holds."""
    if not (args.models / "target" / "config.json").is_file():
        raise SystemExit(f"{args.models}/target is missing: train the embedded family first (make train-embedded)")
    server_args = ["--model", str(args.models / "target"), "--dtype", args.dtype, "--num-threads", str(args.threads)]
    server_args += ["--compile"] if args.compile else []
    for flag, name in (("--draft-model", "draft"), ("--eagle3", "eagle3")):
        if (args.models / name / "config.json").is_file():
            server_args += [flag, str(args.models / name)]
    return server_args + args.server_args.split()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--rounds", type=int, default=2, help="repeat HF and ours, alternating which goes first")
    args = ap.parse_args(argv)
    server_args = our_server_args(args)
    torch.set_num_threads(args.threads)
    eng = offline_engine(args.models, args.threads, args.dtype, args.compile)
    offline_methods = tuple(args.offline_methods.split(","))
    rows = []
    with started_server(None, server_args) as url:
        methods = args.methods.split(",") if args.methods else [m for m in offered_methods(url) if m != "prediction"]
        sides = {
            "HF": lambda: hf_rows(args.models, args.prompt_sets, args.prompts, args.max_tokens, args.k, args.dtype),
            "ours": lambda: our_rows(url, args.prompt_sets, args.prompts, args.max_tokens, args.k, methods),
            "ours offline": lambda: offline_rows(
                eng, args.prompt_sets, args.prompts, args.max_tokens, args.k, offline_methods
            ),
        }
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
            print(f"-- round {rnd + 1} of {args.rounds}: " + ", ".join(order), flush=True)
            for name in order:
                rows += [dict(r, round=rnd) for r in sides[name]()]
    per_round = rows
    rows = pool_rounds(rows)
    table = ratios(rows)
    print_table(table)
    offline_table = ratios(rows, who="ours-offline")
    print("\nthe engine alone (no HTTP on either side):")
    print_table(offline_table)
    if args.rounds > 1:
        spread = {}
        for rnd in range(args.rounds):
            for r in ratios([x for x in per_round if x.get("round") == rnd]):
                spread.setdefault((r["prompt_set"], r["hf"]), []).append(r["ratio_best"])
        print(
            "ours best ÷ HF per round: "
            + "; ".join(f"{pset} {mode} " + "/".join(f"{v:.2f}" for v in vals) for (pset, mode), vals in spread.items())
        )
    print("\nserving path cost at batch 1: " + "; ".join(serving_cost(rows)))
    out = RESULTS / time.strftime("baselines-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    command = "python -m loadtest.bench_baselines " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {
        "command": command,
        "machine": platform.platform(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "threads": args.threads,
        "dtype": args.dtype,
        "compile": args.compile,
        "rounds": args.rounds,
    }
    (out / "results.json").write_text(
        json.dumps(
            {"meta": meta, "rows": rows, "per_round": per_round, "ratios": table, "ratios_offline": offline_table},
            indent=2,
        )
    )
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
