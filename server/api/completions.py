"""POST /v1/completions: prompts (text, texts, token ids, lists of token ids) -> text completions.

Echo prepends the prompt text (token-id prompts are decoded); with logprobs it also returns the
prompt's logprobs, the first token's being null. Streaming sends one chunk per engine step per
choice (all tokens accepted in that step at once); an echoed prompt goes out just before the
choice's first generated text.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from specserve.server.api.errors import APIError, bad_request
from specserve.server.api.generation import ChoiceState, until_disconnect
from specserve.server.api.logprobs import CompletionLogprobsFormatter, merge
from specserve.server.api.params import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    check_token_ids,
    resolve_max_tokens,
    sampling_params,
)
from specserve.server.api.protocol import CompletionRequest
from specserve.server.api.responses import CompletionChoice, CompletionChunk, CompletionResponse
from specserve.server.api.serving import Call, Serving
from specserve.server.api.streaming import primed, sse_response
from specserve.server.engine.outputs import RequestOutput


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None               # as sent; None for token-id prompts (decoded only for echo)


class CompletionServing(Serving):
    async def create(self, req: CompletionRequest, request: Request) -> Response:
        deadline = self.deadline(req)
        engine = self.engine_for(req.model)
        prompts = await self._prompts(engine, req)
        spec, notice = self.choose_speculation(engine, req)
        prediction = await self.prediction_ids(engine, req, spec)
        structured = await self.structured(engine, req)
        max_tokens = [resolve_max_tokens(req.max_tokens, len(p.token_ids), engine.max_model_len,
                                         COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt") for p in prompts]
        vocab = engine.tokenizer.vocab_size

        def params_for(p: int, i: int):
            return sampling_params(req, max_tokens=max_tokens[p], logprobs=req.logprobs, index=i,
                                   vocab_size=vocab, structured=structured)
        call_id = self.new_id("cmpl")
        subs = self.fan_out(call_id, [p.token_ids for p in prompts], req.n, spec, params_for,
                            prediction, prompt_logprobs=req.echo and req.logprobs is not None)
        call = Call(call_id, self.now(), engine.model_name, req, spec, notice, subs,
                    [len(p.token_ids) for p in prompts])
        choice_prompts = [prompts[i // req.n] for i in range(len(subs))]
        if req.stream:
            # Waiting for the first output (queue, prefill) also watches for the client leaving.
            outputs = await until_disconnect(request, primed(self.outputs(engine, subs, deadline)))
            return sse_response(self._events(engine, call, choice_prompts, outputs))
        states = await until_disconnect(request, self.collect(engine, subs, deadline))
        return self.json(self._response(engine, call, choice_prompts, states))

    async def _prompts(self, engine: Any, req: CompletionRequest) -> list[Prompt]:
        raw = req.prompt
        batched = not (isinstance(raw, str) or (raw and isinstance(raw[0], int)))
        if not batched:
            raw = [raw]
        if not raw:
            raise bad_request("prompt must not be empty", param="prompt")
        prompts: list[Prompt] = []
        for i, item in enumerate(raw):
            param = f"prompt.{i}" if batched else "prompt"
            if isinstance(item, str):
                if not item:
                    raise bad_request(f"{param} must not be an empty string", param=param)
                prompts.append(Prompt(await self.encode(engine, item, param), item))
            else:
                prompts.append(Prompt(list(item), None))
            check_token_ids(prompts[-1].token_ids, engine.tokenizer.vocab_size, param)
        return prompts

    @staticmethod
    def _echo_text(engine: Any, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else engine.tokenizer.decode(prompt.token_ids)

    def _formatter(self, engine: Any, req: CompletionRequest) -> CompletionLogprobsFormatter | None:
        if req.logprobs is None:
            return None
        return CompletionLogprobsFormatter(engine.tokenizer, req.logprobs)

    def _response(self, engine: Any, call: Call, prompts: list[Prompt],
                  states: list[ChoiceState]) -> CompletionResponse:
        req = call.request
        assert isinstance(req, CompletionRequest)
        choices = []
        for state, prompt in zip(states, prompts):
            text = (self._echo_text(engine, prompt) if req.echo else "") + state.text
            fmt = self._formatter(engine, req)
            logprobs = None
            if fmt is not None:
                logprobs = fmt.prompt(prompt.token_ids, state.prompt_logprobs) if req.echo else None
                logprobs = merge(logprobs, fmt.output(state.logprobs))
            choices.append(CompletionChoice(index=state.index, text=text, logprobs=logprobs,
                                            finish_reason=state.finish_reason))
        return CompletionResponse(id=call.id, created=call.created, model=call.model, choices=choices,
                                  usage=self.usage(call, states),
                                  speculation=self.speculation_info(call, states))

    async def _events(self, engine: Any, call: Call, prompts: list[Prompt],
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        req = call.request
        assert isinstance(req, CompletionRequest)
        states = [ChoiceState(index=i) for i in range(len(call.subs))]
        formatters = [self._formatter(engine, req) for _ in call.subs]
        started = [False] * len(call.subs)
        async with contextlib.aclosing(outputs):
            async for i, out in outputs:
                state, fmt = states[i], formatters[i]
                state.add(out)
                if not (out.token_ids or out.text or out.finished):
                    continue                          # e.g. a prefill chunk's prompt logprobs only
                if out.finish_reason == "error":
                    raise APIError(500, "the engine failed while generating this request", type="server_error")
                if req.echo and not started[i]:
                    echo_lp = fmt.prompt(prompts[i].token_ids, state.prompt_logprobs) if fmt else None
                    echo = self._chunk(call, i, self._echo_text(engine, prompts[i]), echo_lp, None)
                    yield self.chunk(echo, call.include_usage)
                started[i] = True
                logprobs = fmt.output(out.logprobs or []) if fmt else None
                chunk = self._chunk(call, i, out.text, logprobs, out.finish_reason if out.finished else None)
                if out.finished:
                    chunk.speculation = self.speculation_info(call, [state])
                yield self.chunk(chunk, call.include_usage)
            if call.include_usage:
                final = CompletionChunk(id=call.id, created=call.created, model=call.model, choices=[],
                                        usage=self.usage(call, states),
                                        speculation=self.speculation_info(call, states))
                yield self.chunk(final, True)

    @staticmethod
    def _chunk(call: Call, index: int, text: str, logprobs: Any,
               finish_reason: str | None) -> CompletionChunk:
        return CompletionChunk(id=call.id, created=call.created, model=call.model,
                               choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                         finish_reason=finish_reason)])
