"""Sampler: target logits rows -> the processed distribution each request asked for.

For every row of a verification batch (see sampling/batch.py for the layout):

    raw logits --LogitsProcessor--> penalties, logit_bias, min_tokens ban   (all rows)
      greedy rows: argmax                                                   -> greedy_token_ids
      random rows: / temperature -> min_p -> top_k -> top_p -> softmax     -> target_probs

Work is skipped where it is not needed: greedy rows never pay for a softmax, only the rows of
requests that asked for min_p/top_k/top_p pay for a topk or sort, and a batch without penalties,
bias or bans never copies the logits before scaling. The per-request knobs become per-row tensors
through the batch's row groups, so there is no Python loop over rows.

Worked example: logits [2, 1, 0], temperature 0.5 -> [4, 2, 0] -> softmax [0.867, 0.117, 0.016];
with top_k = 2 -> [0.881, 0.119, 0]; a greedy row with the same logits emits token 0.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sampling.batch import SamplingBatch
from specserve.sampling.logits_processor import LogitsProcessor
from specserve.sampling.params import SamplingParams
from specserve.sampling.truncation import apply_min_p, apply_top_k_top_p


@dataclass
class ProcessedRows:
    greedy_token_ids: torch.Tensor   # [batch.greedy.num_rows] long, argmax of each greedy row
    target_probs: torch.Tensor       # [batch.random.num_rows, vocab] float32, rows sum to 1


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()):
        self.logits_processor = LogitsProcessor(eos_token_ids)

    def __call__(self, target_logits: torch.Tensor,  # [num_rows, vocab] float32, not modified
                 batch: SamplingBatch) -> ProcessedRows:
        logits = self.logits_processor(target_logits, batch)   # [num_rows, vocab]
        greedy, random = batch.greedy, batch.random
        if len(greedy) == 0:
            greedy_token_ids = torch.empty(0, dtype=torch.long, device=batch.device)
        elif greedy.covers_batch:
            greedy_token_ids = logits.argmax(dim=-1)
        else:
            greedy_token_ids = logits.index_select(0, greedy.rows).argmax(dim=-1)
        if len(random) == 0:
            target_probs = logits.new_empty(0, batch.vocab_size)
        else:
            rows = logits if random.covers_batch else logits.index_select(0, random.rows)
            target_probs = self._target_probs(rows, batch)
        return ProcessedRows(greedy_token_ids=greedy_token_ids, target_probs=target_probs)

    @staticmethod
    def _target_probs(logits: torch.Tensor,  # [batch.random.num_rows, vocab], penalised
                      batch: SamplingBatch) -> torch.Tensor:
        group = batch.random
        params = [batch.seqs[i].params for i in group.reqs]
        temperature = batch.per_request(group, [p.temperature for p in params], logits.dtype)
        scaled = logits / temperature[:, None]   # [rows, vocab], a fresh tensor: safe to edit in place
        vocab = batch.vocab_size
        members = [m for m, p in enumerate(params) if p.min_p > 0 or p.top_p < 1 or 0 < p.top_k < vocab]
        if len(members) == len(params):
            scaled = _truncate(scaled, params, group.local_req, batch)
        elif members:
            # Only the rows that asked for truncation pay for its topk / sort.
            local_rows, member_of_row = batch.member_rows(group, members)
            truncated = _truncate(scaled.index_select(0, local_rows), [params[m] for m in members],
                                  member_of_row, batch)
            scaled.index_copy_(0, local_rows, truncated)
        return scaled.softmax(dim=-1)


def _truncate(scaled: torch.Tensor,        # [rows, vocab] temperature-scaled logits
              params: list[SamplingParams],
              owner_of_row: torch.Tensor,  # [rows] long, index into params
              batch: SamplingBatch) -> torch.Tensor:
    """[rows, vocab]: min_p, then top_k, then top_p (sampling/truncation.py) with -inf cuts."""
    vocab = batch.vocab_size
    if any(p.min_p > 0.0 for p in params):
        apply_min_p(scaled, batch.per_row([p.min_p for p in params], owner_of_row, scaled.dtype))
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]   # vocab = off
    max_top_k = max((k for k in top_ks if k < vocab), default=0)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if not (use_top_p or max_top_k):
        return scaled
    return apply_top_k_top_p(scaled, batch.per_row(top_ks, owner_of_row, torch.long),
                             batch.per_row([p.top_p for p in params], owner_of_row, scaled.dtype),
                             max_top_k=max_top_k, use_top_p=use_top_p)
