"""RequestGuard: the ASGI middleware every HTTP request passes before FastAPI sees it.

In order, each answered with the OpenAI error body:
  1. headers larger than --max-header-bytes       -> 431 (h11 itself refuses far larger ones, see http_server.py)
  2. /v1/* while the server drains                 -> 503
  3. Content-Length above --max-body-bytes          -> 413 at once, before a byte of the body is read;
     a chunked body is read up to the cap and refused as soon as it passes it (never buffered whole)
  4. counts /v1/* requests in flight (the drain waits for them)
  5. any exception nothing else handled             -> 500, logged, connection kept

Why (5) lives here: Starlette's last-resort handler re-raises after answering, and uvicorn then
closes the keep-alive connection, so a client's next request on it dies with a reset.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.server.api.errors import APIError, internal_error

logger = logging.getLogger("specserve.api")


class RequestGuard:
    def __init__(self, app: ASGIApp, state: Any) -> None:     # state: ServerState
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.state.limits
        rejection = self._check_headers(scope, limits)
        if rejection is not None:
            await send_error(send, rejection, close=True)
            return
        guarded = scope["path"].startswith("/v1/")
        if guarded and self.state.lifecycle.draining:
            await send_error(send, APIError(503, "The server is shutting down and accepts no new requests; "
                                            "retry on another replica.", code="server_shutting_down"))
            return
        if _is_chunked(scope):
            receive, rejection = await _buffer_body(receive, limits.max_body_bytes)
            if rejection is not None:
                await send_error(send, rejection, close=True)
                return
        if guarded:
            self.state.lifecycle.enter()
        try:
            await self._call(scope, receive, send)
        finally:
            if guarded:
                self.state.lifecycle.leave()

    async def _call(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)
        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:   # the last resort: answer, log, keep serving
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send, internal_error(exc))

    @staticmethod
    def _check_headers(scope: Scope, limits: Any) -> APIError | None:
        headers = scope["headers"]
        size = sum(len(k) + len(v) + 4 for k, v in headers)       # "name: value\r\n"
        if size > limits.max_header_bytes:
            return APIError(431, f"request headers are {size} bytes, more than this server accepts "
                            f"({limits.max_header_bytes})", code="headers_too_large")
        for key, value in headers:
            if key == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    return APIError(400, "Content-Length is not a number", code="invalid_request")
                if length > limits.max_body_bytes:
                    return _too_large(length, limits.max_body_bytes)
        return None


def _too_large(size: int, cap: int, at_least: bool = False) -> APIError:
    more = "more than " if at_least else ""
    return APIError(413, f"request body is {more}{size} bytes, more than this server accepts ({cap}); "
                    "send a shorter prompt or fewer prompts per request", code="request_too_large")


def _is_chunked(scope: Scope) -> bool:
    return any(k == b"transfer-encoding" for k, _ in scope["headers"]) and not any(
        k == b"content-length" for k, _ in scope["headers"])


async def _buffer_body(receive: Receive, cap: int) -> tuple[Receive, APIError | None]:
    """Read a body of unknown length up to `cap` bytes; then replay it to the app."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if size > cap:
            return receive, _too_large(size, cap, at_least=True)
        if not message.get("more_body", False):
            break

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()
    return replay, None


async def send_error(send: Send, err: APIError, close: bool = False) -> None:
    body = json.dumps(err.body(), ensure_ascii=False).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    if close:       # the rest of an oversized request is not read: this connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
