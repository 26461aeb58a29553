"""`auto`'s resting requests: one that drafted nothing last step plain-decodes without running its lookups or
its choice while those cost more than REST_SHARE of its share of the step (GoodputPolicy.resting); what the
lookups and the choice cost is measured as they run (AutoSpeculator.choose, SpecDispatcher._choose)."""
import pytest
from test_spec_policy import fitted_policy, seq

from specserve.server.engine.spec_policy import PROBE_EVERY, RECHOOSE_EVERY, GoodputPolicy
from specserve.server.engine.stats import StepStats
from specserve.speculators.auto import AutoSpeculator
from specserve.speculators.base import DraftProposal, Speculator


def _rests(p: GoodputPolicy, lookups: tuple[str, ...]) -> dict[int, tuple[bool, bool]]:
    """dry steps -> (rests alone, rests in a 16-sequence step) for one cut `auto` request."""
    r = seq("a", 8, method="auto").request
    out = {}
    for dry in range(PROBE_EVERY + 1):
        p.dry[r.request_id] = dry
        out[dry] = (p.resting(r, 1, lookups), p.resting(r, 16, lookups))
    return out


CROWDED = [d for d in range(1, PROBE_EVERY - 1) if d % RECHOOSE_EVERY]   # dry steps a crowded request rests


def test_a_cut_auto_request_rests_from_its_lookups_only_in_a_crowded_step():
    """Lookups of 0.4 ms a request are ~5 % of a lone request's step and ~50 % of its share of a 16-sequence
    step: only there does a request that drafted nothing skip them, and it still re-chooses every
    RECHOOSE_EVERY-th dry step and on its probe. With no lookups and a free choice it never rests."""
    p = fitted_policy(0.008, 0.0003)
    p.observe_lookup("suffix", 0.0004, 1)
    rests = _rests(p, ("suffix", "ngram"))
    assert not any(alone for alone, _ in rests.values())
    assert [d for d, (_, crowded) in rests.items() if crowded] == CROWDED
    assert not any(alone or crowded for alone, crowded in _rests(p, ()).values())


def test_the_choice_itself_counts_toward_resting_as_the_lookups_do():
    """A choice of 0.4 ms a request, with no lookup to run, rests a cut request in a crowded step as 0.4 ms
    of lookups would, and never a lone one; it is an EMA per request of what each step's choice took."""
    p = fitted_policy(0.008, 0.0003)
    p.observe_choice(0.0064, 16)                                      # 0.4 ms a request
    assert p.choice_s == pytest.approx(0.0004)
    rests = _rests(p, ())
    assert not any(alone for alone, _ in rests.values())
    assert [d for d, (_, crowded) in rests.items() if crowded] == CROWDED
    p.observe_choice(0.0, 0)                                          # a step that chose for nobody
    assert p.choice_s == pytest.approx(0.0004)
    for _ in range(60):
        p.observe_choice(0.00005, 1)                                   # cheaper now: 6 % of a 0.8 ms share
    assert p.choice_s == pytest.approx(0.00005, rel=0.02)
    assert not any(crowded for _, crowded in _rests(p, ()).values())


class _CountingLookup(Speculator):
    """A context lookup that drafts [7] for every request, remembers whom it was asked about and advances a
    fake clock by `cost` seconds a request."""
    name = "ngram"

    def __init__(self, clock: list[float] | None = None, cost: float = 0.0) -> None:
        self.asked: list[str] = []
        self.clock, self.cost = clock, cost

    def propose(self, requests, ks):
        self.asked += [r.request_id for r in requests]
        if self.clock is not None:
            self.clock[0] += self.cost * len(requests)
        return DraftProposal([[7] * min(k, 1) for k in ks], [None] * len(ks))


def test_auto_runs_no_lookup_for_a_resting_request_and_times_the_ones_it_runs():
    lookup = _CountingLookup()
    auto = AutoSpeculator({"ngram": lookup})
    reqs = [seq(f"r{i}", 4, method="auto").request for i in range(4)]
    choices = auto.choose(reqs, [4] * 4, resting=lambda r: r.request_id in ("r1", "r3"))
    assert lookup.asked == ["r0", "r2"]
    assert choices == ["ngram", "none", "ngram", "none"]
    seconds, asked = auto.lookup_seconds["ngram"]
    assert asked == 2 and seconds >= 0.0
    seconds, chosen_for = auto.choice_seconds
    assert chosen_for == 2 and seconds >= 0.0                         # the resting ones cost no choice


def test_the_dispatcher_books_the_choice_apart_from_the_lookups(monkeypatch):
    """A step of 3 `auto` requests whose lookup takes 1 ms each and whose pricing takes 6 ms in all: the
    learner gets 1 ms a request for the lookup and 2 ms a request for the choice, not 3."""
    from specserve.server.engine import spec_dispatch
    clock = [0.0]
    monkeypatch.setattr(spec_dispatch.time, "perf_counter", lambda: clock[0])   # auto's clock too
    lookup = _CountingLookup(clock, 0.001)
    loaded = {"ngram": lookup}
    loaded["auto"] = AutoSpeculator(loaded)
    dispatcher = spec_dispatch.SpecDispatcher(loaded, policy=fitted_policy(0.008, 0.0003))
    learner = dispatcher.learner

    def slow_choice(requests, ks, lengths, **kw):
        clock[0] += 0.006
        return ["ngram"] * len(requests)
    monkeypatch.setattr(learner, "choose_methods", slow_choice)
    dispatcher.propose([seq(f"r{i}", 4, method="auto") for i in range(3)], StepStats())
    assert learner.lookup_s["ngram"] == pytest.approx(0.001)
    assert learner.choice_s == pytest.approx(0.002)
