"""/v1/chat/completions against the real server (chat template from models/tokenizer)."""
from __future__ import annotations

from conftest import SERVED_NAME

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
LONG = {"ignore_eos": True}


def template_len(tokenizer, messages) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_completion_shape_and_usage(client, hf_tokenizer):
    r = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=6,
                                       extra_body=LONG)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == SERVED_NAME
    (choice,) = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == template_len(hf_tokenizer, MESSAGES)
    assert r.usage.completion_tokens == 6
    spec = r.model_extra["speculation"]      # the server default
    assert (spec["method"], spec["num_speculative_tokens"]) == ("auto", 8)


def test_chat_content_parts_and_developer_role(client, hf_tokenizer):
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                          {"type": "text", "text": "there"}]}]
    r = client.chat.completions.create(model=SERVED_NAME, messages=parts, max_tokens=2)
    same = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
    assert r.usage.prompt_tokens == template_len(hf_tokenizer, same)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=5, logprobs=True,
                                       top_logprobs=2, extra_body=LONG)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    # token strings show a split character as U+FFFD each; their raw bytes rebuild the exact text
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", "replace") == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2 and isinstance(t.bytes, list)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_chat_n_and_seed(client):
    kwargs = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 8, "n": 2, "seed": 11,
              "temperature": 0.8, "extra_body": LONG}
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 16


def test_chat_stream_equals_non_stream_greedy(client):
    kwargs = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    first, *rest, usage = chunks
    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in rest)
    assert text == whole.choices[0].message.content
    assert rest[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_prediction_is_lossless_and_reported(client):
    kwargs = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
              "extra_body": LONG}
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    r = client.chat.completions.create(**kwargs, prediction={"type": "content", "content": plain})
    assert r.choices[0].message.content == plain
    spec = r.model_extra["speculation"]
    assert spec["method"] == "prediction"
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == spec["num_accepted_tokens"] > 0
    assert details.rejected_prediction_tokens == spec["num_draft_tokens"] - spec["num_accepted_tokens"]
