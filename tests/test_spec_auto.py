"""`auto` (speculators/auto.py, spec_dispatch.py, method_choice.choose_method): greedy output unchanged alone
and mixed with other methods; the response books steps per chosen method; between a drafter that knows the
answer and one that never does it picks the first; the acceptance-collapse signal warns once per window,
is counted, and stops auto choosing the collapsed method."""
from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from test_spec_draft_model import GREEDY, assert_no_leaks, encode, make_engine, write_target_and_draft

from specserve.sampling.params import SamplingParams
from specserve.server.api.responses import SpeculationInfo
from specserve.server.engine import acceptance, method_choice, spec_policy
from specserve.server.engine.spec_policy import GoodputPolicy
from specserve.server.engine.stats import StepStats
from specserve.server.metrics import Metrics
from specserve.speculators import registry
from specserve.speculators.auto import AutoSpeculator, continue_agreeing, longest_lookup
from specserve.speculators.base import DraftProposal, SpecParams, SpecRequest, SpecStats, Speculator

ANSWERS: dict[tuple[int, ...], list[int]] = {}     # prompt -> its greedy output (what the oracle knows)
PLAIN = SamplingParams(**GREEDY, max_tokens=32)


def _answer_drafts(r: SpecRequest, k: int) -> list[int]:
    prompt = tuple(r.all_token_ids[:r.num_tokens - len(r.output_token_ids)])
    return ANSWERS[prompt][len(r.output_token_ids):][:k]


class OracleSpeculator(Speculator):
    """Drafts the target's own greedy continuation: accepted always. It is made the costlier of the two
    (2 ms a call), so only the acceptance estimates can make auto prefer it."""
    name = "oracle"
    delay_s = 0.0

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        time.sleep(self.delay_s)
        return DraftProposal([_answer_drafts(r, k) for r, k in zip(requests, ks)], [None] * len(ks))


class SlowOracleSpeculator(OracleSpeculator):
    delay_s = 0.002


class GarbageSpeculator(Speculator):
    """Drafts a token the answer never continues with: rejected always."""
    name = "garbage"

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        drafts = []
        for r, k in zip(requests, ks):
            right = _answer_drafts(r, 1)
            drafts.append([(right[0] + 1) % 50 if right else 3] * k)
        return DraftProposal(drafts, [None] * len(ks))


class TurncoatSpeculator(Speculator):
    """The planted bad drafter: right until `bad` is set, then always wrong (a drafter that stops
    matching its target, e.g. after the target was swapped)."""
    name = "turncoat"
    bad = False

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        source = GarbageSpeculator() if self.bad else OracleSpeculator()
        return source.propose(requests, ks)


def method(name: str, cls: type) -> registry.Method:
    return registry.Method(name, f"{__name__}:{cls.__name__}", "always")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_target_and_draft(tmp_path_factory.mktemp("auto"))


def test_greedy_equals_plain_alone_and_mixed_and_books_steps_per_method(dirs):
    engine = make_engine(dirs["target"], draft_model=str(dirs["draft"]), suffix_scope="global")
    assert "auto" in engine.engine.spec.methods
    auto = engine.engine.spec.speculators["auto"]
    assert {"ngram", "suffix", "draft"} <= set(auto.members)
    assert "prediction" not in auto.members and "hybrid" not in auto.members   # its parts are members
    prompts = encode(engine)
    refs = [engine.generate([p], PLAIN)[0].token_ids for p in prompts]
    alone = engine.generate([prompts[0]], PLAIN, SpecParams("auto", 4))[0]
    assert alone.token_ids == refs[0]
    specs = [SpecParams("auto", 4), SpecParams("draft", 3), SpecParams("auto", 8), SpecParams(),
             SpecParams("suffix", 4)]
    mixed = engine.generate(prompts, PLAIN, [specs[i % len(specs)] for i in range(len(prompts))])
    assert [o.token_ids for o in mixed] == refs
    for out in [alone, *(o for i, o in enumerate(mixed) if i % len(specs) in (0, 2))]:
        stats = out.spec_stats
        assert stats.method == "auto" and stats.by_method
        assert set(stats.by_method) <= {*auto.members, "none"}
        assert sum(r[1] for r in stats.by_method.values()) == stats.num_draft_tokens
        assert sum(r[2] for r in stats.by_method.values()) == stats.num_accepted_tokens
        info = SpeculationInfo.from_stats([stats], SpecParams("auto", 4))
        assert {m: u.num_steps for m, u in info.by_method.items()} == {m: r[0] for m, r in stats.by_method.items()}
    assert_no_leaks(engine)


