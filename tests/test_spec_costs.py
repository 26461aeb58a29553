"""What drafting costs the goodput policy and `auto`: lookups once per request, model drafters per depth plus
their follow-up observe, catch-ups apart; cut requests probe; acceptance per greedy/sampled band. How `auto`
prices its candidates with these costs: test_auto_pricing.py."""
from contextlib import contextmanager

import pytest
from test_spec_policy import fitted_policy, seq

from specserve.sampling.params import SamplingParams
from specserve.server.engine.request import Request
from specserve.server.engine.scheduler import ScheduledSeq
from specserve.server.engine.spec_policy import PROBE_EVERY, GoodputPolicy
from specserve.server.engine.step_cost import StepCostModel
from specserve.speculators.base import DraftProposal, SpecParams, Speculator


def _step(p: GoodputPolicy, s: ScheduledSeq, k: int) -> int:
    """One scheduling step of a lone request: its slots reset to k, trimmed, the dry count booked."""
    s.num_draft_slots = k
    p.trim([s])
    p.note_drafting([s])
    return s.num_draft_slots


def test_a_request_cut_to_nothing_probes_and_recovers_when_the_probes_are_accepted():
    """A cut request brings no evidence: without probes an estimate that fell low (one batch of rejected
    first drafts) stays low for good. Every PROBE_EVERY dry steps it drafts one position; accepted probes
    lift the estimate until the policy keeps drafting deeper."""
    p = fitted_policy()
    for _ in range(50):
        p.observe_acceptance("suffix", 4, 0)                    # the method's history: all rejected
    s = seq("a", 4, method="suffix")
    kept = [_step(p, s, 4) for _ in range(3 * PROBE_EVERY)]
    assert kept == ([0] * (PROBE_EVERY - 1) + [1]) * 3           # cut, except one position per probe
    stats = s.request.spec_stats
    for _ in range(200):                                          # the probes are accepted
        if _step(p, s, 4):
            stats.record(s.num_draft_slots, s.num_draft_slots)
            p.observe_acceptance("suffix", s.num_draft_slots, s.num_draft_slots)
    assert _step(p, s, 4) == 4


def test_a_lookups_cost_is_paid_once_per_request_not_per_depth():
    p = fitted_policy()
    p.observe_lookup("suffix", 0.004, 1)                           # 4 ms per request and step
    assert p.lookup_s["suffix"] == pytest.approx(0.004) and "suffix" not in p.draft_step_s
    good = seq("g", 8, accepted=90, attempted=100, method="suffix")
    p.trim([good])
    assert good.num_draft_slots == 8                               # 4 ms once, then T1 per position
    p.observe_propose("per-depth", 0.004 * 8, 8)                   # the same 4 ms charged at every depth
    as_model = seq("m", 8, accepted=90, attempted=100, method="per-depth")
    p.trim([as_model])
    assert as_model.num_draft_slots < 8
    p.lookup_s["suffix"] = 1.0                                     # a lookup dearer than the whole step
    dear = seq("d", 8, accepted=90, attempted=100, method="suffix")
    p.trim([dear])
    assert dear.num_draft_slots == 0
    # an auto request's lookup already ran before the choice: nothing left to pay but the positions
    req = Request("auto", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8), SpecParams("auto", 8))
    req.num_computed_tokens = 2
    chose = ScheduledSeq(req, 1, 8)
    p.trim([chose], ["suffix"])
    assert chose.num_draft_slots > 0


