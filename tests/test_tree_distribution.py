"""Unseeded sampled draft trees through the whole engine keep the target's distribution (the setup, law and
chi-square of tests/test_engine_distribution.py: T = 1, top-p, min-p, logit_bias, six tokens carry the mass).

A tree verifies deterministic children, so at a node each child x is accepted with probability p(x) under
the target's row renormalised without the siblings rejected before it (sampling/tree_verify.py). A planted
bug that keeps the rejected siblings in the distribution (later siblings and the final draw see them
again) must fail the test.
"""
from __future__ import annotations

import pytest
from test_engine_distribution import BIAS, MIN_P, NUM_REQUESTS, NUM_TOKENS, PROMPT, TOP_P, S, p_value, setup

from specserve.sampling import tree_verify
from specserve.sampling.params import SamplingParams
from specserve.speculators.base import DraftTree, SpecParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")
__all__ = ["setup"]


def tree_continuations(engine) -> tuple[list[tuple[int, ...]], float]:
    params = SamplingParams(temperature=1.0, top_p=TOP_P, min_p=MIN_P, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logit_bias={t: BIAS for t in S})
    outs = engine.generate([PROMPT] * NUM_REQUESTS, params, SpecParams("eagle3", 6, draft_tree=DraftTree(3, 3)))
    assert all(o.spec_stats.num_tree_steps > 0 for o in outs)
    steps = sum(o.spec_stats.num_tree_steps for o in outs)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
    return [tuple(o.token_ids) for o in outs], accepted / steps


def test_sampled_tree_keeps_the_targets_distribution(setup):
    engine, law = setup
    samples, depth = tree_continuations(engine)
    assert depth > 0.1, depth                           # trees do get accepted
    p = p_value(samples, law)
    print(f"tree: mean accepted depth {depth:.2f}, p = {p:.3g}")
    assert p > 1e-3, p


def test_keeping_rejected_siblings_fails_it(setup, monkeypatch):
    engine, law = setup
    monkeypatch.setattr(tree_verify, "_reject", lambda p, token: None)
    samples, _ = tree_continuations(engine)
    p = p_value(samples, law)
    print(f"tree keeping rejected siblings: p = {p:.3g}")
    assert p < 1e-6, p
