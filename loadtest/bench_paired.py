"""HF generate() vs our server, batch 1, interleaved per prompt: the drift-robust form of bench_baselines.

  python -m loadtest.bench_paired --dtype bfloat16 --compile          # embedded family, greedy, k = 4

bench_baselines runs each side over all prompts before the other (a minute or more per side); on a VM whose
speed moves by tens of percent within minutes the ratio then depends on which side met the slow minute
(HF prompt lookup measured 269 and 198 tok/s in two rounds of one such run). Here every arm runs on the
same prompt back to back, in forward order on even prompts and reverse order on odd ones, so all arms share
each minute of the machine. Arms: HF plain / prompt lookup / assisted, ours through HTTP for every loaded
method (aiohttp streaming client, loadtest/sse_client.py), and our engine without HTTP (none, ngram). Each
request writes exactly max_tokens tokens (HF min_new_tokens, ours ignore_eos); an arm's tok/s is its summed
tokens ÷ summed request seconds (HF: the generate() call; HTTP: send to last chunk; offline: generate()).
Printed: bench_baselines' two ratio tables (through HTTP, and the engine alone) and the per-prompt spread.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from loadtest import bench_baselines as bb
from loadtest.prompt_sets import load_prompt_set
from loadtest.request_builder import build_request
from loadtest.server_proc import offered_methods, started_server
from loadtest.sse_client import stream_completion

RESULTS = Path(__file__).resolve().parent / "results"


async def _http_one(url: str, model: str, prompt: str, method: str, k: int, max_tokens: int) -> tuple[int, float]:
    import aiohttp
    opts = SimpleNamespace(method=method, k=k, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    body = build_request(model, {"prompt": prompt}, opts)          # the request loadtest.serve sends
    async with aiohttp.ClientSession() as session:
        rec = await stream_completion(session, f"{url}/v1/completions", body, {})
    if not rec.ok:
        raise RuntimeError(f"ours {method}: {rec.error}")
    return rec.output_tokens, rec.e2el


def arms(url: str, model: str, hf, eng, methods: list[str], offline_methods: list[str], k: int,
         max_tokens: int) -> dict[tuple[str, str], object]:
    """(who, method) -> run(prompt) -> (tokens, seconds)."""
    tok, target, modes = hf
    out: dict[tuple[str, str], object] = {}
    for mode, kw in modes.items():
        out[("hf", mode)] = lambda p, kw=kw: bb.hf_generate(tok, target, p, max_tokens, kw)
    for m in ["none", *methods]:
        out[("ours", m)] = lambda p, m=m: asyncio.run(_http_one(url, model, p, m, k, max_tokens))
    for m in offline_methods:
        out[("ours-offline", m)] = lambda p, m=m: bb.offline_generate(eng, p, m, k, max_tokens)
    return out


def run_paired(runs: dict, sets: list[str], n: int, rounds: int, log=print) -> tuple[list[dict], list[dict]]:
    """Every arm on every prompt, order alternating per prompt -> (pooled rows, per-request rows)."""
    names = list(runs)
    per_request = []
    for rnd in range(rounds):
        for pset in sets:
            for i, row in enumerate(load_prompt_set(pset, n, 0)):
                order = names if (i + rnd) % 2 == 0 else names[::-1]
                for who, method in order:
                    tokens, seconds = runs[(who, method)](row["prompt"])
                    per_request.append({"who": who, "method": method, "prompt_set": pset, "prompt": i,
                                        "round": rnd, "output_tokens": tokens, "seconds": seconds})
                log(f"  {pset} prompt {i + 1}/{n} round {rnd + 1}: " + " ".join(
                    f"{r['who']}:{r['method']}={r['output_tokens'] / r['seconds']:.0f}"
                    for r in per_request[-len(names):]))
    pooled: dict[tuple, dict] = {}
    for r in per_request:
        p = pooled.setdefault((r["who"], r["method"], r["prompt_set"]),
                              {"who": r["who"], "method": r["method"], "prompt_set": r["prompt_set"],
                               "output_tokens": 0, "seconds": 0.0})
        p["output_tokens"] += r["output_tokens"]
        p["seconds"] += r["seconds"]
    for p in pooled.values():
        p["tok_per_s"] = p["output_tokens"] / p["seconds"]
    return list(pooled.values()), per_request


def prompt_spread(per_request: list[dict], ours: tuple[str, str], hf_mode: str) -> dict[str, list[float]]:
    """Per prompt set: ours ÷ HF tok/s on each (prompt, round) — how much a single pair can say."""
    speed = {(r["who"], r["method"], r["prompt_set"], r["prompt"], r["round"]): r["output_tokens"] / r["seconds"]
             for r in per_request}
    out: dict[str, list[float]] = {}
    for (who, method, pset, i, rnd), v in speed.items():
        if (who, method) == ours and ("hf", hf_mode, pset, i, rnd) in speed:
            out.setdefault(pset, []).append(v / speed[("hf", hf_mode, pset, i, rnd)])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bb.add_common_args(ap)
    ap.add_argument("--url", default=None, help="a running server on the same target (default: start one)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every prompt's arms (order alternating)")
    args = ap.parse_args(argv)
    server_args = bb.our_server_args(args)
    torch.set_num_threads(args.threads)
    hf = bb.hf_models(args.models, args.k, args.dtype)
    eng = bb.offline_engine(args.models, args.threads, args.dtype, args.compile)
    with started_server(args.url, server_args) as url:
        import httpx
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        methods = args.methods.split(",") if args.methods else [m for m in offered_methods(url) if m != "prediction"]
        runs = arms(url, model, hf, eng, methods, args.offline_methods.split(","), args.k, args.max_tokens)
        rows, per_request = run_paired(runs, args.prompt_sets, args.prompts, args.rounds)
    table, offline_table = bb.ratios(rows), bb.ratios(rows, who="ours-offline")
    bb.print_table(table)
    print("\nthe engine alone (no HTTP on either side):")
    bb.print_table(offline_table)
    for r in table:
        spread = prompt_spread(per_request, ("ours", r["ours_best"]), r["hf"]).get(r["prompt_set"], [])
        if spread:
            print(f"{r['prompt_set']} {r['ours_best']} ÷ HF {r['hf']} per prompt: median "
                  f"{statistics.median(spread):.2f}, range {min(spread):.2f}-{max(spread):.2f}")
    print("\nserving path cost at batch 1: " + "; ".join(bb.serving_cost(rows)))
    out = RESULTS / time.strftime("paired-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    command = "python -m loadtest.bench_paired " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": command, "machine": platform.platform(), "torch": torch.__version__,
            "threads": args.threads, "dtype": args.dtype, "compile": args.compile, "rounds": args.rounds}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "per_request": per_request,
                                                 "ratios": table, "ratios_offline": offline_table}, indent=2))
    print(f"wrote {out / 'results.json'}")
    return {"dir": str(out), "ratios": table, "ratios_offline": offline_table, "rows": rows}


if __name__ == "__main__":
    main()
