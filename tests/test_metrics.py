"""server/metrics.py without a model: what each sink books, which series exist when, and the HTTP hook."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from specserve.server.engine.stats import RequestTimings, SpecStepStats, StepStats
from specserve.server.metrics import Metrics, instrument_app

MODEL = "m"


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value("specserve:" + name, {"model_name": MODEL, **labels})


def series_names(m: Metrics) -> set[str]:
    return {s.name for fam in m.registry.collect() for s in fam.samples}


def test_nothing_is_exported_before_the_model_has_a_name():
    assert not series_names(Metrics())


def test_ready_creates_every_series_at_zero():
    m = Metrics()
    m.set_model_name(MODEL, {"none": 0, "ngram": 3, "prediction": 2})
    for method in ("ngram", "prediction"):
        for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                     "spec_decode_num_accepted_tokens_total", "spec_decode_tokens_per_step_count"):
            assert value(m, name, method=method) == 0, (name, method)
    assert value(m, "spec_decode_num_drafts_total", method="none") is None     # k = 0 never drafts
    assert value(m, "spec_decode_num_accepted_tokens_per_pos_total", method="ngram", position="2") == 0
    assert value(m, "spec_decode_num_accepted_tokens_per_pos_total", method="ngram", position="3") is None
    for method in ("none", "ngram", "prediction"):
        assert value(m, "time_to_first_token_seconds_count", method=method) == 0
        assert value(m, "inter_token_latency_seconds_count", method=method) == 0
    for reason in ("stop", "length", "abort"):
        assert value(m, "request_success_total", finished_reason=reason) == 0
    for name in ("generation_tokens_total", "prompt_tokens_total", "num_preemptions_total",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(m, name) == 0, name


def step(**kw) -> StepStats:
    return StepStats(**kw)


def test_on_step_books_speculation_by_method_and_position():
    m = Metrics()
    m.set_model_name(MODEL, ["ngram", "prediction"])
    m.on_step(step(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_preemptions=1, num_prompt_tokens=7,
                   num_generation_tokens=5,
                   spec={"ngram": SpecStepStats(2, 6, 3, [2, 1, 0], [3, 2]),
                         "prediction": SpecStepStats(1, 2, 0, [0, 0], [1])},
                   spec_refused={"token_budget": 2}))
    m.on_step(step(spec={"ngram": SpecStepStats(1, 4, 4, [1, 1, 1, 1], [5])}))
    assert value(m, "spec_decode_num_drafts_total", method="ngram") == 3
    assert value(m, "spec_decode_num_draft_tokens_total", method="ngram") == 10
    assert value(m, "spec_decode_num_accepted_tokens_total", method="ngram") == 7
    assert [value(m, "spec_decode_num_accepted_tokens_per_pos_total", method="ngram", position=str(p))
            for p in range(4)] == [3, 2, 1, 1]
    assert value(m, "spec_decode_tokens_per_step_count", method="ngram") == 3
    assert value(m, "spec_decode_tokens_per_step_sum", method="ngram") == 10
    assert value(m, "spec_decode_tokens_per_step_bucket", method="ngram", le="2.0") == 1
    # A step of drafts that were all rejected still moves the method's series together.
    assert value(m, "spec_decode_num_accepted_tokens_total", method="prediction") == 0
    assert value(m, "spec_decode_num_draft_tokens_total", method="prediction") == 2
    assert value(m, "spec_decode_refused_total", reason="token_budget") == 2
    assert value(m, "num_preemptions_total") == 1 and value(m, "prompt_tokens_total") == 7
    assert value(m, "generation_tokens_total") == 5
    # Gauges hold the latest step.
    assert value(m, "num_requests_running") == 0 and value(m, "kv_cache_usage_perc") == 0


def test_finished_requests_feed_the_latency_histograms_by_method():
    m = Metrics()
    m.set_model_name(MODEL)
    timings = RequestTimings(finish_reason="length", num_prompt_tokens=4, num_output_tokens=5, queue_time=0.1,
                             ttft=0.3, e2e_latency=1.1, inter_token_latencies=[0.2, 0.2, 0.4],
                             method="ngram")
    m.on_step(step(finished=[timings, RequestTimings("abort", 4, 0, 0.5, None, 0.5)]))
    assert value(m, "request_success_total", finished_reason="length") == 1
    assert value(m, "request_success_total", finished_reason="abort") == 1
    assert value(m, "time_per_output_token_seconds_sum", method="ngram") == pytest.approx(0.2)
    assert value(m, "time_to_first_token_seconds_count", method="ngram") == 1
    assert value(m, "inter_token_latency_seconds_count", method="ngram") == 3
    assert value(m, "e2e_request_latency_seconds_sum", method="ngram") == pytest.approx(1.1)
    assert value(m, "request_queue_time_seconds_sum", method="none") == pytest.approx(0.5)
    assert value(m, "time_to_first_token_seconds_count", method="none") == 0    # aborted before a token


def test_the_existing_sinks_still_work_and_registries_are_separate():
    a, b = Metrics("a"), Metrics("b")
    a.set_queue_sizes(3, 4)
    a.on_finished(RequestTimings("stop", 1, 2, 0.0, 0.1, 0.2))
    assert a.registry.get_sample_value("specserve:num_requests_waiting", {"model_name": "a"}) == 4
    assert b"specserve:num_requests_running" in a.render()
    assert not series_names(b)


def test_renaming_moves_new_samples_to_the_new_label():
    m = Metrics()
    m.on_step(step(num_generation_tokens=2))
    m.set_model_name(MODEL)
    m.on_step(step(num_generation_tokens=3))
    assert m.registry.get_sample_value("specserve:generation_tokens_total", {"model_name": "unknown"}) == 2
    assert value(m, "generation_tokens_total") == 3


def test_http_requests_are_counted_by_route_template_and_status():
    m = Metrics()
    m.set_model_name(MODEL)
    app = FastAPI()
    instrument_app(app, m)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        return {"id": model_id}

    @app.get("/metrics")
    async def scrape() -> str:
        return "scrapes are not counted"

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        return StreamingResponse(iter([b"a", b"b"]), media_type="text/plain")

    with TestClient(app) as client:
        assert client.get("/v1/models/x").status_code == 200
        assert client.get("/v1/models/y/z").status_code == 200
        assert client.get("/stream").text == "ab"
        assert client.get("/random/path/1").status_code == 404
        assert client.post("/stream").status_code == 405
        assert client.get("/metrics").status_code == 200
    assert value(m, "http_requests_total", handler="/v1/models/{model_id:path}", status="200") == 2
    assert value(m, "http_requests_total", handler="/stream", status="200") == 1
    assert value(m, "http_requests_total", handler="/stream", status="405") == 1
    assert value(m, "http_requests_total", handler="none", status="404") == 1
    assert value(m, "http_request_duration_seconds_count", handler="/stream") == 2
    assert value(m, "http_requests_total", handler="/metrics", status="200") is None
