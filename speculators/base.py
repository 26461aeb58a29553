"""The speculator interface and the per-request speculation choice."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

METHODS = ("none", "ngram", "prediction", "draft", "eagle3", "mtp", "hybrid")


@dataclass(frozen=True)
class SpecParams:
    """One request's speculation choice. method 'none' or k == 0 is plain decoding (same code path)."""
    method: str = "none"
    num_speculative_tokens: int = 0
    options: dict[str, Any] = field(default_factory=dict)   # method options, e.g. prompt_lookup_min/max
    adaptive: bool = True      # False: always draft k (the server's goodput policy never cuts it)

    @property
    def k(self) -> int:
        return 0 if self.method == "none" else self.num_speculative_tokens


def count_accepted_positions(per_pos: list[int], num_draft: int, num_accepted: int) -> None:
    """Grow per_pos to num_draft entries and count one acceptance at positions 0..num_accepted-1."""
    if len(per_pos) < num_draft:
        per_pos.extend([0] * (num_draft - len(per_pos)))
    for i in range(num_accepted):
        per_pos[i] += 1


def attempted_positions(num_draft: int, num_accepted: int) -> int:
    """Draft positions a verification reached: the accepted ones plus the first rejected one, if any.
    accepted / attempted estimates the acceptance at a position given the earlier ones were accepted."""
    return min(num_accepted + 1, num_draft)


@dataclass
class SpecStats:
    """Per-request speculation counters, reported in the response's `speculation` field."""
    method: str = "none"
    k: int = 0
    num_drafts: int = 0            # verification steps that carried >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [k]
    num_attempted_positions: int = 0   # positions reached: accepted + the first rejected one (acceptance estimate)
    num_steps_k_reduced: int = 0       # steps where the goodput policy drafted fewer than k

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_attempted_positions += attempted_positions(num_draft, num_accepted)
        count_accepted_positions(self.accepted_per_pos, num_draft, num_accepted)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class DraftProposal:
    token_ids: list[list[int]]                   # per request, k_i draft ids (k_i may be < asked, even 0)
    draft_probs: list[torch.Tensor | None]     # per request, [k_i, vocab] or None (deterministic drafts)


@dataclass
class VerifiedStep:
    """What one target forward computed for the requests of one method (prefill chunks included).

    Model-based speculators read the target's hidden states here (EAGLE-3 taps, MTP inputs) instead of
    running the target again. Row r of `hidden` belongs to requests[i] when
    token_offsets[i] <= r < token_offsets[i] + query_lens[i]; those rows are the positions
    num_computed_before[i] .. num_computed_before[i] + query_lens[i] - 1 of that request, i.e. its known
    tokens followed by the drafts it verified. Only the first `valid_lens[i]` rows hold states of tokens
    that stay in the context (the known tokens + accepted drafts); the rest were rejected.
    """
    requests: list[Any]
    num_computed_before: list[int]     # the request's num_computed_tokens when the step began
    token_offsets: list[int]
    query_lens: list[int]
    valid_lens: list[int]
    num_accepted: list[int]            # accepted drafts (0 for prefill chunks)
    sampled: list[bool]                # whether the step emitted tokens for the request
    hidden: torch.Tensor             # [num_tokens, hidden] final-normed target states
    prenorm_hidden: torch.Tensor     # [num_tokens, hidden] before the final norm
    aux_hidden: list[torch.Tensor]   # per tapped layer [num_tokens, hidden] (empty unless requested)


class Speculator(Protocol):
    name: str
    # target layers whose entering residual streams the speculator needs from every forward (EAGLE-3)
    aux_layer_ids: tuple[int, ...] = ()

    def validate(self, options: dict) -> None:
        """Raise ValueError for method options it does not understand (HTTP 400)."""
        ...

    def propose(self, requests: Sequence[Any], ks: Sequence[int]) -> DraftProposal:
        """Up to ks[i] draft tokens for requests[i] (engine Request objects, read-only)."""
        ...

    def observe(self, step: VerifiedStep) -> None:
        """Called after every forward that included requests of this method (after update of the
        requests' counters and outputs), for methods that keep state (draft KV, hidden states)."""
        ...

    def release(self, request: Any) -> None:
        """Forget per-request state (request finished, aborted or preempted)."""
        ...

    # Optional, model-based drafters: `refusals` (collections.Counter reason -> count of what they could
    # not do, drained into spec_decode_refused_total every step); `records_states` + `record(step,
    # slot_mapping)` (see every target forward's rows, for the prefix-cache state stash).
