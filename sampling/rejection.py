"""RejectionSampler: verify every request's drafts against the target in one vectorised pass.

Request i brings k_i >= 0 drafts and owns k_i + 1 consecutive logits rows; row j is the target's
next-token scores after prompt + output + drafts[:j]. k_i = 0 is plain decoding through the same
code: one row, nothing to verify, one bonus token.

Greedy requests (temperature 0): draft j is accepted while it equals the argmax of the processed
row j. At the first mismatch the row's argmax is emitted instead; if all k drafts match, the argmax
of the last row is the bonus token. Output == plain greedy decoding, token for token.

Seeded random requests (coupled sampling, sampling/coupled.py): row j's token is
argmax(log target_probs[j] + g_j), g_j Gumbel noise keyed by (seed, absolute position); drafts are
verified against those ids exactly as greedy drafts are against the argmax. Output == plain seeded
decoding, token for token, whatever the drafts.

Unseeded random requests (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): draft x_j is
accepted with probability min(1, target_probs[j, x_j] / draft_probs[j, x_j]). At the first
rejection j the *recovered* token is drawn from norm(max(target_probs[j] - draft_probs[j], 0)); if
all are accepted the *bonus* token is drawn from target_probs[k]. Each emitted token is then
distributed exactly as target_probs given the tokens before it. draft_probs = None means
deterministic drafts, i.e. one-hot: accept with probability target_probs[j, x_j], recover from
target_probs[j] with x_j zeroed.

Worked example (random, deterministic drafts), vocab 3, drafts [1, 2], uniforms [0.4, 0.7]:
  row 0 target_probs [0.2, 0.5, 0.3]: 0.4 < 0.5       -> accept 1
  row 1 target_probs [0.6, 0.1, 0.3]: 0.7 < 0.3 fails -> reject 2, recover from [0.6, 0.1, 0]
  output: token_ids = [1, r] with r ~ [6/7, 1/7, 0], num_accepted = 1 (row 2 is never read).

Not done here: the engine truncates the emitted tokens at stop tokens / stop strings / max_tokens
afterwards (an accepted run may cross a stop id), and rolls back the KV of rejected positions.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.sampling import coupled
from specserve.sampling.batch import RowGroup, SamplingBatch
from specserve.sampling.draft_distribution import DraftDistribution
from specserve.sampling.logits_processor import grammar_rows
from specserve.sampling.logprobs import collect_logprobs
from specserve.sampling.outputs import SeqSamplingInput, SeqSamplingOutput
from specserve.sampling.rng import RandomDraws, inverse_cdf
from specserve.sampling.sampler import Sampler


def _count_accepted(accepted: torch.Tensor,  # [m, max_drafts] bool
                    ) -> torch.Tensor:
    """[m] long: length of the leading run of True (drafts after the first rejection don't count)."""
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _plain_greedy(seq: SeqSamplingInput) -> bool:
    """Greedy with nothing that edits the scores this step (no penalty, bias, min_tokens ban) and no logprobs:
    the whole verification is an argmax per row (of the grammar-masked rows under a structured output)."""
    p = seq.params
    return (p.greedy and p.logprobs is None and not p.logit_bias and not p.has_penalties
            and p.min_tokens <= len(seq.output_token_ids))


def _verify_plain_greedy(target_logits: torch.Tensor,  # [sum_i(k_i + 1), vocab], any float dtype
                         seqs: Sequence[SeqSamplingInput]) -> list[SeqSamplingOutput]:
    """The greedy rule of the module docstring without the batched machinery: one argmax over all rows
    and one device->host copy, then each request's leading run of drafts equal to its rows' argmax.
    (argmax is exact in any dtype, and a bf16 -> float32 cast cannot change it, ties included.)"""
    grammar = grammar_rows(seqs, target_logits.shape[1], target_logits.device)
    if grammar is not None:                             # a grammar leaves at least one token in every row
        rows, allowed = grammar                         # [M], [M, vocab]
        target_logits = target_logits.index_copy(
            0, rows, target_logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
    best = target_logits.argmax(dim=-1).tolist()       # [rows]
    outputs, row = [], 0
    for seq in seqs:
        drafts = seq.draft_token_ids
        mine = best[row:row + len(drafts) + 1]
        n = 0
        while n < len(drafts) and drafts[n] == mine[n]:
            n += 1
        outputs.append(SeqSamplingOutput(token_ids=mine[:n + 1], num_accepted=n))
        row += len(drafts) + 1
    return outputs


class RejectionSampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()):
        # eos_token_ids: the model's EOS ids, banned (unless ignore_eos) while output < min_tokens.
        self.sampler = Sampler(eos_token_ids)

    def __call__(self, target_logits: torch.Tensor,  # [sum_i(k_i + 1), vocab] float32, not modified
                 seqs: Sequence[SeqSamplingInput]) -> list[SeqSamplingOutput]:
        if all(map(_plain_greedy, seqs)):
            return _verify_plain_greedy(target_logits, seqs)
        return self.verify_batched(target_logits, seqs)

    def verify_batched(self, target_logits: torch.Tensor,  # [sum_i(k_i + 1), vocab], not modified
                       seqs: Sequence[SeqSamplingInput]) -> list[SeqSamplingOutput]:
        """Every rule of the module docstring, vectorised over the batch (what __call__ runs unless the
        whole batch is plain greedy)."""
        # Penalties, softmax and cumulative sums need float32 even when the model ran in bf16.
        target_logits = target_logits.float()
        batch = SamplingBatch.build(seqs, target_logits)
        processed = self.sampler(target_logits, batch)
        width = batch.max_drafts + 1
        token_ids = torch.zeros(len(batch.seqs), width, dtype=torch.long, device=batch.device)  # [n, k+1]
        num_accepted = torch.zeros(len(batch.seqs), dtype=torch.long, device=batch.device)     # [n]
        if len(batch.greedy):
            tokens, accepted = self._verify_argmax(batch, batch.greedy, processed.greedy_token_ids)
            token_ids[batch.greedy.req_index] = tokens
            num_accepted[batch.greedy.req_index] = accepted
        for group, probs, verify in self._sampled_groups(batch, processed.target_probs):
            tokens, accepted = verify(batch, group, probs)
            token_ids[group.req_index] = tokens
            num_accepted[group.req_index] = accepted
        # One device->host copy for the whole batch.
        return self._outputs(target_logits, batch, token_ids.tolist(), num_accepted.tolist())

    def _sampled_groups(self, batch: SamplingBatch,
                        target_probs: torch.Tensor,  # [batch.random.num_rows, vocab] float32
                        ) -> list[tuple[RowGroup, torch.Tensor, object]]:
        """The sampled requests split into (group, its target_probs rows, verifier): seeded ones coupled,
        the others by rejection. A group that is all of batch.random reuses its rows without a copy."""
        random = batch.random
        if len(random) == 0:
            return []
        seeded = [m for m, i in enumerate(random.reqs) if batch.seqs[i].params.coupled]
        if not seeded:
            return [(random, target_probs, self._verify_random)]
        if len(seeded) == len(random):
            return [(random, target_probs, self._verify_coupled)]
        others = [m for m in range(len(random)) if m not in set(seeded)]
        out = []
        for members, verify in ((seeded, self._verify_coupled), (others, self._verify_random)):
            local_rows, _ = batch.member_rows(random, members)
            out.append((batch.group([random.reqs[m] for m in members]), target_probs.index_select(0, local_rows),
                        verify))
        return out

    @staticmethod
    def _verify_coupled(batch: SamplingBatch, group: RowGroup,
                        target_probs: torch.Tensor,  # [group.num_rows, vocab] float32
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Seeded requests: each row's token is its Gumbel-max (sampling/coupled.py), verified like greedy."""
        seqs = [batch.seqs[i] for i in group.reqs]
        seeds = batch.per_request(group, [s.params.seed for s in seqs], torch.long)             # [rows]
        first = batch.per_request(group, [len(s.prompt_token_ids) + len(s.output_token_ids) for s in seqs],
                                  torch.long)                                                    # [rows]
        keys = coupled.noise_keys(seeds, coupled.absolute_positions(first, group.row_pos))
        return RejectionSampler._verify_argmax(batch, group, coupled.coupled_choice(target_probs, keys))

    @staticmethod
    def _verify_argmax(batch: SamplingBatch, group: RowGroup,
                       argmax_ids: torch.Tensor,  # [group.num_rows] long: the token each row decides
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [m, max_drafts + 1] (valid up to num_accepted inclusive), num_accepted [m]."""
        max_drafts = batch.max_drafts
        columns = torch.arange(max_drafts + 1, device=batch.device)
        # Padding columns j > k read the request's last row; they are never emitted.
        rows = group.local_start[:, None] + torch.minimum(columns[None, :], group.num_drafts[:, None])
        target_ids = argmax_ids[rows]                                              # [m, k+1]
        drafts = batch.draft_ids.index_select(0, group.req_index)                  # [m, k]
        valid = columns[None, :max_drafts] < group.num_drafts[:, None]             # [m, k]
        accepted = (drafts == target_ids[:, :max_drafts]) & valid
        # Accepted drafts equal the argmax, so the argmax row holds the whole emitted run.
        return target_ids, _count_accepted(accepted)

    @staticmethod
    def _verify_random(batch: SamplingBatch, group: RowGroup,
                       target_probs: torch.Tensor,  # [group.num_rows, vocab] float32
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [m, max_drafts + 1] (valid up to num_accepted inclusive), num_accepted [m]."""
        max_drafts = batch.max_drafts
        seqs = [batch.seqs[i] for i in group.reqs]
        draws = RandomDraws.draw(seqs, max_drafts, batch.device)
        drafts = batch.draft_ids.index_select(0, group.req_index)                  # [m, k]
        draft_dist = DraftDistribution.build(seqs, drafts, group.num_drafts, batch.vocab_size)
        columns = torch.arange(max_drafts, device=batch.device)
        valid = columns[None, :] < group.num_drafts[:, None]                       # [m, k]
        rows = group.local_start[:, None] + torch.minimum(columns[None, :], group.num_drafts[:, None])
        target_of_drafts = target_probs[rows, drafts]                              # [m, k]
        draft_of_drafts = draft_dist.prob_of_drafts()                              # [m, k]
        # A draft the drafter gave probability 0 cannot have been sampled from it; accept it only if
        # the target allows it at all (ratio treated as 1 or 0) rather than divide by zero.
        ratio = torch.where(draft_of_drafts > 0,
                            target_of_drafts / draft_of_drafts.clamp(min=torch.finfo(torch.float32).tiny),
                            (target_of_drafts > 0).float()).clamp(max=1.0)
        num_accepted = _count_accepted((draws.uniforms < ratio) & valid)          # [m]
        final_rows = group.local_start + num_accepted                              # [m]
        final_target = target_probs.index_select(0, final_rows)                    # [m, vocab]
        weights = draft_dist.residual(final_target, num_accepted)                  # [m, vocab]
        # An all-zero residual needs target_probs == draft_probs at that row, where rejection has
        # probability 0; float rounding can still get there, and the target row is then exact.
        weights = torch.where(weights.sum(dim=-1, keepdim=True) > 0, weights, final_target)
        final_ids = inverse_cdf(weights, draws.final)                              # [m]
        tokens = torch.cat([drafts, drafts.new_zeros(len(seqs), 1)], dim=1)        # [m, k+1]
        tokens.scatter_(1, num_accepted[:, None], final_ids[:, None])
        return tokens, num_accepted

    @staticmethod
    def _outputs(target_logits: torch.Tensor,  # [num_rows, vocab] raw
                 batch: SamplingBatch, token_ids: list[list[int]], num_accepted: list[int],
                 ) -> list[SeqSamplingOutput]:
        outputs, logprob_owner = [], []
        lp_rows: list[int] = []
        lp_tokens: list[int] = []
        lp_top: list[int] = []
        for i, seq in enumerate(batch.seqs):
            emitted = token_ids[i][:num_accepted[i] + 1]
            outputs.append(SeqSamplingOutput(token_ids=emitted, num_accepted=num_accepted[i]))
            if seq.params.logprobs is not None:
                # The j-th emitted token came from the request's row j.
                lp_rows.extend(range(batch.row_start[i], batch.row_start[i] + len(emitted)))
                lp_tokens.extend(emitted)
                lp_top.extend([seq.params.logprobs] * len(emitted))
                logprob_owner.append(i)
        if logprob_owner:
            logprobs = iter(collect_logprobs(target_logits, lp_rows, lp_tokens, lp_top))
            for i in logprob_owner:
                outputs[i].logprobs = [next(logprobs) for _ in outputs[i].token_ids]
        return outputs
