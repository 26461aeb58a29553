"""A second real server started with non-default flags: --api-key, a limit, a default speculation."""
from __future__ import annotations

import httpx
import openai
import pytest
from conftest import LOCKED_API_KEY as KEY
from conftest import SERVED_NAME


def test_api_key_required(locked_url):
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY}):
        r = httpx.post(f"{locked_url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{locked_url}/v1/models").status_code == 401
    assert httpx.get(f"{locked_url}/health").status_code == 200       # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{locked_url}/v1", api_key="wrong", max_retries=0).models.list()


def test_flags_reach_the_server(locked_url):
    client = openai.OpenAI(base_url=f"{locked_url}/v1", api_key=KEY, max_retries=0)
    r = client.completions.create(model=SERVED_NAME, prompt="hi there", max_tokens=3, n=2)
    assert len(r.choices) == 2
    spec = r.model_extra["speculation"]                   # the --speculation default applies
    assert (spec["method"], spec["num_speculative_tokens"]) == ("ngram", 3)
    with pytest.raises(openai.BadRequestError) as info:   # --max-n 2
        client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1, n=3)
    assert info.value.body["param"] == "n"
    schema = httpx.get(f"{locked_url}/openapi.json").json()["components"]["schemas"]
    assert schema["CompletionRequest"]["properties"]["n"]["maximum"] == 2
