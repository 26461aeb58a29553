"""The start-up acceptance probe (server/engine/spec_probe.py): every loaded model drafter drafts before the
first request, its acceptance is kept as a small prior per band, and nothing else of it stays behind."""
from __future__ import annotations

import pytest
from test_cli import serve_parser
from test_spec_draft_model import GREEDY, assert_no_leaks, encode, make_engine, write_target_and_draft

from specserve.sampling.params import SamplingParams
from specserve.server.cli import configs_from_args, main
from specserve.server.config import EngineConfig
from specserve.server.engine.acceptance import AcceptanceHistory
from specserve.server.engine.spec_probe import PRIOR_POSITIONS
from specserve.speculators.base import SpecParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_target_and_draft(tmp_path_factory.mktemp("probe"))


def test_the_probe_seeds_each_drafters_history_in_both_bands_and_leaves_nothing_else(dirs):
    probed = make_engine(dirs["target"], draft_model=str(dirs["draft"]), speculation_probe_tokens=16,
                         suffix_scope="global")
    plain = make_engine(dirs["target"], draft_model=str(dirs["draft"]), speculation_probe_tokens=0,
                        suffix_scope="global")
    history = probed.engine.spec.learner.history
    for band in ("greedy", "sampled"):
        assert 0 < history.attempted("draft", band) <= PRIOR_POSITIONS
        assert ("draft", band) not in history.fast           # the collapse signal starts from real traffic
        assert not any(key[:2] == ("draft", band) for key in history.traffic)   # nor the traffic level
        assert history.rating("draft", band) == pytest.approx(history.probed[("draft", band)])
        assert 0 < history.probed[("draft", band)] < 1
        assert plain.engine.spec.learner.history.attempted("draft", band) == 0
    assert probed.engine.spec.learner.draft_step_s.get("draft", 0.0) > 0.0       # its cost is measured too
    learner = probed.engine.spec.learner                  # at depths 1-8: a line before any traffic
    e0, e1 = learner.draft_cost("draft")
    assert learner.draft_fit["draft"].fit() == (e0, e1) and e1 > 0 and e0 + e1 > 0
    assert learner.propose_log is None and "draft" not in plain.engine.spec.learner.draft_fit
    c0, c1 = learner.catch_up["draft"].fit()              # its requests' prompt reads: a catch-up line
    assert c1 > 0 and c0 + c1 > 0 and learner.catch_up_log is None
    assert "draft" not in plain.engine.spec.learner.catch_up
    assert probed.engine.spec.learner.cost.steps == 0       # its steps' shape does not set the step line
    assert not probed.engine.live
    assert_no_leaks(probed)
    assert probed.engine.spec.speculators["suffix"].shared.end == 0    # no probe text joins the suffix cache
    prompts = encode(probed)
    params = SamplingParams(**GREEDY, max_tokens=24)
    for spec in (SpecParams(), SpecParams("draft", 4), SpecParams("auto", 4)):
        assert [o.token_ids for o in probed.generate(prompts, params, spec)] == \
            [o.token_ids for o in plain.generate(prompts, params, spec)]


def test_a_context_window_too_short_for_the_probe_texts_still_starts(dirs):
    engine = make_engine(dirs["target"], draft_model=str(dirs["draft"]), max_model_len=24,
                         speculation_probe_tokens=64)
    assert 0 < engine.engine.spec.learner.history.attempted("draft", "greedy") <= PRIOR_POSITIONS
    assert_no_leaks(engine)


def test_cap_keeps_the_acceptance_and_bounds_the_weight():
    history = AcceptanceHistory()
    for _ in range(40):
        history.observe("eagle3", 4, 3)
    rate = history.slow[("eagle3", "greedy")][0] / history.slow[("eagle3", "greedy")][1]
    history.cap("eagle3", "greedy", 12.0)
    acc, att = history.slow[("eagle3", "greedy")]
    assert att == 12.0 and acc / att == pytest.approx(rate)
    assert ("eagle3", "greedy") not in history.fast
    history.cap("mtp", "greedy", 12.0)                      # nothing seen: nothing made up
    assert history.attempted("mtp") == 0


def test_the_flag_sets_it_and_bad_values_are_refused():
    assert configs_from_args(serve_parser().parse_args(["--speculation-probe-tokens", "0"]))[0] \
        .speculation_probe_tokens == 0
    for bad in (-1, 10_000):
        with pytest.raises(ValueError, match="speculation_probe_tokens"):
            EngineConfig(speculation_probe_tokens=bad).validate()
        assert main(["serve", "--speculation-probe-tokens", str(bad)]) == 2     # a start-up error


def test_the_probe_rates_each_drafter_at_a_longer_context_where_the_window_holds_its_text(dirs):
    probed = make_engine(dirs["target"], draft_model=str(dirs["draft"]), speculation_probe_tokens=16,
                         kv_gb=0.02)
    history = probed.engine.spec.learner.history
    for band in ("greedy", "sampled"):
        assert 0 < history.probed_context[("draft", band, 1)] < 1
        assert history.rating("draft", band, 400) == pytest.approx(history.probed_context[("draft", band, 1)])
        assert history.rating("draft", band, 100) == pytest.approx(history.probed[("draft", band)])
    assert_no_leaks(probed)
    short = make_engine(dirs["target"], draft_model=str(dirs["draft"]), max_model_len=256,
                        speculation_probe_tokens=16)
    assert not short.engine.spec.learner.history.probed_context       # its long text does not fit
