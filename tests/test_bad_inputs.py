"""Bad input, part two (tests/test_api_errors.py has the first ~50 cases): every request below gets a
4xx with the OpenAI error body (or, where marked, is legal and succeeds), and after EACH one /health
is 200 and a normal request succeeds. Transport-level abuse (huge headers, 100 MB bodies, chunked
bodies, broken UTF-8, JSON bombs) goes through the real uvicorn of the shared test server.
"""
from __future__ import annotations

import json
import socket

import httpx
import pytest
from conftest import LOCKED_API_KEY, MAX_MODEL_LEN, SERVED_NAME
from reliability_support import assert_error, assert_still_serving

MSG = [{"role": "user", "content": "hi"}]
LONG_PREDICTION = {"type": "content", "content": "hello " * 2000}          # ~2000+ tokens > context
C, CHAT = "/v1/completions", "/v1/chat/completions"

# (path, body without model, expected status, param (... = any), code (... = any))
BAD_JSON = [
    # prompts: types, lengths, context
    (C, {"prompt": True}, 400, "prompt", ...),
    (C, {"prompt": {"text": "x"}}, 400, "prompt", ...),
    (C, {"prompt": [1.5, 2]}, 400, ..., ...),
    (C, {"prompt": [["a"]]}, 400, ..., ...),
    (C, {"prompt": ["x"] * 65}, 400, "prompt", ...),                          # --max-prompts 64
    (C, {"prompt": [2**31]}, 400, ..., ...),
    (C, {"prompt": [7] * MAX_MODEL_LEN, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
    (C, {"prompt": [7] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    (C, {"prompt": [7] * (MAX_MODEL_LEN + 100), "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
    (C, {"prompt": "a" * 1_000_000, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),  # huge single token
    (C, {"prompt": ["ok", "word " * 2000]}, 400, "prompt", "context_length_exceeded"),
    (C, {"prompt": "a\ud800b"}, 400, "prompt", ...),                          # lone surrogate
    (C, {"model": 123, "prompt": "x"}, 400, "model", ...),
    (C, {"model": "\udfff", "prompt": "x"}, 400, "model", ...),
    # numbers out of range / of the wrong type
    (C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", ...),
    (C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", ...),
    # strict types, as OpenAI's API: no "yes" for a boolean, no "3" or 2.0 for an integer
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream", ...),
    (C, {"prompt": "x", "stream": 1}, 400, "stream", ...),
    (C, {"prompt": "x", "echo": "true"}, 400, "echo", ...),
    (C, {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens", ...),
    (C, {"prompt": "x", "max_tokens": 2.0}, 400, "max_tokens", ...),
    (C, {"prompt": "x", "n": "1"}, 400, "n", ...),
    (C, {"prompt": "x", "temperature": "0.5"}, 400, "temperature", ...),
    (C, {"prompt": "x", "speculation": {"method": "ngram", "num_speculative_tokens": "4"}}, 400, ..., ...),
    (CHAT, {"messages": MSG, "logprobs": "true"}, 400, "logprobs", ...),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": "yes"}, "stream": True}, 400, ..., ...),
    (C, {"prompt": "x", "max_tokens": -(2**63)}, 400, "max_tokens", ...),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature", ...),
    (C, {"prompt": "x", "temperature": 2.5}, 400, "temperature", ...),
    (C, {"prompt": "x", "top_p": -0.1}, 400, "top_p", ...),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", ...),
    (C, {"prompt": "x", "top_k": -2}, 400, "top_k", ...),
    (C, {"prompt": "x", "min_p": 1.5}, 400, "min_p", ...),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", ...),
    (C, {"prompt": "x", "repetition_penalty": 3}, 400, "repetition_penalty", ...),
    (C, {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty", ...),
    (C, {"prompt": "x", "presence_penalty": "high"}, 400, "presence_penalty", ...),
    (C, {"prompt": "x", "n": -1}, 400, "n", ...),
    (C, {"prompt": "x", "n": 2**63}, 400, "n", ...),
    (C, {"prompt": "x", "best_of": 0}, 400, "best_of", ...),
    (C, {"prompt": "x", "logprobs": -1}, 400, "logprobs", ...),
    (C, {"prompt": "x", "seed": -(2**63) - 1}, 400, "seed", ...),
    (C, {"prompt": "x", "seed": 1.5}, 400, "seed", ...),
    (C, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", ...),
    (C, {"prompt": "x", "stream": "maybe"}, 400, "stream", ...),
    (C, {"prompt": "x", "request_timeout": 0}, 400, "request_timeout", ...),
    (C, {"prompt": "x", "request_timeout": 10**9}, 400, "request_timeout", ...),
    # logit_bias, stop
    (C, {"prompt": "x", "logit_bias": {"5": "x"}}, 400, ..., ...),
    (C, {"prompt": "x", "logit_bias": [1, 2]}, 400, "logit_bias", ...),
    (C, {"prompt": "x", "logit_bias": {"-1": 1}}, 400, ..., ...),
    (C, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias", ...),
    (C, {"prompt": "x", "logit_bias": {"\ud800": 1}}, 400, ..., ...),
    (C, {"prompt": "x", "stop": ""}, 400, "stop", ...),
    (C, {"prompt": "x", "stop": [1, 2]}, 400, ..., ...),
    (C, {"prompt": "x", "stop": ["s"] * 17}, 400, "stop", ...),                # --max-stop 16
    (C, {"prompt": "x", "stop": ["\ud800"]}, 400, "stop.0", ...),
    (C, {"prompt": "x", "stop_token_ids": [-1]}, 400, ..., ...),
    (C, {"prompt": "x", "stop_token_ids": [10**8]}, 400, "stop_token_ids", ...),
    # speculation and prediction
    (C, {"prompt": "x", "speculation": "ngram"}, 400, "speculation", ...),
    (C, {"prompt": "x", "speculation": {}}, 400, ..., ...),
    (C, {"prompt": "x", "speculation": {"method": "ngram", "num_speculative_tokens": 2**40}}, 400, ..., ...),
    (C, {"prompt": "x", "speculation": {"method": "ngram", "num_speculative_tokens": 1.5}}, 400, ..., ...),
    (C, {"prompt": "x", "speculation": {"method": "ngram", "prompt_lookup_max": -1}}, 400, "speculation", ...),
    (C, {"prompt": "x", "speculation": {"method": "none", "bogus": 1}}, 400, "speculation", ...),
    (C, {"prompt": "x", "speculation": {"method": "hybrid", "draft_tree": {"top_k": 2}}}, 400, "speculation", ...),
    (C, {"prompt": "x", "speculation": {"method": "eagle3", "draft_tree": "wide"}}, 400, "speculation", ...),
    (C, {"prompt": "x", "speculation": {"method": "eagle3", "num_speculative_tokens": 4,
                                         "draft_tree": {"top_k": 0, "depth": 2}}}, 400, "speculation", ...),
    (C, {"prompt": "x", "speculation": {"method": "eagle3", "num_speculative_tokens": 4,
                                         "draft_tree": {"top_k": 2, "depth": 5}}}, 400, "speculation", ...),
    (C, {"prompt": "x", "speculation": {"method": "ngram", "num_speculative_tokens": 16,
                                         "draft_tree": {"top_k": 2, "depth": 4}}}, 400, "speculation", ...),
    (C, {"prompt": "x", "speculation": {"method": "ngram", "prompt_lookup_max": "\ud800"}}, 400, ..., ...),
    (C, {"prompt": "x", "prediction": LONG_PREDICTION}, 400, "prediction", ...),
    (C, {"prompt": "x", "prediction": {"type": "content", "content": 5}}, 400, ..., ...),
    (C, {"prompt": "x", "prediction": {"type": "content", "content": "\ud800"}}, 400, ..., ...),
    # chat
    (CHAT, {"messages": "hi"}, 400, "messages", ...),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages.0.role", ...),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0", ...),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, ..., ...),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, ..., ...),
    (CHAT, {"messages": [{"role": "function", "content": "x"}]}, 400, "messages.0.role", ...),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": "n" * 300}]}, 400, "messages.0.name", ...),
    (CHAT, {"messages": MSG * 1025}, 400, "messages", ...),                    # --max-messages 1024
    (CHAT, {"messages": [{"role": "user", "content": "\udbff!"}]}, 400, ..., ...),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 200_000}]}, 400, "messages",
     "context_length_exceeded"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens", ...),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", ...),
    (CHAT, {"messages": MSG, "temperature": 1e999}, 400, "temperature", ...),
    (CHAT, {"messages": MSG, "prediction": LONG_PREDICTION}, 400, "prediction", ...),
    (CHAT, {"messages": MSG, "user": "u" * 1000}, 400, "user", ...),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD_JSON,
                         ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, *_) in enumerate(BAD_JSON)])
def test_bad_json_requests(server_url, path, body, status, param, code):
    data = json.dumps({"model": SERVED_NAME, **body}).encode()      # lone surrogates as \\udxxx escapes
    r = httpx.post(server_url + path, content=data, headers={"content-type": "application/json"}, timeout=60)
    assert_error(r, status, param, code)
    assert_still_serving(server_url)


def _raw(url: str, payload: bytes) -> bytes:
    """Send raw bytes, return everything the server answers before it closes or goes quiet."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _post_raw(body: bytes, content_type: str = "application/json") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


RAW_BODIES = {
    "non-utf8": (b'{"model": "tiny-llama", "prompt": "\xff\xfe\xfd"}', "invalid_json"),
    "cesu-surrogate-bytes": (b'{"prompt": "\xed\xa0\x80"}', ...),      # json.loads lets it through
    "deep-nesting": (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json"),
    "5000-digit-int": (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),
    "null-body": (b"null", ...),
    "trailing-garbage": (b'{"prompt": "x"} trailing', "invalid_json"),
}


@pytest.mark.parametrize("name", list(RAW_BODIES))
def test_raw_bodies(server_url, name):
    body, code = RAW_BODIES[name]
    r = httpx.post(server_url + C, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert_error(r, 400, ..., code)
    assert_still_serving(server_url)


def test_utf16_json_is_read_like_utf8(server_url):
    """json.loads detects UTF-16/32 by their BOM; harmless, so it is accepted rather than refused."""
    body = json.dumps({"model": SERVED_NAME, "prompt": "é", "max_tokens": 1}).encode("utf-16")
    r = httpx.post(server_url + C, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    assert_still_serving(server_url)


def test_wrong_content_type(server_url):
    r = httpx.post(server_url + C, content=json.dumps({"model": SERVED_NAME, "prompt": "x"}),
                   headers={"content-type": "text/plain"}, timeout=60)
    assert_error(r, 400)
    assert_still_serving(server_url)


def test_nul_bytes_in_prompt_are_text(server_url):
    r = httpx.post(server_url + C, json={"model": SERVED_NAME, "prompt": "a\x00b\x00", "max_tokens": 2,
                                         "echo": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("a\x00b\x00")
    assert_still_serving(server_url)


def test_prompt_exactly_at_the_limit_succeeds(server_url):
    """prompt + max_tokens == max_model_len is legal (and the largest prompt that is)."""
    body = {"model": SERVED_NAME, "prompt": [7] * (MAX_MODEL_LEN - 1), "max_tokens": 1}
    r = httpx.post(server_url + C, json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (MAX_MODEL_LEN - 1, 1)
    with httpx.stream("POST", server_url + C, json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200 and "data: [DONE]" in s.read().decode()
    assert_still_serving(server_url)


def test_huge_header_is_431(server_url):
    r = httpx.post(server_url + C, json={"model": SERVED_NAME, "prompt": "x"},
                   headers={"x-padding": "a" * 20_000}, timeout=60)
    assert_error(r, 431, None, "headers_too_large")
    many = {f"x-h{i}": "v" * 20 for i in range(1000)}
    assert_error(httpx.get(server_url + "/v1/models", headers=many, timeout=60), 431)
    assert_still_serving(server_url)


def test_megabyte_header_is_refused_by_the_protocol_layer(server_url):
    """h11 stops reading past its buffer cap (--max-header-bytes + 8 KiB) and answers 400 in the
    OpenAI shape; the kernel may turn that close into a reset before we read the answer (we are still
    sending), which is fine: the point is that the server moves on."""
    for size in (1_000_000, 100_000):
        try:
            answer = _raw(server_url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size
                          + b"\r\n\r\n")
        except OSError:        # reset, broken pipe, or "not connected" on shutdown() after a reset
            answer = b""
        if answer:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), head
            assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert_still_serving(server_url)


def test_malformed_http_is_refused(server_url):
    for payload in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
                    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Nul: a\x00b\r\n\r\n",
                    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64):       # TLS hello
        assert _raw(server_url, payload).startswith(b"HTTP/1.1 400"), payload[:40]
    assert_still_serving(server_url)


def test_100mb_body_is_413_before_it_is_read(server_url):
    body = b'{"prompt": "' + b"a" * 100_000_000 + b'"}'
    r = httpx.post(server_url + C, content=body, headers={"content-type": "application/json"}, timeout=120)
    assert_error(r, 413, None, "request_too_large")
    assert_still_serving(server_url)


def test_chunked_body_over_the_cap_is_413(server_url):
    def chunks():
        for _ in range(80):                       # 5 MiB > the 4 MiB default, no Content-Length
            yield b"a" * 65536
    r = httpx.post(server_url + C, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert_error(r, 413, None, "request_too_large")
    small = httpx.post(server_url + C, content=iter([json.dumps({"model": SERVED_NAME, "prompt": "x",
                                                                  "max_tokens": 1}).encode()]),
                       headers={"content-type": "application/json"}, timeout=60)
    assert small.status_code == 200, small.text           # chunked under the cap is served
    assert_still_serving(server_url)


def test_wrong_method_and_odd_paths(server_url):
    assert_error(httpx.put(server_url + C, json={}, timeout=30), 405)
    assert_error(httpx.get(server_url + "/v1/models/%ED%A0%80", timeout=30), 404)
    assert_error(httpx.get(server_url + "/v1/../../etc/passwd", timeout=30), 404)
    assert_still_serving(server_url)


def test_garbage_api_keys_are_401(locked_url):
    for value in (b"Bearer \xff\xfe", b"Bearer " + b"k" * 10_000, b"Basic " + LOCKED_API_KEY.encode(),
                  b"bearer  " + LOCKED_API_KEY.encode() + b"x"):
        r = httpx.get(locked_url + "/v1/models", headers=[(b"authorization", value)], timeout=30)
        assert_error(r, 401, None, "invalid_api_key")
    ok = httpx.get(locked_url + "/v1/models", headers={"Authorization": f"Bearer {LOCKED_API_KEY}"})
    assert ok.status_code == 200
