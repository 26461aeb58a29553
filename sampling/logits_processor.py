"""LogitsProcessor: the user's edits to the target's scores that bind greedy decoding too.

Applied to every row, greedy or random, in this order:

1. penalties (sampling/penalties.py): defined on the model's own scores, as in HF/vLLM, so they
   come first (a repetition penalty divides a positive logit; it must see the model's sign).
2. logit_bias: the user's additive override, applied on top of the penalised scores (an explicit
   +100 still wins against a penalty, as OpenAI users expect).
3. min_tokens: while a row's output length (output + drafts[:j]) is below min_tokens, the request's
   stop token ids and, unless ignore_eos, the model's EOS ids get -inf. Last, so nothing re-enables
   them. A banned draft then has target probability 0 and is always rejected.
4. grammar: a structured-output request's rows get -inf wherever its grammar forbids the token; row j's
   mask was computed after the drafts before it (specserve/grammar/state.py), so a draft the grammar
   forbids has target probability 0 there and is rejected at that position, and the recovered token
   comes from the masked distribution. A grammar that leaves only stop tokens while min_tokens bans
   them wins: such a row keeps the grammar's tokens (an empty row has no distribution).

Temperature and top-k/top-p/min-p are argmax-invariant and live in sampling/sampler.py; they only
shape the distribution of random rows.

Worked example (min_tokens): output has 1 token, min_tokens = 3, drafts = [a, b, c], EOS = 2.
Rows j = 0, 1 have output lengths 1 and 2 < 3, so EOS is banned there; rows 2 and 3 may end.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.sampling.batch import SamplingBatch
from specserve.sampling.params import SamplingParams
from specserve.sampling.penalties import apply_penalties


class LogitsProcessor:
    def __init__(self, eos_token_ids: Sequence[int] = ()):
        # The model's end-of-sequence ids (tokenizer EOS plus generation_config's eos_token_id list).
        self.eos_token_ids = tuple(eos_token_ids)

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """Ids that end the request: what min_tokens bans. EOS does not end an ignore_eos request."""
        if params.ignore_eos:
            return list(params.stop_token_ids)
        if not params.stop_token_ids:   # the common case, kept cheap: it runs per request per step
            return list(self.eos_token_ids)
        return list(params.stop_token_ids) + [t for t in self.eos_token_ids if t not in params.stop_token_ids]

    def __call__(self, target_logits: torch.Tensor,  # [num_rows, vocab] float32, raw; not modified
                 batch: SamplingBatch) -> torch.Tensor:
        """[num_rows, vocab]: the scores after penalties, bias and bans (target_logits if none apply)."""
        seqs = batch.seqs
        needs_penalties = any(s.params.has_penalties for s in seqs)
        bias_reqs = [i for i, s in enumerate(seqs) if s.params.logit_bias]
        bans = {i: self.stop_ids(s.params) for i, s in enumerate(seqs)
                if len(s.output_token_ids) < s.params.min_tokens}
        bans = {i: ids for i, ids in bans.items() if ids}
        masked = [i for i, s in enumerate(seqs) if s.grammar_mask is not None]
        if not (needs_penalties or bias_reqs or bans or masked):
            return target_logits
        # Raw logits stay untouched: logprobs are reported from them.
        logits = target_logits.clone()
        apply_penalties(logits, batch)
        if bias_reqs:
            self._apply_logit_bias(logits, batch, bias_reqs)
        if bans:
            self._apply_min_tokens(logits, batch, bans)
        if masked:
            _apply_grammar(logits, target_logits, batch, masked)
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor,  # [num_rows, vocab], modified in place
                          batch: SamplingBatch, reqs: list[int]) -> None:
        entry_req, token_ids, biases = [], [], []
        for i in reqs:
            for token_id, bias in batch.seqs[i].params.logit_bias.items():
                entry_req.append(i)
                token_ids.append(int(token_id))
                biases.append(float(bias))
        entry_of, rows, _ = batch.entry_rows(entry_req, [batch.num_drafts[i] + 1 for i in entry_req])
        tokens = torch.tensor(token_ids, dtype=torch.long, device=batch.device)[entry_of]   # [M]
        values = torch.tensor(biases, dtype=logits.dtype, device=batch.device)[entry_of]    # [M]
        # A dict has each token once, so (row, token) pairs are unique and accumulate is a plain +=.
        logits.index_put_((rows, tokens), values, accumulate=True)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor,  # [num_rows, vocab], modified in place
                          batch: SamplingBatch, bans: dict[int, list[int]]) -> None:
        """bans: request index -> the stop ids it must not emit before min_tokens."""
        entry_req, token_ids, entry_nrows = [], [], []
        for i, stop_ids in bans.items():
            seq = batch.seqs[i]
            # Row j has len(output) + j generated tokens before it; it is banned while that is short.
            banned_rows = min(batch.num_drafts[i] + 1, seq.params.min_tokens - len(seq.output_token_ids))
            for token_id in stop_ids:
                entry_req.append(i)
                token_ids.append(token_id)
                entry_nrows.append(banned_rows)
        entry_of, rows, _ = batch.entry_rows(entry_req, entry_nrows)
        tokens = torch.tensor(token_ids, dtype=torch.long, device=batch.device)[entry_of]   # [M]
        logits[rows, tokens] = float("-inf")


def grammar_rows(seqs: Sequence, vocab: int, device: torch.device,
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows [M] long, allowed [M, vocab] bool) of the requests with a grammar_mask, rows counted over the
    whole ragged batch (request i owns len(draft_token_ids) + 1 rows); None when no request has one."""
    rows, masks, start = [], [], 0
    for seq in seqs:
        n = len(seq.draft_token_ids) + 1
        mask = seq.grammar_mask                                         # [n, mask vocab] bool
        if mask is not None:
            width = min(mask.shape[1], vocab)
            if width < vocab:                                           # ids the tokenizer does not have
                mask = torch.cat([mask[:, :width], mask.new_zeros(n, vocab - width)], dim=1)
            rows.append(torch.arange(start, start + n))
            masks.append(mask[:, :vocab])
        start += n
    if not rows:
        return None
    return torch.cat(rows).to(device), torch.cat(masks).to(device)


def _apply_grammar(logits: torch.Tensor,         # [num_rows, vocab], modified in place
                   target_logits: torch.Tensor,  # [num_rows, vocab] raw
                   batch: SamplingBatch, reqs: list[int]) -> None:
    found = grammar_rows(batch.seqs, batch.vocab_size, batch.device)
    assert found is not None and reqs
    rows, allowed = found                                               # [M], [M, vocab]
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    empty = ~torch.isfinite(masked).any(dim=-1)                         # [M]
    if bool(empty.any()):
        masked[empty] = target_logits.index_select(0, rows[empty]).masked_fill(~allowed[empty], float("-inf"))
    logits.index_copy_(0, rows, masked)