def test_auto_picks_the_drafter_that_drafts_well(dirs):
    with registry.registered(method("garbage", GarbageSpeculator)), \
            registry.registered(method("oracle", SlowOracleSpeculator)):
        engine = make_engine(dirs["target"], suffix_scope="request")
        prompts = encode(engine)
        for p in prompts:
            ANSWERS[tuple(p)] = engine.generate([p], PLAIN)[0].token_ids
        outs = engine.generate(prompts, PLAIN, SpecParams("auto", 4))
        assert [o.token_ids for o in outs] == [ANSWERS[tuple(p)] for p in prompts]
        used: dict[str, int] = {}
        for o in outs:
            for m, row in o.spec_stats.by_method.items():
                used[m] = used.get(m, 0) + row[0]
        assert used["oracle"] > 4 * used.get("garbage", 0), used
        steps = engine.engine.spec.speculators["auto"]
        assert "oracle" in steps.members and "garbage" in steps.members



def test_the_hybrids_model_drafts_are_booked_under_its_drafter_too(dirs):
    """`auto` rates a drafter by the server's history of it; under the default method (the hybrid) that
    drafter's acceptance is booked under `hybrid` and under the drafter's own name."""
    engine = make_engine(dirs["target"], draft_model=str(dirs["draft"]))
    learner = engine.engine.spec.learner
    assert learner.history.attempted("draft") == 0
    engine.generate(encode(engine), PLAIN, SpecParams("hybrid", 4))
    hybrid = engine.engine.spec.speculators["hybrid"]
    assert hybrid.fallback_name == "draft" and hybrid.drafted_by["draft"] > 0
    assert 0 < learner.history.attempted("draft") <= learner.history.attempted("hybrid")
    assert not hybrid.source                                        # forgotten with the requests
    assert_no_leaks(engine)

def test_a_collapsing_drafter_is_reported_once_and_auto_stops_choosing_it(dirs, caplog):
    with registry.registered(method("turncoat", TurncoatSpeculator)):
        engine = make_engine(dirs["target"], suffix_scope="request", speculation_policy="fixed")
        prompts = encode(engine) * 2
        for p in prompts:
            ANSWERS[tuple(p)] = engine.generate([p], PLAIN)[0].token_ids
        turncoat = engine.engine.spec.speculators["turncoat"]
        with caplog.at_level(logging.WARNING, logger=acceptance.__name__):
            good = engine.generate(prompts, PLAIN, SpecParams("turncoat", 4))
            assert not [r for r in caplog.records if "collapsed" in r.getMessage()]
            turncoat.bad = True
            outs = engine.generate(prompts, PLAIN, SpecParams("turncoat", 4))
        assert [o.token_ids for o in good + outs] == [ANSWERS[tuple(p)] for p in prompts] * 2
        assert outs[0].spec_stats.num_accepted_tokens == 0
        warned = [r for r in caplog.records if "collapsed" in r.getMessage()]
        assert len(warned) == 1 and "turncoat" in warned[0].getMessage()
        learner = engine.engine.spec.learner
        assert learner.is_collapsed("turncoat")
        request = SimpleNamespace(request_id="q", spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
                                  sampling_params=PLAIN)
        assert learner.choose_method(request, 4, {"turncoat": 4}) == "none"
        assert learner.choose_method(request, 4, {"turncoat": 4, "ngram": 4}) == "ngram"


def test_collapse_signal_window_counter_and_recovery():
    now = [0.0]
    policy = GoodputPolicy(clock=lambda: now[0])
    for _ in range(100):
        policy.observe_acceptance("eagle3", 4, 3)
    assert not policy.is_collapsed("eagle3") and policy.drain_collapses() == {}
    for _ in range(150):
        policy.observe_acceptance("eagle3", 4, 0)
    assert policy.is_collapsed("eagle3") and policy.drain_collapses() == {"eagle3": 1}
    assert policy.drain_collapses() == {}                     # once per window however long it lasts
    now[0] += acceptance.COLLAPSE_WINDOW_S + 1
    assert not policy.is_collapsed("eagle3")                 # auto may try it again after the window
    for _ in range(100):
        policy.observe_acceptance("ngram", 4, 2)              # another method, steady: never reported
    assert policy.drain_collapses() == {}
    m = Metrics()
    m.set_model_name("m", {"none": 0, "eagle3": 4})
    m.on_step(StepStats(spec_collapsed={"eagle3": 1}))
    assert m.registry.get_sample_value("specserve:spec_decode_acceptance_collapse_total",
                                       {"model_name": "m", "method": "eagle3"}) == 1


