"""Server flags A/B at batch 1: several of our servers, each method through HTTP, and the engine without HTTP.

  python -m loadtest.bench_server_ab --dtype bfloat16 --compile --config thread= \\
      --config "process=--engine-process" --methods none,ngram --prompts 6 --rounds 2

Every `--config NAME=FLAGS` is one server (our_server_args plus FLAGS), started one after another before
the run (each is up once /health says ready, i.e. its engine is built). Arms: each server x each method, and
the offline engine x each method (the reference: what the serving path costs). Like bench_paired, all arms
run on each prompt back to back, order reversed on the next prompt, so a drifting VM slows every arm alike.
Idle servers cost nothing measurable (0.3 % CPU). Printed: tok/s per arm and ÷ the offline engine.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import httpx
import torch

from loadtest import bench_baselines as bb
from loadtest.bench_paired import _http_one, run_paired
from loadtest.server_proc import started_server

RESULTS = Path(__file__).resolve().parent / "results"


def parse_config(text: str) -> tuple[str, list[str]]:
    """'process=--engine-process --num-threads 1' -> ('process', ['--engine-process', '--num-threads', '1'])."""
    name, sep, flags = text.partition("=")
    if not sep or not name or name == "offline":
        raise argparse.ArgumentTypeError(f"--config wants NAME=FLAGS (NAME not 'offline'), got {text!r}")
    return name, flags.split()


def relative_to_offline(rows: list[dict]) -> list[dict]:
    """Per (prompt set, method): every server's tok/s and its ratio to the offline engine's."""
    offline = {(r["prompt_set"], r["method"]): r["tok_per_s"] for r in rows if r["who"] == "offline"}
    out = []
    for r in rows:
        ref = offline.get((r["prompt_set"], r["method"]))
        out.append({**r, "vs_offline": r["tok_per_s"] / ref if ref else None})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bb.add_common_args(ap)
    ap.add_argument("--config", action="append", type=parse_config, required=True, metavar="NAME=FLAGS",
                    help="one server: a name and the flags it adds (repeat; FLAGS may be empty)")
    ap.add_argument("--rounds", type=int, default=2, help="repeat every prompt's arms (order alternating)")
    args = ap.parse_args(argv)
    if len({name for name, _ in args.config}) != len(args.config):
        raise SystemExit("--config names must differ")
    methods = (args.methods or "none,ngram").split(",")
    torch.set_num_threads(args.threads)
    eng = bb.offline_engine(args.models, args.threads, args.dtype, args.compile)
    with contextlib.ExitStack() as stack:
        runs = {}
        for name, flags in args.config:
            url = stack.enter_context(started_server(None, bb.our_server_args(args) + flags))
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            for m in methods:
                runs[(name, m)] = (lambda p, url=url, model=model, m=m:
                                   asyncio.run(_http_one(url, model, p, m, args.k, args.max_tokens)))
        for m in methods:
            runs[("offline", m)] = lambda p, m=m: bb.offline_generate(eng, p, m, args.k, args.max_tokens)
        rows, per_request = run_paired(runs, args.prompt_sets, args.prompts, args.rounds)
    rows = relative_to_offline(rows)
    print(f"\n{'prompt set':<18} {'server':<14} {'method':<8} {'tok/s':>8} {'÷ offline':>10}")
    for r in sorted(rows, key=lambda r: (r["prompt_set"], r["method"], r["who"])):
        print(f"{r['prompt_set']:<18} {r['who']:<14} {r['method']:<8} {r['tok_per_s']:8.1f} {r['vs_offline']:10.3f}")
    out = RESULTS / time.strftime("server-ab-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    meta = {"command": "python -m loadtest.bench_server_ab " + " ".join(sys.argv[1:] if argv is None else argv),
            "configs": dict(args.config), "torch": torch.__version__, "threads": args.threads}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "per_request": per_request}, indent=2))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
