"""Derive a reduced-draft-vocabulary EAGLE-3 head from a full-vocabulary one, without retraining.

Keeps the lm_head rows of the N most frequent ids of the training split and writes the public `d2t`
offset table and `t2d` mask (docs/formats.md), so the head scores N ids per step instead of V:

    python -m training.restrict_eagle3 --head models/eagle3 --draft-vocab 2048 --out /tmp/eagle3-2048
    python -m loadtest.bench_spec_core --eagle3 /tmp/eagle3-2048 ...      # compare tau and c

A head trained with `train_eagle3 --draft-vocab N` learns the restricted distribution itself and should do
at least as well; this tool measures the trade-off before paying for a retrain.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from training.eagle3 import select_draft_vocab
from training.export import draft_vocab_tables


def restrict_head(head_dir: Path, out_dir: Path, draft_ids: torch.Tensor) -> Path:
    """Copy head_dir to out_dir with lm_head reduced to the rows `draft_ids` (ascending target ids)."""
    cfg = json.loads((head_dir / "config.json").read_text())
    tensors = load_file(str(head_dir / "model.safetensors"))
    vocab = cfg["vocab_size"]
    if "d2t" in tensors or cfg.get("draft_vocab_size", vocab) != vocab:
        raise ValueError(f"{head_dir} already has a reduced draft vocabulary")
    if draft_ids.numel() == 0 or not torch.equal(draft_ids, torch.unique(draft_ids)) or int(draft_ids[-1]) >= vocab:
        raise ValueError("draft_ids must be distinct ascending ids inside the vocabulary")
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(head_dir, out_dir)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][draft_ids].contiguous()
    tensors.update(draft_vocab_tables(draft_ids, vocab))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["draft_vocab_size"] = int(draft_ids.numel())
    cfg.setdefault("specserve_training", {})["restricted_from_full_vocab"] = True
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


def main(argv=None) -> None:
    from training import common
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=common.REPO / "models" / "eagle3")
    ap.add_argument("--draft-vocab", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    vocab = json.loads((args.head / "config.json").read_text())["vocab_size"]
    train_stream, _ = common.token_streams()
    ids = select_draft_vocab(train_stream, vocab, args.draft_vocab)
    restrict_head(args.head, args.out, ids)
    print(f"wrote {args.out}: lm_head over the {args.draft_vocab} most frequent of {vocab} ids")


if __name__ == "__main__":
    main()
