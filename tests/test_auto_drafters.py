"""Which model drafter an `auto` request drafts with (server/engine/method_choice.py, acceptance.py): untried
drafters explored, the start-up probe's ranking scaled by the traffic level, explorers bounded by the evidence,
a request's own text level, the drafter it keeps, and what leaving it costs."""
import zlib
from types import SimpleNamespace

import pytest

from specserve.sampling.params import SamplingParams
from specserve.server.engine import acceptance, method_choice
from specserve.server.engine.spec_policy import GoodputPolicy
from specserve.speculators.base import SpecParams, SpecStats


def test_an_untried_drafter_is_explored_and_a_request_keeps_the_drafter_it_took():
    """A drafter whose history is empty is rated at an upper confidence bound, so the server tries it; a
    request then drafts with the model drafter it took (or a lookup, or none) and does not flip between
    drafters on its own few noisy positions, unless its drafter accepts far less on it than another is
    expected to or has collapsed."""
    policy = GoodputPolicy()
    for _ in range(300):
        policy.observe_acceptance("eagle3", 4, 2, "sampled")      # 0.6 per position on the server
    policy.draft_step_s.update(eagle3=0.002, draft=0.002)
    request = SimpleNamespace(num_tokens=100, request_id="r", spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
                              sampling_params=SamplingParams(temperature=0.8, max_tokens=64))
    assert policy.request_alpha(request, "draft") == pytest.approx(acceptance.PRIOR_ALPHA)
    assert policy.request_alpha(request, "draft", explore=True) > policy.request_alpha(request, "eagle3",
                                                                                         explore=True)
    lengths = {"eagle3": 4, "draft": 4, "ngram": 0}
    assert policy.choose_method(request, 4, lengths) == "draft"                  # the untried one
    rows = request.spec_stats.by_method
    rows["draft"] = [6, 20, 5, 17]                                # it did poorly on this request
    assert policy.request_alpha(request, "eagle3", explore=True) > policy.request_alpha(request, "draft")
    assert policy.choose_method(request, 4, lengths) in ("draft", "none")         # no flip to eagle3
    for _ in range(200):
        policy.observe_acceptance("ngram", 4, 4, "sampled")
    assert policy.choose_method(request, 4, {**lengths, "ngram": 4}) == "ngram"   # lookups stay open
    rows["draft"] = [10, 40, 0, 30]                               # it does not suit this request at all
    assert policy.choose_method(request, 4, lengths) == "eagle3"
    rows["draft"] = [6, 20, 5, 17]
    policy.is_collapsed = lambda method, band=None: method == "draft"
    assert policy.choose_method(request, 4, lengths) == "eagle3"


def _explorer_id(explores: bool) -> str:
    return next(f"r{i}" for i in range(1000)
                if (zlib.crc32(f"r{i}".encode()) % method_choice.EXPLORE_EVERY == 0) == explores)


