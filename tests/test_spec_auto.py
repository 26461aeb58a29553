"""`auto` (speculators/auto.py, spec_dispatch.py, method_choice.choose_method): greedy output unchanged alone
and mixed with other methods; the response books steps per chosen method; between a drafter that knows the
answer and one that never does it picks the first; the acceptance-collapse signal warns once per window,
is counted, and stops auto choosing the collapsed method. Which model drafter a request takes:
test_auto_drafters.py."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from test_spec_draft_model import GREEDY, assert_no_leaks, encode, make_engine, write_target_and_draft

from specserve.sampling.params import SamplingParams
from specserve.server.api.responses import SpeculationInfo
from specserve.server.engine import acceptance, spec_policy
from specserve.server.engine.spec_policy import GoodputPolicy
from specserve.server.engine.stats import StepStats
from specserve.server.metrics import Metrics
from specserve.speculators import registry
from specserve.speculators.auto import AutoSpeculator, continue_agreeing, longest_lookup
from specserve.speculators.base import DraftProposal, SpecParams, SpecRequest, SpecStats, Speculator

ANSWERS: dict[tuple[int, ...], list[int]] = {}     # prompt -> its greedy output (what the oracle knows)
PLAIN = SamplingParams(**GREEDY, max_tokens=32)


class Fake(SimpleNamespace):
    """A request for AutoSpeculator.choose: the test appends what it emits to all_token_ids."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


def fake(rid: str, temperature: float = 0.0, tokens: Sequence[int] = (1, 2, 3)) -> Fake:
    return Fake(request_id=rid, spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
                sampling_params=SamplingParams(temperature=temperature, max_tokens=64), all_token_ids=list(tokens))


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
    # every lookup offer auto scored reached the server's per-depth history (what prices a request's depths)
    scored = [o.spec_stats.lookup_depths for o in (alone, *mixed) if o.spec_stats.method == "auto"]
    depths = engine.engine.spec.learner.history.depths
    assert scored and {(m, "greedy") for d in scored for m in d} == set(depths)
    for method in {m for d in scored for m in d}:           # depth 1's offers, decayed a little on the server
        first = sum(d[method][0][0] for d in scored if method in d)
        assert first > 0 and depths[(method, "greedy")][0][0] == pytest.approx(first, rel=0.5)
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
                                  sampling_params=PLAIN, num_tokens=100)
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
    request = SimpleNamespace(num_tokens=100, request_id="r", spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
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
    request = fake("r")
    assert auto.choose([request], [4]) == ["suffix"]
    assert seen == [{"suffix": 4, "ngram": 4}]
    assert auto.drafts("suffix", [request], [4]).token_ids == [[4, 4, 9, 9]]


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

    def request(rid: str, temperature: float, steps: int) -> Fake:
        r = fake(rid, temperature)
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


def test_every_offered_lookup_draft_is_scored_against_what_the_request_went_on_to_emit():
    """A lookup's drafts, chosen or not, are scored once their outcome is known (a mismatch, or the whole
    draft matched), and the request's estimate of a lookup comes from them, not from the few (hard) steps it
    was verified on; a request that ran no lookups offers nothing, a released one is forgotten."""
    drafts = {"suffix": [5, 6], "ngram": [9, 9, 9]}

    class Fixed(Speculator):
        def __init__(self, name: str) -> None:
            self.name = name

        def propose(self, requests, ks):
            return DraftProposal([drafts[self.name][:k] for k in ks], [None] * len(ks))

    auto = AutoSpeculator({"suffix": Fixed("suffix"), "ngram": Fixed("ngram")})
    auto.chooser = lambda reqs, ks, lengths: ["suffix"] * len(reqs)
    r = fake("r")
    auto.choose([r], [4])                    # offered at position 3: suffix [5, 6], ngram [9, 9, 9]
    r.all_token_ids.append(5)
    auto.choose([r], [4])                    # suffix matched so far (not scored yet), ngram missed at once
    assert r.spec_stats.lookup_scores == {"ngram": [0, 1]}
    r.all_token_ids += [6, 9]
    auto.choose([r], [4], no_lookups=lambda request: True)
    # position 3: suffix matched whole (2 of 2); position 4 ([6, 9] emitted): both missed their first token
    assert r.spec_stats.lookup_scores == {"ngram": [0, 2], "suffix": [2, 3]}
    # per depth [reached, accepted]: suffix's first draft reached and passed depths 1 and 2, its second missed at 1
    assert r.spec_stats.lookup_depths == {"ngram": [[2], [0]], "suffix": [[2, 1], [1, 1]]}
    auto.choose([r], [4], no_lookups=lambda request: True)
    assert r.spec_stats.lookup_scores == {"ngram": [0, 2], "suffix": [2, 3]}     # nothing new was offered

    policy = GoodputPolicy()
    r.spec_stats.by_method["ngram"] = [1, 3, 3, 3]      # verified once, on a step where it was right
    assert policy.request_alpha(r, "ngram") == policy.alpha("ngram", 0, 2)
    assert policy.request_alpha(r, "suffix") == policy.alpha("suffix", 2, 3) > policy.request_alpha(r, "ngram")
    auto.choose([r], [4])
    auto.release(r)
    assert "r" not in auto._offered


def test_a_lookup_whose_last_draft_was_emitted_whole_is_kept_unpriced_while_it_drafts_all_k():
    """A request that emitted the whole of a lookup's latest draft keeps that lookup, without the chooser
    and without running the other lookups, while it drafts all k; a draft cut short, a partly rejected one
    or a lookup that now drafts fewer than k sends the request back to the chooser."""
    answer = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    ran: list[str] = []

    class Copy(Speculator):
        """Drafts the answer from the request's position, `cut` tokens at most."""
        cut = 8

        def __init__(self, name: str) -> None:
            self.name = name

        def propose(self, requests, ks):
            ran.append(self.name)
            return DraftProposal([answer[r.num_tokens - 3:][:min(k, self.cut)] for r, k in zip(requests, ks)],
                                 [None] * len(ks))

    suffix, ngram = Copy("suffix"), Copy("ngram")
    auto = AutoSpeculator({"suffix": suffix, "ngram": ngram, "eagle3": Speculator()})
    priced: list[str] = []
    auto.chooser = lambda reqs, ks, lengths: priced.extend(r.request_id for r in reqs) or ["suffix"] * len(reqs)
    r, other = fake("r"), fake("o")
    assert auto.choose([r, other], [2, 2]) == ["suffix", "suffix"]
    assert priced == ["r", "o"] and ran == ["suffix", "ngram"]          # nothing emitted yet: both priced
    r.all_token_ids += [5, 6, 7]                                       # r emitted its 2-token draft whole
    other.all_token_ids += [5, 9]                                      # other's second token was not the draft
    priced.clear(), ran.clear()
    assert auto.choose([r, other], [2, 2]) == ["suffix", "suffix"]
    assert priced == ["o"]
    assert ran == ["suffix", "suffix", "ngram"]      # r: its kept lookup, which drafts all k; o: every lookup
    # r runs only its kept lookup once that drafts all k
    r.all_token_ids += [8, 9, 10]
    priced.clear(), ran.clear()
    assert auto.choose([r], [2]) == ["suffix"] and priced == [] and ran == ["suffix"]
    # a lookup that now drafts fewer than k: priced again, with every lookup's draft
    r.all_token_ids += [11, 12, 13]
    suffix.cut = ngram.cut = 1
    priced.clear(), ran.clear()
    auto.choose([r], [2])
    assert priced == ["r"] and ran == ["suffix", "ngram"]
    auto.release(r)
    assert "r" not in auto._whole
