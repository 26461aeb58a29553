"""A drafter's rating at longer contexts (server/engine/acceptance.py context_bucket, set_probe_context,
probe_at): the start-up probe measures every drafter on one long text too, a drafter that falls apart
there is rated low at long contexts only, and `auto` gives a long request the drafter that holds up."""
import zlib
from types import SimpleNamespace

import pytest

from specserve.sampling.params import SamplingParams
from specserve.server.engine import method_choice
from specserve.server.engine.acceptance import CONTEXT_BASE, AcceptanceHistory, context_bucket
from specserve.server.engine.spec_policy import GoodputPolicy
from specserve.speculators.base import SpecParams, SpecStats


def test_context_buckets_double():
    assert [context_bucket(n) for n in (0, 1, CONTEXT_BASE - 1, CONTEXT_BASE, 2 * CONTEXT_BASE - 1,
                                        2 * CONTEXT_BASE, 4 * CONTEXT_BASE - 1, 4 * CONTEXT_BASE)] == \
        [0, 0, 0, 1, 1, 2, 2, 3]


def _probed() -> AcceptanceHistory:
    history = AcceptanceHistory()
    history.set_probe("eagle3", "sampled", 240.4, 400.0)      # 0.60, 0.58 and 0.55 once shrunk
    history.set_probe("mtp", "sampled", 232.3, 400.0)
    history.set_probe("draft", "sampled", 220.2, 400.0)
    return history


def test_a_drafter_that_falls_apart_at_long_contexts_is_rated_low_there_only():
    history = _probed()
    short, long_, longer = CONTEXT_BASE // 2, 3 * CONTEXT_BASE // 2, 6 * CONTEXT_BASE
    # the probe's long text: harder for all (eagle3 0.50, mtp 0.48), and the draft model falls apart (0.25)
    history.set_probe_context("sampled", 1, {"eagle3": (50.0, 100.0), "mtp": (48.0, 100.0),
                                             "draft": (25.0, 100.0)})
    assert history.rating("eagle3", "sampled", short) == pytest.approx(0.60)
    assert history.rating("draft", "sampled", short) == pytest.approx(0.55)
    e3, draft = history.rating("eagle3", "sampled", long_), history.rating("draft", "sampled", long_)
    assert 0.45 < e3 < 0.52 and 0.24 < draft < 0.30       # each near its own, shrunk a little to the shift
    assert history.rating("draft", "sampled", longer) == pytest.approx(draft)   # past the probe: its longest
    assert history.rating("eagle", "sampled", long_) is None                   # not probed at all

    same = _probed()          # a long text only harder for every drafter alike keeps the probe's gap
    same.set_probe_context("sampled", 1, {"eagle3": (30.0, 100.0), "mtp": (29.0, 100.0), "draft": (27.5, 100.0)})
    assert same.rating("draft", "sampled", long_) / same.rating("eagle3", "sampled", long_) == \
        pytest.approx(0.55 / 0.60)
    lucky = _probed()         # one text's few positions demote a drafter, never promote it past the others
    lucky.set_probe_context("sampled", 1, {"eagle3": (30.0, 100.0), "mtp": (29.0, 100.0), "draft": (45.0, 100.0)})
    ranked = sorted(("eagle3", "mtp", "draft"), key=lambda m: lucky.rating(m, "sampled", long_), reverse=True)
    assert ranked == ["eagle3", "mtp", "draft"]           # it measured 0.45 there, the others 0.30 and 0.29


