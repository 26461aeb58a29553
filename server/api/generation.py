"""Generation: one HTTP request fanned out to its engine requests (n choices x prompts) and merged back.

Each engine request runs in its own task that pumps its `RequestOutput` deltas into one queue; the
HTTP side reads `(choice index, delta)` in arrival order. Closing or cancelling the reader (client
disconnect, error in another choice, deadline) cancels every pump, and the engine aborts those
requests and frees their KV blocks at its next step boundary.

Admission (server/api/admission.py) happens when the reader first asks for an output: all engine
requests at once or a 429. Each is released from the waiting count at its first output, and in any
case when the reader goes away. A deadline ends every unfinished choice with finish_reason
"length", keeping what was generated, as if max_tokens had been reached.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from specserve.sampling.outputs import TokenLogprob
from specserve.sampling.params import SamplingParams
from specserve.server.api.errors import APIError, bad_request
from specserve.server.engine.errors import ContextLengthError
from specserve.server.engine.outputs import RequestOutput
from specserve.speculators.base import SpecParams, SpecStats

T = TypeVar("T")


@dataclass
class SubRequest:
    """One engine request: one prompt, one choice."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    spec: SpecParams
    prediction_token_ids: list[int] | None = None
    prompt_logprobs: bool = False


@dataclass
class ChoiceState:
    """Everything one choice has produced so far (filled from its deltas)."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    spec_stats: SpecStats = field(default_factory=SpecStats)

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs:       # chunked prefill delivers them in pieces
            self.prompt_logprobs = (self.prompt_logprobs or []) + list(out.prompt_logprobs)
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_output_tokens = out.num_output_tokens
        self.spec_stats = out.spec_stats
        if out.finished:
            self.finish_reason = out.finish_reason


def engine_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception the engine raised while admitting a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return bad_request(str(exc), param="prompt", code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return APIError(500, f"the engine failed this request ({type(exc).__name__}: {exc})",
                    type="server_error")


async def fan_in(engine: Any, subs: list[SubRequest], admission: Any = None,
                 deadline: float | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (index into subs, delta) until every sub-request finished; raise APIError on failure.

    admission: an Admission to book the sub-requests with (429 raised here); deadline: event-loop time.
    """
    if admission is not None:
        admission.admit([s.request_id for s in subs], [len(s.prompt_token_ids) for s in subs])
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, sub: SubRequest) -> None:
        try:
            async for out in engine.generate(sub.request_id, sub.prompt_token_ids, sub.params, sub.spec,
                                             prediction_token_ids=sub.prediction_token_ids,
                                             prompt_logprobs=sub.prompt_logprobs):
                if admission is not None:
                    admission.release(sub.request_id)
                queue.put_nowait((i, out, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which maps it to an HTTP error
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, None, None))       # this sub-request is done

    tasks = [asyncio.create_task(pump(i, sub)) for i, sub in enumerate(subs)]
    last: list[RequestOutput | None] = [None] * len(subs)
    done = [False] * len(subs)
    try:
        while not all(done):
            item = await _next(queue, deadline)
            if item is None:                                  # deadline passed
                for i in (i for i, d in enumerate(done) if not d):
                    yield i, _timed_out(subs[i], last[i])
                return
            i, out, exc = item
            if exc is not None:
                raise engine_error(exc)
            if out is None or done[i]:          # the pump's end marker follows a finished delta
                done[i] = True
                continue
            last[i] = out
            done[i] = out.finished
            yield i, out
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        if admission is not None:
            for sub in subs:
                admission.release(sub.request_id)


async def _next(queue: asyncio.Queue, deadline: float | None) -> Any:
    """The next queue item, or None once the deadline has passed."""
    if deadline is None:
        return await queue.get()
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0 and queue.empty():
        return None
    try:
        return await asyncio.wait_for(queue.get(), max(remaining, 0))
    except asyncio.TimeoutError:
        return None


def _timed_out(sub: SubRequest, last: RequestOutput | None) -> RequestOutput:
    """The closing delta of a choice cut by its deadline: no new tokens, finish_reason "length"."""
    if last is None:
        return RequestOutput(sub.request_id, [], "", None, finished=True, finish_reason="length",
                             num_prompt_tokens=len(sub.prompt_token_ids))
    return dataclasses.replace(last, token_ids=[], text="", logprobs=None, finished=True,
                               finish_reason="length", stop_reason=None, prompt_logprobs=None)


async def collect(outputs: AsyncIterator[tuple[int, RequestOutput]], num_choices: int) -> list[ChoiceState]:
    """Run every sub-request to completion (non-streaming responses)."""
    states = [ChoiceState(index=i) for i in range(num_choices)]
    async with contextlib.aclosing(outputs) as items:  # type: ignore[type-var]
        async for i, out in items:
            states[i].add(out)
    for state in states:
        if state.finish_reason == "error":
            raise APIError(500, "the engine failed while generating this request", type="server_error")
    return states


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (so the engine aborts and frees KV)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:      # server shutting down: stop the work too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise APIError(499, "client disconnected", type="invalid_request_error")
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # After the body has been read, receive() blocks until the client goes away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
