"""Bad input gets a 4xx with the OpenAI error body, and the server keeps serving afterwards."""
from __future__ import annotations

import openai
import pytest
from conftest import MAX_MODEL_LEN, SERVED_NAME

OK = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]


def assert_error(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def assert_still_serving(http) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=OK)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": [[]]}, "prompt.0", None),
    ({"prompt": [10**9]}, "prompt", None),
    ({"prompt": [-1]}, "prompt.0", None),
    ({"prompt": 5}, "prompt", None),
    ({}, "prompt", None),
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": 2**63}, "max_tokens", None),
    ({"prompt": "x", "temperature": -0.5}, "temperature", None),
    ({"prompt": "x", "top_p": 0}, "top_p", None),
    ({"prompt": "x", "n": 0}, "n", None),
    ({"prompt": "x", "n": 1000}, "n", None),
    ({"prompt": "x", "logprobs": 21}, "logprobs", None),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", None),
    ({"prompt": "x", "seed": 2**64}, "seed", None),
    ({"prompt": "x", "stop": ["s"] * 1000}, "stop", None),
    ({"prompt": "x", "stop": ["x" * 1000]}, "stop.0", None),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias", None),
    ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias.5", None),
    ({"prompt": "x", "logit_bias": {"notanid": 1}}, "logit_bias.notanid", None),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens", None),
    ({"prompt": "x", "suffix": "tail"}, "suffix", None),
    ({"prompt": "x", "best_of": 3}, "best_of", None),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", None),
    ({"prompt": "x", "speculation": {"method": "magic"}}, "speculation", None),
    ({"prompt": "x", "speculation": {"method": "ngram", "num_speculative_tokens": -1}},
     "speculation.num_speculative_tokens", None),
    ({"prompt": "x", "speculation": {"method": "ngram", "num_speculative_tokens": 60}}, "speculation", None),
    ({"prompt": "x", "speculation": {"method": "prediction"}}, "speculation.method", None),
    ({"prompt": "x", "prediction": {"type": "nope", "content": "x"}}, "prediction.type", None),
]


@pytest.mark.parametrize("body,param,code", BAD_COMPLETIONS,
                         ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_bad_completion_requests(http, body, param, code):
    assert_error(http.post("/v1/completions", json={"model": SERVED_NAME, **body}), 400, param, code)
    assert_still_serving(http)


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0"),
    ({"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": MSG, "max_completion_tokens": MAX_MODEL_LEN}, "messages"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name"),
    ({"messages": MSG, "tool_choice": "required"}, None),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, None),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": MSG, "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"messages": MSG, "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"messages": MSG, "structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs"),
    ({"messages": MSG, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"messages": MSG, "structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"messages": MSG, "structured_outputs": {"regex": "a" * 70000}}, "structured_outputs"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, None),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_bad_chat_requests(http, body, param):
    assert_error(http.post("/v1/chat/completions", json={"model": SERVED_NAME, **body}), 400, param)
    assert_still_serving(http)


@pytest.mark.parametrize("raw", [b'{"prompt": "x",', b"not json", b"", b"[1, 2]", b'"just a string"',
                                 b'{"prompt": "x", "temperature": NaN}',
                                 b'{"prompt": "x", "top_p": Infinity}'])
def test_malformed_bodies(http, raw):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_still_serving(http)


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/completions", json={**OK, "frobnicate": True, "service_tier": "auto"})
    assert r.status_code == 200, r.text


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-nope", prompt="x", max_tokens=1)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=MSG, max_tokens=1)
    assert_error(http.get("/v1/models/gpt-nope"), 404, "model", "model_not_found")
    assert_error(http.get("/no/such/route"), 404)
    assert_still_serving(http)


def test_errors_through_the_openai_client(client, http):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt="x" * 10, max_tokens=MAX_MODEL_LEN)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=1,
                                  extra_body={"speculation": {"method": "warp-drive"}})
    assert "warp-drive" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt="x", suffix="y", max_tokens=1)
    assert "suffix" in info.value.message
    with pytest.raises(openai.BadRequestError):         # validation before the stream starts
        client.completions.create(model=SERVED_NAME, prompt="", max_tokens=1, stream=True)
    assert_still_serving(http)
