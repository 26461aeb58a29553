"""/v1/completions against the real server (tiny random Llama) with the official openai client."""
from __future__ import annotations

import httpx
import pytest
from conftest import SERVED_NAME

PROMPT = "The quick brown fox jumps over the lazy dog"
LONG = {"ignore_eos": True}      # random weights may sample EOS early; these tests want exact lengths


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_string_prompt_usage_is_exact(client, hf_tokenizer):
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=7, logprobs=0, temperature=0,
                                  extra_body=LONG)     # greedy: a sampled byte token would split a character
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == SERVED_NAME
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == n_tokens(hf_tokenizer, PROMPT)
    assert r.usage.completion_tokens == 7 == len(choice.logprobs.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert "".join(choice.logprobs.tokens) == choice.text


def test_text_ending_inside_a_character_is_flushed(client, hf_tokenizer):
    """A reply cut mid-character ends in U+FFFD, exactly as decoding its tokens gives; nothing is dropped."""
    rocket = hf_tokenizer("🚀", add_special_tokens=False).input_ids
    assert len(rocket) > 1                                   # byte fallback: one token per UTF-8 byte
    for n in range(1, len(rocket)):
        bias = {str(rocket[0]): 100}                         # force the first byte of the rocket, n times
        r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=n, logit_bias=bias,
                                      extra_body=LONG)
        assert r.choices[0].text == hf_tokenizer.decode([rocket[0]] * n) and r.choices[0].text.endswith("\ufffd")
        chunks = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=n, logit_bias=bias,
                                           stream=True, extra_body=LONG)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_default_max_tokens_is_16(client):
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, extra_body=LONG)
    assert r.usage.completion_tokens == 16


def test_list_and_token_id_prompts(client, hf_tokenizer):
    ids = hf_tokenizer(PROMPT, add_special_tokens=False).input_ids
    prompts = ["Hello", "A much longer second prompt than the first"]
    r = client.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=3, extra_body=LONG)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == sum(n_tokens(hf_tokenizer, p) for p in prompts)
    assert r.usage.completion_tokens == 6
    by_ids = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=SERVED_NAME, prompt=[ids, ids[:3]], max_tokens=2, extra_body=LONG)
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == len(ids) + 3


def test_n_choices_fan_out(client, hf_tokenizer):
    r = client.completions.create(model=SERVED_NAME, prompt=["one", "two words"], n=3, max_tokens=4,
                                  seed=7, temperature=1.0, extra_body=LONG)
    assert [c.index for c in r.choices] == list(range(6))
    # the prompt is counted once per prompt, whatever n is; every choice's tokens are counted
    assert r.usage.prompt_tokens == n_tokens(hf_tokenizer, "one") + n_tokens(hf_tokenizer, "two words")
    assert r.usage.completion_tokens == 24
    assert len({c.text for c in r.choices[:3]}) > 1          # seeds seed+i: the choices differ


def test_seed_reproducible_at_temperature(client):
    kwargs = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.8, "seed": 1234,
              "extra_body": LONG}
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
    assert client.completions.create(**{**kwargs, "seed": 4321}).choices[0].text != first


