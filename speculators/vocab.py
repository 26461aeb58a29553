"""Vocabulary compatibility of a draft model with the target: drafts are token ids, so both models must
give every id the same meaning.

Rule: when both directories ship a tokenizer.json, their id -> token maps (model vocab + added tokens)
must be identical; the embedding sizes may differ (Qwen2.5-0.5B pads to 151936 rows, 7B to 152064:
same tokenizer, both fine). Without a tokenizer.json on either side, vocab_size must match exactly.

Example: a draft whose tokenizer maps id 17 to "ab" where the target has "ba" is refused with
"... id 17 is 'ab' in the draft but 'ba' in the target".
"""
from __future__ import annotations

import json
from pathlib import Path


def tokenizer_vocab(directory: str | Path) -> dict[int, str] | None:
    """id -> token string from a tokenizer.json (BPE/WordPiece/WordLevel dicts, Unigram lists), or None."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, dict):
        ids = {int(i): tok for tok, i in vocab.items()}
    else:   # Unigram: [[token, score], ...], the id is the position
        ids = {i: entry[0] for i, entry in enumerate(vocab)}
    for added in data.get("added_tokens") or []:
        ids[int(added["id"])] = added["content"]
    return ids


def check_same_vocabulary(target_tokenizer_dir: str | Path | None, target_vocab_size: int,
                          draft_dir: str | Path, draft_vocab_size: int) -> None:
    """Raise ValueError (a startup error) when the draft's ids do not mean the target's tokens."""
    target = tokenizer_vocab(target_tokenizer_dir) if target_tokenizer_dir is not None else None
    draft = tokenizer_vocab(draft_dir)
    if target is None or draft is None:
        if draft_vocab_size != target_vocab_size:
            raise ValueError(f"draft model {draft_dir} has vocab_size {draft_vocab_size} but the target has "
                             f"{target_vocab_size} (and no tokenizer.json on both sides to prove the ids agree); "
                             "a draft model must share the target's vocabulary")
        return
    if draft != target:
        diff = sorted(set(draft.items()) ^ set(target.items()))
        tid = diff[0][0]
        raise ValueError(f"draft model {draft_dir} has a different vocabulary than the target "
                         f"({len(draft)} vs {len(target)} tokens; e.g. id {tid} is {draft.get(tid)!r} in the "
                         f"draft but {target.get(tid)!r} in the target); a draft model must use the target's "
                         "tokenizer")
    if draft_vocab_size < len(draft):
        raise ValueError(f"draft model {draft_dir}: vocab_size {draft_vocab_size} is smaller than its "
                         f"tokenizer ({len(draft)} tokens)")