def test_greedy_and_sampled_acceptance_are_kept_apart():
    """A method accepts far less at T = 0.8 than at T = 0: traffic moving from greedy to sampled is not a
    collapse, and a greedy request's prior does not come from sampled ones."""
    p = GoodputPolicy()
    for _ in range(200):
        p.observe_acceptance("eagle3", 4, 4, "greedy")
    for _ in range(200):
        p.observe_acceptance("eagle3", 4, 0, "sampled")
    assert p.alpha("eagle3", 0, 0, "greedy") > 0.99 and p.alpha("eagle3", 0, 0, "sampled") < 0.02
    assert p.drain_collapses() == {} and not p.is_collapsed("eagle3")
    for _ in range(200):
        p.observe_acceptance("eagle3", 4, 0, "greedy")              # the same fall within one band
    assert p.drain_collapses() == {"eagle3": 1}
    assert p.is_collapsed("eagle3", "greedy") and not p.is_collapsed("eagle3", "sampled")


def test_a_lookups_acceptance_falling_with_its_text_is_no_collapse():
    """n-gram and suffix accept what the text repeats: a move from repeated to fresh prompts is no broken
    drafter, so it is not reported and `auto` keeps choosing them (the hybrid and prediction likewise)."""
    p = GoodputPolicy()
    for method in ("ngram", "suffix", "hybrid", "prediction", "draft"):
        for _ in range(200):
            p.observe_acceptance(method, 4, 4, "greedy")
        for _ in range(200):
            p.observe_acceptance(method, 4, 0, "greedy")
    assert p.drain_collapses() == {"draft": 1}
    assert not any(p.is_collapsed(m) for m in ("ngram", "suffix", "hybrid", "prediction"))


def test_a_catch_up_forward_does_not_read_as_the_price_of_every_draft_step():
    """A draft model's first propose for a request reads its whole prompt; divided by the depth it would
    price every later draft step at many times its cost. One sample moves the estimate at most 2x; a real,
    lasting change still gets through."""
    p = GoodputPolicy()
    for _ in range(10):
        p.observe_propose("draft", 0.004, 4)                       # 1 ms per depth
    p.observe_propose("draft", 0.400, 4)                           # a 400 ms prompt catch-up
    assert p.draft_step_s["draft"] == pytest.approx(0.9 * 0.001 + 0.1 * 0.002)
    for _ in range(60):
        p.observe_propose("draft", 0.012, 4)                       # the drafter really got 3x slower
    assert p.draft_step_s["draft"] == pytest.approx(0.003, rel=0.01)


class _CatchingUp(Speculator):
    """A model drafter on a fake clock: 50 ms of catch-up on a request's first propose, then 1 ms per
    draft step."""
    name = "slowstart"
    last_catch_up_s = 0.0

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.seen = clock, set()

    def propose(self, requests, ks):
        from specserve.speculators.base import DraftProposal
        fresh = [r for r in requests if r.request_id not in self.seen]
        self.seen.update(r.request_id for r in fresh)
        self.last_catch_up_s = 0.050 * len(fresh)
        self.clock[0] += self.last_catch_up_s + 0.001 * max(ks)
        return DraftProposal([[7] * k for k in ks], [None] * len(ks))

    def drain_refusals(self):
        return {}


@contextmanager
def _slowstart(monkeypatch, drafter: type = _CatchingUp, with_auto: bool = False):
    """A dispatcher (no policy) over the fake model drafter `slowstart`, registered, on a fake clock."""
    from specserve.server.engine import spec_dispatch
    from specserve.speculators import registry
    from specserve.speculators.auto import AutoSpeculator
    clock = [0.0]
    monkeypatch.setattr(spec_dispatch.time, "perf_counter", lambda: clock[0])
    entry = registry.Method("slowstart", f"{__name__}:_CatchingUp", "always", model_based=True)
    with registry.registered(entry):
        loaded = {"slowstart": drafter(clock)}
        if with_auto:
            loaded["auto"] = AutoSpeculator(loaded)
        yield spec_dispatch.SpecDispatcher(loaded, policy=None)


def test_a_catch_up_is_not_booked_as_the_drafters_price_per_depth(monkeypatch):
    from specserve.server.engine.stats import StepStats
    with _slowstart(monkeypatch) as dispatcher:
        for step in range(5):
            seqs = [seq(f"r{step}", 4, method="slowstart")]             # a new request every step
            dispatcher.propose(seqs, StepStats())
    cost = dispatcher.learner.draft_step_s["slowstart"]
    assert cost == pytest.approx(0.001)                               # 1 ms per depth, catch-ups aside