def test_logprobs_legacy_format(client):
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5, logprobs=3, extra_body=LONG)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_prompt_logprobs(client, hf_tokenizer):
    ids = hf_tokenizer(PROMPT, add_special_tokens=False).input_ids
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1,
                                  extra_body=LONG)
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 4 == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.tokens[: len(ids)] == [hf_tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    plain = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=2, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_stop_string_is_never_emitted(client):
    base = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "extra_body": LONG}
    full = client.completions.create(**base).choices[0].text
    stop = next(full[i:i + 3] for i in range(4, len(full) - 3) if full[i:i + 3].strip())
    expected = full[: full.index(stop)]
    r = client.completions.create(**base, stop=[stop, "never-matches-xyz"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(**base, stop=stop, stream=True)
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert "".join(chunks) == expected and all(stop not in c for c in chunks)


def test_streaming_chunks_done_and_usage(client, server_url):
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}, extra_body=LONG)
    chunks = list(stream)
    *content, last = chunks
    assert len(content) >= 2 and all(c.usage is None for c in content)
    assert content[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 6
    with httpx.stream("POST", f"{server_url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        events = [line for line in raw.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert '"usage"' not in "".join(events)       # no include_usage: no usage field at all


def test_stream_equals_non_stream_greedy(client):
    kwargs = {"model": SERVED_NAME, "prompt": ["Once upon a time", PROMPT], "max_tokens": 12,
              "temperature": 0}
    whole = client.completions.create(**kwargs)
    texts = ["", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]


def test_speculation_stats_in_response(client):
    r = client.completions.create(model=SERVED_NAME, prompt="a b c a b c a b c a b", max_tokens=8,
                                  temperature=0, extra_body={"speculation": {"method": "ngram",
                                                                             "num_speculative_tokens": 3}})
    spec = r.model_extra["speculation"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    assert spec["mean_acceptance_length"] >= 1.0
    assert len(spec["accepted_per_position"]) <= 3
    plain = client.completions.create(model=SERVED_NAME, prompt="a b c a b c a b c a b", max_tokens=8,
                                      temperature=0, extra_body={"speculation": {"method": "none"}})
    assert plain.choices[0].text == r.choices[0].text            # lossless
    off = plain.model_extra["speculation"]
    assert off["method"] == "none" and off["num_drafts"] == 0 and off["num_speculative_tokens"] == 0


def _refused(http, reason: str) -> float:
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("specserve:spec_decode_refused_total{") and f'reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_ignored_prediction_is_said_in_the_response_and_counted(client, http):
    before = _refused(http, "prediction_ignored")
    r = client.completions.create(model=SERVED_NAME, prompt="x = 1\n", max_tokens=4, temperature=0,
                                  extra_body={"speculation": {"method": "ngram", "num_speculative_tokens": 2},
                                              "prediction": {"type": "content", "content": "x = 1\n"}})
    spec = r.model_extra["speculation"]
    assert spec["method"] == "ngram" and "prediction ignored" in spec["notice"]
    assert spec["cuts"] == {"prediction_ignored": 1}
    assert _refused(http, "prediction_ignored") == before + 1


def test_goodput_policy_fields_and_opt_out(client, http):
    """`num_steps_k_reduced` is always in the response; `"adaptive": false` keeps k fixed (never cut);
    a non-boolean `adaptive` is a 400 naming the field."""
    import openai
    r = client.completions.create(model=SERVED_NAME, prompt="a b c a b c a b c a b", max_tokens=8, temperature=0,
                                  extra_body={"speculation": {"method": "ngram", "num_speculative_tokens": 3,
                                                              "adaptive": False}})
    spec = r.model_extra["speculation"]
    assert spec["num_steps_k_reduced"] == 0 and spec["method"] == "ngram"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=2,
                                  extra_body={"speculation": {"method": "ngram", "adaptive": "maybe"}})
    assert "adaptive" in err.value.body["message"] and err.value.body["param"] == "speculation"


MIXED_PROMPTS = ["a b c a b c a b c a b", "def f(x):\n    return f(x)\ndef f(", PROMPT, "1 2 3 1 2 3 1 2",
                 "import os\nimport os\nimport", "x = x + 1\nx = x + 1\n", "Once upon a time", "[0, 0, 0, 0,"]


def test_eight_concurrent_requests_mixing_methods_and_k_equal_plain_greedy(client, server_url):
    """Mixed batches end to end: 8 requests in flight at once over HTTP, each with its own method and k (and
    Predicted Outputs, exact and wrong), share verification steps; every text equals plain greedy."""
    import asyncio
    kwargs = {"model": SERVED_NAME, "max_tokens": 24, "temperature": 0, "extra_body": dict(LONG)}
    plain = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in MIXED_PROMPTS]
    specs = [
        {"method": "none"},
        {"method": "ngram", "num_speculative_tokens": 1},
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "ngram", "num_speculative_tokens": 8},
        {"method": "prediction", "num_speculative_tokens": 4},
        {"method": "prediction", "num_speculative_tokens": 2},
        {"method": "ngram", "num_speculative_tokens": 5},
        {"method": "prediction", "num_speculative_tokens": 8},
    ]
    predictions = {4: plain[4], 5: "something else entirely", 7: plain[7][:10] + "zzz" + plain[7][10:]}

    async def one(async_client, i: int):
        body = {**LONG, "speculation": specs[i]}
        if i in predictions:
            body["prediction"] = {"type": "content", "content": predictions[i]}
        return await async_client.completions.create(
            model=SERVED_NAME, prompt=MIXED_PROMPTS[i], max_tokens=24, temperature=0, extra_body=body
        )

    async def all_at_once():
        import openai

        async with openai.AsyncOpenAI(
            base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=60
        ) as async_client:  # its own event loop: its own client
            return await asyncio.gather(*(one(async_client, i) for i in range(len(MIXED_PROMPTS))))

    results = asyncio.run(all_at_once())
    assert [r.choices[0].text for r in results] == plain
    for r, spec in zip(results, specs):
        assert r.model_extra["speculation"]["method"] == spec["method"]
    exact = results[4]
    assert exact.usage.completion_tokens_details.accepted_prediction_tokens > 0  # the exact prediction is used


def test_legacy_logprobs_keep_the_sampled_tokens_entry_when_two_tokens_share_a_text():
    """Two ids can decode to the same string (partial UTF-8 bytes both show as U+FFFD); the legacy format is a
    map from text, and its entry for the sampled token's text must be the sampled token's logprob."""
    from types import SimpleNamespace

    from specserve.sampling.outputs import TokenLogprob
    from specserve.server.api.logprobs import CompletionLogprobsFormatter
    texts = {1: "a", 2: "\ufffd", 3: "b", 4: "\ufffd"}
    fmt = CompletionLogprobsFormatter(SimpleNamespace(token_str=texts.__getitem__), num_top=3)
    out = fmt.output([TokenLogprob(4, -9.2, [(1, -8.3), (2, -8.4), (3, -8.5)])])   # 4 sampled, 2 in the top
    assert out.tokens == ["\ufffd"] and out.token_logprobs == [-9.2]
    assert out.top_logprobs == [{"a": -8.3, "\ufffd": -9.2, "b": -8.5}]
