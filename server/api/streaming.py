"""Server-sent events: `data: <json>\\n\\n` per chunk, ending with `data: [DONE]\\n\\n`.

Admission errors (bad prompt, context too long, unknown speculator) must be HTTP errors, not
events: `primed()` awaits the first engine output before the response starts, so anything the
engine rejects surfaces as a normal 4xx. An error after that point is sent as one
`data: {"error": {...}}` event followed by `[DONE]`, as OpenAI does.

A client that goes away is noticed at once, even while its request waits for its first token: the
response listens for `http.disconnect` beside the stream, and on leaving it closes the whole
generator chain (events -> outputs -> fan_in), which cancels the engine requests (abort, KV freed).
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specserve.server.api.errors import APIError

logger = logging.getLogger("specserve.api")
T = TypeVar("T")

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def primed(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """Await the first item now (raising its error here), then yield it and the rest."""
    try:
        first = await items.__anext__()
    except StopAsyncIteration:
        return _empty()

    async def chained() -> AsyncIterator[T]:
        try:
            yield first
            async for item in items:
                yield item
        finally:
            await _close(items)
    return chained()


async def _empty() -> AsyncIterator[Any]:
    return
    yield  # pragma: no cover - makes this an async generator


async def _close(items: Any) -> None:
    if isinstance(items, AsyncGenerator):
        await items.aclose()


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for disconnects and always closes its generator.

    (Starlette only watches under ASGI < 2.4 and never closes the body iterator itself.)
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def until_done(work: Callable[[], Awaitable[None]]) -> None:
                    await work()
                    group.cancel_scope.cancel()
                group.start_soon(until_done, lambda: self._stream(send))
                await until_done(lambda: self.listen_for_disconnect(receive))
        finally:
            await _close(self.body_iterator)

    async def _stream(self, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:          # the client went away mid-write
            pass


def sse_response(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Stream `events` (JSON-able dicts) as SSE; errors become one error event; always ends in [DONE]."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield sse(event)
        except APIError as err:
            yield sse(err.body())
        except Exception as exc:
            logger.exception("error while streaming")
            yield sse(APIError(500, f"internal server error ({type(exc).__name__})",
                               type="server_error").body())
        finally:
            await _close(events)
        yield DONE
    return SSEResponse(body(), media_type="text/event-stream", headers=HEADERS)
