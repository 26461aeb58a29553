"""Schemathesis against the server's own /openapi.json: generated valid and invalid requests for every
operation; none may get a 5xx, every answer must be a status and body the schema documents.

`make test` runs a bounded number of examples per operation; `make fuzz` runs many more
(SPECSERVE_FUZZ_EXAMPLES). The server is an in-process one with its own engine and a 3 s
--request-timeout, so a generated request for 16 x 64 choices of 500 tokens costs seconds, not
minutes; afterwards the engine must be idle with every KV block free.
"""
from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis  # a [test] dependency: missing means a broken install, which must fail, not skip
from conftest import SERVED_NAME
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_support import InProcessServer, assert_still_serving, build_engine
from schemathesis import checks as st_checks

EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "12"))
# positive_data_acceptance is not a property of this API: schema-valid requests may still be refused
# (unknown model name, context length, token ids past the vocabulary, min_tokens > max_tokens, ...).
EXCLUDED = [st_checks.positive_data_acceptance]


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    from specserve.server.api.limits import Limits

    engine = build_engine(tiny_model_dir)
    server = InProcessServer(engine, tiny_model_dir, limits=Limits(request_timeout=3.0))
    try:
        yield server
    finally:
        server.stop()
        server.state.engine = None
        import asyncio
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    spec = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()
    return schemathesis.openapi.from_dict(spec)


# The operations of /openapi.json (test_every_operation_is_fuzzed keeps this list honest). The pytest
# plugin's lazy `from_fixture` needs pytest < 9, so the strategies are driven with hypothesis here.
OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
              "GET /v1/models/{model_id}", "GET /v1/speculators", "GET /v1/engine/stats", "GET /health",
              "GET /ready", "GET /metrics"]
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


def test_every_operation_is_fuzzed(api_schema):
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS)


def steer(body: dict) -> None:
    """Half of the positive cases are nudged past the checks the schema cannot express (the served
    model name, non-null text content), so the fuzzer reaches generation instead of stopping at a
    404 or 400 every time."""
    if "model" in body:
        body["model"] = SERVED_NAME
    if not body.get("stream"):
        body.pop("stream_options", None)
    for unsupported in ("suffix", "tools"):
        body.pop(unsupported, None)
    for message in body.get("messages") or ():
        if isinstance(message, dict) and not isinstance(message.get("content"), str):
            message["content"] = "hi"


# Operations with a body get invalid inputs too (the others have nothing that can be invalid: any
# string is a valid model id).
CASES = [(label, mode) for label in OPERATIONS for mode in MODES
         if mode is MODES[0] or label.startswith("POST")]


@pytest.mark.parametrize("label,mode", CASES, ids=[f"{label}-{mode.value}" for label, mode in CASES])
def test_openapi_fuzz(api_schema, fuzz_server, label, mode):
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, label

    statuses: Counter[int] = Counter()

    @given(case=operation.as_strategy(generation_mode=mode), served=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case, served):
        if served and mode is schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict):
            steer(case.body)
        response = case.call_and_validate(base_url=fuzz_server.url, excluded_checks=EXCLUDED, timeout=60)
        statuses[response.status_code] += 1
        if os.environ.get("SPECSERVE_FUZZ_DEBUG") and response.status_code == 400:
            print(response.json()["error"]["message"][:150])
    check()
    print(label, mode.value, dict(statuses))


def test_after_fuzzing_the_engine_is_idle_and_serving(fuzz_server):
    fuzz_server.wait_idle(timeout=30)
    assert_still_serving(fuzz_server.url)
