"""Render models/README.md (the model card) from the exported configs and runs/eval/results.json.

    python -m training.model_card [--models models] [--results runs/eval/results.json]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from safetensors import safe_open

from training import common
from training.corpus import load_corpus, manifest


def _params(path: Path) -> int:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def render(models: Path, results: dict) -> str:
    m = manifest(load_corpus())
    lines = ["# specserve embedded model family", "",
             "Trained here by `make train-embedded` (`python -m training.all`); recipe and evidence in "
             "`training/README.md`. Corpus: the Python standard library's own source "
             f"(Python {m['python_version']}, tests/site-packages/generated files excluded), split by file: "
             f"{m['train_files']} train files ({m['train_bytes']:,} bytes), {m['heldout_files']} held-out files "
             f"({m['heldout_bytes']:,} bytes). Tokenizer: byte-level BPE, 8192 tokens (`tokenizer/`).", "",
             "| model | layout | params (in the file) | training tokens | epochs | held-out loss (nats/token) |",
             "|---|---|---|---|---|---|"]
    held = results.get("heldout_loss", {})
    for name in ("target", "draft", "eagle3"):
        p = models / name
        if not (p / "config.json").exists():
            continue
        cfg = json.loads((p / "config.json").read_text())
        info = cfg.get("specserve_training", {})
        loss = held.get(name, {}).get("heldout_loss")
        extra = ""
        if name == "target" and "heldout_mtp_loss" in held.get("target", {}):
            extra = f" (MTP, token t+2: {held['target']['heldout_mtp_loss']:.3f})"
        layout = {"target": "LlamaForCausalLM + 1 DeepSeek-style MTP layer", "draft": "LlamaForCausalLM",
                  "eagle3": "EAGLE-3 head (LlamaForCausalLMEagle3)"}[name]
        lines.append(f"| {name} | {layout} | {_params(p) / 1e6:.2f}M | {info.get('tokens', 0) / 1e6:.2f}M | "
                     f"{info.get('epochs', 0):.2f} | {'' if loss is None else f'{loss:.3f}'}{extra} |")
    acc = results.get("acceptance_mean", {})
    lines += ["", "## Greedy speculative acceptance (held-out function prompts, 128 new tokens)", "",
              "| method | k | mean acceptance length (1 + accepted/drafts) |", "|---|---|---|"]
    for key, k in (("draft", 4), ("eagle3", 4), ("mtp_k1", 1)):
        if key in acc:
            lines.append(f"| {key} | {k} | {acc[key]:.2f} |")
    if "mtp_first_pos_accept" in acc:
        lines.append(f"\nMTP first-position acceptance: {acc['mtp_first_pos_accept']:.2f}")
    lines += ["", "## MTP storage", "", "DeepSeek-V3 layout: `model.layers.{L}.{enorm,hnorm,eh_proj,input_layernorm,"
              "self_attn.*,post_attention_layernorm,mlp.*,shared_head.norm}` with L = num_hidden_layers, declared by "
              "`num_nextn_predict_layers: 1`; conventions under `mtp` in `target/config.json` (embedding-then-hidden "
              "concat, post-final-norm hidden, shared embedding and lm_head).", "", "## Samples (target, greedy)", ""]
    for s in results.get("samples", [])[:4]:
        lines += ["```python", s["prompt"] + s["completion"], "```", ""]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=common.REPO / "models")
    ap.add_argument("--results", type=Path, default=common.RUNS_DIR / "eval" / "results.json")
    args = ap.parse_args(argv)
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    (args.models / "README.md").write_text(render(args.models, results))
    print(f"wrote {args.models / 'README.md'}")


if __name__ == "__main__":
    main()
