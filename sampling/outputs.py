"""Typed values crossing the sampler boundary (engine <-> sampling)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float                                        # the target model's log-probability of token_id
    top: list[tuple[int, float]] = field(default_factory=list)   # top-N (token_id, logprob), best first


@dataclass
class SeqSamplingInput:
    """One request's rows in the verification batch: rows = len(draft_token_ids) + 1 consecutive logits rows.

    Row j is the target's next-token distribution after all_tokens + draft_token_ids[:j].
    """
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]           # emitted before this step (drafts not included)
    draft_token_ids: Sequence[int] = ()       # k_i >= 0 drafts being verified
    draft_probs: torch.Tensor | None = None   # [k_i, vocab] float32, or None = deterministic (one-hot)
    # [k_i + 1, vocab] bool, the grammar's allowed tokens at each row (row j after drafts[:j]), or None
    grammar_mask: torch.Tensor | None = None


@dataclass
class SeqSamplingOutput:
    token_ids: list[int]                      # 1 .. k_i + 1 tokens: accepted drafts + recovered/bonus token
    num_accepted: int                         # drafts accepted (len(token_ids) - 1)
    logprobs: list[TokenLogprob] | None = None   # one per emitted token when params.logprobs is not None
