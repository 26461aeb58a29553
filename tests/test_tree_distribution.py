"""Unseeded sampled draft trees through the whole engine keep the target's distribution (the setup, law and
chi-square of tests/test_engine_distribution.py: T = 1, top-p, min-p, logit_bias, six tokens carry the mass).

The EAGLE-3 head's and the draft model's children are drawn without replacement from their distribution q and
verified by recursive rejection sampling (sampling/recursive_rejection.py): child x_i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)), a rejection moves p to the residual norm(max(p_i - q_i, 0)) and q to
q without x_i. A planted bug that keeps the target's row after a rejection (later siblings and the final draw see the
rejected mass again) must fail the test.
"""
from __future__ import annotations

import pytest
from test_engine_distribution import BIAS, MIN_P, NUM_REQUESTS, NUM_TOKENS, PROMPT, TOP_P, S, p_value, setup

from specserve.sampling import recursive_rejection
from specserve.sampling.params import SamplingParams
from specserve.speculators.base import DraftTree, SpecParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")
__all__ = ["setup"]


def tree_continuations(engine, method: str = "eagle3") -> tuple[list[tuple[int, ...]], float]:
    params = SamplingParams(temperature=1.0, top_p=TOP_P, min_p=MIN_P, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logit_bias={t: BIAS for t in S})
    outs = engine.generate([PROMPT] * NUM_REQUESTS, params, SpecParams(method, 6, draft_tree=DraftTree(3, 3)))
    assert all(o.spec_stats.num_tree_steps > 0 for o in outs)
    steps = sum(o.spec_stats.num_tree_steps for o in outs)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
    return [tuple(o.token_ids) for o in outs], accepted / steps


@pytest.mark.parametrize("method", ["eagle3", "draft"])
def test_sampled_tree_keeps_the_targets_distribution(setup, method):
    engine, law = setup
    samples, depth = tree_continuations(engine, method)
    assert depth > 0.1, depth                           # trees do get accepted
    p = p_value(samples, law)
    print(f"{method} tree: mean accepted depth {depth:.2f}, p = {p:.3g}")
    assert p > 1e-3, p


def test_keeping_the_row_after_a_rejection_fails_it(setup, monkeypatch):
    engine, law = setup
    monkeypatch.setattr(recursive_rejection, "residual", lambda target_probs, draft_probs: target_probs)
    samples, _ = tree_continuations(engine)
    p = p_value(samples, law)
    print(f"tree keeping the row after a rejection: p = {p:.3g}")
    assert p < 1e-6, p
