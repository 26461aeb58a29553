"""Sampled draft-tree children (speculators/tree_children.py) and their verification (sampling/recursive_rejection.py)
at the sampler level, on small random distributions.

- K children drawn without replacement from q (Gumbel-top-K), verified by recursive rejection sampling: the
  emitted token is distributed as p (chi-square over many trials), and a planted bug that keeps the target's
  distribution after a rejection, or that does not renormalise q after removing a rejected child, fails it;
- the children's order is a draw without replacement from q (the law of the first two);
- a seeded request's first child is its chain's coupled draft at that position, its children the best of
  log q + g; greedy children are the top K by log-probability, as before;
- deterministic children (the lookups: no q) keep the one-hot rule, and keeping a rejected sibling in the
  row fails it.
"""
from __future__ import annotations

import pytest
import torch
from test_rejection_stats import chi_square_p_value

from specserve.sampling import recursive_rejection, tree_verify
from specserve.sampling.params import SamplingParams
from specserve.sampling.tree_verify import TreeVerifier
from specserve.speculators.draft_sampling import sample_drafts
from specserve.speculators.tree_children import draw_children, top_children

pytestmark = pytest.mark.usefixtures("single_torch_thread")
TRIALS = 12_000

# (target_probs p, draft_probs q, K): q leans on tokens p does not favour, so each planted bug moves the exact
# law of every case far enough (chi-square excess > 400 at TRIALS draws, computed by enumerating the orders)
CASES = {
    "v6-k2": ([0.05, 0.30, 0.25, 0.20, 0.10, 0.10], [0.70, 0.10, 0.05, 0.05, 0.05, 0.05], 2),
    "v7-k3": ([0.05, 0.05, 0.30, 0.20, 0.15, 0.15, 0.10], [0.45, 0.35, 0.05, 0.05, 0.04, 0.03, 0.03], 3),
    "v8-k3": ([0.02, 0.03, 0.25, 0.20, 0.15, 0.15, 0.10, 0.10], [0.50, 0.30, 0.06, 0.04, 0.04, 0.03, 0.02, 0.01], 3),
}
UNSEEDED = SamplingParams(temperature=1.0)


def emitted(target_probs: list[float], draft_probs: list[float], k: int, seed: int) -> torch.Tensor:
    """[TRIALS] the verified token of a node whose K children are drawn from draft_probs (q), the target's row
    target_probs (p)."""
    torch.manual_seed(seed)
    logits = torch.tensor(draft_probs).log()[None].expand(TRIALS, -1).contiguous()   # [TRIALS, V]
    kids = draw_children(logits, [UNSEEDED] * TRIALS, [0] * TRIALS, [k] * TRIALS)
    target = torch.tensor(target_probs)
    out = [recursive_rejection.verify_children(target, c.probs, c.tokens)[1] for c in kids]
    return torch.tensor(out)


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_children_emit_the_targets_distribution(case):
    target, draft, k = CASES[case]
    value = chi_square_p_value(emitted(target, draft, k, seed=1), torch.tensor(target, dtype=torch.float64))
    assert value > 1e-3, value


def _stale_residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    return target_probs                             # bug: the target's distribution is not updated


def _unnormalised_without(draft_probs: torch.Tensor, token: int) -> torch.Tensor:
    rest = draft_probs.clone()
    rest[token] = 0.0                               # bug: q without the rejected child, not renormalised
    return rest


@pytest.mark.parametrize("bug", ["stale_residual", "unnormalised_without"])
def test_a_planted_bug_fails_it(bug, monkeypatch):
    if bug == "stale_residual":
        monkeypatch.setattr(recursive_rejection, "residual", _stale_residual)
    else:
        monkeypatch.setattr(recursive_rejection, "without", _unnormalised_without)
    best = max(chi_square_p_value(emitted(target, draft, k, seed=1), torch.tensor(target, dtype=torch.float64))
               for target, draft, k in CASES.values())
    assert best < 1e-6, best


def test_children_are_drawn_without_replacement_from_q():
    q = [0.35, 0.25, 0.2, 0.12, 0.08]                                            # draft_probs
    torch.manual_seed(3)
    logits = torch.tensor(q).log()[None].expand(TRIALS, -1).contiguous()
    kids = draw_children(logits, [UNSEEDED] * TRIALS, [0] * TRIALS, [2] * TRIALS)
    assert all(len(c.tokens) == 2 and c.scores[0] == 0.0 > c.scores[1] for c in kids)
    v = len(q)
    pairs = torch.tensor([c.tokens[0] * v + c.tokens[1] for c in kids])
    law = torch.tensor([q[a] * q[b] / (1 - q[a]) if a != b else 0.0 for a in range(v) for b in range(v)],
                       dtype=torch.float64)
    assert chi_square_p_value(pairs, law) > 1e-3


def test_seeded_first_child_is_the_chains_coupled_draft():
    torch.manual_seed(0)
    logits = torch.randn(24, 50) * 2                                              # [rows, V]
    params = [SamplingParams(temperature=0.8, seed=s % 5, top_p=0.95) for s in range(24)]
    positions = [10 + 3 * i for i in range(24)]
    kids = draw_children(logits, params, positions, [4] * 24)
    chain, _ = sample_drafts(logits, params, positions, [0] * 24)
    assert [c.tokens[0] for c in kids] == chain
    again = draw_children(logits, params, positions, [4] * 24)                    # no RNG: the same children
    assert [c.tokens for c in again] == [c.tokens for c in kids]
    assert all(c.scores[0] == 0.0 and c.scores == sorted(c.scores, reverse=True) for c in kids)
    assert all(c.probs is not None and abs(float(c.probs.sum()) - 1) < 1e-5 for c in kids)


def test_greedy_children_are_the_top_k_by_log_probability():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    kids = draw_children(logits, [SamplingParams(temperature=0.0)] * 6, [0] * 6, [3] * 6)
    for row, c in zip(logits.log_softmax(dim=-1), kids):
        assert list(c) == top_children(row, 3) and c.probs is None


def test_deterministic_children_keep_the_one_hot_rule(monkeypatch):
    """The lookups' children carry no q: each is accepted with p(x) of what is left of the row."""
    target = torch.tensor(CASES["v7-k3"][0])
    torch.manual_seed(2)
    law = torch.tensor(CASES["v7-k3"][0], dtype=torch.float64)
    out = torch.tensor([TreeVerifier._sample(target, [1, 0, 4])[1] for _ in range(TRIALS)])
    assert chi_square_p_value(out, law) > 1e-3
    monkeypatch.setattr(tree_verify, "_reject", lambda row, token: None)     # bug: rejected siblings stay
    out = torch.tensor([TreeVerifier._sample(target, [1, 0, 4])[1] for _ in range(TRIALS)])
    assert chi_square_p_value(out, law) < 1e-6
