"""loadtest workloads for cross-request drafting: repeated requests come back after all first sends,
mixed alternates repeats with fresh prompts, agentic turns carry the conversation, and served workloads
send one OpenAI `user` (the suffix cache's default scope)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from loadtest.bench_auto import arms, held_out_ratio
from loadtest.prompt_sets import WORKLOAD_USER, load_prompt_set, mixed, next_turn, repeated
from loadtest.request_builder import build_request


def test_repeated_and_mixed_orders():
    assert repeated(["a", "b"]) == ["a", "b", "a", "b"]
    assert mixed(["a", "b"], ["x", "y", "z"]) == ["a", "x", "b", "y", "z"]
    rows = load_prompt_set("repeated", 6)
    prompts = [r["prompt"] for r in rows]
    assert len(prompts) == 6 and prompts[:3] == prompts[3:] and len(set(prompts)) == 3
    rows = load_prompt_set("mixed", 6)
    prompts = [r["prompt"] for r in rows]
    first, rest = prompts[:2], prompts[2:]
    assert rest[0::2] == first and not set(rest[1::2]) & set(first)


def test_agentic_turn_carries_prompt_and_answer():
    nxt = next_turn("PROMPT ", "ANSWER", 0)
    assert nxt.startswith("PROMPT ANSWER") and len(nxt) > len("PROMPT ANSWER")
    assert next_turn("p", "a", 1) != next_turn("p", "a", 0)


def test_served_workloads_send_one_user():
    args = SimpleNamespace(max_tokens=8, temperature=0.0, method="suffix", k=4)
    row = load_prompt_set("repeated", 2)[0]
    assert build_request("m", row, args)["user"] == WORKLOAD_USER
    assert "user" not in build_request("m", load_prompt_set("code_completion", 1)[0], args)


def test_bench_auto_compares_extra_single_methods_at_k_before_auto():
    specs = arms(8, ["eagle3", "ngram", "mtp"])
    assert list(specs) == ["none", "ngram", "hybrid k=4", "suffix", "eagle3", "mtp", "auto"]
    assert (specs["eagle3"].method, specs["eagle3"].num_speculative_tokens) == ("eagle3", 8)
    assert specs["hybrid k=4"].num_speculative_tokens == 4
    assert list(arms(8)) == ["none", "ngram", "hybrid k=4", "suffix", "auto"]


def test_held_out_best_is_picked_on_the_other_rounds():
    """bench_auto's held-out ratio compares each round with the fixed method fastest in the rest: a method
    that was fast in one round only is not the best of that round's comparison."""
    toks = {"a": 100, "b": 100, "auto": 100}
    rounds = [({"a": 1.0, "b": 0.8, "auto": 1.0}, dict(toks)),     # b lucky here
              ({"a": 1.0, "b": 1.2, "auto": 1.0}, dict(toks))]     # a best here and over both
    # round 0 is compared with a (fastest in round 1), round 1 with b (fastest in round 0)
    assert held_out_ratio(rounds, ["a", "b"]) == pytest.approx((200 / 2.0) / (200 / 2.2))
    assert held_out_ratio(rounds[:1], ["a", "b"]) is None
