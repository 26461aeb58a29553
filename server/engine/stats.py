"""Per-step and per-request statistics the engine emits; server/metrics.py turns them into Prometheus."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStepStats:
    """Speculation counters of one step for one method."""
    num_drafts: int = 0              # requests that verified >= 1 draft token this step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)    # [max k in step]
    tokens_per_step: list[int] = field(default_factory=list)     # per verifying request: accepted + 1
    num_grammar_rejected: int = 0    # requests whose drafts the grammar forbade at some position this step
    # per verifying request: ("chain" | "tree", drafts accepted: the accepted path's depth)
    accepted_depths: list[tuple[str, int]] = field(default_factory=list)
    num_tree_nodes: int = 0          # draft-tree nodes verified this step


@dataclass
class RequestTimings:
    """Filled when a request finishes (seconds, monotonic clock differences)."""
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    queue_time: float                 # arrival -> first scheduled
    ttft: float | None                # arrival -> first token
    e2e_latency: float
    inter_token_latencies: list[float] = field(default_factory=list)   # gaps between output events
    method: str = "none"


@dataclass
class StepStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0       # fraction of KV blocks in use
    num_preemptions: int = 0          # preemptions during this step
    num_prompt_tokens: int = 0        # prompt tokens computed this step (cache hits excluded)
    num_generation_tokens: int = 0    # tokens emitted this step
    spec: dict[str, SpecStepStats] = field(default_factory=dict)   # method -> counters
    spec_refused: dict[str, int] = field(default_factory=dict)     # reason -> requests refused/reduced this step
    spec_collapsed: dict[str, int] = field(default_factory=dict)   # method -> acceptance collapses reported
    finished: list[RequestTimings] = field(default_factory=list)
