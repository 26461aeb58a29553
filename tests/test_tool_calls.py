"""Tool calls: the three families' formats parsed (and split while streaming), and end to end with the
official openai client on tiny random models whose tokenizer configs carry each family's chat template
(tests/chat_templates/): tools rendered, `tool` messages accepted, required / named calls enforced by
the parameter schemas, OpenAI's exact shapes streaming and not."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
from conftest import SERVED_NAME, ServerProcess

from specserve.server.api.tool_parsers import StreamSplitter, get_parser

TEMPLATES = Path(__file__).parent / "chat_templates"
FAMILIES = ("hermes", "llama3_json", "mistral")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather now.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSG = [{"role": "user", "content": "Weather in Paris?"}]


# ------------------------------------------------------------------------- parsers
@pytest.mark.parametrize("family,text,content,calls", [
    ("hermes", 'Let me look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
               '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Let me look.", [("f", {"x": 1}), ("g", {})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{broken", "<tool_call>{broken", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "z"}}', None,
     [("f", {"x": 1}), ("g", {"y": "z"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", {})]),
    ("llama3_json", 'The answer is {"name": 1}', 'The answer is {"name": 1}', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": [1, 2]}}]', "Sure.", [("f", {"x": [1, 2]})]),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
])
def test_parsers_read_each_family_format(family, text, content, calls):
    got_content, got = get_parser(family).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("family,text", [
    ("hermes", 'Checking <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'),
    ("mistral", 'Ok [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]'),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}'),
    ("hermes", "plain text with a < sign and <tool but no call"),
])
def test_stream_splitter_sends_content_and_holds_calls(family, text):
    for size in (1, 3, 7):
        splitter = StreamSplitter(get_parser(family))
        sent = "".join(splitter.feed(text[i:i + size]) for i in range(0, len(text), size))
        rest, calls = splitter.finish()
        content, expected = get_parser(family).parse(text)
        assert [c.name for c in calls] == [c.name for c in expected]
        if expected:
            assert "{" not in sent and (sent + rest).strip() == (content or "")    # no call text leaked
        else:
            assert sent + rest == text


# ------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def family_servers(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-families")
    procs = {}
    for family in FAMILIES:
        model = root / family
        shutil.copytree(tiny_model_dir, model)
        cfg_path = model / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = (TEMPLATES / f"{family}.jinja").read_text()
        cfg_path.write_text(json.dumps(cfg))
        procs[family] = ServerProcess(model, root / f"{family}.log", "--tool-call-parser", family)
    try:
        yield {family: openai.OpenAI(base_url=f"{p.wait_ready()}/v1", api_key="x", max_retries=0, timeout=60)
               for family, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


def assert_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert names is None or call.function.name in names


@pytest.mark.parametrize("family", FAMILIES)
def test_named_and_required_calls_are_enforced(family_servers, family):
    client = family_servers[family]
    named = client.chat.completions.create(
        model=SERVED_NAME, messages=MSG, tools=TOOLS, max_tokens=100, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_calls(choice.message.tool_calls, {"get_weather"})
    plain = client.chat.completions.create(model=SERVED_NAME, messages=MSG, max_tokens=1)
    assert named.usage.prompt_tokens > plain.usage.prompt_tokens + 20        # the template rendered the tools
    for parallel in (None, False):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        required = client.chat.completions.create(model=SERVED_NAME, messages=MSG, tools=TOOLS, max_tokens=160,
                                                  temperature=1.0, seed=3, tool_choice="required", **extra)
        choice = required.choices[0]
        if parallel is None and choice.finish_reason == "length":
            # parallel calls: a random model may keep adding calls past max_tokens; cut, it stays text
            assert choice.message.content.startswith("[{") and choice.message.tool_calls is None
            continue
        assert choice.finish_reason == "tool_calls"
        assert_calls(choice.message.tool_calls)
        if parallel is False:
            assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_calls_have_openai_delta_shape(family_servers, family):
    client = family_servers[family]
    for tool_choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        stream = client.chat.completions.create(model=SERVED_NAME, messages=MSG, tools=TOOLS, max_tokens=160,
                                                temperature=0.7, seed=4, tool_choice=tool_choice, stream=True,
                                                parallel_tool_calls=False)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            for c in chunk.choices:
                finish = c.finish_reason or finish
                assert not c.delta.content
                for d in c.delta.tool_calls or ():
                    if d.id is not None:                      # the opening delta of a call
                        assert d.index not in calls and d.type == "function" and d.function.name
                        calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                    calls[d.index]["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and calls
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_and_none_answer_in_text_and_tool_messages_render(family_servers, family):
    client = family_servers[family]
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    for tool_choice in ("auto", "none"):
        r = client.chat.completions.create(model=SERVED_NAME, messages=history, tools=TOOLS, max_tokens=12,
                                           temperature=0, tool_choice=tool_choice)
        # a random model does not write its family's call format: the output is text
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content
    stream = client.chat.completions.create(model=SERVED_NAME, messages=history, tools=TOOLS, max_tokens=12,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content


def test_tool_errors_are_400s(family_servers):
    client = family_servers["hermes"]
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=SERVED_NAME, messages=MSG, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]
    with pytest.raises(openai.BadRequestError, match="no-such-type"):
        client.chat.completions.create(model=SERVED_NAME, messages=MSG, tools=bad, tool_choice="required")
