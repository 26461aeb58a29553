"""An engine failure (an exception inside Engine.step) marks the server unhealthy and fails every
request in flight and every new one with a 500 in OpenAI shape, promptly: nothing hangs. A failure
while adding one request fails only that request. Failures are injected by monkeypatching the
in-process engine; the server has no debug switch for it."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from conftest import SERVED_NAME
from reliability_support import (
    InProcessServer,
    assert_error,
    assert_still_serving,
    build_engine,
    live_requests,
    stream_events,
    wait_until,
)

C, CHAT = "/v1/completions", "/v1/chat/completions"
LONG = {"model": SERVED_NAME, "prompt": "go", "max_tokens": 400, "ignore_eos": True}


@pytest.fixture
def server(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    srv = InProcessServer(engine, tiny_model_dir)
    yield srv
    srv.stop()
    asyncio.run(engine.shutdown())


def test_step_failure_fails_in_flight_and_new_requests(server, monkeypatch):
    streamed: list = []
    first = threading.Event()
    stream = threading.Thread(target=stream_events, args=(server.url, LONG, streamed, first))
    plain: list[httpx.Response] = []
    blocking = threading.Thread(target=lambda: plain.append(httpx.post(server.url + C, json=LONG, timeout=60)))
    stream.start()
    blocking.start()
    assert first.wait(30)
    wait_until(lambda: len(live_requests(server.engine)) == 2, 30)

    def broken_step():
        raise RuntimeError("injected failure inside Engine.step")
    monkeypatch.setattr(server.engine.engine, "step", broken_step)
    start = time.monotonic()
    stream.join(30)
    blocking.join(30)
    assert not stream.is_alive() and not blocking.is_alive(), "requests hung after the engine died"
    assert time.monotonic() - start < 10

    err = assert_error(plain[0], 500)
    assert err["type"] == "server_error" and "injected failure" in err["message"]
    assert streamed[0] == 200 and streamed[-1] == "[DONE]"
    last = json.loads(streamed[-2])
    assert last["error"]["type"] == "server_error" and "injected failure" in last["error"]["message"]

    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert "injected failure" in health.json()["error"]
    assert httpx.get(server.url + "/ready").status_code == 503
    for path, body in ((C, {"model": SERVED_NAME, "prompt": "x", "max_tokens": 2}),
                       (C, {"model": SERVED_NAME, "prompt": "x", "max_tokens": 2, "stream": True}),
                       (CHAT, {"model": SERVED_NAME, "messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(server.url + path, json=body, timeout=10)
        assert_error(r, 500, None, "engine_dead")
    assert httpx.get(server.url + "/v1/models").status_code == 500


def test_failure_adding_one_request_fails_only_that_request(server, monkeypatch):
    add = server.engine.engine.add_request

    def picky_add(request_id, prompt, *args):
        if len(prompt) == 7:
            raise RuntimeError("injected failure while adding")
        return add(request_id, prompt, *args)
    monkeypatch.setattr(server.engine.engine, "add_request", picky_add)
    r = httpx.post(server.url + C, json={"model": SERVED_NAME, "prompt": [9] * 7, "max_tokens": 2})
    err = assert_error(r, 500)
    assert "injected failure while adding" in err["message"]
    assert server.engine.dead is None
    assert_still_serving(server.url)
    server.wait_idle()
