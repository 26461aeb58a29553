"""One command for the whole embedded family, from scratch, fixed seeds, resumable:

    python -m training.all --threads 2              # (make train-embedded) the real run
    python -m training.all --smoke                  # tiny end-to-end check of the pipeline (~3 min, runs/smoke/)

Stages (each is skipped when its export already exists, and resumes from runs/<name>/ckpt.pt when cut):
  1. tokenizer  retrained from the corpus and compared byte for byte with the committed models/tokenizer
  2. target     training.train_target   (Llama + MTP), lr 2e-3   -> runs/target-stage1 (an export)
  3. target-2   training.train_target   second stage from it, lr 1e-3, fresh schedule -> models/target
  4. draft      training.train_draft                              -> models/draft
  5. eagle3     training.train_eagle3   (on the frozen target, 2048-token draft vocab) -> models/eagle3
  5b. eagle1    training.train_eagle1   (EAGLE-1 head, same loop, fc with bias, row stride 4) -> models/eagle
  6. evaluate   training.evaluate       (losses, samples, acceptance) -> runs/eval/results.json
  7. card       training.model_card     -> models/README.md
Budgets are the token counts the shipped models were trained on (PLAN_TOKENS), so a rerun on any machine
does the same optimizer steps; --tokens replaces some, --scale multiplies them all. How long they take
depends on the CPU: ~4x faster where bf16 autocast is used (AMX / AVX512-BF16) than in fp32.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

from training import common

# Tokens each shipped model was trained on (whole 4096-token steps; see models/README.md).
PLAN_TOKENS = {"target": 3_321_856, "target-2": 4_997_120, "draft": 4_603_904, "eagle3": 5_998_592,
               "eagle1": 450_560}
STAGE_ARGS = {"target-2": ["--lr", "1e-3"], "eagle3": ["--draft-vocab", "2048"], "eagle1": ["--row-stride", "4"]}
EXIT_RESUME = 75   # "not finished, rerun to resume" (EX_TEMPFAIL)


def check_tokenizer() -> None:
    from training.corpus import load_corpus
    from training.tokenizer import build_tokenizer, save_tokenizer
    with tempfile.TemporaryDirectory() as d:
        save_tokenizer(build_tokenizer(load_corpus().train_texts()), Path(d))
        new = hashlib.sha256((Path(d) / "tokenizer.json").read_bytes()).hexdigest()
    shipped = common.TOKENIZER_DIR / "tokenizer.json"
    if not shipped.exists():
        sys.exit("models/tokenizer is missing: run python -m training.tokenizer first")
    old = hashlib.sha256(shipped.read_bytes()).hexdigest()
    if new != old:
        sys.exit(f"retrained tokenizer {new[:12]} != committed {old[:12]} (different Python stdlib?); "
                 "the committed tokenizer is final: rerun with --skip-tokenizer-check to train on it anyway")
    print(f"[all] tokenizer reproduced byte for byte ({old[:12]})", flush=True)


def _parse_budgets(text: str | None) -> dict[str, str]:
    """"target=2.7e7,draft=2e7" -> {"target": "2.7e7", ...} (token budgets that replace the minute plan)."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        k, v = part.split("=")
        out[k.strip()] = v.strip()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every stage's planned token budget")
    ap.add_argument("--tokens", default=None, help="replace planned token budgets, e.g. target=2.7e7,draft=2e7")
    ap.add_argument("--time-limit-minutes", type=float, default=None,
                    help="stop cleanly (checkpoint, exit code 75) after this many minutes; rerun the same "
                         "command to resume")
    ap.add_argument("--only", choices=["target", "draft", "eagle3", "eagle1", "evaluate", "card"], nargs="*")
    ap.add_argument("--smoke", action="store_true", help="tiny models, tiny budgets, outputs under runs/smoke")
    ap.add_argument("--skip-tokenizer-check", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda to train on a GPU (bf16 autocast)")
    args = ap.parse_args(argv)
    from training import evaluate, model_card, train_draft, train_eagle1, train_eagle3, train_target
    t0 = time.time()
    stages = args.only or ["target", "draft", "eagle3", "eagle1", "evaluate", "card"]
    models = common.RUNS_DIR / "smoke" / "models" if args.smoke else common.REPO / "models"
    prefix = "smoke-" if args.smoke else ""
    tokens = _parse_budgets(args.tokens)
    if args.smoke:
        tokens = {"target": "2e4", "target-2": "1e4", "draft": "1e4", "eagle3": "4e3", "eagle1": "4e3", **tokens}
    if not args.smoke and not args.skip_tokenizer_check:
        check_tokenizer()

    stage1 = common.RUNS_DIR / ("smoke" if args.smoke else "") / "target-stage1"   # stage 1's export -> stage 2
    outs = {"target": stage1, "target-2": models / "target", "draft": models / "draft", "eagle3": models / "eagle3",
            "eagle1": models / "eagle"}

    def common_args(stage: str) -> list[str]:
        budget = tokens.get(stage, f"{PLAN_TOKENS[stage] * args.scale:.0f}")
        a = ["--name", prefix + stage, "--out", str(outs[stage]), "--threads", str(args.threads),
             "--device", args.device, "--tokens", budget] + STAGE_ARGS.get(stage, [])
        if args.time_limit_minutes is not None:
            left = args.time_limit_minutes - (time.time() - t0) / 60
            if left < 1:
                print(f"[all] time limit reached before {stage}; rerun the same command to resume", flush=True)
                sys.exit(EXIT_RESUME)
            a += ["--stop-after-minutes", f"{left:.1f}"]
        return a

    smoke = {"target": ["--preset", "tiny", "--batch-size", "4", "--seq-len", "64", "--eval-windows", "4",
                        "--final-eval-windows", "8"],
             "draft": ["--batch-size", "4", "--seq-len", "64", "--eval-windows", "4", "--final-eval-windows", "8"],
             "eagle3": ["--batch-size", "2", "--seq-len", "64", "--eval-windows", "2", "--draft-vocab", "512"],
             "eagle1": ["--batch-size", "2", "--seq-len", "64", "--eval-windows", "2"]}
    smoke["target-2"] = smoke["target"]
    trainers = {"target": train_target.main, "target-2": train_target.main, "draft": train_draft.main,
                "eagle3": train_eagle3.main, "eagle1": train_eagle1.main}
    for stage in ("target", "target-2", "draft", "eagle3", "eagle1"):
        done = outs[stage] / "model.safetensors"
        wanted = stage in stages or (stage == "target-2" and "target" in stages)
        if not wanted or done.exists() or (stage == "target" and (outs["target-2"] / "model.safetensors").exists()):
            continue
        extra = {"target-2": ["--init-from", str(stage1)], "eagle3": ["--target", str(models / "target")],
                 "eagle1": ["--target", str(models / "target")]}.get(stage, [])
        if stage not in ("eagle3", "eagle1") and not args.smoke and common.precision(args.device) == "fp32":
            extra.append("--compile")  # helps fp32 on CPU; with bf16 autocast it halved throughput here
        trainers[stage](common_args(stage) + extra + (smoke[stage] if args.smoke else []))
        if not done.exists():
            print(
                f"[all] {stage} is not finished (time limit reached); rerun the same command to resume", flush=True
            )
            sys.exit(EXIT_RESUME)
    results = common.RUNS_DIR / (prefix + "eval") / "results.json"
    if "evaluate" in stages:
        evaluate.main(
            ["--models", str(models), "--out", str(results), "--threads", str(args.threads)]
            + (["--prompts", "2", "--new-tokens", "16", "--heldout-windows", "8"] if args.smoke else [])
        )
    if "card" in stages:
        model_card.main(["--models", str(models), "--results", str(results)])
    print(f"[all] done in {(time.time() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
