"""OpenAI response and stream-chunk schemas (completions, chat), plus our per-request `speculation` field.

Shapes follow OpenAI's exactly (ids "cmpl-..." / "chatcmpl-...", object names, `usage` with
`completion_tokens_details.accepted_prediction_tokens / rejected_prediction_tokens`); the extra
top-level `speculation` object reports what the speculative decoder did for this request.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from specserve.speculators.base import CUT_REASONS, SpecParams, SpecStats


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    audio_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class SpeculationRequested(BaseModel):
    method: str
    num_speculative_tokens: int


class SpeculationMethodUse(BaseModel):
    """`auto`: what one method did for the request (`none`: the steps auto chose plain decoding)."""
    num_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int


class SpeculationTree(BaseModel):
    top_k: int
    depth: int
    num_tree_steps: int = 0
    num_tree_nodes: int = 0
    accepted_depth: list[int] = Field(default_factory=list)
    mean_accepted_depth: float = 0.0


class SpeculationInfo(BaseModel):
    """What speculation did for this request (summed over its choices).

    `cuts` counts, per reason (speculators/base.py CUT_REASONS: token_budget, load, drafter_cache_full,
    prefix_unseen, prediction_ignored), the steps whose drafts were reduced or refused; `notice` says the
    same in words, and `requested` is what was asked for when the engine ran another method or k.
    All three are present only when the request did not get everything it asked for: speculation is
    never cut silently.
    """
    method: str
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_rate: float | None = None            # accepted / draft tokens (None: no drafts)
    mean_acceptance_length: float = 1.0                # tokens per verification step = 1 + accepted / drafts
    accepted_per_position: list[int] = Field(default_factory=list)
    num_steps_k_reduced: int = 0          # steps where the server's goodput policy drafted fewer than k
    cuts: dict[str, int] | None = None    # reason -> steps affected
    by_method: dict[str, SpeculationMethodUse] | None = None   # auto: per method it chose
    # structured outputs: steps where the grammar forbade a draft (rejected at that position; the token
    # emitted there came from the grammar-masked distribution). Absent for free-text requests.
    grammar_rejected: int | None = None
    # draft trees (absent for chains): the tree asked for, the steps that verified one, the nodes they
    # verified, and accepted_depth[d] = tree steps whose accepted path was d nodes deep
    draft_tree: SpeculationTree | None = None
    requested: SpeculationRequested | None = None
    notice: str | None = None

    @classmethod
    def from_stats(cls, stats: list[SpecStats], requested: SpecParams,
                   notice: str | None = None) -> SpeculationInfo:
        """`notice`: what the HTTP edge already decided (a prediction it could not use)."""
        drafts = sum(s.num_drafts for s in stats)
        draft_tokens = sum(s.num_draft_tokens for s in stats)
        accepted = sum(s.num_accepted_tokens for s in stats)
        per_pos = [0] * max((len(s.accepted_per_pos) for s in stats), default=0)
        for s in stats:
            for i, count in enumerate(s.accepted_per_pos):
                per_pos[i] += count
        cuts: dict[str, int] = {"prediction_ignored": 1} if notice is not None else {}
        for s in stats:
            for reason, count in s.cuts.items():
                cuts[reason] = cuts.get(reason, 0) + count
        used: dict[str, list[int]] = {}
        for s in stats:
            for m, row in s.by_method.items():
                acc = used.setdefault(m, [0, 0, 0])
                for j in range(3):
                    acc[j] += row[j]
        method = stats[0].method if stats else requested.method
        k = stats[0].k if stats else requested.k
        info = cls(method=method, num_speculative_tokens=k, num_drafts=drafts,
                   num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
                   acceptance_rate=accepted / draft_tokens if draft_tokens else None,
                   mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0,
                   accepted_per_position=per_pos, cuts=cuts or None,
                   num_steps_k_reduced=cuts.get("load", 0),
                   by_method={m: SpeculationMethodUse(num_steps=r[0], num_draft_tokens=r[1], num_accepted_tokens=r[2])
                              for m, r in used.items()} or None)
        if any(s.grammar_rejected for s in stats):
            info.grammar_rejected = sum(s.grammar_rejected for s in stats)
        info.draft_tree = _tree_info(stats)
        words = [notice] if notice is not None else []
        words += [f"{CUT_REASONS.get(r, r)} ({n} step{'s' if n != 1 else ''})"
                  for r, n in cuts.items() if r != "prediction_ignored"]
        if (method, k) != (requested.method, requested.k):
            info.requested = SpeculationRequested(method=requested.method,
                                                  num_speculative_tokens=requested.k)
            words.insert(0, f"asked for {requested.method} with k={requested.k}; "
                            f"the engine ran {method} with k={k}")
        info.notice = "; ".join(words) or None
        return info


# ---- /v1/completions -------------------------------------------------------------------------

class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    speculation: SpeculationInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: SpeculationInfo | None = None


# ---- /v1/chat/completions --------------------------------------------------------------------

class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str                  # JSON text, as OpenAI returns it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    speculation: SpeculationInfo | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculation: SpeculationInfo | None = None


def _tree_info(stats: list[SpecStats]) -> SpeculationTree | None:
    """The draft-tree part of the stats (n choices summed), or None when no choice asked for a tree."""
    trees = [s for s in stats if s.draft_tree is not None]
    if not trees:
        return None
    depth = [0] * max(len(s.accepted_depth_steps) for s in trees)
    for s in trees:
        for d, count in enumerate(s.accepted_depth_steps):
            depth[d] += count
    steps = sum(depth)
    return SpeculationTree(**trees[0].draft_tree, num_tree_steps=sum(s.num_tree_steps for s in trees),
                           num_tree_nodes=sum(s.num_tree_nodes for s in trees), accepted_depth=depth,
                           mean_accepted_depth=sum(d * c for d, c in enumerate(depth)) / steps if steps else 0.0)
