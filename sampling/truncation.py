"""Truncation: min-p, top-k and top-p masks on temperature-scaled logits (vLLM v1's order).

Order: min_p first (relative to the most likely token of the full scaled distribution), then
top_k, then top_p on the distribution renormalised over the surviving top-k tokens. A removed token
gets logit -inf, so the softmax that follows renormalises over the kept set. The most likely token
is always kept, which is why these steps never change the argmax (greedy rows skip them).

Worked example, scaled probabilities [0.5, 0.3, 0.15, 0.05]:
  min_p = 0.2 removes tokens below 0.2 * 0.5 = 0.1 -> keeps {0, 1, 2};
  top_k = 2 keeps {0, 1}; top_p = 0.7 keeps the shortest prefix of the sorted list whose mass
  reaches 0.7 -> {0, 1} (0.5 alone is short of 0.7; 0.5 + 0.3 reaches it).
Ties: top_k keeps every token tied with the k-th value (as HF does); top_p cuts tied tokens in
the order the sort returns them.

Cost: a full vocabulary sort is by far the most expensive step of sampling, so top_p first looks
for its cut among each row's TOP_P_CANDIDATES most likely tokens (a partial topk) and sorts the
whole row only when the cut falls beyond them (a very flat distribution).
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")
TOP_P_CANDIDATES = 1024


def apply_min_p(logits: torch.Tensor,  # [rows, vocab] float32, modified in place
                min_p: torch.Tensor,   # [rows] float32, 0 = off
                ) -> None:
    probs = logits.softmax(dim=-1)                                    # [rows, vocab]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)     # [rows, 1]
    logits.masked_fill_(probs < threshold, _NEG_INF)


def _cut(values: torch.Tensor,           # [rows, n] float32, sorted descending
         log_norm: torch.Tensor | None,  # [rows] log-normaliser of the cut distribution; None = values'
         top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k then top-p to sorted values. Returns (values with -inf cuts, kept mass [rows])."""
    kth = values.gather(1, (top_k.clamp(max=values.shape[1]) - 1)[:, None])     # [rows, 1]
    values = values.masked_fill(values < kth, _NEG_INF)
    if log_norm is None:   # the values are the whole (top-k) distribution: normalise over them
        log_norm = values.logsumexp(dim=-1)
    probs = (values - log_norm[:, None]).exp()                                   # [rows, n]
    mass_before = probs.cumsum(dim=-1) - probs                                   # [rows, n]
    # A token goes when the tokens ranked above it already reach top_p. Rows with top_p = 1 are
    # excluded explicitly: rounding can push mass_before to 1.0 in a long tail and drop real tokens.
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return values.masked_fill(drop, _NEG_INF), probs.sum(dim=-1)


def _full_sort(logits: torch.Tensor,  # [rows, vocab]
               top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)            # [rows, vocab]
    kept, _ = _cut(sorted_logits, None, top_k, top_p)
    return torch.empty_like(logits).scatter_(1, sorted_ids, kept)


def apply_top_k_top_p(logits: torch.Tensor,  # [rows, vocab] float32
                      top_k: torch.Tensor,   # [rows] long in [1, vocab]; vocab = off
                      top_p: torch.Tensor,   # [rows] float32 in (0, 1]; 1 = off
                      max_top_k: int,        # largest top_k below vocab (0 if none): from the host
                      use_top_p: bool,       # any top_p < 1: from the host, no device sync
                      ) -> torch.Tensor:
    """[rows, vocab]: logits with the tokens outside top-k, then outside top-p, set to -inf."""
    vocab = logits.shape[1]
    has_top_k = top_k < vocab                                                   # [rows]
    if not use_top_p:
        # top-k alone needs only the k-th largest value, not a sort over the vocabulary.
        kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
        return logits.masked_fill((logits < kth) & has_top_k[:, None], _NEG_INF)
    num_candidates = max(TOP_P_CANDIDATES, max_top_k)
    if num_candidates >= vocab:
        return _full_sort(logits, top_k, top_p)
    values, ids = logits.topk(num_candidates, dim=-1)                          # [rows, C] sorted
    # Rows with top-k hold their whole distribution among the candidates (C >= k); the others
    # are normalised over the full vocabulary.
    full_norm = logits.logsumexp(dim=-1)                                        # [rows]
    topk_norm = values.masked_fill(values < values.gather(1, (top_k.clamp(max=num_candidates) - 1)[:, None]),
                                   _NEG_INF).logsumexp(dim=-1)
    values, kept_mass = _cut(values, torch.where(has_top_k, topk_norm, full_norm), top_k, top_p)
    out = torch.full_like(logits, _NEG_INF).scatter_(1, ids, values)
    untouched = ~has_top_k & (top_p >= 1.0)                # asked for neither: keep every token
    out = torch.where(untouched[:, None], logits, out)
    # The cut lies among the candidates iff they already hold top_p of the mass.
    beyond = ~untouched & ~has_top_k & (kept_mass < top_p)
    if bool(beyond.any()):
        rows = beyond.nonzero().squeeze(1)
        out[rows] = _full_sort(logits[rows], top_k[rows], top_p[rows])
    return out
