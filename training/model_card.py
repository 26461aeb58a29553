"""Render models/README.md (the model card) from the exported configs and runs/eval/results.json.

    python -m training.model_card [--models models] [--results runs/eval/results.json]
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from safetensors import safe_open

from training import common
from training.corpus import load_corpus, manifest


def _params(path: Path) -> int:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


_WORD = re.compile(r"\w+|[^\w\s]")


def repeated_trigram_share(text: str) -> float:
    """Share of word/punctuation 3-grams that already occurred earlier in the same text: a loop measure
    (0 = no 3-gram repeats; a text stuck in "to_to_to" or "value, value, value" scores near 1)."""
    words = _WORD.findall(text)
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def _reference_repetition(texts: list[str], chars: int) -> float:
    """The same measure on real held-out code: the first `chars` characters of each held-out file."""
    shares = [repeated_trigram_share(t[:chars]) for t in texts if len(t) >= chars]
    return sum(shares) / len(shares) if shares else 0.0


def status_lines(results: dict, corpus) -> list[str]:
    """The family's quality bars, each with the measured value and met / not met (nothing hand-written)."""
    held, acc = results.get("heldout_loss", {}), results.get("acceptance_mean", {})
    rows = []
    t, d = held.get("target", {}).get("heldout_loss"), held.get("draft", {}).get("heldout_loss")
    if t is not None and d is not None:
        rows.append(("target held-out loss below the draft's by >= 0.3 nats", f"{d - t:+.3f}", d - t >= 0.3))
    for key, label, bar in (("mtp_first_pos_accept", "MTP first-position acceptance >= 0.6", 0.6),
                            ("draft", "draft mean acceptance length (k = 4) >= 2.3", 2.3),
                            ("eagle3", "EAGLE-3 mean acceptance length (k = 4) >= 2.8", 2.8)):
        if key in acc:
            rows.append((label, f"{acc[key]:.2f}", acc[key] >= bar))
    samples = results.get("samples", [])
    if samples:
        chars = int(sum(len(s["completion"]) for s in samples) / len(samples))
        ours = sum(repeated_trigram_share(s["completion"]) for s in samples) / len(samples)
        ref = _reference_repetition(corpus.heldout_texts(), chars)
        rows.append((f"greedy samples do not loop: repeated 3-gram share <= 1.5x real held-out code's "
                     f"({ref:.2f}, first {chars} chars of each file)", f"{ours:.2f}", ours <= 1.5 * ref))
        sampled = [t for s in samples for t in s.get("sampled", [])]
        if sampled:
            chars = int(sum(len(t) for t in sampled) / len(sampled))
            ours = sum(repeated_trigram_share(t) for t in sampled) / len(sampled)
            ref = _reference_repetition(corpus.heldout_texts(), chars)
            rows.append((f"sampled completions (T = 0.8, top_p = 0.95, {len(sampled)}) do not loop: the same share "
                         f"<= 1.5x real code's ({ref:.2f}, first {chars} chars)", f"{ours:.2f}", ours <= 1.5 * ref))
    if not rows:
        return []
    return (["## Quality bars (generated from runs/eval/results.json)", "",
             "| bar | measured | met |", "|---|---|---|"]
            + [f"| {label} | {value} | {'yes' if ok else '**no**'} |" for label, value, ok in rows] + [""])


def render(models: Path, results: dict) -> str:
    corpus = load_corpus()
    m = manifest(corpus)
    lines = ["# specserve embedded model family", "",
             "Trained here by `make train-embedded` (`python -m training.all`); recipe and evidence in "
             "`training/README.md`. Corpus: the Python standard library's own source "
             f"(Python {m['python_version']}, tests/site-packages/generated files excluded), split by file: "
             f"{m['train_files']} train files ({m['train_bytes']:,} bytes), {m['heldout_files']} held-out files "
             f"({m['heldout_bytes']:,} bytes). Tokenizer: byte-level BPE, 8192 tokens (`tokenizer/`).", "",
             "| model | layout | params (in the file) | training tokens | epochs | held-out loss (nats/token) |",
             "|---|---|---|---|---|---|"]
    held = results.get("heldout_loss", {})
    for name in ("target", "draft", "eagle3", "eagle"):
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
                  "eagle3": "EAGLE-3 head (LlamaForCausalLMEagle3)",
                  "eagle": "EAGLE-1 head (SafeAILab layout; the target's embedding and lm_head)"}[name]
        if name in ("eagle3", "eagle") and info.get("heldout_top1_per_step"):
            extra = ("held-out top-1 agreement with the target, draft steps 1-"
                     f"{len(info['heldout_top1_per_step'])}: "
                     + " / ".join(f"{a:.2f}" for a in info["heldout_top1_per_step"]))
        epochs = f"{info['epochs']:.2f}" if "epochs" in info else "—"
        lines.append(f"| {name} | {layout} | {_params(p) / 1e6:.2f}M | {info.get('tokens', 0) / 1e6:.2f}M | "
                     f"{epochs} | {'' if loss is None else f'{loss:.3f}'}{extra} |")
    acc = results.get("acceptance_mean", {})
    lines += [""] + status_lines(results, corpus)
    lines += ["## Greedy speculative acceptance (held-out function prompts, 128 new tokens)", "",
              "| method | k | mean acceptance length (1 + accepted/drafts) |", "|---|---|---|"]
    for key, k in (("draft", 4), ("eagle3", 4), ("eagle", 4), ("mtp_k1", 1)):
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
    sampled = [s for s in results.get("samples", [])[:2] if s.get("sampled")]
    if sampled:
        lines += ["## Samples (target, T = 0.8, top_p = 0.95, first seed)", "",
                  "Greedy decoding of a small LM falls into loops that sampling from the same model does not "
                  "(the loop rows of the quality-bar table above).", ""]
        for s in sampled:
            lines += ["```python", s["prompt"] + s["sampled"][0], "```", ""]
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
