"""DraftDistribution: what the drafters claimed about their drafts, for the random-sampling requests.

A request either sends draft_probs [k, vocab] (the distribution each draft was sampled from) or
None: deterministic drafts (n-gram, prediction, greedy heads), which are exactly a one-hot
distribution on the proposed token. Both give an exact (lossless) rejection sampler; the one-hot
case never materialises a [k, vocab] row.

Worked example, vocab 3, target_probs row [0.6, 0.1, 0.3], rejected draft token 2:
  one-hot draft:            residual max([0.6, 0.1, 0.3] - [0, 0, 1], 0) = [0.6, 0.1, 0]
  draft_probs [0.2, 0.1, 0.7]: residual max([0.4, 0.0, -0.4], 0)         = [0.4, 0.0, 0]
The sampler draws the recovered token proportionally to the residual (no explicit renormalisation:
its inverse-CDF draw, sampling/rng.py, scales by the row total, so unnormalised weights are fine).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sampling.outputs import SeqSamplingInput


@dataclass
class DraftDistribution:
    draft_ids: torch.Tensor    # [m, max_drafts] long, padded past each request's k
    num_drafts: torch.Tensor   # [m] long
    members: torch.Tensor      # [m_p] long: positions (in the m requests) that sent draft_probs
    stacked: torch.Tensor      # [sum of the members' k, vocab] float32: their draft_probs, stacked
    first_row: torch.Tensor    # [m_p] long: each member's first row in `stacked`
    member_drafts: torch.Tensor  # [m_p] long: each member's k

    @classmethod
    def build(cls, seqs: Sequence[SeqSamplingInput],
              draft_ids: torch.Tensor,   # [m, max_drafts] long
              num_drafts: torch.Tensor,  # [m] long
              vocab_size: int) -> DraftDistribution:
        members, tensors = [], []
        for i, seq in enumerate(seqs):
            k = len(seq.draft_token_ids)
            if seq.draft_probs is None or k == 0:
                continue
            if tuple(seq.draft_probs.shape) != (k, vocab_size):
                raise ValueError(f"draft_probs must be [k={k}, vocab={vocab_size}], "
                                 f"got {tuple(seq.draft_probs.shape)}")
            members.append(i)
            tensors.append(seq.draft_probs)
        device = draft_ids.device
        sizes = [t.shape[0] for t in tensors]
        stacked = (torch.cat(tensors).to(device=device, dtype=torch.float32) if tensors
                   else torch.empty(0, vocab_size, device=device))
        first = [0, *itertools.accumulate(sizes)][:-1]
        return cls(draft_ids=draft_ids, num_drafts=num_drafts,
                   members=torch.tensor(members, dtype=torch.long, device=device),
                   stacked=stacked,
                   first_row=torch.tensor(first, dtype=torch.long, device=device),
                   member_drafts=torch.tensor(sizes, dtype=torch.long, device=device))

    def prob_of_drafts(self) -> torch.Tensor:
        """[m, max_drafts]: draft_probs[j, draft_ids[j]], 1.0 for deterministic drafts (and padding)."""
        probs = torch.ones(self.draft_ids.shape, device=self.draft_ids.device)
        if self.members.numel() and self.draft_ids.shape[1]:
            positions = torch.arange(self.draft_ids.shape[1], device=self.draft_ids.device)
            # Padding positions j >= k read the member's last row; their acceptance is masked anyway.
            rows = self.first_row[:, None] + torch.minimum(positions[None, :],
                                                           self.member_drafts[:, None] - 1)
            probs[self.members] = self.stacked[rows, self.draft_ids[self.members]]
        return probs

    def residual(self, target_probs: torch.Tensor,  # [m, vocab] the target row at num_accepted
                 num_accepted: torch.Tensor,        # [m] long
                 ) -> torch.Tensor:
        """[m, vocab]: max(target_probs - draft_probs, 0) for rejected requests; target_probs otherwise.

        Requests that accepted all their drafts are sampling the bonus token, from the target itself.
        """
        rejected = num_accepted < self.num_drafts                                  # [m]
        weights = target_probs.clone()                                             # [m, vocab]
        if self.draft_ids.shape[1] == 0:
            return weights
        position = num_accepted.clamp(max=self.draft_ids.shape[1] - 1)[:, None]    # [m, 1]
        rejected_ids = self.draft_ids.gather(1, position)                          # [m, 1]
        # One-hot drafts: subtracting the one-hot row just zeroes the rejected token. Members are
        # overwritten below, and their own row subtraction covers that token anyway.
        kept = weights.gather(1, rejected_ids) * (~rejected)[:, None]
        weights.scatter_(1, rejected_ids, kept)
        if self.members.numel():
            # A member that accepted everything has no row at num_accepted; it reads its last row,
            # multiplied by 0 below.
            row = self.first_row + torch.minimum(num_accepted[self.members],
                                                 self.member_drafts - 1)           # [m_p]
            draft_rows = self.stacked[row] * rejected[self.members, None]          # [m_p, vocab]
            weights[self.members] = (target_probs[self.members] - draft_rows).clamp_(min=0.0)
        return weights
