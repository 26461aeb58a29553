"""Coupled sampling: how a seeded request draws its tokens, so that speculation cannot change its text.

A seeded sampled request makes every sampling decision as

    token at absolute position t = argmax_v ( log p_t(v) + g_t(v) )

where p_t is the processed distribution of that decision (sampler.py: penalties, logit_bias, the
min_tokens ban, temperature, min-p/top-k/top-p; tokens outside the support have log p = -inf) and
g_t(v) is standard Gumbel noise that depends on nothing but (seed, t, v). The Gumbel-max trick makes
the token distributed exactly as p_t. Because the noise of a position is fixed before anything is
drafted, the emitted sequence is a function of the prompt, the parameters and the seed alone:

- plain decoding emits argmax(log p_t + g_t) at each t: the reference text;
- verification accepts draft d_t iff it equals that argmax, emits the argmax at the first mismatch
  (the recovered token) and, with every draft accepted, the argmax of the next row (the bonus token).
  Accepted drafts equal what plain decoding emits, so every row sees the same context and the same
  p_t: the text is the plain text whatever k, the batch, chunking, preemption or load;
- model drafters draw a seeded request's drafts with the same g_t over their own distribution q_t
  (speculators/draft_sampling.py), so a draft is accepted iff argmax(log q_t + g_t) equals
  argmax(log p_t + g_t). Deterministic drafts (n-gram, prediction) are accepted with probability
  p_t(d_t), as under rejection sampling.

The price: given the context, a coupled draft from q is accepted with probability
P[argmax(log q + g) = argmax(log p + g)], which is at most sum_v min(p(v), q(v)) (the rejection
sampler's acceptance, the best any scheme that keeps p can reach); docs/sampling.md has the numbers.

The noise is counter-based: g_t(v) is a hash of (seed, t, v) (SplitMix64's finaliser, Steele et al.
2014), so it needs no generator state to carry across steps, preemptions or drafters, and the same key
gives the same bits on every device. 53 hash bits make a float64 uniform u in (0, 1); g = -log(-log u).

Worked example: p = [0.5, 0.3, 0.2], g = [0.1, 0.9, -0.2] -> log p + g = [-0.59, -0.30, -1.81]:
token 1. A draft 1 at this position is accepted; a draft 0 is rejected and 1 is emitted instead.
"""
from __future__ import annotations

import torch

# SplitMix64 constants as signed int64 (torch has no uint64 arithmetic; int64 products wrap).
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_POSITION_SALT = 0x632BE59BD9B4E019


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask the sign bits it copies)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser: a bijection of 64-bit words whose output bits all depend on every input bit."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def absolute_positions(first: torch.Tensor,    # [rows] long: position of the row's request's first row
                       offset: torch.Tensor,   # [rows] long: j, rows of the request before this one
                       ) -> torch.Tensor:
    """[rows] long: the absolute position whose token a row decides (the noise key's position)."""
    return first + offset


def noise_keys(seeds: torch.Tensor,       # [rows] long: the request's seed (each of n choices has its own)
               positions: torch.Tensor,   # [rows] long: absolute position of the decided token
               ) -> torch.Tensor:
    """[rows] long: one 64-bit key per (seed, position); the noise of a row is a function of it alone."""
    return _mix(_mix(seeds * _GOLDEN) + positions * _POSITION_SALT)


def gumbel_noise(keys: torch.Tensor,  # [rows] long from noise_keys
                 vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 standard Gumbel noise, g(v) a hash of (key, v)."""
    token_ids = torch.arange(vocab, dtype=torch.long, device=keys.device)             # [vocab]
    bits = _mix(keys[:, None] + (token_ids[None, :] + 1) * _GOLDEN)                   # [rows, vocab]
    u = (_shift_right(bits, 11).double() + 0.5) * 2.0 ** -53                            # (0, 1)
    return -torch.log(-torch.log(u))


def coupled_scores(probs: torch.Tensor,   # [rows, vocab] float32 distribution, rows sum to 1
                   keys: torch.Tensor,    # [rows] long from noise_keys
                   ) -> torch.Tensor:
    """[rows, vocab] float64: log probs + g, the perturbed scores whose argmax is the coupled choice (a draft
    tree's seeded children are their top K: speculators/tree_children.py). log 0 = -inf: never chosen."""
    return probs.double().log() + gumbel_noise(keys, probs.shape[1])


def coupled_choice(probs: torch.Tensor,   # [rows, vocab] float32 processed distribution, rows sum to 1
                   keys: torch.Tensor,    # [rows] long from noise_keys
                   ) -> torch.Tensor:
    """[rows] long: argmax(log probs + g). Zero-probability tokens have log 0 = -inf: never chosen."""
    return coupled_scores(probs, keys).argmax(dim=-1)