def test_a_heads_observe_after_drafting_is_part_of_the_first_depths_price():
    p = fitted_policy()
    p.observe_propose("eagle3", 0.001, 1)
    crowd = [seq(f"e{i}", 2, 70, 100, "eagle3") for i in range(8)]
    p.trim(crowd)
    assert all(s.num_draft_slots > 0 for s in crowd)
    p.observe_follow_up("eagle3", 0.2)                               # an observe dearer than the gain
    again = [seq(f"f{i}", 2, 70, 100, "eagle3") for i in range(8)]
    p.trim(again)
    assert all(s.num_draft_slots == 0 for s in again)


def test_a_cold_first_follow_up_is_forgotten_within_a_few_steps():
    """A head's first observe (warm-up, or a catch-up folded into it) can cost 3x its steady price; the
    estimate falls to the steady price in a few samples instead of pricing the head out for good."""
    p = GoodputPolicy()
    p.observe_follow_up("eagle3", 0.0035)
    for _ in range(4):
        p.observe_follow_up("eagle3", 0.0011)
    assert p.follow_up_s["eagle3"] < 0.0013
    for _ in range(3):
        p.observe_follow_up("eagle3", 0.05)                          # outliers above it move it little
    assert p.follow_up_s["eagle3"] < 0.0025
    for _ in range(60):
        p.observe_follow_up("eagle3", 0.003)                         # a real rise is followed
    assert p.follow_up_s["eagle3"] > 0.0028

def test_a_tree_step_is_priced_per_depth_not_per_verified_node(monkeypatch):
    """A tree of 8 nodes and depth 2 runs 2 draft forwards: its propose time divided by 8 would price the
    drafter's forward at a quarter of its cost, and the policy would then draft deeper than pays."""
    from dataclasses import replace

    from specserve.server.engine.stats import StepStats
    from specserve.speculators.base import DraftTree

    class _Tree(_CatchingUp):
        def propose(self, requests, ks):
            self.seen.update(r.request_id for r in requests)      # no catch-up: only depth forwards
            self.clock[0] += 0.001 * max(r.spec_params.draft_tree.depth for r in requests)
            return DraftProposal([[7] * k for k in ks], [None] * len(ks))

    with _slowstart(monkeypatch, _Tree) as dispatcher:
        for step in range(5):
            s = seq(f"t{step}", 8, method="slowstart")
            s.request.spec_params = replace(s.request.spec_params, draft_tree=DraftTree(top_k=4, depth=2))
            dispatcher.propose([s], StepStats())
    assert dispatcher.learner.draft_step_s["slowstart"] == pytest.approx(0.001)


def test_the_ledger_counts_rows_a_drafter_skipped_since_it_last_drafted():
    from specserve.server.engine.catch_up import CatchUpLedger
    ledger = CatchUpLedger()
    r = seq("a", 4).request                                           # 3 prompt tokens
    assert ledger.behind(r, "eagle3", None) == 3                      # never drafted: everything
    ledger.drafted(r, "eagle3")
    r.output_token_ids += [5, 6, 7, 8]
    assert ledger.behind(r, "eagle3", "eagle3") == 0                  # drafted last step: its own observe
    assert ledger.behind(r, "eagle3", "suffix") == 4                  # skipped the 4 tokens since
    assert ledger.behind(r, "draft", "suffix") == 7
    ledger.forget(r.request_id)                                       # released: a later use starts over
    assert ledger.behind(r, "eagle3", "suffix") == 7


