"""Serving: what /v1/completions and /v1/chat/completions share.

Model check, tokenization (bounded: text that cannot fit the context is refused before the tokenizer
runs), prediction tokens, the fan-out of one HTTP request into engine requests (prompts x n choices,
choice index = prompt index * n + i), its deadline, usage and speculation reports, and JSON
rendering of responses and chunks.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel

from specserve.sampling.params import SamplingParams, StructuredSpec
from specserve.server.api.errors import bad_request
from specserve.server.api.generation import ChoiceState, SubRequest, collect, fan_in
from specserve.server.api.params import speculation
from specserve.server.api.protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.api.responses import (
    CompletionTokensDetails,
    PromptTokensDetails,
    SpeculationInfo,
    Usage,
)
from specserve.server.api.state import ServerState
from specserve.server.api.structured import request_spec
from specserve.server.api.tools import forced_spec
from specserve.speculators.base import SpecParams

AnyRequest = CompletionRequest | ChatCompletionRequest


@dataclass
class Call:
    """One HTTP request in flight: its id, what it asked for and its engine requests."""
    id: str
    created: int
    model: str
    request: AnyRequest
    spec: SpecParams
    notice: str | None
    subs: list[SubRequest]
    prompt_lens: list[int]            # per prompt (usage counts each prompt once, whatever n is)

    @property
    def include_usage(self) -> bool:
        return self.request.include_usage


class Serving:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def engine_for(self, model: str | None) -> Any:
        self.state.check_model(model)
        return self.state.engine

    async def encode(self, engine: Any, text: str, param: str = "prompt") -> list[int]:
        """Token ids of `text`; 400 when it cannot fit the context or the tokenizer refuses it."""
        cap = self.state.max_prompt_chars(engine)
        if len(text) > cap:
            raise bad_request(f"{param} is {len(text)} characters: more than this model's context of "
                              f"{engine.max_model_len} tokens can hold whatever the text (at most {cap})",
                              param=param, code="context_length_exceeded")
        try:
            if len(text) < 4096:
                return engine.tokenizer.encode(text)
            return await asyncio.to_thread(engine.tokenizer.encode, text)
        except (TypeError, ValueError, UnicodeError) as exc:
            raise bad_request(f"{param} could not be tokenized: {exc}", param=param) from None

    def deadline(self, req: AnyRequest) -> float | None:
        """Event-loop time by which the request must be done (--request-timeout, request_timeout)."""
        timeouts = [t for t in (self.state.limits.request_timeout, req.request_timeout) if t is not None]
        return asyncio.get_running_loop().time() + min(timeouts) if timeouts else None

    def outputs(self, engine: Any, subs: list[SubRequest], deadline: float | None
                ) -> AsyncIterator[tuple[int, Any]]:
        return fan_in(engine, subs, self.state.admission, deadline)

    async def collect(self, engine: Any, subs: list[SubRequest], deadline: float | None) -> list[ChoiceState]:
        return await collect(self.outputs(engine, subs, deadline), len(subs))

    def choose_speculation(self, engine: Any, req: AnyRequest) -> tuple[SpecParams, str | None]:
        """The request's speculation and its notice; a refusal is counted, never silent."""
        spec, notice = speculation(engine, req)
        if notice is not None:
            self.state.metrics.on_spec_refused("prediction_ignored")
        return spec, notice

    async def structured(self, engine: Any, req: AnyRequest) -> StructuredSpec | None:
        """The request's output constraint (response_format, structured_outputs, or a forced tool call),
        compiled off the event loop; 400 naming the problem when it cannot be used."""
        try:
            spec, param = request_spec(req.response_format, req.structured_outputs)
        except ValueError as exc:
            raise bad_request(str(exc), param="response_format") from None
        if isinstance(req, ChatCompletionRequest) and req.uses_tools:
            spec, param = forced_spec(req.tools or [], req.tool_choice, req.parallel_tool_calls), "tools"
        if spec is None:
            return None
        try:
            await engine.check_structured(spec)
        except ValueError as exc:
            raise bad_request(str(exc), param=param, code="invalid_structured_output") from None
        return spec

    async def prediction_ids(self, engine: Any, req: AnyRequest, spec: SpecParams) -> list[int] | None:
        """Predicted Outputs' text as token ids (the prediction speculator's draft source)."""
        if req.prediction is None or spec.method != "prediction":
            return None
        ids = await self.encode(engine, req.prediction.text, "prediction")
        if len(ids) > engine.max_model_len:
            raise bad_request(f"prediction is {len(ids)} tokens, longer than the model's context "
                              f"({engine.max_model_len})", param="prediction")
        return ids

    @staticmethod
    def fan_out(call_id: str, prompts: list[list[int]], n: int, spec: SpecParams,
                params_for: Callable[[int, int], SamplingParams], prediction: list[int] | None,
                prompt_logprobs: bool = False) -> list[SubRequest]:
        """One SubRequest per (prompt, choice); params_for(prompt index, choice index)."""
        subs: list[SubRequest] = []
        for p, ids in enumerate(prompts):
            for i in range(n):
                subs.append(SubRequest(f"{call_id}-{len(subs)}", ids, params_for(p, i), spec,
                                       prediction, prompt_logprobs))
        return subs

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def now() -> int:
        return int(time.time())

    # ---- reports ---------------------------------------------------------------------------------

    @staticmethod
    def usage(call: Call, states: list[ChoiceState]) -> Usage:
        prompt_tokens = sum(call.prompt_lens)
        completion_tokens = sum(s.num_output_tokens for s in states)
        # Prompts are counted once whatever n is; so are their cached tokens (first choice's count).
        n = max(1, len(states) // max(1, len(call.prompt_lens)))
        cached = sum(s.num_cached_tokens for s in states[::n])
        details = CompletionTokensDetails()
        if call.spec.method == "prediction":
            accepted = sum(s.spec_stats.num_accepted_tokens for s in states)
            drafted = sum(s.spec_stats.num_draft_tokens for s in states)
            details.accepted_prediction_tokens = accepted
            details.rejected_prediction_tokens = drafted - accepted
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     completion_tokens_details=details)

    @staticmethod
    def speculation_info(call: Call, states: list[ChoiceState]) -> SpeculationInfo:
        return SpeculationInfo.from_stats([s.spec_stats for s in states], call.spec, call.notice)

    # ---- rendering -------------------------------------------------------------------------------

    @staticmethod
    def json(model: BaseModel) -> Response:
        return Response(content=model.model_dump_json(), media_type="application/json")

    @staticmethod
    def chunk(model: BaseModel, include_usage: bool) -> dict[str, Any]:
        """A stream chunk as OpenAI sends it: `usage` only when asked for (then null until the end),
        `speculation` only on chunks that finish a choice, empty chat deltas as `{}`."""
        data = model.model_dump()
        if not include_usage:
            data.pop("usage", None)
        if data.get("speculation") is None:
            data.pop("speculation", None)
        for choice in data.get("choices", ()):
            if "delta" in choice:
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
                for call in choice["delta"].get("tool_calls", ()):
                    _drop_none(call)
        return data



def _drop_none(data: dict[str, Any]) -> None:
    """Tool-call deltas carry only what is new (OpenAI omits id, type and name after the first)."""
    for key in [k for k, v in data.items() if v is None]:
        del data[key]
    for value in data.values():
        if isinstance(value, dict):
            _drop_none(value)
