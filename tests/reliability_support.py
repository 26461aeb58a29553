"""Helpers for the reliability suites: OpenAI-error assertions, an in-process server whose engine the
test can inspect and break, and a raw-socket SSE client that can hang up at any byte.

The in-process server is the real app on real uvicorn (h11, the guard middleware, DrainingServer) in
a background thread, over an AsyncEngine built in this process from the tiny test checkpoint, so a
test can read `engine.engine.scheduler.bm.num_free_blocks` exactly and monkeypatch `Engine.step`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from conftest import MAX_MODEL_LEN, SERVED_NAME, free_port

from specserve.server.engine.messages import Abort

OK_BODY = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 2}


def assert_error(response: httpx.Response, status: int, param: Any = ..., code: Any = ...) -> dict:
    """`response` is `status` with exactly the OpenAI error body; returns body["error"]."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def assert_still_serving(url: str) -> None:
    """/health is 200 and a normal request succeeds (on a fresh connection)."""
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json=OK_BODY)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


def engine_config(model_dir: Path, **overrides: Any):
    from specserve.server.config import EngineConfig
    return EngineConfig(**{"model": str(model_dir), "served_model_name": SERVED_NAME, "dtype": "float32",
                           "device": "cpu", "max_model_len": MAX_MODEL_LEN, "kv_cache_memory_gb": 0.02,
                           **overrides})


def build_engine(model_dir: Path, **overrides: Any):
    from specserve.server.engine.async_engine import AsyncEngine
    return AsyncEngine.from_config(engine_config(model_dir, **overrides))


class InProcessServer:
    """create_app(engine=...) served by DrainingServer on a free port, in a daemon thread."""

    def __init__(self, engine: Any, model_dir: Path, limits: Any = None, lifecycle: Any = None,
                 server_config: Any = None) -> None:
        from specserve.server.api.app import create_app, drain
        from specserve.server.api.http_server import DrainingServer, uvicorn_config
        from specserve.server.api.limits import Limits

        limits = limits or Limits()
        self.engine = engine
        self.app = create_app(engine_config(model_dir), server_config, limits, engine=engine,
                              lifecycle=lifecycle)
        self.state = self.app.state.specserve
        self.url = f"http://127.0.0.1:{free_port()}"
        config = uvicorn_config(self.app, "127.0.0.1", int(self.url.rsplit(":", 1)[1]), "warning",
                                limits.max_header_bytes)
        self.server = DrainingServer(config, drain=lambda: drain(self.app))
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.01)

    def sigterm(self) -> None:
        """What SIGTERM does (DrainingServer.handle_exit), minus the OS signal."""
        import signal
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def bm(self) -> Any:
        return self.engine.engine.scheduler.bm

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Until the engine holds no request and every KV block is free (fails after `timeout`)."""
        wait_until(lambda: (not self.engine.engine.scheduler.has_work and not self.engine.engine.live
                            and self.bm.num_free_blocks == self.bm.num_blocks
                            and self.state.admission.num_requests == 0), timeout,
                   lambda: f"running={self.engine.num_running} waiting={self.engine.num_waiting} "
                           f"live={len(self.engine.engine.live)} free={self.bm.num_free_blocks}/"
                           f"{self.bm.num_blocks} admission={self.state.admission.num_requests}")


def wait_until(predicate: Any, timeout: float, describe: Any = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not reached in {timeout}s: {describe()}"
        time.sleep(0.02)


def engine_stats(url: str, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/v1/engine/stats", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_engine_idle(url: str, timeout: float = 30.0) -> dict:
    """Poll /v1/engine/stats until nothing runs, waits or holds a KV block; returns the last stats."""
    last: dict = {}

    def idle() -> bool:
        nonlocal last
        last = engine_stats(url)
        return (last["num_requests_running"] == 0 and last["num_requests_waiting"] == 0
                and last["num_free_kv_blocks"] == last["num_kv_blocks"]
                and last["admission"]["waiting_requests"] == 0)
    wait_until(idle, timeout, lambda: json.dumps(last))
    return last


# ---- raw HTTP: hang up wherever we like --------------------------------------------------------------

def raw_request(path: str, body: dict, host: str) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def cut_stream(url: str, path: str, body: dict, rng: random.Random, max_extra_bytes: int = 2000,
                     read_timeout: float = 60.0) -> int:
    """Send a streaming request, read up to the end of its first SSE event, then a random number of
    further bytes (0..max_extra_bytes), then hang up (FIN or RST at random). Returns the status."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw_request(path, body, f"{host}:{port}"))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), read_timeout)
        status = int(head.split(b" ", 2)[1])
        if status == 200:
            await asyncio.wait_for(reader.readuntil(b"\n\n"), read_timeout)       # first chunk
            extra = rng.randint(0, max_extra_bytes)
            with contextlib.suppress(asyncio.IncompleteReadError):
                if extra:
                    await asyncio.wait_for(reader.readexactly(extra), read_timeout)
        return status
    except asyncio.IncompleteReadError:
        return 200          # the stream ended before our cut point: a full response
    finally:
        if rng.random() < 0.5:
            writer.transport.abort()                   # RST
        else:
            writer.close()                              # FIN
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def open_request(url: str, path: str, body: dict) -> Any:
    """A blocking socket that has sent `body` and reads nothing: hang it up with `hang_up()`."""
    import socket
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(raw_request(path, body, f"{host}:{port}"))
    return sock


def hang_up(sock: Any, reset: bool = True) -> None:
    import socket
    import struct
    if reset:       # RST instead of FIN: the harshest way a client can vanish
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class StepProbe:
    """Counts engine steps and records, per request id, the step count when the HTTP side sent its
    abort and when the engine thread executed it (monkeypatched onto one AsyncEngine)."""

    def __init__(self, engine: Any, monkeypatch: Any) -> None:
        self.steps = 0
        self.abort_sent: dict[str, int] = {}
        self.abort_done: dict[str, int] = {}
        inner, send, abort = engine.engine.step, engine._send, engine.engine.abort

        def step() -> Any:
            self.steps += 1
            return inner()

        def recording_send(cmd: Any) -> None:
            if isinstance(cmd, Abort):
                self.abort_sent.setdefault(cmd.request_id, self.steps)
            send(cmd)

        def recording_abort(request_id: str) -> Any:
            self.abort_done.setdefault(request_id, self.steps)
            return abort(request_id)
        monkeypatch.setattr(engine.engine, "step", step)
        monkeypatch.setattr(engine, "_send", recording_send)
        monkeypatch.setattr(engine.engine, "abort", recording_abort)

    def steps_to_abort(self, request_id: str) -> int:
        """Engine steps that ran between the abort being sent and being executed."""
        return self.abort_done[request_id] - self.abort_sent[request_id]


def live_requests(engine: Any) -> list:
    return [live.request for live in list(engine.engine.live.values())]


def stream_events(url: str, body: dict, out: list, first: threading.Event) -> None:
    """Stream a completion from url; append the HTTP status then every SSE data payload; set `first`
    at the first event. Run in a thread so a test can act (SIGTERM, failure) mid-stream."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        out.append(s.status_code)
        for line in s.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                first.set()
