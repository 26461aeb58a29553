"""RandomDraws: every random number one sampling step consumes, per request.

A random-sampling request with k drafts consumes exactly, in this order:
  k uniforms in [0, 1)  - one acceptance test per draft position;
  vocab Exp(1) draws    - the noise of an exponential race that picks the final (recovered or
                          bonus) token: argmax(weights / noise) is a sample from weights / sum.
The count depends only on k, never on what was accepted or on the rest of the batch, so a request
with its own seeded torch.Generator reproduces its outputs whenever it sees the same drafts.
Requests without a generator draw from the global RNG in one batched call.

Worked example of the race: weights [0.2, 0.8], noise [0.5, 4.0] gives ratios [0.4, 0.2] -> token 0.
P(token i) = weights_i / sum(weights) because min_i(noise_i / weights_i) is an exponential race.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sampling.outputs import SeqSamplingInput


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator a seeded request keeps for its lifetime (None when unseeded).

    The engine creates it once, at admission, on the logits' device, and passes the same object in
    every step's SeqSamplingInput so the stream continues instead of restarting.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)   # manual_seed takes [0, 2**64); negative seeds wrap
    return generator


@dataclass
class RandomDraws:
    uniforms: torch.Tensor      # [m, max_drafts] float32; entries j >= k_i are unused padding
    noise: torch.Tensor         # [m, vocab] float32 Exp(1), strictly positive

    @classmethod
    def draw(cls, seqs: Sequence[SeqSamplingInput], max_drafts: int, vocab_size: int,
             device: torch.device) -> RandomDraws:
        """Draws for the random-sampling requests `seqs`, each from its own generator if it has one."""
        uniforms = torch.rand(len(seqs), max_drafts, device=device)              # [m, max_drafts]
        noise = torch.empty(len(seqs), vocab_size, device=device).exponential_()  # [m, vocab]
        for i, seq in enumerate(seqs):
            if seq.generator is None:
                continue
            # Overwrite the seeded request's slots in place from its own stream (views, no copies).
            uniforms[i, :len(seq.draft_token_ids)].uniform_(generator=seq.generator)
            noise[i].exponential_(generator=seq.generator)
        # exponential_ can return exactly 0; weight / 0 would be inf (or NaN for a zero weight),
        # letting an impossible token win the race.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return cls(uniforms=uniforms, noise=noise)
