"""Lifecycle: /health (liveness) vs /ready (readiness); SIGTERM stops admitting (503 in OpenAI shape),
drains in-flight requests up to --drain-timeout, fails what is left with a 503, and exits 0; which
probes need the API key; the new flags."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import threading
import time

import httpx
import pytest
from conftest import SERVED_NAME, ServerProcess
from reliability_support import (
    InProcessServer,
    assert_error,
    build_engine,
    live_requests,
    stream_events,
    wait_until,
)

from specserve.server.api.lifecycle import LifecycleConfig
from specserve.server.api.limits import Limits
from specserve.server.cli import build_parser, configs_from_args, flag_for, lifecycle_from_args

C = "/v1/completions"
LONG = {"model": SERVED_NAME, "prompt": "go", "ignore_eos": True}


@pytest.fixture(scope="module")
def sigterm_server(tiny_model_dir, tmp_path_factory):
    """The real process the SIGTERM test kills, started early: it boots while the other tests run."""
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("sigterm") / "server.log",
                         "--drain-timeout", "60")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir, sigterm_server):
    engine = build_engine(tiny_model_dir)
    yield engine
    asyncio.run(engine.shutdown())


def _start_stream(url: str, body: dict) -> tuple[threading.Thread, list]:
    out: list = []
    first = threading.Event()
    thread = threading.Thread(target=stream_events, args=(url, body, out, first), daemon=True)
    thread.start()
    assert first.wait(30), out
    return thread, out


def _assert_draining(url: str) -> None:
    err = assert_error(httpx.post(url + C, json={"model": SERVED_NAME, "prompt": "x"}, timeout=10), 503)
    assert err["code"] == "server_shutting_down"
    assert httpx.get(url + "/ready", timeout=10).status_code == 503
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "draining"


def test_drain_lets_in_flight_requests_finish(engine, tiny_model_dir):
    srv = InProcessServer(engine, tiny_model_dir, lifecycle=LifecycleConfig(drain_timeout=60))
    assert httpx.get(srv.url + "/ready").json() == {"status": "ready"}
    thread, events = _start_stream(srv.url, {**LONG, "max_tokens": 150})
    srv.sigterm()
    wait_until(lambda: srv.state.lifecycle.draining, 5)
    _assert_draining(srv.url)
    thread.join(60)
    assert events[0] == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    srv.thread.join(30)
    assert not srv.thread.is_alive(), "the server did not exit after draining"
    srv.wait_idle()


def test_drain_deadline_fails_what_is_left_with_503(engine, tiny_model_dir):
    srv = InProcessServer(engine, tiny_model_dir, lifecycle=LifecycleConfig(drain_timeout=0.5))
    thread, events = _start_stream(srv.url, {**LONG, "max_tokens": 480})
    plain: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: plain.append(
        httpx.post(srv.url + C, json={**LONG, "max_tokens": 480}, timeout=60)), daemon=True)
    worker.start()
    wait_until(lambda: len(live_requests(engine)) == 2, 30)
    srv.sigterm()
    thread.join(30)
    worker.join(30)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert assert_error(plain[0], 503)["code"] == "server_shutting_down"
    srv.thread.join(30)
    assert not srv.thread.is_alive()
    srv.wait_idle()


# ---- probes and auth -------------------------------------------------------------------------------

KEY = "sk-lifecycle"


def _server_with_key(engine, model_dir, **lifecycle) -> InProcessServer:
    from specserve.server.config import ServerConfig
    return InProcessServer(engine, model_dir, lifecycle=LifecycleConfig(**lifecycle),
                           server_config=ServerConfig(api_key=KEY))


@pytest.mark.parametrize("public_health,public_metrics", [(True, False), (False, True)])
def test_probe_auth_flags(engine, tiny_model_dir, public_health, public_metrics):
    srv = _server_with_key(engine, tiny_model_dir, public_health=public_health, public_metrics=public_metrics)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        for path, public in (("/health", public_health), ("/ready", public_health),
                             ("/metrics", public_metrics)):
            r = httpx.get(srv.url + path, timeout=10)
            if public:
                assert r.status_code == 200, (path, r.text)
            else:
                assert_error(r, 401, None, "invalid_api_key")
            assert httpx.get(srv.url + path, headers=auth, timeout=10).status_code == 200
        assert_error(httpx.get(srv.url + "/v1/engine/stats", timeout=10), 401)
        assert httpx.get(srv.url + "/v1/engine/stats", headers=auth, timeout=10).status_code == 200
    finally:
        srv.stop()


def test_liveness_and_readiness_while_loading():
    from fastapi.testclient import TestClient

    from specserve.server.api.app import create_app
    from specserve.server.config import EngineConfig
    release = threading.Event()

    def slow_factory(cfg, on_step=None):
        release.wait(30)
        raise RuntimeError("no model in this test")
    app = create_app(EngineConfig(), engine_factory=slow_factory)
    with TestClient(app) as client:
        for path in ("/health", "/ready"):
            r = client.get(path)
            assert r.status_code == 503 and r.json()["status"] == "loading"
        assert_error(client.post(C, json={"prompt": "x"}), 503)
        release.set()
        wait_until(lambda: client.get("/health").json()["status"] == "failed", 10)
        assert "no model" in client.get("/ready").json()["error"]


# ---- flags -----------------------------------------------------------------------------------------

def _serve_parser():
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices["serve"]


def test_every_lifecycle_field_has_a_documented_flag():
    actions = {opt: a for a in _serve_parser()._actions for opt in a.option_strings}
    for f in dataclasses.fields(LifecycleConfig):
        flag = flag_for(f.name)
        assert flag in actions and "default" in (actions[flag].help or "").lower(), flag


def test_reliability_flags_become_configs(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    args = _serve_parser().parse_args([
        "--max-body-bytes", "2048", "--max-header-bytes", "4096", "--max-waiting-requests", "3",
        "--max-waiting-tokens", "99", "--request-timeout", "2.5", "--drain-timeout", "7",
        "--no-public-health", "--public-metrics"])
    _, _, limits = configs_from_args(args)
    assert (limits.max_body_bytes, limits.max_header_bytes) == (2048, 4096)
    assert (limits.max_waiting_requests, limits.max_waiting_tokens, limits.request_timeout) == (3, 99, 2.5)
    assert lifecycle_from_args(args) == LifecycleConfig(drain_timeout=7, public_health=False,
                                                        public_metrics=True)
    assert lifecycle_from_args(_serve_parser().parse_args([])) == LifecycleConfig()


@pytest.mark.parametrize("bad", [{"max_body_bytes": 10}, {"request_timeout": 0}, {"max_waiting_requests": 0},
                                 {"max_header_bytes": True}])
def test_bad_limits_are_refused(bad):
    with pytest.raises(ValueError):
        Limits(**bad).validate()
    with pytest.raises(ValueError):
        LifecycleConfig(drain_timeout=-1).validate()


def test_sigterm_on_the_real_process_drains_and_exits_0(sigterm_server):
    url = sigterm_server.wait_ready()
    thread, events = _start_stream(url, {**LONG, "max_tokens": 400})
    sigterm_server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(url + "/ready", timeout=10).status_code == 200:     # the signal is async
        assert time.monotonic() < deadline
        time.sleep(0.02)
    _assert_draining(url)
    thread.join(60)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert sigterm_server.proc.wait(timeout=30) == 0
