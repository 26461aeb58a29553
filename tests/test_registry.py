"""A method added through the registry alone is requested, validated, drafted and verified exactly."""
from __future__ import annotations

from collections.abc import Sequence

import pytest

from specserve import LLM, SamplingParams
from specserve.speculators import registry
from specserve.speculators.base import DraftProposal, SpecRequest, Speculator
from specserve.speculators.hybrid import HybridSpeculator


class RepeatLastSpeculator(Speculator):
    """Toy method: drafts the context's last token `repeat` times (deterministic drafts)."""
    name = "repeat_last"

    @staticmethod
    def validate(options: dict) -> None:
        if set(options) - {"repeat"}:
            raise ValueError(f"repeat_last takes only 'repeat', got {sorted(options)}")

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        drafts = [[r.all_token_ids[-1]] * min(k, r.spec_params.options.get("repeat", k))
                  for r, k in zip(requests, ks)]
        return DraftProposal(drafts, [None] * len(drafts))


TOY = registry.Method("repeat_last", f"{__name__}:RepeatLastSpeculator", "always")


def test_table_order_drives_methods_and_the_hybrids_fallback():
    assert registry.METHODS[0] == "none" and set(registry.METHODS[1:]) == set(registry.BY_NAME)
    assert registry.MODEL_DRAFTERS == ("eagle3", "eagle", "mtp", "draft")
    assert HybridSpeculator.over({"draft": object(), "mtp": object()}).fallback_name == "mtp"
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.Method("ngram", TOY.target, "always"))
    with pytest.raises(ValueError, match="unknown speculation method"):
        registry.validator("nope")


def test_a_toy_method_registered_in_one_place_serves_requests(tiny_model_dir):
    with registry.registered(TOY):
        llm = LLM(model=str(tiny_model_dir), kv_cache_memory_gb=0.05, num_threads=1, speculation_policy="fixed")
        assert "repeat_last" in llm.methods
        with pytest.raises(ValueError, match="only 'repeat'"):
            llm.generate("x", speculation={"method": "repeat_last", "bogus": 1})
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        prompts = ["a a a a a a", "def f(x):\n    return x"]
        plain = llm.generate(prompts, params, {"method": "none"})
        toy = llm.generate(prompts, params, {"method": "repeat_last", "num_speculative_tokens": 3})
        assert [c.token_ids for c in toy] == [c.token_ids for c in plain]
        stats = toy[0].spec_stats
        assert stats.method == "repeat_last" and stats.num_draft_tokens > 0
    assert "repeat_last" not in registry.METHODS
