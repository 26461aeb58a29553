"""Stop bookkeeping inside accepted runs, min_tokens for stop strings, and the one rule for "greedy".

- A stop token inside an accepted run ends the request there: the KV count and the acceptance booked
  (accepted_prediction_tokens, spec_decode_num_accepted_tokens) count only the kept tokens.
- min_tokens gates stop strings as it gates stop token ids (vLLM does both).
- temperature below GREEDY_TEMPERATURE is greedy everywhere: params, sampler, drafters.
"""
from __future__ import annotations

import pytest
from test_engine_speculative import GREEDY, make_engine, plain

from specserve.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from specserve.speculators.base import SpecParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, speculation_policy="fixed")


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.engine.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")


def watch_finishes(engine) -> list[tuple[int, int]]:
    """(num_computed_tokens, num_tokens) of each request as the scheduler finishes it."""
    seen: list[tuple[int, int]] = []
    sched = engine.engine.scheduler
    original = sched.finish

    def finish(req, reason):
        seen.append((req.num_computed_tokens, req.num_tokens))
        original(req, reason)
    sched.finish = finish
    return seen


def test_stop_token_inside_an_accepted_run_books_only_the_kept_tokens(engine, prompt):
    ref = plain(engine, [prompt], max_tokens=30)[0].token_ids
    stop_id = ref[4]
    first = ref.index(stop_id)
    assert 1 <= first <= 6             # inside the first accepted run: tokens 1..9 come from one step
    finishes = watch_finishes(engine)
    try:
        got = engine.generate([prompt], SamplingParams(**GREEDY, max_tokens=30, stop_token_ids=[stop_id]),
                              SpecParams("prediction", 8), predictions=[ref])[0]
    finally:
        del engine.engine.scheduler.finish
    assert got.token_ids == ref[:first + 1] and got.finish_reason == "stop"
    computed, tokens = finishes[-1]
    assert computed == tokens - 1                      # KV of every kept token but the last, nothing beyond
    st = got.spec_stats
    # every step emits its kept accepted drafts + 1 token: the booked acceptance never exceeds the output
    assert st.num_accepted_tokens == len(got.token_ids) - got.num_steps
    assert st.num_accepted_tokens < st.num_draft_tokens


def test_max_tokens_inside_an_accepted_run_books_only_the_kept_tokens(engine, prompt):
    ref = plain(engine, [prompt], max_tokens=30)[0].token_ids
    got = engine.generate([prompt], SamplingParams(**GREEDY, max_tokens=5), SpecParams("prediction", 8),
                          predictions=[ref])[0]
    assert got.token_ids == ref[:5] and got.finish_reason == "length"
    assert got.spec_stats.num_accepted_tokens == len(got.token_ids) - got.num_steps


def test_stop_strings_wait_for_min_tokens(engine, prompt):
    ref = plain(engine, [prompt], max_tokens=20)[0]
    tok = engine.engine.tokenizer
    # a stop string completed by the 2nd token that occurs nowhere later in the text
    early = tok.decode(ref.token_ids[:2])
    stop = next(early[i:] for i in range(len(early)) if ref.text.count(early[i:]) == 1)
    assert stop and ref.text.index(stop) + len(stop) <= len(early)
    stopped = plain(engine, [prompt], max_tokens=20, stop=[stop])[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 2
    for spec in (SpecParams("none", 0), SpecParams("ngram", 4)):
        held = engine.generate([prompt], SamplingParams(**GREEDY, max_tokens=20, stop=[stop], min_tokens=5), spec)[0]
        assert held.token_ids == ref.token_ids and held.finish_reason == "length", spec
        assert held.text == ref.text and stop in held.text      # the ignored match does not cut the text


def test_one_rule_for_greedy(engine, prompt):
    tiny = GREEDY_TEMPERATURE / 10
    assert SamplingParams(temperature=tiny).greedy and not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    assert not SamplingParams(temperature=tiny, seed=3).coupled           # greedy wins over the seed
    ref = plain(engine, [prompt], max_tokens=20)[0].token_ids
    for spec in (SpecParams("none", 0), SpecParams("ngram", 4)):
        got = engine.generate([prompt], SamplingParams(temperature=tiny, seed=3, ignore_eos=True, max_tokens=20),
                              spec)[0]
        assert got.token_ids == ref, spec
