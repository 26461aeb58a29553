"""DraftSampler: turn a drafter's logits rows into draft tokens, and the probabilities they were drawn from.

Greedy requests get the argmax and no probabilities (deterministic drafts, one-hot for the rejection
sampler). Sampled requests draw from the DRAFTER's own distribution at the request's temperature,
truncated by its min_p / top_k / top_p (penalties and logit_bias are the target's business: any draft
distribution keeps verification exact). Truncating like the target usually raises acceptance.

- unseeded: an inverse-CDF draw from the global RNG, and that probs row for the rejection sampler;
- seeded: coupled sampling (sampling/coupled.py). The draft for absolute position t is
  argmax(log q_t + g_t) with the same Gumbel noise g_t the target's decision at t uses, over the
  drafter's distribution mapped to target ids (-inf outside the drafter's vocabulary). Its probs row is
  returned too (what the draft was chosen from) though verification only compares ids. Where q_t and
  p_t agree the draft is the target's token, so a close drafter keeps most of its acceptance, and the
  seed's text never depends on the draft.

Worked example: logits row [2.0, 1.0, 0.0], temperature 0.5, top_k 2 -> scaled [4, 2, 0] ->
probs [0.881, 0.119, 0] -> a draw, e.g. token 0, and that probs row for the rejection sampler.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.grammar.draft_mask import mask_draft_logits
from specserve.sampling import coupled
from specserve.sampling.params import SamplingParams
from specserve.sampling.rng import inverse_cdf
from specserve.sampling.truncation import apply_min_p, apply_top_k_top_p


def sample_drafts(logits: torch.Tensor,                        # [n, vocab] float32 (-inf = impossible)
                  params: Sequence[SamplingParams],
                  starts: Sequence[int],                       # [n] the request's num_tokens this step
                  offsets: Sequence[int],                      # [n] drafts before this one in the step
                  ) -> tuple[list[int], list[torch.Tensor | None]]:
    """-> (one draft token per row, per row a [vocab] float32 probs row, or None for greedy rows)."""
    n = logits.shape[0]
    tokens = logits.argmax(dim=-1)                                           # [n]
    probs_out: list[torch.Tensor | None] = [None] * n
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        sub = [params[i] for i in random_rows]
        probs = drafter_probs(logits.index_select(0, rows).float(), sub)                # [m, vocab]
        drawn = _draw(probs, sub, [starts[i] for i in random_rows], [offsets[i] for i in random_rows])
        tokens = tokens.index_copy(0, rows, drawn)
        for j, i in enumerate(random_rows):
            probs_out[i] = probs[j]
    return tokens.tolist(), probs_out


def append_drafts(items: Sequence, logits: torch.Tensor,  # [n, vocab] float32, row i for items[i]
                  ) -> None:
    """Sample one draft per item and append it (and its probs, when sampled) to item.tokens / item.probs.

    items: per-request drafting state with `.request`, `.tokens` and `.probs` lists (draft model, heads).
    The next draft of an item stands at absolute position request.num_tokens + len(item.tokens).
    A request under a grammar drafts from the masked logits (specserve/grammar/draft_mask.py).
    """
    logits = mask_draft_logits(items, logits)
    tokens, probs = sample_drafts(logits, [it.request.sampling_params for it in items],
                                  [it.request.num_tokens for it in items], [len(it.tokens) for it in items])
    for item, tok, prob in zip(items, tokens, probs):
        item.tokens.append(tok)
        if prob is not None:
            item.probs.append(prob)


def drafter_probs(logits: torch.Tensor,   # [m, vocab] float32
                  params: Sequence[SamplingParams]) -> torch.Tensor:
    """[m, vocab]: softmax of the temperature-scaled, truncated logits (sampled requests only: temperature > 0).
    A draft tree's sampled children are drawn from it too (speculators/tree_children.py)."""
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temperature[:, None]                                   # a fresh tensor: editable
    if any(p.min_p > 0 for p in params):
        apply_min_p(scaled, torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device))
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]   # vocab = off
    max_top_k = max((k for k in top_ks if k < vocab), default=0)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if max_top_k or use_top_p:
        scaled = apply_top_k_top_p(scaled, torch.tensor(top_ks, device=logits.device),
                                   torch.tensor([p.top_p for p in params], dtype=logits.dtype,
                                                device=logits.device),
                                   max_top_k=max_top_k, use_top_p=use_top_p)
    return scaled.softmax(dim=-1)


def _draw(probs: torch.Tensor,    # [m, vocab] rows sum to 1
          params: list[SamplingParams], starts: list[int], offsets: list[int]) -> torch.Tensor:
    """[m] long: seeded rows their coupled choice, the others one inverse-CDF draw each (sampling/rng.py).

    Not torch.multinomial: it cost ~4.7 ms per 16 x 8192 call on this CPU, more than a head's forward.
    """
    seeded = [j for j, p in enumerate(params) if p.coupled]
    drawn = (inverse_cdf(probs, torch.rand(probs.shape[0], dtype=probs.dtype, device=probs.device))
             if len(seeded) < len(params) else torch.empty(len(params), dtype=torch.long, device=probs.device))
    if seeded:
        index = torch.tensor(seeded, dtype=torch.long, device=probs.device)
        seeds = torch.tensor([params[j].seed for j in seeded], dtype=torch.long, device=probs.device)
        # the same key rule as the target's row deciding this position (coupled.absolute_positions)
        where = coupled.absolute_positions(
            torch.tensor([starts[j] for j in seeded], dtype=torch.long, device=probs.device),
            torch.tensor([offsets[j] for j in seeded], dtype=torch.long, device=probs.device))
        choice = coupled.coupled_choice(probs.index_select(0, index), coupled.noise_keys(seeds, where))
        drawn = drawn.index_copy(0, index, choice)
    return drawn