def test_choice_follows_expected_tokens_per_second():
    policy = GoodputPolicy()
    request = SimpleNamespace(request_id="r", spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
                              sampling_params=PLAIN)
    assert policy.choose_method(request, 4, {"ngram": 0}) == "none"          # nothing to draft
    for _ in range(50):
        policy.observe_acceptance("ngram", 4, 0)
        policy.observe_acceptance("suffix", 4, 4)
    assert policy.choose_method(request, 4, {"ngram": 4, "suffix": 4}) == "suffix"
    assert policy.choose_method(request, 4, {"ngram": 4, "suffix": 1}) in ("suffix", "none")
    policy.draft_step_s["draft"] = 10.0                                        # a drafter costing 10 steps
    assert policy.choose_method(request, 4, {"draft": 4}) == "none"
    assert longest_lookup(request, 4, {"ngram": 3, "suffix": 1, "draft": 4}) == "ngram"
    assert longest_lookup(request, 4, {"ngram": 1, "draft": 4}) == "draft"
    assert longest_lookup(request, 4, {"ngram": 0}) == "none"
    assert AutoSpeculator({}).choose([request], [0]) == ["none"]




def test_a_lookup_draft_is_continued_by_a_longer_one_that_agrees_with_it():
    """Two lookups whose drafts agree predict the same text: the shorter one is offered at the longer one's
    length; drafts that differ anywhere in their overlap stay as they were."""
    got = continue_agreeing({"suffix": [5, 6], "ngram": [5, 6, 7, 8]})
    assert got == {"suffix": [5, 6, 7, 8], "ngram": [5, 6, 7, 8]}
    assert continue_agreeing({"suffix": [5, 9], "ngram": [5, 6, 7]}) == {"suffix": [5, 9], "ngram": [5, 6, 7]}
    assert continue_agreeing({"suffix": [], "ngram": [5, 6]}) == {"suffix": [], "ngram": [5, 6]}
    assert continue_agreeing({"suffix": [1, 2, 3], "ngram": [1]}) == {"suffix": [1, 2, 3], "ngram": [1, 2, 3]}

    class Fixed(Speculator):
        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

        def propose(self, requests, ks):
            return DraftProposal([self.ids[:k] for k in ks], [None] * len(ks))

    auto = AutoSpeculator({"suffix": Fixed([4, 4]), "ngram": Fixed([4, 4, 9, 9, 9])})
    seen: list[dict[str, int]] = []
    auto.chooser = lambda reqs, ks, lengths: seen.extend(lengths) or ["suffix"] * len(reqs)
    request = SimpleNamespace(request_id="r", spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
                              sampling_params=PLAIN)
    assert auto.choose([request], [4]) == ["suffix"]
    assert seen == [{"suffix": 4, "ngram": 4}]
    assert auto.drafts("suffix", [request], [4]).token_ids == [[4, 4, 9, 9]]


def test_an_untried_drafter_is_explored_and_a_request_keeps_the_drafter_it_took():
    """A drafter whose history is empty is rated at an upper confidence bound, so the server tries it; a
    request then drafts with the model drafter it took (or a lookup, or none) and does not flip between
    drafters on its own few noisy positions, unless its drafter accepts far less on it than another is
    expected to or has collapsed."""
    policy = GoodputPolicy()
    for _ in range(300):
        policy.observe_acceptance("eagle3", 4, 2, "sampled")      # 0.6 per position on the server
    policy.draft_step_s.update(eagle3=0.002, draft=0.002)
    request = SimpleNamespace(request_id="r", spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
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
                               sampling_params=SamplingParams(temperature=0.8, max_tokens=64))
    assert policy.choose_method(request(_explorer_id(False)), 4, lengths) == "eagle3"
    assert policy.choose_method(request(_explorer_id(True)), 4, lengths) == "mtp"    # least traffic
    explorer = request(_explorer_id(True))
    explorer.spec_stats.by_method["eagle3"] = [5, 20, 10, 20]   # it drafts with one already: no exploring
    assert policy.choose_method(explorer, 4, lengths) == "eagle3"

    for i in range(300):                                      # mtp on the same server: 0.2 to eagle3's 1/3
        history.observe("mtp", 4, 1 if i % 4 == 0 else 0, "sampled")
    gap = history.rating("mtp", "sampled") / history.rating("eagle3", "sampled")
    assert gap < 0.85 * 0.55 / 0.60


