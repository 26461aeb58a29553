"""Admission control: beyond --max-waiting-requests / --max-waiting-tokens a request gets 429 with
Retry-After and the OpenAI error body; what was admitted keeps running; a request larger than the
bounds on its own is still admitted when nothing else waits."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from conftest import SERVED_NAME
from reliability_support import (
    InProcessServer,
    assert_error,
    build_engine,
    hang_up,
    live_requests,
    open_request,
    wait_until,
)

C = "/v1/completions"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = build_engine(tiny_model_dir, max_num_seqs=1)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture
def server(engine, tiny_model_dir, request):
    from specserve.server.api.limits import Limits
    srv = InProcessServer(engine, tiny_model_dir, limits=Limits(**request.param))
    yield srv
    srv.stop()


def _hold_slot(srv: InProcessServer):
    """Occupy the engine's one slot with a long request that is past its first token."""
    sock = open_request(srv.url, C, {"model": SERVED_NAME, "prompt": "hold", "max_tokens": 480,
                                     "ignore_eos": True})
    wait_until(lambda: any(r.num_output_tokens > 0 for r in live_requests(srv.engine)), 30)
    wait_until(lambda: srv.state.admission.num_requests == 0, 10)
    return sock


def _queue(srv: InProcessServer, body: dict, count: int) -> list:
    socks = [open_request(srv.url, C, {"model": SERVED_NAME, **body}) for _ in range(count)]
    return socks


@pytest.mark.parametrize("server", [{"max_waiting_requests": 2}], indirect=True)
def test_429_beyond_max_waiting_requests(server):
    holder = _hold_slot(server)
    waiting = _queue(server, {"prompt": "w", "max_tokens": 2}, 2)
    wait_until(lambda: server.state.admission.num_requests == 2, 10)
    for body in ({"prompt": "x", "max_tokens": 2}, {"prompt": "x", "max_tokens": 2, "stream": True},
                 {"prompt": ["a", "b"], "max_tokens": 2}):
        r = httpx.post(server.url + C, json={"model": SERVED_NAME, **body}, timeout=30)
        assert_error(r, 429, None, "server_overloaded")
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
    assert server.state.admission.num_requests == 2           # refused requests booked nothing
    assert httpx.get(server.url + "/health").status_code == 200
    for sock in [holder, *waiting]:
        hang_up(sock)
    server.wait_idle()
    assert server.state.admission.num_rejected == 3


@pytest.mark.parametrize("server", [{"max_waiting_tokens": 300}], indirect=True)
def test_429_beyond_max_waiting_tokens_and_admitted_work_finishes(server):
    holder = _hold_slot(server)
    results: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: results.append(httpx.post(
        server.url + C, json={"model": SERVED_NAME, "prompt": [5] * 200, "max_tokens": 2}, timeout=60)))
    worker.start()
    wait_until(lambda: server.state.admission.num_tokens == 200, 10)
    r = httpx.post(server.url + C, json={"model": SERVED_NAME, "prompt": [5] * 150, "max_tokens": 2})
    assert_error(r, 429, None, "server_overloaded")
    assert "prompt tokens" in r.json()["error"]["message"]
    ok = httpx.post(server.url + C, json={"model": SERVED_NAME, "prompt": [5] * 50, "max_tokens": 2,
                                          "request_timeout": 0.2})
    assert ok.status_code == 200, ok.text                       # still under the bound: admitted
    hang_up(holder)
    worker.join(60)
    assert results and results[0].status_code == 200, results   # the admitted one was served
    server.wait_idle()


@pytest.mark.parametrize("server", [{"max_waiting_requests": 2, "max_waiting_tokens": 10}], indirect=True)
def test_a_request_larger_than_the_bounds_runs_when_nothing_waits(server):
    r = httpx.post(server.url + C, json={"model": SERVED_NAME, "prompt": [5] * 40, "n": 3, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    server.wait_idle()
