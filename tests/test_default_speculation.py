"""The server default (`--speculation`) is checked at start-up like a request's `speculation` field."""
from __future__ import annotations

import pytest
from conftest import SERVED_NAME

from specserve.server.config import EngineConfig, parse_speculation
from specserve.server.engine.builder import build_engine


def engine_config(tiny_model_dir, speculation: str) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), kv_cache_memory_gb=0.05, num_threads=1,
                        speculation=parse_speculation(speculation))


@pytest.mark.parametrize("speculation,message", [
    ('{"method": "draft"}', r"'draft' is not loaded on this server \(draft needs --draft-model"),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "'eagle3' is not loaded"),
    ('{"method": "hybrid"}', "'hybrid' is not loaded"),
    ('{"method": "prediction"}', "cannot be the default"),
    ('{"method": "ngram", "prompt_lookup_min": 0}', "prompt_lookup_min must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 9}', "k must be in"),
])
def test_a_default_the_engine_cannot_serve_fails_the_start(tiny_model_dir, speculation, message):
    with pytest.raises(ValueError, match=message):
        build_engine(engine_config(tiny_model_dir, speculation))


def test_a_loaded_default_builds_and_serves(tiny_model_dir):
    engine, _ = build_engine(engine_config(tiny_model_dir, '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert "ngram" in engine.spec.methods


# ---- without --speculation: the best loaded method ------------------------------------------------

@pytest.mark.parametrize("loaded,max_k,expected", [
    (["none", "ngram", "prediction", "eagle3", "mtp", "draft", "hybrid", "suffix", "auto"], 8, ("auto", 8)),
    (["none", "ngram", "prediction", "suffix", "auto"], 2, ("auto", 2)),
    (["none", "ngram", "prediction", "eagle3", "hybrid"], 8, ("hybrid", 4)),       # an engine without auto
    (["none", "ngram", "prediction"], 8, ("ngram", 4)),
    (["none", "ngram", "prediction", "hybrid"], 2, ("hybrid", 2)),
    (["none", "ngram", "auto"], 0, ("none", 0)),
])
def test_the_default_is_the_best_loaded_method(loaded, max_k, expected):
    from specserve.speculators.registry import default_speculation
    spec = default_speculation(loaded, max_k)
    assert (spec.method, spec.k) == expected


def test_with_a_model_drafter_loaded_the_default_is_auto_under_the_goodput_policy(tiny_model_dir):
    from specserve import LLM
    from specserve.sampling.params import SamplingParams
    llm = LLM(model=str(tiny_model_dir), draft_model=str(tiny_model_dir), kv_cache_memory_gb=0.05,
              num_threads=1, dtype="float32")
    assert llm.default_speculation.method == "auto" and llm.default_speculation.k == 8
    assert llm.engine.spec.policy is not None                 # goodput is the default policy
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (spec_out,) = llm.generate(["a b c a b c a b"], params)
    (plain,) = llm.generate(["a b c a b c a b"], params, speculation={"method": "none"})
    stats = spec_out.spec_stats
    # each step emits one token plus the drafts it accepted, whichever method auto took for it
    rows = stats.by_method.values()
    assert stats.method == "auto" and stats.k == 8 and sum(row[0] + row[2] for row in rows) == 24
    assert set(stats.by_method) <= {"none", "draft", "ngram", "suffix"}
    assert plain.spec_stats.num_drafts == 0 and spec_out.token_ids == plain.token_ids


def test_a_plain_openai_request_is_speculative_and_none_turns_it_off(client, http):
    listed = http.get("/v1/speculators").json()["default"]
    assert listed == {"method": "auto", "num_speculative_tokens": 8, "options": {}}
    prompt = "x = 1\nx = 1\nx = 1\nx = 1\nx ="
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=32, temperature=0,
                                  extra_body={"ignore_eos": True})
    spec = r.model_extra["speculation"]
    assert spec["method"] == "auto" and spec["num_speculative_tokens"] == 8 and spec["num_drafts"] > 0
    assert sum(row["num_steps"] for m, row in spec["by_method"].items() if m != "none") == spec["num_drafts"]
    off = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=32, temperature=0,
                                    extra_body={"ignore_eos": True, "speculation": {"method": "none"}})
    assert off.model_extra["speculation"]["num_drafts"] == 0 and off.choices[0].text == r.choices[0].text
