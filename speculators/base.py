"""The speculator interface and the per-request speculation choice."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import torch

METHODS = ("none", "ngram", "prediction", "draft", "eagle3", "mtp")


@dataclass(frozen=True)
class SpecParams:
    """One request's speculation choice. method 'none' or k == 0 is plain decoding (same code path)."""
    method: str = "none"
    num_speculative_tokens: int = 0
    options: dict[str, Any] = field(default_factory=dict)   # method options, e.g. prompt_lookup_min/max

    @property
    def k(self) -> int:
        return 0 if self.method == "none" else self.num_speculative_tokens


@dataclass
class SpecStats:
    """Per-request speculation counters, reported in the response's `speculation` field."""
    method: str = "none"
    k: int = 0
    num_drafts: int = 0            # verification steps that carried >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [k]

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class DraftProposal:
    token_ids: list[list[int]]                   # per request, k_i draft ids (k_i may be < asked, even 0)
    draft_probs: list["torch.Tensor | None"]     # per request, [k_i, vocab] or None (deterministic drafts)


class Speculator(Protocol):
    name: str

    def propose(self, requests: Sequence[Any], ks: Sequence[int]) -> DraftProposal:
        """Up to ks[i] draft tokens for requests[i] (engine Request objects, read-only)."""
        ...

    def update(self, requests: Sequence[Any], num_accepted: Sequence[int]) -> None:
        """Called after verification, for methods that keep state (draft KV, hidden states)."""
        ...

    def release(self, request: Any) -> None:
        """Forget per-request state (request finished, aborted or preempted)."""
        ...