def test_probed_drafters_keep_their_probe_ranking_when_hard_text_lowers_the_one_that_drafted_it():
    """Traffic histories are not paired: the drafter that met hard text looks worse than one that met
    none. Rated by the probe scaled by the band's traffic level, the ranking survives; a drafter that does
    worse than its probe says relative to the others on the same server falls; a request takes the best
    rated drafter, and one in EXPLORE_EVERY the one with the least traffic."""
    history = acceptance.AcceptanceHistory()
    unprobed = acceptance.AcceptanceHistory()
    for h in (history, unprobed):
        h.observe("eagle3", 4, 3, "sampled")                 # the probe's own steps: cleared by set_probe
    history.set_probe("eagle3", "sampled", 240.4, 400.0)      # 0.60 and 0.55 once shrunk
    history.set_probe("mtp", "sampled", 220.2, 400.0)
    for i in range(150):                                      # hard text, all of it drafted by eagle3
        for h in (history, unprobed):
            h.observe("eagle3", 4, i % 2, "sampled")          # 1 of 3 positions accepted
    traffic = 1 / 3
    assert unprobed.alpha("mtp", 0, 0, "sampled") > unprobed.alpha("eagle3", 0, 0, "sampled")   # confounded
    e3, mtp = history.rating("eagle3", "sampled"), history.rating("mtp", "sampled")
    assert e3 == pytest.approx(traffic, rel=0.08)
    assert mtp / e3 == pytest.approx(0.55 / 0.60)                 # the probe's order and gap
    assert history.alpha("mtp", 0, 0, "sampled") == pytest.approx(mtp)
    assert history.rating("ngram", "sampled") is None and history.rating("mtp", "greedy") is None

    policy = GoodputPolicy()
    policy.history = history
    policy.cost.fit = lambda: (0.010, 0.0005)
    policy.draft_step_s.update(eagle3=0.001, mtp=0.001)
    lengths = {"eagle3": 4, "mtp": 4, "ngram": 0}

    def request(rid: str) -> SimpleNamespace:
        return SimpleNamespace(request_id=rid, spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
                               sampling_params=SamplingParams(temperature=0.8, max_tokens=64), num_tokens=100)
    assert policy.choose_method(request(_explorer_id(False)), 4, lengths) == "eagle3"
    assert policy.choose_method(request(_explorer_id(True)), 4, lengths) == "mtp"    # least traffic
    explorer = request(_explorer_id(True))
    explorer.spec_stats.by_method["eagle3"] = [5, 20, 10, 20]   # it drafts with one already: no exploring
    assert policy.choose_method(explorer, 4, lengths) == "eagle3"

    for i in range(1500):                         # both on the same server's text: mtp 0.2 to eagle3's 1/3
        history.observe("eagle3", 4, i % 2, "sampled")
        history.observe("mtp", 4, 1 if i % 4 == 0 else 0, "sampled")
    gap = history.rating("mtp", "sampled") / history.rating("eagle3", "sampled")
    assert gap < 0.85 * 0.55 / 0.60


def test_a_few_requests_text_does_not_reorder_the_probed_drafters():
    """Each request's text moves what its drafter accepts more than the drafters differ (EAGLE-3 at T = 0.8
    on an agentic turn: 0.22 to 0.68 a position per request), so a drafter's traffic ratio needs several
    requests' positions (RATIO_WEIGHT, over the longer RATIO_DECAY memory) before it reorders the probe's
    ranking: eagle3 meeting one hard request of two, mtp two ordinary ones, leaves eagle3 first."""
    history = acceptance.AcceptanceHistory()
    history.set_probe("eagle3", "sampled", 240.4, 400.0)      # 0.60 and 0.55 once shrunk
    history.set_probe("mtp", "sampled", 220.2, 400.0)
    for eagle3_accepts in (0.2, 0.6):                          # per request: 50 verifications of each
        for i in range(50):
            history.observe("eagle3", 4, 1 if (i % 10) < 10 * eagle3_accepts else 0, "sampled")
            history.observe("mtp", 4, 1 if (i % 10) < 6 else 0, "sampled")
    assert history.rating("eagle3", "sampled") > history.rating("mtp", "sampled")


def test_explorers_stop_trying_a_drafter_once_its_traffic_shows_it_cannot_rate_best():
    """An explorer takes a drafter rated below the best while its traffic is too thin to rule it out (its
    rating plus a standard error of its traffic ratio reaches the best); once it has drafted enough
    positions on the server at the rating its probe gave it, explorers take the best drafter like the rest.
    A drafter rated as high as the best stays worth exploring."""
    history = acceptance.AcceptanceHistory()
    history.set_probe("eagle3", "sampled", 240.4, 400.0)      # 0.60 and 0.55 once shrunk
    history.set_probe("mtp", "sampled", 220.2, 400.0)
    history.long[("eagle3", "sampled", 0)] = [600.0, 1000.0, 600.0]   # on traffic at its probe's level
    policy = GoodputPolicy()
    policy.history = history
    lengths = {"eagle3": 4, "mtp": 4}
    explorer = SimpleNamespace(num_tokens=100, request_id=_explorer_id(True), spec_params=SpecParams("auto", 4),
                               spec_stats=SpecStats(), sampling_params=SamplingParams(temperature=0.8))
    assert policy.explorer(explorer, lengths) == "mtp"       # no traffic: it could still rate best
    history.long[("mtp", "sampled", 0)] = [165.0, 300.0, 165.0]   # 0.55 a position, as probed
    history._forget()
    assert history.rating("mtp", "sampled") / history.rating("eagle3", "sampled") == \
        pytest.approx(0.55 / 0.60, rel=0.03)
    assert policy.explorer(explorer, lengths) is None        # 300 positions: it cannot
    history.set_probe("mtp", "sampled", 240.4, 400.0)        # probed as good as eagle3: explored again
    assert policy.explorer(explorer, lengths) == "mtp"


