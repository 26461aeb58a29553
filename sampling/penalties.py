"""Penalties: repetition (HF/vLLM), presence and frequency (OpenAI), applied per verification row.

Semantics, for a row whose history is prompt + output + drafts[:j]:

- repetition_penalty r (multiplicative, over prompt + output + drafts[:j]): a seen token's logit
  becomes logit / r when positive and logit * r otherwise, so r > 1 always makes it less likely.
- frequency_penalty f and presence_penalty p (additive, over generated tokens only, i.e.
  output + drafts[:j]): logit -= f * count + p * (count > 0).

Why the draft prefix matters: if the drafts are accepted, row j's token is emitted right after
them, and plain decoding would have penalised it with drafts[:j] already in the output. Forgetting
them makes speculative output differ from plain output (vLLM and TGI both shipped that bug), and the
statistical test in tests/test_rejection_stats.py fails when `add_draft_prefix` is disabled.

Worked example: output = [5], drafts = [7, 5], frequency_penalty = 1. Row 0 sees counts {5: 1};
row 1 sees {5: 1, 7: 1}; row 2 sees {5: 2, 7: 1}, so token 5 loses 1, 1 and 2 logits respectively.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from specserve.sampling.batch import RowGroup, SamplingBatch
from specserve.sampling.outputs import SeqSamplingInput


def _flat_index(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
                ) -> torch.Tensor:
    """Index into a flattened [len(token_lists), vocab] table: list e, token t -> e * vocab + t."""
    lengths = [len(t) for t in token_lists]
    total = sum(lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long,
                          device=device)                                        # [total]
    owner = torch.repeat_interleave(torch.arange(len(token_lists), device=device),
                                    torch.tensor(lengths, dtype=torch.long, device=device), output_size=total)
    return owner * vocab_size + tokens                                         # [total]


def output_counts(seqs: Sequence[SeqSamplingInput], vocab_size: int, device: torch.device,
                  ) -> torch.Tensor:
    """[len(seqs), vocab] float32: how often each token occurs in each request's output so far."""
    index = _flat_index([s.output_token_ids for s in seqs], vocab_size, device)
    counts = torch.zeros(len(seqs) * vocab_size, dtype=torch.float32, device=device)
    # float adds of 1.0 are exact below 2**24, so a scatter in any order gives the same counts
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts.view(len(seqs), vocab_size)


def prompt_mask(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
                ) -> torch.Tensor:
    """[len(token_lists), vocab] bool: which tokens occur in each list."""
    mask = torch.zeros(len(token_lists) * vocab_size, dtype=torch.bool, device=device)
    mask[_flat_index(token_lists, vocab_size, device)] = True
    return mask.view(len(token_lists), vocab_size)


def add_draft_prefix(counts: torch.Tensor,      # [rows, vocab] float32, modified in place
                     prefix_ids: torch.Tensor,  # [rows, max_drafts] long, the request's drafts
                     row_pos: torch.Tensor,     # [rows] long, j: how many of them precede the row
                     ) -> None:
    """counts[r] += one per token in drafts[:row_pos[r]]: the row's speculative output suffix."""
    max_drafts = prefix_ids.shape[1]
    if max_drafts == 0:
        return
    positions = torch.arange(max_drafts, device=counts.device)
    weights = (positions[None, :] < row_pos[:, None]).to(counts.dtype)   # [rows, max_drafts]
    counts.scatter_add_(1, prefix_ids, weights)


def _penalised(logits: torch.Tensor,      # [rows, vocab] raw scores of the group's rows
               counts: torch.Tensor,      # [rows, vocab] generated-token counts incl. draft prefix
               group: RowGroup, batch: SamplingBatch) -> torch.Tensor:
    params = [batch.seqs[i].params for i in group.reqs]
    if any(p.repetition_penalty != 1.0 for p in params):
        # Prompt tokens only of requests that use the repetition penalty: the others don't read it.
        prompts = [s.prompt_token_ids if s.params.repetition_penalty != 1.0 else ()
                   for s in (batch.seqs[i] for i in group.reqs)]
        seen = prompt_mask(prompts, batch.vocab_size, batch.device)[group.local_req] | (counts > 0)
        rep = batch.per_request(group, [p.repetition_penalty for p in params], logits.dtype)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        freq = batch.per_request(group, [p.frequency_penalty for p in params], logits.dtype)[:, None]
        pres = batch.per_request(group, [p.presence_penalty for p in params], logits.dtype)[:, None]
        logits = logits - freq * counts - pres * (counts > 0).to(logits.dtype)
    return logits


def apply_penalties(logits: torch.Tensor,  # [num_rows, vocab] float32, modified in place
                    batch: SamplingBatch) -> None:
    """Apply each request's penalties to its rows; requests without penalties cost nothing."""
    reqs = [i for i, s in enumerate(batch.seqs) if s.params.has_penalties]
    if not reqs:
        return
    group = batch.group(reqs)
    seqs = [batch.seqs[i] for i in reqs]
    counts = output_counts(seqs, batch.vocab_size, batch.device)[group.local_req]   # [rows_p, vocab]
    prefix_ids = batch.draft_ids.index_select(0, group.req_index)[group.local_req]  # [rows_p, kmax]
    add_draft_prefix(counts, prefix_ids, group.row_pos)
    if group.covers_batch:
        logits.copy_(_penalised(logits, counts, group, batch))
    else:
        logits.index_copy_(0, group.rows, _penalised(logits[group.rows], counts, group, batch))
