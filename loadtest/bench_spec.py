"""Speculative sweep: method x k x concurrency x temperature x prompt set, against a server it starts.

  make bench-spec                      # full grid on the default (embedded) model
  python -m loadtest.bench_spec --quick   # a small grid for a smoke run

Writes loadtest/results/<stamp>/results.json and PNG plots: speedup vs concurrency per method,
mean acceptance length per method and prompt set, per-position acceptance.

Every ratio divides by the `none` row of the same cell (concurrency, temperature, prompt set). On a VM whose
speed drifts by tens of percent within minutes one `none` measurement per cell is not enough (a 2-core EPYC
run gave none 1080 tok/s at concurrency 8 and 920 at 16 in one sweep). `--rounds R` measures each cell R
times back to back, its points in forward then reverse order, and pools each point's rounds: tokens/s from
summed tokens and seconds, acceptance from summed counters (`pool_rounds`).
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

import httpx

from loadtest.serve import amain as serve_amain
from loadtest.serve_metrics import parse_spec_counters, spec_delta
from loadtest.server_proc import offered_methods, started_server

RESULTS = Path(__file__).resolve().parent / "results"


def run_point(url: str, method: str, k: int, conc: int, temp: float, pset: str, args) -> dict:
    """One grid point through loadtest.serve. ignore_eos: every request writes exactly max_tokens (a prompt
    whose first token is EOS would otherwise count as a failed request, as vLLM's benchmark counts it)."""
    ns = SimpleNamespace(url=url, model=None, api_key=None, method=method, k=k, concurrency=[conc],
                         num_prompts=max(args.min_prompts, conc * args.prompts_per_slot),
                         request_rate=None, prompt_set=pset, max_tokens=args.max_tokens,
                         temperature=temp, ignore_eos=True, goodput={}, seed=0, timeout=900,
                         quiet=True)
    before = httpx.get(f"{url}/metrics").text
    res = asyncio.run(serve_amain(ns))[0]
    res["per_pos"] = per_pos_delta(before, httpx.get(f"{url}/metrics").text, method)
    return res


def per_pos_delta(before: str, after: str, method: str) -> list[float]:
    """Accepted count per draft position / number of drafts, over the run."""
    def parse(text: str) -> dict[int, float]:
        out = {}
        for line in text.splitlines():
            if "spec_decode_num_accepted_tokens_per_pos_total{" in line and f'method="{method}"' in line:
                pos = int(line.split('position="')[1].split('"')[0])
                out[pos] = out.get(pos, 0.0) + float(line.rsplit(" ", 1)[1])
        return out
    b, a = parse(before), parse(after)
    drafts = (parse_spec_counters(after).get(method, {}).get("drafts", 0)
              - parse_spec_counters(before).get(method, {}).get("drafts", 0))
    return [(a[p] - b.get(p, 0.0)) / drafts for p in sorted(a)] if drafts else []


def grid(args, methods: list[str]):
    """Every point; `prediction` only on prompt sets that carry a prediction (code_editing)."""
    from loadtest.prompt_sets import load_prompt_set
    for temp in args.temperatures:
        for pset in args.prompt_sets:
            has_prediction = bool(load_prompt_set(pset, 1)[0].get("prediction"))
            for conc in args.concurrency:
                yield "none", 0, conc, temp, pset
                for method in methods:
                    if method == "prediction" and not has_prediction:
                        continue
                    for k in args.ks:
                        yield method, k, conc, temp, pset


def by_cell(points: list[tuple]) -> list[list[tuple]]:
    """Grid points (method, k, concurrency, T, prompt set) grouped by cell, in grid order."""
    cells: dict[tuple, list[tuple]] = {}
    for p in points:
        cells.setdefault(p[2:], []).append(p)
    return list(cells.values())


def pool_rounds(rounds: list[dict]) -> dict:
    """One grid point measured in several rounds -> one result. Throughput: summed tokens ÷ summed seconds;
    acceptance: from the summed counters; per-position acceptance: weighted by each round's drafts; latency
    percentiles: the mean of the rounds'. The rounds themselves are kept under "rounds"."""
    if len(rounds) == 1:
        return rounds[0]
    tokens = sum(r["total_output_tokens"] for r in rounds)
    seconds = sum(r["duration_s"] for r in rounds)
    completed = sum(r["completed"] for r in rounds)
    counters: dict[str, dict[str, float]] = {}
    for r in rounds:
        for m, d in r["speculation"].items():
            c = counters.setdefault(m, {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0})
            for key in c:
                c[key] += d[key]
    method = rounds[0]["method"]
    weights = [r["speculation"].get(method, {}).get("drafts", 0.0) if r["per_pos"] else 0.0 for r in rounds]
    width = max(len(r["per_pos"]) for r in rounds)
    per_pos = [sum(w * (r["per_pos"][p] if p < len(r["per_pos"]) else 0.0) for w, r in zip(weights, rounds))
               / sum(weights) for p in range(width)] if sum(weights) else []
    latency = {name: {q: sum(r[name][q] for r in rounds) / len(rounds) for q in rounds[0][name]}
               for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}
    return {**rounds[0], **latency, "completed": completed, "failed": sum(r["failed"] for r in rounds),
            "duration_s": seconds, "total_output_tokens": tokens, "output_throughput": tokens / seconds,
            "request_throughput": completed / seconds, "speculation": spec_delta({}, counters),
            "per_pos": per_pos, "rounds": rounds}


def _cell(r: dict) -> tuple:
    return r["concurrency"], r["temperature"], r["prompt_set"]


def none_throughput(results: list[dict]) -> dict[tuple, float]:
    """(concurrency, temperature, prompt set) -> output tokens/s without speculation: every ratio's base."""
    return {_cell(r): r["output_throughput"] for r in results if r["method"] == "none"}


def plot(results: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    base = none_throughput(results)
    for r in results:
        r["speedup"] = r["output_throughput"] / base[_cell(r)]
    temps = sorted({r["temperature"] for r in results})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for key in sorted({(r["method"], r["k"]) for r in results if r["method"] != "none"}):
            pts = sorted((r["concurrency"], r["speedup"]) for r in results
                         if (r["method"], r["k"]) == key and r["temperature"] == t
                         and r["prompt_set"] == results[0]["prompt_set"])
            ax.plot(*zip(*pts), marker="o", label=f"{key[0]} k={key[1]}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="concurrency", ylabel="output tok/s vs none", title=f"T={t}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_concurrency.png", dpi=110)
    fig, ax = plt.subplots(figsize=(8, 4))
    sets = sorted({r["prompt_set"] for r in results})
    methods = sorted({r["method"] for r in results if r["method"] != "none"})
    for i, m in enumerate(methods):
        vals = []
        for s in sets:
            rs = [r for r in results if r["method"] == m and r["prompt_set"] == s and r["concurrency"] == 1]
            vals.append(max((r["speculation"].get(m, {}).get("mean_acceptance_length", 1.0) for r in rs), default=1))
        ax.bar([j + i / (len(methods) + 1) for j in range(len(sets))], vals, 1 / (len(methods) + 1), label=m)
    ax.set_xticks(range(len(sets)), sets)
    ax.set(ylabel="mean acceptance length", title="concurrency 1, best k")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_length.png", dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    lowest = min(r["concurrency"] for r in results), min(r["temperature"] for r in results)
    for m in methods:
        rs = [r for r in results if r["method"] == m and r["per_pos"]
              and (r["concurrency"], r["temperature"]) == lowest and r["prompt_set"] == results[0]["prompt_set"]]
        if rs:   # the largest k, and only its k positions (the server's counters have max-k slots)
            best = max(rs, key=lambda r: r["k"])
            ax.plot(range(1, best["k"] + 1), best["per_pos"][:best["k"]], marker="o", label=f"{m} k={best['k']}")
    ax.set(xlabel="draft position", ylabel="acceptance rate",
           title=f"per-position acceptance, {results[0]['prompt_set']}, concurrency {lowest[0]}, T={lowest[1]}")
    if ax.lines:
        ax.legend()
    else:   # e.g. a sweep of `none` alone: say so instead of an empty legend
        ax.text(0.5, 0.5, "no speculative run here", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out / "per_position_acceptance.png", dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--server-args", default="", help="extra flags for the server it starts")
    ap.add_argument("--methods", default=None, help="comma list (default: every loaded speculator)")
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 6])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.8])
    ap.add_argument("--prompt-sets", type=lambda s: s.split(","),
                    default=["code_completion", "code_editing", "docstring_to_code", "prose", "repeated"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts-per-slot", type=int, default=2)
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="measure every cell this many times (order alternating)")
    ap.add_argument("--quick", action="store_true", help="k=4, concurrency 1,4, T=0, two prompt sets")
    args = ap.parse_args(argv)
    if args.quick:
        args.ks, args.concurrency, args.temperatures = [4], [1, 4], [0.0]
        args.prompt_sets, args.max_tokens = ["code_completion", "code_editing"], 64
    out = RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    with started_server(args.url, args.server_args.split()) as url:
        methods = args.methods.split(",") if args.methods else offered_methods(url)
        meta = {
            "command": "python -m loadtest.bench_spec " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": platform.platform(),
            "python": platform.python_version(),
            "processor": platform.processor(),
            "server": url,
        }
        results = []
        cells = by_cell(list(grid(args, methods)))
        total, done = sum(len(c) for c in cells) * args.rounds, 0
        for points in cells:
            measured: dict[tuple, list[dict]] = {p: [] for p in points}
            for rnd in range(args.rounds):
                for m, k, c, t, s in points if rnd % 2 == 0 else points[::-1]:
                    done += 1
                    print(f"[{done}/{total}] {m} k={k} c={c} T={t} {s}", file=sys.stderr, flush=True)
                    measured[(m, k, c, t, s)].append(run_point(url, m, k, c, t, s, args))
            results += [pool_rounds(measured[p]) for p in points]
            # written after every cell: a cut sweep keeps what it measured
            (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    table = summary_table(results)
    (out / "table.md").write_text(table)
    print(table)
    plot(results, out)
    print(f"wrote {out}")
    return {"dir": str(out), "results": results}


def summary_table(results: list[dict]) -> str:
    """Markdown: one row per (prompt set, T, method, k), one speedup column per concurrency."""
    concs = sorted({r["concurrency"] for r in results})
    base = none_throughput(results)
    rows: dict[tuple, dict[int, str]] = {}
    for r in results:
        b = base.get(_cell(r))
        key = (r["prompt_set"], r["temperature"], r["method"], r["k"])
        tau = r.get("speculation", {}).get(r["method"], {}).get("mean_acceptance_length")
        cell = (
            f"{r['output_throughput']:.0f} tok/s"
            if r["method"] == "none"
            else (f"{r['output_throughput'] / b:.2f}x" if b else "?") + (f" (τ {tau:.2f})" if tau else "")
        )
        rows.setdefault(key, {})[r["concurrency"]] = cell
    lines = [
        "| prompt set | T | method | k | " + " | ".join(f"c={c}" for c in concs) + " |",
        "|---|---|---|---|" + "---|" * len(concs),
    ]
    for (pset, t, m, k), cells in rows.items():
        lines.append(f"| {pset} | {t} | {m} | {k} | " + " | ".join(cells.get(c, "") for c in concs) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
