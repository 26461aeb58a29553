"""A model drafter's catch-up line from the start (DraftCosts.set_catch_up_prior): the start-up probe's requests
each read their prompt in the same forward an `auto` request's switch to the drafter runs, at the rows the
drafter counts (last_catch_up_rows); those reads are the line's prior, and `auto`'s own switches then set its
level."""
import pytest
from test_spec_costs import _CatchingUp, _slowstart
from test_spec_policy import seq

from specserve.server.engine.draft_costs import CATCH_UP_MIN_STEPS
from specserve.server.engine.spec_policy import GoodputPolicy
from specserve.server.engine.stats import StepStats


class _CountingRows(_CatchingUp):
    """_CatchingUp that counts the rows of its catch-ups: a request's tokens on its first propose."""

    def propose(self, requests, ks):
        fresh = [r for r in requests if r.request_id not in self.seen]
        out = super().propose(requests, ks)
        self.last_catch_up_rows = sum(r.num_tokens for r in fresh)
        return out


def test_a_drafters_own_requests_prompt_reads_are_logged_only_while_the_probe_records(monkeypatch):
    with _slowstart(monkeypatch, _CountingRows) as dispatcher:
        learner = dispatcher.learner
        dispatcher.propose([seq("traffic", 4, method="slowstart")], StepStats())
        assert learner.catch_up_log is None and "slowstart" not in learner.catch_up     # traffic: nothing
        learner.catch_up_log = []
        first = seq("probe", 4, method="slowstart")
        dispatcher.propose([first], StepStats())                       # 50 ms over its 3 prompt tokens
        dispatcher.propose([first], StepStats())                       # in step: no catch-up
        assert learner.catch_up_log == [("slowstart", 3, pytest.approx(0.050))]
        assert "slowstart" not in learner.catch_up                     # a prior, set when the probe ends


def test_the_probes_prompt_reads_start_the_line_and_autos_own_switches_then_set_its_level():
    p = GoodputPolicy()
    line = [(rows, 0.001 + 0.000025 * rows) for rows in (41, 51, 53, 61, 384)]
    log = [("eagle3", rows, s) for rows, s in line] * 2 + [("mtp", 51, 0.003), ("mtp", 51, 0.0031)]
    assert "eagle3" not in p.catch_up
    assert p.set_catch_up_prior("eagle3", log) == pytest.approx((0.001, 0.000025))
    assert p.catch_up_s("eagle3", 300) == pytest.approx(0.001 + 0.000025 * 300)      # before any switch
    assert p.set_catch_up_prior("mtp", log) is None and "mtp" not in p.catch_up        # one row count only
    probe_300 = p.catch_up_s("eagle3", 300)
    for i in range(CATCH_UP_MIN_STEPS):                     # switches at 2/3 of the probe's price
        rows = 10 + 60 * i
        p.observe_catch_up("eagle3", (0.001 + 0.000025 * rows) * 2 / 3, rows)
    assert 0.6 * probe_300 < p.catch_up_s("eagle3", 300) < 0.75 * probe_300   # at their level
