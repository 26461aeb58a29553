"""Masking a drafter's logits rows with its requests' grammars, so drafts are proposed under the constraint.

A drafter that samples from the masked distribution returns that distribution as draft_probs: the
rejection sampler stays exact (any draft distribution does, if it is the one sampled from) and, since
the target row carries the same mask, acceptance stays as high as without the constraint.

A row whose drafter puts no mass on any allowed token (e.g. an EAGLE-3 head whose reduced vocabulary
lacks every token the grammar allows) gets the uniform distribution over the allowed tokens instead: a
proper distribution, so still exact.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def mask_draft_logits(items: Sequence, logits: torch.Tensor,  # [n, vocab] float32, row i for items[i]
                      ) -> torch.Tensor:
    """[n, vocab]: `logits` with -inf where each item's request grammar forbids the next token.

    items: per-request drafting state with `.request` (its `grammar` may be None) and `.tokens` (the
    drafts proposed so far this step). Returns `logits` itself when no item is constrained."""
    rows = [i for i, it in enumerate(items) if getattr(it.request, "grammar", None) is not None]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        allowed = items[i].request.grammar.draft_mask(list(items[i].tokens))   # [mask vocab] bool or None
        if allowed is None:          # the drafts so far are already invalid: this one cannot matter
            continue
        row = torch.zeros(vocab, dtype=torch.bool)
        width = min(vocab, allowed.shape[0])
        row[:width] = allowed[:width]
        row = row.to(logits.device)
        masked = logits[i].masked_fill(~row, float("-inf"))
        if not bool(torch.isfinite(masked).any()):
            masked = torch.zeros_like(masked).masked_fill(~row, float("-inf"))
        logits[i] = masked
    return logits
