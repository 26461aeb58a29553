"""Structured outputs over HTTP with the official openai client: response_format (json_object, json_schema)
and structured_outputs (regex, choice, grammar) on both endpoints, streaming and not, with n, logprobs,
prediction and speculation; the grammar-rejection counter in the response and in /metrics; what
/v1/models says. Tool calls: tests/test_tool_calls.py."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import SERVED_NAME

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "days", "sunny"], "additionalProperties": False}
MSG = [{"role": "user", "content": "Plan a trip as JSON."}]
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}


def test_chat_json_schema_validates_with_and_without_speculation(client):
    for speculation in ({"method": "none"}, {"method": "ngram", "num_speculative_tokens": 4}):
        r = client.chat.completions.create(model=SERVED_NAME, messages=MSG, max_tokens=80, temperature=0,
                                           response_format=JSON_SCHEMA_FORMAT,
                                           extra_body={"speculation": speculation})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert r.model_extra["speculation"]["method"] == speculation["method"]
        if speculation["method"] == "none":
            plain = choice.message.content
    assert choice.message.content == plain        # greedy: speculation changes nothing


def test_chat_json_schema_streams_n_choices_with_logprobs(client):
    stream = client.chat.completions.create(model=SERVED_NAME, messages=MSG, max_tokens=80, temperature=1.0,
                                            seed=5, n=2, logprobs=True, top_logprobs=2, stream=True,
                                            response_format=JSON_SCHEMA_FORMAT)
    texts, finish, logprobs = ["", ""], [None, None], [0, 0]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
            logprobs[c.index] += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
    assert finish == ["stop", "stop"]
    for text, n in zip(texts, logprobs):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert n >= 5


def test_completions_take_response_format_and_structured_outputs(client):
    r = client.completions.create(model=SERVED_NAME, prompt="trip = ", max_tokens=80, temperature=0,
                                  extra_body={"response_format": JSON_SCHEMA_FORMAT})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=SERVED_NAME, prompt="id: ", max_tokens=20, temperature=0.8, seed=1,
                                  extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("structured,check", [
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'}, lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
    ({"grammar": 'start: "x" NUM\nNUM: /[0-9]{2}/'}, lambda t: re.fullmatch(r"x[0-9]{2}", t)),   # Lark
    ({"regex": r"(ab|cd){2,3}"}, lambda t: re.fullmatch(r"(ab|cd){2,3}", t)),
    ({"json_object": True}, None),
])
def test_structured_outputs_kinds_on_chat(client, structured, check):
    r = client.chat.completions.create(model=SERVED_NAME, messages=MSG, max_tokens=60, temperature=0.9, seed=2,
                                       extra_body={"structured_outputs": structured})
    text = r.choices[0].message.content
    if check is None:             # any JSON object: complete ones parse
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")
        return
    assert r.choices[0].finish_reason == "stop" and check(text), text


def test_prediction_with_a_schema_counts_the_drafts_the_grammar_forbids(client, http):
    bad = '{"city": "Paris", "days": "many", "sunny": true}'    # "many" breaks the schema at that position
    r = client.chat.completions.create(model=SERVED_NAME, messages=MSG, max_tokens=80, temperature=0,
                                       response_format=JSON_SCHEMA_FORMAT,
                                       extra_body={"prediction": {"type": "content", "content": bad}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    spec = r.model_extra["speculation"]
    assert spec["method"] == "prediction" and spec["num_draft_tokens"] > 0
    assert spec["grammar_rejected"] >= 1
    metrics = http.get("/metrics").text
    rejected = [line for line in metrics.splitlines()
                if line.startswith("specserve:spec_decode_grammar_rejected_total") and 'method="prediction"' in line]
    assert rejected and float(rejected[0].rsplit(" ", 1)[1]) >= 1


def test_bad_constraints_are_400s_that_name_the_problem(http):
    cases = [
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs", "undefined_rule"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
         "response_format", "wat"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "json"),
        ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs", "--max-grammar-bytes"),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, None, "not both"),
    ]
    for body, param, words in cases:
        for route, base in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "x"})):
            r = http.post(route, json={"model": SERVED_NAME, "max_tokens": 4, **base, **body})
            assert r.status_code == 400, (route, body, r.text)
            err = r.json()["error"]
            assert words in err["message"], (body, err)
            if param is not None:
                assert err["param"] is not None and err["param"].startswith(param), err
    assert http.get("/health").status_code == 200


def test_models_say_what_is_supported(http):
    card = http.get("/v1/models").json()["data"][0]["structured_outputs"]
    assert card["response_format"] == ["text", "json_object", "json_schema"]
    assert set(card["structured_outputs"]) == {"json", "regex", "choice", "grammar", "json_object"}
    assert card["tool_call_parser"] == "hermes" and card["max_grammar_bytes"] == 65536