def test_the_dispatcher_books_a_catch_up_per_row_only_for_requests_auto_switched(monkeypatch):
    from specserve.server.engine.stats import StepStats
    with _slowstart(monkeypatch, with_auto=True) as dispatcher:
        s = seq("a", 4, method="auto")
        booked = []
        dispatcher.learner.observe_catch_up = lambda method, seconds, rows: booked.append((method, seconds, rows))
        dispatcher.propose([s], StepStats())                          # first use: 50 ms over its 3 tokens
        s.num_draft_slots = 4
        fresh = seq("b", 4, method="auto")
        dispatcher.propose([s, fresh], StepStats())                   # a is warm: the 50 ms are b's 3 rows
        assert booked == [("slowstart", pytest.approx(0.050), 3), ("slowstart", pytest.approx(0.050), 3)]


def test_a_prefill_step_does_not_count_as_a_step_without_drafts():
    """A request's prefill cannot draft: were it counted, every new `auto` request would start resting."""
    p = fitted_policy()
    r = seq("p", 8, method="auto")
    r.request.num_computed_tokens = 0
    prefill = ScheduledSeq(r.request, 3, 0)                          # the whole prompt: it samples
    assert prefill.samples
    p.note_drafting([prefill])
    r.request.num_computed_tokens = 2
    assert r.request.request_id not in p.dry
    r.num_draft_slots = 0
    p.note_drafting([r])
    assert p.dry[r.request.request_id] == 1


def test_the_step_line_leaves_out_the_speculators_own_observes(monkeypatch):
    """A head's observe after a step is priced per method (its follow-up); the step time the cost line
    learns must not count it again, or every head's step reads a follow-up dearer than it is."""
    from types import SimpleNamespace

    from specserve.server.engine import spec_dispatch

    clock = [0.0]
    monkeypatch.setattr(spec_dispatch.time, "perf_counter", lambda: clock[0])

    class _Observing(Speculator):
        name = "observing"

        def observe(self, step):
            clock[0] += 0.004                                         # a 4 ms forward over the verified rows

    policy = GoodputPolicy()
    dispatcher = spec_dispatch.SpecDispatcher({"observing": _Observing()}, policy=policy)
    s = seq("o", 0, method="observing")
    result = SimpleNamespace(batch=SimpleNamespace(token_offsets=[0], query_lens=[1]), hidden=None,
                             prenorm_hidden=None, aux_hidden=None)
    dispatcher.observe([s], [3], [0], result)
    assert dispatcher.observe_s == pytest.approx(0.004)
    dispatcher.observe_step([s], [[]], 0.030)                         # forward, sampling and that observe
    assert policy.cost.st == pytest.approx(0.026) and policy.cost.sn == 1
    dispatcher.observe([s], [4], [0], result)                         # each step's own observes only
    assert dispatcher.observe_s == pytest.approx(0.004)


def test_a_proposes_fixed_part_is_priced_once_not_per_depth():
    """A propose of depth D costs e0 + e1 * D: fitted once its depths spread, the deep draft is priced at
    e1 per extra depth, not at the shallow one's average per depth; at one depth only, the EMA per depth."""
    p = GoodputPolicy()
    for _ in range(40):
        p.observe_propose("eagle3", 0.001 + 0.0012 * 4, 4)
    assert p.draft_cost("eagle3") == (0.0, pytest.approx(0.00145, rel=1e-3))
    for i in range(40):
        depth = 1 + i % 8
        p.observe_propose("eagle3", 0.001 + 0.0012 * depth, depth)
    e0, e1 = p.draft_cost("eagle3")
    assert e0 == pytest.approx(0.001, rel=0.02) and e1 == pytest.approx(0.0012, rel=0.02)


