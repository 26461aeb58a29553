"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> one assistant reply per choice.

Streaming follows OpenAI: each choice opens with a delta `{"role": "assistant", "content": ""}`,
then content deltas (one per engine step, all tokens accepted in that step at once), and the chunk
that carries its finish_reason; with include_usage a last chunk has `choices: []` and the usage.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from specserve.server.api.chat_tools import ToolCallFormat, ToolCallStream
from specserve.server.api.errors import APIError, bad_request
from specserve.server.api.generation import ChoiceState, until_disconnect
from specserve.server.api.logprobs import chat_logprobs
from specserve.server.api.params import (
    check_token_ids,
    resolve_max_tokens,
    sampling_params,
)
from specserve.server.api.protocol import ChatCompletionRequest
from specserve.server.api.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
)
from specserve.server.api.serving import Call, Serving
from specserve.server.api.streaming import primed, sse_response
from specserve.server.engine.outputs import RequestOutput


class ChatServing(Serving):
    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        deadline = self.deadline(req)
        engine = self.engine_for(req.model)
        prompt = await self._render(engine, req)
        spec, notice = self.choose_speculation(engine, req)
        prediction = await self.prediction_ids(engine, req, spec)
        structured = await self.structured(engine, req)
        max_tokens = resolve_max_tokens(req.requested_max_tokens, len(prompt), engine.max_model_len,
                                        None, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        vocab = engine.tokenizer.vocab_size

        def params_for(_: int, i: int):
            return sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, index=i, vocab_size=vocab,
                                   structured=structured)
        call_id = self.new_id("chatcmpl")
        subs = self.fan_out(call_id, [prompt], req.n, spec, params_for, prediction)
        call = Call(call_id, self.now(), engine.model_name, req, spec, notice, subs, [len(prompt)])
        if req.stream:
            # Waiting for the first output (queue, prefill) also watches for the client leaving.
            outputs = await until_disconnect(request, primed(self.outputs(engine, subs, deadline)))
            return sse_response(self._events(engine, call, outputs))
        states = await until_disconnect(request, self.collect(engine, subs, deadline))
        return self.json(self._response(engine, call, states))

    async def _render(self, engine: Any, req: ChatCompletionRequest) -> list[int]:
        tokenizer = engine.tokenizer
        if not tokenizer.has_chat_template:
            raise bad_request(f"the model {engine.model_name} has no chat template; use /v1/completions "
                              "with your own prompt format", param="messages", code="no_chat_template")
        messages = [m.to_template_dict() for m in req.messages]
        tools = [t.template_dict() for t in req.tools] if req.tools else None
        try:
            text = await asyncio.to_thread(tokenizer.render_chat, messages, True, tools)
        except Exception as exc:  # noqa: BLE001 - a template rejecting the messages is a user error
            raise bad_request(f"the chat template could not render these messages: {exc}",
                              param="messages") from None
        ids = await self.encode(engine, text, "messages")
        check_token_ids(ids, tokenizer.vocab_size, "messages")
        return ids

    def _logprobs(self, engine: Any, call: Call, entries: Any) -> ChatLogprobs | None:
        req = call.request
        assert isinstance(req, ChatCompletionRequest)
        if not req.logprobs:
            return None
        return chat_logprobs(engine.tokenizer, entries or [], req.top_logprobs or 0)

    def _tool_format(self, req: ChatCompletionRequest) -> ToolCallFormat | None:
        if not req.uses_tools:
            return None
        return ToolCallFormat(req.tool_choice, self.state.engine_config.tool_call_parser, req.parallel_tool_calls)

    def _response(self, engine: Any, call: Call, states: list[ChoiceState]) -> ChatCompletionResponse:
        assert isinstance(call.request, ChatCompletionRequest)
        tools = self._tool_format(call.request)
        choices = []
        for s in states:
            message, finish = (tools.message(s.text, s.finish_reason) if tools is not None
                               else (ChatResponseMessage(content=s.text), s.finish_reason))
            choices.append(ChatChoice(index=s.index, message=message,
                                      logprobs=self._logprobs(engine, call, s.logprobs), finish_reason=finish))
        return ChatCompletionResponse(id=call.id, created=call.created, model=call.model, choices=choices,
                                      usage=self.usage(call, states),
                                      speculation=self.speculation_info(call, states))

    async def _events(self, engine: Any, call: Call,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        states = [ChoiceState(index=i) for i in range(len(call.subs))]
        assert isinstance(call.request, ChatCompletionRequest)
        tools = self._tool_format(call.request)
        streams = [tools.stream() for _ in states] if tools is not None else None
        async with contextlib.aclosing(outputs):
            for i in range(len(call.subs)):
                yield self._chunk(call, i, ChatDelta(role="assistant", content=""), None, None)
            async for i, out in outputs:
                states[i].add(out)
                if not (out.token_ids or out.text or out.finished):
                    continue
                if out.finish_reason == "error":
                    raise APIError(500, "the engine failed while generating this request", type="server_error")
                if streams is not None:
                    async for chunk in self._tool_chunks(engine, call, streams[i], states[i], out):
                        yield chunk
                    continue
                delta = ChatDelta(content=out.text) if out.text or not out.finished else ChatDelta()
                spec = self.speculation_info(call, [states[i]]) if out.finished else None
                yield self._chunk(call, i, delta, self._logprobs(engine, call, out.logprobs),
                                  out.finish_reason if out.finished else None, spec)
            if call.include_usage:
                final = ChatCompletionChunk(id=call.id, created=call.created, model=call.model, choices=[],
                                            usage=self.usage(call, states),
                                            speculation=self.speculation_info(call, states))
                yield self.chunk(final, True)

    async def _tool_chunks(self, engine: Any, call: Call, stream: ToolCallStream, state: ChoiceState,
                           out: RequestOutput) -> AsyncIterator[dict[str, Any]]:
        """A choice's chunks when tools are in play: content and tool-call deltas, then its finish."""
        i = state.index
        delta = stream.feed(out.text)
        logprobs = self._logprobs(engine, call, out.logprobs)
        if delta is not None or (logprobs is not None and not out.finished):
            yield self._chunk(call, i, delta or ChatDelta(), logprobs, None)
            logprobs = None
        if not out.finished:
            return
        rest, finish = stream.finish(out.finish_reason)
        for extra in rest:
            yield self._chunk(call, i, extra, None, None)
        yield self._chunk(call, i, ChatDelta(), logprobs, finish, self.speculation_info(call, [state]))

    def _chunk(self, call: Call, index: int, delta: ChatDelta, logprobs: ChatLogprobs | None,
               finish_reason: str | None, spec: Any = None) -> dict[str, Any]:
        chunk = ChatCompletionChunk(id=call.id, created=call.created, model=call.model,
                                    choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                                             finish_reason=finish_reason)],
                                    speculation=spec)
        return self.chunk(chunk, call.include_usage)
