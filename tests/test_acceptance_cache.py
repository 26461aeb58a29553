"""The ratings, levels and per-depth acceptances AcceptanceHistory keeps between counts (rating, level,
depth_alphas) and its index of each drafter's context buckets: a count drops exactly what it changes, so a kept
answer is always the one a fresh computation gives, and a lookup's count (most steps of a batch-1 `auto` request)
leaves the drafters' ratings kept."""
import random

import pytest

from specserve.server.engine.acceptance import CONTEXT_BASE, AcceptanceHistory

DRAFTERS = ("eagle3", "mtp", "draft")
LOOKUPS = ("suffix", "ngram")
BANDS = ("greedy", "sampled")
CONTEXTS = (10, CONTEXT_BASE + 10, 3 * CONTEXT_BASE)


def _probed() -> AcceptanceHistory:
    history = AcceptanceHistory()
    for i, m in enumerate(DRAFTERS):
        for band in BANDS:
            history.set_probe(m, band, 240.0 - 20 * i, 400.0)
        history.set_probe_context("greedy", 1, {m: (50.0 - 5 * i, 100.0) for i, m in enumerate(DRAFTERS)})
    return history


def _fresh(history: AcceptanceHistory, method: str, band: str, depth: int) -> tuple:
    kept = [dict(history._rated), dict(history._depth_rated), dict(history._raw), dict(history._levels)]
    for cache in (history._rated, history._raw, history._depth_rated, history._levels):
        cache.clear()
    try:
        return history.rating(method, band, CONTEXTS[1]), history.depth_alphas(method, band, depth)
    finally:
        history._rated, history._depth_rated, history._raw, history._levels = kept


def _buckets_in_order(history: AcceptanceHistory) -> dict:
    out: dict = {}
    for m, b, c in history.long:
        out.setdefault((m, b), []).append(c)
    return out


def test_every_kept_rating_and_depth_acceptance_is_what_a_fresh_computation_gives():
    rng = random.Random(7)
    history = _probed()
    for _ in range(400):
        method, band = rng.choice(DRAFTERS + LOOKUPS), rng.choice(BANDS)
        draft = rng.randint(1, 8)
        accepted = rng.randint(0, draft)
        if method in LOOKUPS and rng.random() < 0.5:
            history.observe_offer(method, draft, accepted, band)
        else:
            history.observe(method, draft, accepted, band, watch=method in DRAFTERS, context=rng.choice(CONTEXTS))
        if rng.random() < 0.02:                 # a drafter probed again: its traffic starts over
            history.set_probe(rng.choice(DRAFTERS), band, 200.0, 400.0)
        assert history._long_buckets == _buckets_in_order(history)
        for m in DRAFTERS + LOOKUPS:            # read everything, so that the next count meets a full cache
            for b in BANDS:
                kept = (history.rating(m, b, CONTEXTS[1]), history.depth_alphas(m, b, 6))
                assert kept == _fresh(history, m, b, 6)


def test_a_lookups_count_keeps_the_drafters_ratings_and_the_other_methods_depths():
    history = _probed()
    history.observe("eagle3", 4, 2, "greedy", context=CONTEXTS[0])
    history.observe_offer("ngram", 5, 1, "greedy")
    rated = {m: history.rating(m, "greedy", CONTEXTS[0]) for m in DRAFTERS}
    ngram = history.depth_alphas("ngram", "greedy", 5)
    history.observe("suffix", 8, 8, "greedy", watch=False, context=CONTEXTS[0])
    history.observe_offer("suffix", 8, 3, "greedy")
    assert {key[0] for key in history._rated} >= set(DRAFTERS)          # not computed again
    assert history.depth_alphas("ngram", "greedy", 5) is ngram
    assert {m: history.rating(m, "greedy", CONTEXTS[0]) for m in DRAFTERS} == rated
    history.observe("mtp", 4, 1, "greedy", context=CONTEXTS[0])          # a drafter's count moves the levels
    assert not history._rated
    assert history.rating("eagle3", "greedy", CONTEXTS[0]) != pytest.approx(rated["eagle3"], abs=1e-12)