def test_explorers_stop_trying_a_drafter_once_its_traffic_shows_it_cannot_rate_best():
    """An explorer takes a drafter rated below the best while its traffic is too thin to rule it out (its
    rating plus a standard error of its traffic ratio reaches the best); once it has drafted enough
    positions on the server at the rating its probe gave it, explorers take the best drafter like the rest.
    A drafter rated as high as the best stays worth exploring."""
    history = acceptance.AcceptanceHistory()
    history.set_probe("eagle3", "sampled", 240.4, 400.0)      # 0.60 and 0.55 once shrunk
    history.set_probe("mtp", "sampled", 220.2, 400.0)
    history.traffic[("eagle3", "sampled")] = [600.0, 1000.0]  # on traffic at its probe's level
    policy = GoodputPolicy()
    policy.history = history
    lengths = {"eagle3": 4, "mtp": 4}
    explorer = SimpleNamespace(request_id=_explorer_id(True), spec_params=SpecParams("auto", 4),
                               spec_stats=SpecStats(), sampling_params=SamplingParams(temperature=0.8))
    assert policy.explorer(explorer, lengths) == "mtp"       # no traffic: it could still rate best
    history.traffic[("mtp", "sampled")] = [165.0, 300.0]      # 0.55 a position, as probed
    history._rated.clear()
    assert history.rating("mtp", "sampled") / history.rating("eagle3", "sampled") == \
        pytest.approx(0.55 / 0.60, rel=0.03)
    assert policy.explorer(explorer, lengths) is None        # 300 positions: it cannot
    history.set_probe("mtp", "sampled", 240.4, 400.0)        # probed as good as eagle3: explored again
    assert policy.explorer(explorer, lengths) == "mtp"


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
    hard = SimpleNamespace(request_id=_explorer_id(False), spec_params=SpecParams("auto", 4),
                           spec_stats=SpecStats(), sampling_params=SamplingParams(temperature=0.8))
    hard.spec_stats.by_method["eagle3"] = [30, 80, 12, 60]    # 0.2 a position where 0.6 was expected
    level = policy.history.request_level(hard.spec_stats.by_method, "sampled")
    assert level == pytest.approx((12 + 8) / (60 * 0.6 + 8), rel=0.01)
    assert policy.request_alpha(hard, "mtp") == pytest.approx(0.55 * level, rel=0.01)
    assert policy.kept_drafter(hard, lengths) == "eagle3"      # mtp is no longer 2x what it accepts
    easy = SimpleNamespace(request_id=_explorer_id(False), spec_params=SpecParams("auto", 4),
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


def test_over_http_the_response_shows_steps_per_chosen_method_and_metrics_label_them(client, http):
    from conftest import SERVED_NAME

    def drafted(method_name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in http.get("/metrics").text.splitlines()
                   if line.startswith("specserve:spec_decode_num_draft_tokens_total{")
                   and f'method="{method_name}"' in line)
    before = {m: drafted(m) for m in ("ngram", "suffix", "auto")}
    r = client.completions.create(model=SERVED_NAME, prompt="a b c a b c a b c a b c a b", max_tokens=24,
                                  temperature=0, user="alice",
                                  extra_body={"ignore_eos": True,
                                              "speculation": {"method": "auto", "num_speculative_tokens": 4}})
    spec = r.model_extra["speculation"]
    assert spec["method"] == "auto" and spec["by_method"]
    assert sum(u["num_draft_tokens"] for u in spec["by_method"].values()) == spec["num_draft_tokens"]
    grew = {m: drafted(m) - before[m] for m in before}
    assert grew["auto"] == 0                          # steps are booked under the method auto chose
    assert sum(grew.values()) == sum(u["num_draft_tokens"] for m, u in spec["by_method"].items()
                                     if m in ("ngram", "suffix"))


def test_a_sampled_request_whose_drafter_is_in_step_skips_the_lookups_on_most_steps():
    """At T > 0 a request whose model drafter drafted for it last step chooses between that drafter and
    none without running the lookups, except on every RECHOOSE_EVERY-th step; greedy requests, and ones
    that took a lookup or nothing last step, always run them. `choose` runs the lookups for the others."""
    policy = GoodputPolicy()

    def request(rid: str, temperature: float, steps: int) -> SimpleNamespace:
        r = SimpleNamespace(request_id=rid, spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
                            sampling_params=SamplingParams(temperature=temperature, max_tokens=64))
        r.spec_stats.by_method["eagle3"] = [steps, 4 * steps, steps, 2 * steps]
        return r
    sampled, greedy = request("s", 0.8, 5), request("g", 0.0, 5)
    assert policy.skips_lookups(sampled, "eagle3")
    assert not policy.skips_lookups(request("s4", 0.8, spec_policy.RECHOOSE_EVERY * 2), "eagle3")
    assert not policy.skips_lookups(greedy, "eagle3")
    assert not policy.skips_lookups(sampled, "suffix") and not policy.skips_lookups(sampled, None)

    seen: list[list[str]] = []

    class Lookup(Speculator):
        def propose(self, requests, ks):
            seen.append([r.request_id for r in requests])
            return DraftProposal([[7, 7] for _ in requests], [None] * len(requests))

    auto = AutoSpeculator({"suffix": Lookup(), "eagle3": Speculator()})
    got: list[dict[str, int]] = []
    auto.chooser = lambda reqs, ks, lengths: got.extend(lengths) or ["eagle3"] * len(reqs)
    assert auto.choose([sampled, greedy], [4, 4], no_lookups=lambda r: r.request_id == "s") == ["eagle3"] * 2
    assert seen == [["g"]]
    assert got == [{"suffix": 0, "eagle3": 4}, {"suffix": 2, "eagle3": 4}]