def test_explorers_skip_a_drafter_too_dear_to_lead_at_any_acceptance_its_evidence_allows():
    """Probed level with EAGLE-3 and untried, a drafter costing three times as much per depth could not give
    more tokens per second even at the top of its standard error: explorers leave it; priced the same, it
    is explored."""
    history = acceptance.AcceptanceHistory()
    history.set_probe("eagle3", "greedy", 240.4, 400.0)
    history.set_probe("mtp", "greedy", 240.4, 400.0)
    policy = GoodputPolicy()
    policy.history = history
    policy.cost.fit = lambda: (0.015, 0.0005)
    lengths = {"eagle3": 8, "mtp": 8, "ngram": 0}
    explorer = SimpleNamespace(num_tokens=100, request_id=_explorer_id(True), spec_params=SpecParams("auto", 8),
                               spec_stats=SpecStats(), sampling_params=SamplingParams(temperature=0.0))

    def price(mtp_per_depth: float) -> None:
        for method, per_depth in (("eagle3", 0.002), ("mtp", mtp_per_depth)):
            policy.set_draft_prior(method, [(method, d, per_depth * d) for d in (1, 2, 4, 8)])
    price(0.002)
    assert policy.explorer(explorer, lengths) in ("eagle3", "mtp")     # either could lead: least traffic
    history.long[("eagle3", "greedy", 0)] = [60.0, 100.0, 60.0]
    history._forget()
    assert policy.explorer(explorer, lengths) == "mtp"
    price(0.006)
    assert policy.explorer(explorer, lengths) is None
    assert policy.choose_method(explorer, 8, lengths) == "eagle3"


def test_a_request_whose_text_suits_no_drafter_expects_the_others_no_better_than_its_own():
    """A probed drafter a request has not drafted with is expected at its server rating times how the
    request's text suited the drafters it did use. A request accepting a third of what its drafter's
    rating predicts no longer finds an untried drafter twice as good (it stays, or plain-decodes) where
    it used to leave for each in turn; a request on easy text is not held back."""
    history = acceptance.AcceptanceHistory()
    history.set_probe("eagle3", "sampled", 240.4, 400.0)      # 0.60 and 0.55 once shrunk
    history.set_probe("mtp", "sampled", 220.2, 400.0)
    policy = GoodputPolicy()
    policy.history = history
    policy.cost.fit = lambda: (0.010, 0.0005)
    policy.draft_step_s.update(eagle3=0.001, mtp=0.001)
    lengths = {"eagle3": 4, "mtp": 4}
    hard = SimpleNamespace(num_tokens=100, request_id=_explorer_id(False), spec_params=SpecParams("auto", 4),
                           spec_stats=SpecStats(), sampling_params=SamplingParams(temperature=0.8))
    hard.spec_stats.by_method["eagle3"] = [30, 80, 12, 60]    # 0.2 a position where 0.6 was expected
    level = policy.history.request_level(hard.spec_stats.by_method, "sampled")
    weight = acceptance.SAMPLED_DRAFTER_WEIGHT * 0.6            # alpha()'s weight, in expected positions
    assert level == pytest.approx((12 + weight) / (60 * 0.6 + weight), rel=0.01)
    assert policy.request_alpha(hard, "eagle3") == pytest.approx(0.6 * level, rel=0.01)   # the same shrinkage
    assert policy.request_alpha(hard, "mtp") == pytest.approx(0.55 * level, rel=0.01)
    assert policy.kept_drafter(hard, lengths) == "eagle3"      # mtp is no longer 2x what it accepts
    easy = SimpleNamespace(num_tokens=100, request_id=_explorer_id(False), spec_params=SpecParams("auto", 4),
                           spec_stats=SpecStats(), sampling_params=SamplingParams(temperature=0.8))
    easy.spec_stats.by_method["eagle3"] = [30, 80, 54, 60]    # 0.9 a position
    assert policy.request_alpha(easy, "mtp") > 0.55


