"""Request bookkeeping shared by scheduler and engine. No torch here (the scheduler is tested in ms)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from specserve.sampling.params import SamplingParams
from specserve.speculators.base import SpecParams, SpecStats


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    spec_params: SpecParams = field(default_factory=SpecParams)
    arrival_time: float = field(default_factory=time.monotonic)
    # per-request speculation payload (e.g. Predicted Outputs' token ids); speculators read it
    prediction_token_ids: list[int] | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Invariant: the KV cache holds valid entries for all_token_ids[:num_computed_tokens].
    # Rollback of rejected drafts is this counter alone; their slots are overwritten later.
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0     # prompt tokens served from the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)      # chained hashes of full, computed blocks
    needs_prompt_logprobs: bool = False
    draft_token_ids: list[int] = field(default_factory=list)   # drafts verified in the current step
    num_preemptions: int = 0
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # matched stop string or stop token id
    spec_stats: SpecStats = field(default_factory=SpecStats)
    # specserve.grammar.state.GrammarState of a structured-output request (None: free text); drafters and
    # the verifier mask with it
    grammar: Any = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    itl: list[float] = field(default_factory=list)     # gaps between output events (seconds)

    def __post_init__(self) -> None:
        self.spec_stats.method = self.spec_params.method
        self.spec_stats.k = self.spec_params.k
        tree = self.spec_params.draft_tree
        if tree is not None and tree.top_k > 1:
            self.spec_stats.draft_tree = {"top_k": tree.top_k, "depth": tree.depth}

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating prompt and output (hot path)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