def test_the_harder_text_of_long_requests_is_charged_to_their_context_not_to_the_drafter_drafting_them():
    """Each position is predicted at its context's probe value and each context bucket has its level: when
    EAGLE-3 drafts the long requests (agentic turns, harder than the probe's long text) and the draft model
    the short ones (as probed), EAGLE-3 stays rated above the draft model at short contexts. One level for
    all contexts would charge the long requests' text to EAGLE-3's own ratio (0.89 against the draft
    model's 1.13) and rate the draft model first on short requests."""
    history = _probed()
    history.set_probe_context("sampled", 1, {"eagle3": (50.0, 100.0), "mtp": (48.0, 100.0),
                                             "draft": (25.0, 100.0)})
    long_e3 = history.probe_at("eagle3", "sampled", 1)
    for i in range(600):
        history.observe("eagle3", 4, i % 2, "sampled", context=3 * CONTEXT_BASE // 2)    # 1/3 a position
        history.observe("draft", 1, 1 if i % 20 < 11 else 0, "sampled", context=CONTEXT_BASE // 2)   # 0.55
    acc, att, predicted = history.long[("eagle3", "sampled", 1)]
    assert predicted == pytest.approx(att * long_e3)
    short = CONTEXT_BASE // 2
    assert history.rating("eagle3", "sampled", short) == pytest.approx(0.60, rel=0.03)
    assert history.rating("draft", "sampled", short) == pytest.approx(0.55, rel=0.03)
    assert history.rating("eagle3", "sampled", 3 * CONTEXT_BASE // 2) == pytest.approx(1 / 3, rel=0.05)


def _long_probed_policy() -> GoodputPolicy:
    """A policy whose probe found the draft model falling apart at long contexts (the heads holding up),
    the draft model the cheaper forward."""
    policy = GoodputPolicy()
    policy.history = _probed()
    policy.history.set_probe_context("sampled", 1, {"eagle3": (50.0, 100.0), "mtp": (48.0, 100.0),
                                                    "draft": (25.0, 100.0)})
    policy.cost.fit = lambda: (0.010, 0.0005)
    policy.draft_step_s.update(eagle3=0.001, draft=0.0002)
    return policy


def test_a_long_request_drafts_with_the_drafter_that_holds_up_at_long_contexts():
    policy = _long_probed_policy()
    rid = next(f"r{i}" for i in range(1000) if zlib.crc32(f"r{i}".encode()) % method_choice.EXPLORE_EVERY)

    def request(num_tokens: int) -> SimpleNamespace:
        return SimpleNamespace(request_id=rid, spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
                               sampling_params=SamplingParams(temperature=0.8, max_tokens=64),
                               num_tokens=num_tokens)
    lengths = {"eagle3": 4, "draft": 4}
    assert policy.choose_method(request(CONTEXT_BASE // 2), 4, lengths) == "draft"
    assert policy.choose_method(request(3 * CONTEXT_BASE // 2), 4, lengths) == "eagle3"


def test_a_request_that_grows_into_the_contexts_where_its_drafter_falls_apart_moves_to_the_best_there():
    """It took the draft model at a short context and accepts from it as the probe said; past the long
    probe's context the server rates the draft model far below EAGLE-3 there, so the request drafts with
    EAGLE-3 from then on, though its own counts with the draft model (taken at the shorter context) are good."""
    policy = _long_probed_policy()
    request = SimpleNamespace(request_id="r", spec_params=SpecParams("auto", 4), spec_stats=SpecStats(),
                              sampling_params=SamplingParams(temperature=0.8, max_tokens=256),
                              num_tokens=CONTEXT_BASE - 20)
    request.spec_stats.by_method["draft"] = [20, 80, 40, 72]            # 0.56 a position
    lengths = {"eagle3": 4, "draft": 4, "mtp": 4}
    assert policy.kept_drafter(request, lengths) == "draft"
    assert policy.choose_method(request, 4, lengths) == "draft"
    request.num_tokens = 3 * CONTEXT_BASE // 2
    assert policy.kept_drafter(request, lengths) == "eagle3"
    assert policy.choose_method(request, 4, lengths) == "eagle3"
    request.spec_stats.by_method["eagle3"] = [5, 20, 9, 17]             # a few steps on it: the draft model
    assert policy.choose_method(request, 4, lengths) == "eagle3"         # still has most, and is not taken