def test_a_heads_propose_whose_first_draft_its_follow_up_computed_is_priced_at_each_depth():
    """A head's first draft comes from its follow-up observe: its propose of depth D costs ~1.2 ms + 3 ms per
    depth after the first. The line may fall below 0 at depth 0 (never at depth 1) and prices each depth
    as run, fitted from depths as little spread as traffic's (1-3); held through 0 it read the mean per
    depth, ~2.5 ms, dear at depths 1-2 and cheap beyond."""
    p = GoodputPolicy()
    for i in range(60):
        depth = (1, 2, 2, 3)[i % 4]
        p.observe_propose("eagle3", 0.0012 + 0.003 * (depth - 1), depth)
    e0, e1 = p.draft_cost("eagle3")
    assert e1 == pytest.approx(0.003, rel=0.02) and e0 == pytest.approx(-0.0018, rel=0.05)
    for depth in (1, 2, 3, 4):
        assert e0 + e1 * depth == pytest.approx(0.0012 + 0.003 * (depth - 1), rel=0.05)
    for _ in range(60):                 # a slope steeper than the mean allows: through 0 at depth 1, not 0
        p.observe_propose("mtp", 0.0, 1)
        p.observe_propose("mtp", 0.008, 3)
    e0, e1 = p.draft_cost("mtp")
    assert e0 + e1 >= 0.0 and e0 + 3 * e1 == pytest.approx(0.008, rel=0.05)


def test_a_step_lines_floor_stays_at_no_tokens():
    """The step-cost line itself keeps t0 >= 0 (floor_n = 0): a forward of 0 tokens costs no less than 0."""
    m = StepCostModel()
    for i in range(60):
        n = 1 + i % 5
        m.observe(n, 0.0012 + 0.003 * (n - 1))
    t0, t1 = m.fit()
    assert t0 == 0.0 and t1 * 3 == pytest.approx(sum(0.0012 + 0.003 * (n - 1) for n in range(1, 6)) / 5, rel=0.05)


def test_a_drafters_line_from_timed_depths_prices_its_shallow_depths_before_any_traffic():
    """The probe times each drafter at depths 1, 2, 4 and 8 (spec_probe.time_drafters): the median at each
    depth starts its line, which stands before traffic and prices depth 1 at its fixed part plus one
    depth, not at the mean per depth of depth-8 proposes (the draft model: 3.1 ms where depth 1 costs 4.6).
    Traffic's proposes, all at one depth, then move the line's level and keep its slope."""
    p = GoodputPolicy()
    for _ in range(20):                              # the acceptance rounds: depth-8 proposes only
        p.observe_propose("draft", 0.0017 + 0.0029 * 8, 8)
    assert p.draft_cost("draft")[0] == 0.0           # one depth: its mean per depth, 3.1 ms
    assert sum(p.draft_cost("draft")) == pytest.approx(0.0031, rel=0.01)
    p.draft_fit.clear()
    log = [("draft", d, 0.0017 + 0.0029 * d) for d in (1, 2, 4, 8) for _ in range(5)]
    log += [("draft", 1, 0.05), ("eagle3", 1, 0.001), ("draft", 4, 0.0001)]      # a cold call, others
    e0, e1 = p.set_draft_prior("draft", log)
    assert (e0, e1) == pytest.approx((0.0017, 0.0029), rel=0.02) == p.draft_cost("draft")
    assert p.set_draft_prior("eagle3", log) is None and "eagle3" not in p.draft_fit   # one depth timed
    for _ in range(40):                              # traffic: depth 2, each 1 ms dearer than the line
        p.observe_propose("draft", 0.0017 + 0.0029 * 2 + 0.001, 2)
    e0, e1 = p.draft_cost("draft")
    assert e1 == pytest.approx(0.0029, rel=0.05) and e0 + 2 * e1 == pytest.approx(0.0085, rel=0.02)


def test_proposes_are_logged_only_while_the_probe_records_them():
    p = GoodputPolicy()
    p.observe_propose("mtp", 0.004, 2)
    assert p.propose_log is None
    p.propose_log = []
    p.observe_propose("mtp", 0.006, 3)
    p.observe_propose("mtp", 0.006, 0)               # no draft forward: nothing to price
    assert p.propose_log == [("mtp", 3, 0.006)]
