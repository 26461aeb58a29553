"""DraftSampler: turn a drafter's logits rows into draft tokens, and the probabilities they were drawn from.

Greedy requests (temperature 0) get the argmax and no probabilities (deterministic drafts, one-hot for
the rejection sampler). Random requests draw from the DRAFTER's own distribution at the request's
temperature, truncated by its min_p / top_k / top_p (penalties and logit_bias are the target's
business: any draft distribution keeps rejection sampling exact, as long as the one returned is the
one sampled from). Truncating like the target usually raises acceptance.

A seeded request draws from its own generator (created by the speculator from the seed), so a seeded
request stays reproducible with model-based drafts too.

Worked example: logits row [2.0, 1.0, 0.0], temperature 0.5, top_k 2 -> scaled [4, 2, 0] ->
probs [0.881, 0.119, 0] -> a draw, e.g. token 0, and that probs row for the rejection sampler.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.grammar.draft_mask import mask_draft_logits
from specserve.sampling.params import SamplingParams
from specserve.sampling.rng import inverse_cdf
from specserve.sampling.truncation import apply_min_p, apply_top_k_top_p


def draft_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator for a seeded random request, offset from the seed so it never mirrors the target's stream."""
    if params.seed is None or params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed((params.seed + 0x5EED_D4AF7) % 2**64)
    return gen


def sample_drafts(logits: torch.Tensor,                        # [n, vocab] float32 (-inf = impossible)
                  params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None],
                  ) -> tuple[list[int], list[torch.Tensor | None]]:
    """-> (one draft token per row, per row a [vocab] float32 probs row or None for greedy rows)."""
    n = logits.shape[0]
    tokens = logits.argmax(dim=-1)                                           # [n]
    probs_out: list[torch.Tensor | None] = [None] * n
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        sub = [params[i] for i in random_rows]
        probs = _probs(logits.index_select(0, rows).float(), sub)           # [m, vocab]
        drawn = _draw(probs, [generators[i] for i in random_rows])           # [m]
        tokens = tokens.index_copy(0, rows, drawn)
        for j, i in enumerate(random_rows):
            probs_out[i] = probs[j]
    return tokens.tolist(), probs_out


def append_drafts(items: Sequence, logits: torch.Tensor,  # [n, vocab] float32, row i for items[i]
                  generators: Sequence[torch.Generator | None]) -> None:
    """Sample one draft per item and append it (and its probs, when sampled) to item.tokens / item.probs.

    items: per-request drafting state with `.request`, `.tokens` and `.probs` lists (draft model, heads).
    A request under a grammar drafts from the masked logits (specserve/grammar/draft_mask.py).
    """
    logits = mask_draft_logits(items, logits)
    tokens, probs = sample_drafts(logits, [it.request.sampling_params for it in items], generators)
    for item, tok, prob in zip(items, tokens, probs):
        item.tokens.append(tok)
        if prob is not None:
            item.probs.append(prob)


def _probs(logits: torch.Tensor,   # [m, vocab] float32
           params: list[SamplingParams]) -> torch.Tensor:
    """[m, vocab]: softmax of the temperature-scaled, truncated logits."""
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
          generators: list[torch.Generator | None]) -> torch.Tensor:
    """[m] long: one inverse-CDF draw per row (sampling/rng.py), seeded rows from their own generator.

    Not torch.multinomial: it cost ~4.7 ms per 16 x 8192 call on this CPU, more than a head's forward.
    """
    if all(g is None for g in generators):
        u = torch.rand(probs.shape[0], dtype=probs.dtype, device=probs.device)
    else:
        u = torch.cat([torch.rand(1, dtype=probs.dtype, device=probs.device, generator=g)
                       for g in generators])                                   # None: the global RNG
    return inverse_cdf(probs, u)
