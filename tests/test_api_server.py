"""/v1/models, /v1/speculators, /health and /metrics of the real server."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import MAX_MODEL_LEN, SERVED_NAME


def test_models(client, http):
    (model,) = client.models.list().data
    assert model.id == SERVED_NAME and model.object == "model" and model.owned_by == "specserve"
    extra = model.model_extra
    assert extra["max_model_len"] == MAX_MODEL_LEN
    assert extra["speculators"]["none"] == 0 and extra["speculators"]["ngram"] >= 1
    assert http.get(f"/v1/models/{SERVED_NAME}").json()["id"] == SERVED_NAME


def test_speculators(http):
    body = http.get("/v1/speculators").json()
    methods = {entry["method"]: entry["max_num_speculative_tokens"] for entry in body["data"]}
    assert methods["none"] == 0 and "ngram" in methods
    assert body["default"]["method"] == "auto"         # chooses among the loaded methods per step


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def settled_metrics(http, done=lambda text: True) -> str:
    """/metrics once `done(text)` holds and two reads agree: the engine thread records a step's
    metrics just after it hands the step's outputs to the HTTP side, so they may lag a response."""
    deadline = time.monotonic() + 10
    previous = None
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        if done(text) and text == previous:
            return text
        previous = text
        time.sleep(0.05)
    pytest.fail("metrics did not settle")


def test_metrics_count_tokens_requests_and_speculation(client, http):
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    success = "specserve:request_success_total"
    before = settled_metrics(http)
    client.completions.create(model=SERVED_NAME, prompt="one two three one two three one two", max_tokens=5,
                              temperature=0, extra_body={"ignore_eos": True,
                                                         "speculation": {"method": "ngram",
                                                                         "num_speculative_tokens": 2}})
    after = settled_metrics(http, lambda text: metric(text, success) > metric(before, success))
    assert f'model_name="{SERVED_NAME}"' in after

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)
    assert delta("specserve:generation_tokens_total") == 5
    assert delta("specserve:prompt_tokens_total") >= 1
    assert delta(success, finished_reason="length") == 1
    assert delta("specserve:e2e_request_latency_seconds_count") == 1
    assert delta("specserve:time_to_first_token_seconds_count") == 1
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_tokens_per_step",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "inter_token_latency_seconds", "time_per_output_token_seconds",
                 "request_queue_time_seconds"):
        assert f"specserve:{name}" in after, name
    assert metric(after, "specserve:num_requests_running") == 0


def test_the_ready_banner_names_the_url_model_default_and_a_working_curl(servers, server_url):
    import re
    import shlex
    log = servers["default"].log_path.read_text()
    banner = next(line for line in log.splitlines() if line.startswith("specserve ready at "))
    assert f"{server_url}/v1" in banner and "default speculation: auto, k = 8" in banner
    curl = shlex.split(next(line for line in log.splitlines() if line.strip().startswith("curl ")))
    url, body = curl[1], json.loads(curl[curl.index("-d") + 1])
    assert re.fullmatch(rf"{re.escape(server_url)}/v1/completions", url)
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
