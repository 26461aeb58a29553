"""Print a markdown table of short tuning runs from runs/<name>/log.jsonl: train-loss EMA at a few
fractions of each run, and the final held-out (and MTP held-out) loss.

    python -m training.tuning_table runs/tune-*
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def summarize(run_dir: Path) -> dict | None:
    recs = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if "loss_ema" in r]
    final = [r for r in recs if r.get("kind") == "final"]
    if not steps or not final:
        return None
    last = steps[-1]["step"]
    at = {}
    for frac in (0.25, 0.5, 0.75, 1.0):
        best = min(steps, key=lambda r: abs(r["step"] - frac * last))
        at[frac] = best["loss_ema"]
    return {"name": run_dir.name, "tokens": final[-1]["tokens"], "steps": final[-1]["steps"], "curve": at,
            "heldout": final[-1]["heldout_loss"], "heldout_mtp": final[-1].get("heldout_mtp_loss")}


def main(argv=None):
    dirs = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    print("| run | tokens | steps | train loss (EMA) at 25/50/75/100 % | held-out | held-out MTP (t+2) |")
    print("|---|---|---|---|---|---|")
    for d in sorted(dirs):
        s = summarize(d) if (d / "log.jsonl").exists() else None
        if s:
            curve = " / ".join(f"{v:.2f}" for v in s["curve"].values())
            mtp = f"{s['heldout_mtp']:.3f}" if s["heldout_mtp"] is not None else "—"
            print(f"| {s['name']} | {s['tokens']:,} | {s['steps']} | {curve} | {s['heldout']:.3f} | {mtp} |")


if __name__ == "__main__":
    main()