def test_leaving_a_drafter_in_step_is_charged_its_next_catch_up_beyond_its_follow_up():
    """A step without the request's own drafter makes it catch up when next chosen: a lookup that would
    win on its own acceptance is not taken while the drafter is in step and its catch-up costs more than
    the follow-up it saves; once the drafter is behind anyway, or for a head whose follow-up costs what
    its catch-up does, the lookup is taken."""
    def setup(follow_up: float) -> tuple[GoodputPolicy, SimpleNamespace]:
        policy = GoodputPolicy()
        policy.cost.fit = lambda: (0.010, 0.0005)                 # a 10 ms step, 0.5 ms a verified row
        policy.draft_step_s["draft"] = 0.002                      # its catch-up (no fit yet): one draft forward
        policy.follow_up_s["draft"] = follow_up
        policy.history.slow[("draft", "sampled")] = [600.0, 1000.0]
        policy.history.slow[("ngram", "sampled")] = [380.0, 1000.0]
        request = SimpleNamespace(request_id="r", spec_params=SpecParams("auto", 8), spec_stats=SpecStats(),
                                  sampling_params=SamplingParams(temperature=0.8, max_tokens=64),
                                  num_tokens=100, num_output_tokens=10)
        request.spec_stats.by_method["draft"] = [6, 20, 12, 20]
        return policy, request

    lengths = {"draft": 8, "ngram": 8}
    policy, request = setup(follow_up=0.0)
    in_step, behind = (lambda r, m: 0), (lambda r, m: 5 if m == "draft" else 0)
    assert policy.leave_s(request, "draft", in_step) == pytest.approx(0.002)
    assert policy.choose_method(request, 8, lengths, behind=in_step) == "draft"
    assert policy.leave_s(request, "draft", behind) == 0.0
    assert policy.choose_method(request, 8, lengths, behind=behind) == "ngram"
    policy, request = setup(follow_up=0.002)
    assert policy.leave_s(request, "draft", in_step) == 0.0
    assert policy.choose_method(request, 8, lengths, behind=in_step) == "ngram"


def test_a_sampled_requests_first_positions_move_its_drafters_estimate_little():
    """When sampling, a drafter's acceptance differs little between requests, so a request's own positions
    count against the probe's rating at SAMPLED_DRAFTER_WEIGHT: 2 of its first 13 drafts accepted leave
    EAGLE-3 near its rating and worth drafting (at PRIOR_WEIGHT: 0.26, below plain decoding, and the request
    stopped drafting); a hundred positions at 0.2 do bring it down. Greedy requests, whose acceptance
    differs much more between texts, keep PRIOR_WEIGHT."""
    history = acceptance.AcceptanceHistory()
    for band in ("greedy", "sampled"):
        history.set_probe("eagle3", band, 240.4, 400.0)          # 0.60 once shrunk
    policy = GoodputPolicy()
    policy.history = history
    policy.cost.fit = lambda: (0.014, 0.00035)
    policy.draft_fit.clear()
    policy.draft_step_s.update(eagle3=0.003)
    policy.follow_up_s.update(eagle3=0.002)

    def request(temperature: float, accepted: int, attempted: int) -> SimpleNamespace:
        r = SimpleNamespace(num_tokens=100, request_id=_explorer_id(False), spec_params=SpecParams("auto", 8),
                            spec_stats=SpecStats(), sampling_params=SamplingParams(temperature=temperature))
        r.spec_stats.by_method["eagle3"] = [attempted, attempted, accepted, attempted]
        return r
    w = acceptance.SAMPLED_DRAFTER_WEIGHT
    unlucky = request(0.8, 2, 13)
    assert policy.request_alpha(unlucky, "eagle3") == pytest.approx((2 + w * 0.6) / (13 + w), rel=0.01)
    assert policy.choose_method(unlucky, 8, {"eagle3": 8}) == "eagle3"
    history.sampled_drafter_weight = acceptance.PRIOR_WEIGHT
    assert policy.request_alpha(unlucky, "eagle3") == pytest.approx((2 + 4 * 0.6) / 17, rel=0.01)
    assert policy.choose_method(unlucky, 8, {"eagle3": 8}) == "none"
    history.sampled_drafter_weight = w
    assert policy.request_alpha(request(0.8, 20, 100), "eagle3") == pytest.approx((20 + w * 0.6) / (100 + w))
    assert policy.request_alpha(request(0.0, 2, 13), "eagle3") == pytest.approx((2 + 4 * 0.6) / 17, rel=0.01)
