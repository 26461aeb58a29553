"""uvicorn, set up for specserve: h11 with a header-size cap, OpenAI-shaped protocol errors, and a
SIGTERM that drains instead of cutting.

uvicorn's own SIGTERM handling stops listening at once (clients get "connection refused", not a
503), gives in-flight requests a fixed grace and then re-raises the signal, so the process exits
143. Here the first SIGTERM/SIGINT starts `drain()` (server/api/lifecycle.py) while the socket stays
open (new /v1 requests get a 503 body), and uvicorn is told to exit only once the drain is over; the
process then exits 0. A second signal exits at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.server.api.errors import APIError

logger = logging.getLogger("specserve.api")

# Room for the request line and the framing on top of --max-header-bytes, before h11 itself refuses.
REQUEST_LINE_ALLOWANCE = 8192


class JSONErrorH11Protocol(H11Protocol):
    """h11's "Invalid HTTP request" answered with the OpenAI error body instead of plain text."""

    def send_400_response(self, msg: str) -> None:
        import h11
        limit = self.config.h11_max_incomplete_event_size
        err = APIError(400, f"invalid HTTP request: malformed, or its request line and headers are "
                       f"larger than {limit} bytes", code="invalid_http_request")
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:          # the connection is in no state to answer
            pass
        self.transport.close()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[Any]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.draining = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not calling super(): it records the signal to re-raise it after shutdown (exit 143).
        if self.draining or self._loop is None or self.should_exit:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:   # a failed drain must still let the process exit
            logger.exception("drain failed")
        self.should_exit = True


def uvicorn_config(app: Any, host: str, port: int, log_level: str, max_header_bytes: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=JSONErrorH11Protocol,
                          h11_max_incomplete_event_size=max_header_bytes + REQUEST_LINE_ALLOWANCE,
                          timeout_graceful_shutdown=5)
