"""What the engine hands back to the HTTP layer, per request, per step."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.sampling.outputs import TokenLogprob
from specserve.speculators.base import SpecStats


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]                  # tokens emitted since the previous output (a whole accepted run)
    text: str                             # text delta since the previous output (stop strings cut out)
    logprobs: list[TokenLogprob] | None   # one per token in token_ids when logprobs were asked
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0            # total so far (usage.completion_tokens when finished)
    num_cached_tokens: int = 0
    spec_stats: SpecStats = field(default_factory=SpecStats)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # echo + logprobs: first entry None
