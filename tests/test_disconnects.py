"""Clients that go away: nothing is lost. Every KV block comes back, nothing stays queued, and the
engine stops working on a request within one step of the server learning that its client left,
whether it was queued, in prefill or mid-stream. Per-request timeouts end requests the same way.
"""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from conftest import MAX_MODEL_LEN, SERVED_NAME
from reliability_support import (
    InProcessServer,
    StepProbe,
    assert_still_serving,
    build_engine,
    cut_stream,
    engine_stats,
    hang_up,
    live_requests,
    open_request,
    wait_engine_idle,
    wait_until,
)

C, CHAT = "/v1/completions", "/v1/chat/completions"
TEXT = "the cat sat on the mat and the cat sat on the mat and the dog sat on the log " * 3


def _mixed_body(rng: random.Random, i: int) -> tuple[str, dict]:
    """A streamed request: completions or chat, speculation none / ngram / prediction, n 1-2."""
    method = ("none", "ngram", "prediction")[i % 3]
    body: dict = {"model": SERVED_NAME, "stream": True, "max_tokens": rng.randint(8, 40),
                  "ignore_eos": True, "n": rng.choice((1, 1, 2)), "temperature": rng.choice((0, 0.8))}
    if method == "ngram":
        body["speculation"] = {"method": "ngram", "num_speculative_tokens": rng.randint(1, 6)}
    elif method == "prediction":
        body["prediction"] = {"type": "content", "content": TEXT[: rng.randint(20, 200)]}
    if rng.random() < 0.5:
        return C, {**body, "prompt": TEXT[: rng.randint(10, 200)]}
    return CHAT, {**body, "messages": [{"role": "user", "content": TEXT[: rng.randint(10, 200)]}]}


def test_500_streams_cut_at_random_points_leak_nothing(server_url):
    rng = random.Random(1234)
    jobs = [_mixed_body(rng, i) for i in range(500)]

    async def run() -> list[int]:
        limit = asyncio.Semaphore(32)

        async def one(i: int) -> int:
            path, body = jobs[i]
            async with limit:
                return await cut_stream(server_url, path, body, random.Random(i), max_extra_bytes=3000)
        return await asyncio.gather(*(one(i) for i in range(len(jobs))))

    statuses = asyncio.run(run())
    assert statuses.count(200) == len(jobs), {s: statuses.count(s) for s in set(statuses)}
    stats = wait_engine_idle(server_url)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    metrics = httpx.get(f"{server_url}/metrics", timeout=30).text
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        line = next(ln for ln in metrics.splitlines() if ln.startswith(f"specserve:{gauge}{{"))
        assert float(line.rsplit(" ", 1)[1]) == 0.0, line
    assert_still_serving(server_url)


# ---- in process: exact engine state, one-slot engine with chunked prefill ---------------------------

@pytest.fixture(scope="module")
def one_slot(tiny_model_dir):
    """max_num_seqs 1 (a second request must queue) and 16-token prefill chunks (prefill is slow)."""
    engine = build_engine(tiny_model_dir, max_num_seqs=1, max_num_batched_tokens=16)
    server = InProcessServer(engine, tiny_model_dir)
    yield server
    server.stop()
    asyncio.run(engine.shutdown())


@pytest.fixture
def probe(one_slot, monkeypatch):
    one_slot.wait_idle()
    yield StepProbe(one_slot.engine, monkeypatch)
    one_slot.wait_idle()


def _blocker(server: InProcessServer):
    """A long running request that holds the only slot; returns its socket once it decodes."""
    sock = open_request(server.url, C, {"model": SERVED_NAME, "prompt": "block", "max_tokens": 480,
                                        "ignore_eos": True})
    wait_until(lambda: any(r.num_output_tokens > 0 for r in live_requests(server.engine)), 30)
    return sock


def _only_new(server: InProcessServer, before: set) -> object:
    wait_until(lambda: len({r.request_id for r in live_requests(server.engine)} - before) == 1, 30)
    return next(r for r in live_requests(server.engine) if r.request_id not in before)


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_queued(one_slot, probe, stream):
    blocker = _blocker(one_slot)
    before = {r.request_id for r in live_requests(one_slot.engine)}
    sock = open_request(one_slot.url, C, {"model": SERVED_NAME, "prompt": "queued", "max_tokens": 50,
                                          "stream": stream})
    queued = _only_new(one_slot, before)
    wait_until(lambda: queued in one_slot.engine.engine.scheduler.waiting, 10)
    hang_up(sock)
    wait_until(lambda: queued.request_id in probe.abort_done, 10)
    assert probe.steps_to_abort(queued.request_id) <= 1
    assert queued not in one_slot.engine.engine.scheduler.waiting and queued.num_output_tokens == 0
    assert live_requests(one_slot.engine)[0].request_id in before          # the blocker runs on
    hang_up(blocker)
    one_slot.wait_idle()


def test_disconnect_mid_prefill(one_slot, probe):
    sock = open_request(one_slot.url, C, {"model": SERVED_NAME, "prompt": [11] * (MAX_MODEL_LEN - 20),
                                          "max_tokens": 10, "stream": True})
    wait_until(lambda: any(16 <= r.num_computed_tokens for r in live_requests(one_slot.engine)), 30)
    (req,) = live_requests(one_slot.engine)
    hang_up(sock)
    one_slot.wait_idle()
    assert req.num_computed_tokens < req.num_prompt_tokens and req.num_output_tokens == 0
    assert probe.steps_to_abort(req.request_id) <= 1


@pytest.mark.parametrize("path,stream", [(C, True), (C, False), (CHAT, True)])
def test_disconnect_mid_generation(one_slot, probe, path, stream):
    body = {"model": SERVED_NAME, "max_tokens": 400, "ignore_eos": True, "stream": stream,
            "speculation": {"method": "ngram", "num_speculative_tokens": 3}}
    body.update({"prompt": TEXT} if path == C else {"messages": [{"role": "user", "content": TEXT}]})
    sock = open_request(one_slot.url, path, body)
    wait_until(lambda: any(r.num_output_tokens >= 5 for r in live_requests(one_slot.engine)), 30)
    (req,) = live_requests(one_slot.engine)
    hang_up(sock, reset=not stream)
    one_slot.wait_idle()
    assert req.num_output_tokens < 400
    assert probe.steps_to_abort(req.request_id) <= 1


def test_request_timeout_ends_with_length_and_frees_blocks(one_slot, probe):
    body = {"model": SERVED_NAME, "prompt": "tick", "max_tokens": 480, "ignore_eos": True,
            "request_timeout": 0.5}
    start = time.monotonic()
    r = httpx.post(one_slot.url + C, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 5
    data = r.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert 0 <= data["usage"]["completion_tokens"] < 480
    with httpx.stream("POST", one_slot.url + C, json={**body, "stream": True}, timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    one_slot.wait_idle()


def test_request_timeout_while_queued(one_slot, probe):
    blocker = _blocker(one_slot)
    r = httpx.post(one_slot.url + CHAT, json={"model": SERVED_NAME, "max_tokens": 5, "request_timeout": 0.3,
                                              "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert r.json()["usage"]["completion_tokens"] == 0
    hang_up(blocker)
    one_slot.wait_idle()
    stats = engine_stats(one_slot.url)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
