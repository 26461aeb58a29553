"""The step-cost line (server/engine/step_cost.py): seconds of a forward against its query tokens, fitted
online over a start-up prior, and the prefix of picks worth a row block."""
import pytest

from specserve.server.engine.step_cost import MIN_FIT_STEPS, StepCostModel, best_stop

T0, T1 = 0.025, 0.0015        # a 2-core CPU step: 25 ms to stream the weights, 1.5 ms per query token


def test_cost_model_recovers_the_line_and_waits_for_spread():
    m = StepCostModel()
    for _ in range(MIN_FIT_STEPS + 4):
        m.observe(8, T0 + T1 * 8)                # always the same N: t0 and t1 cannot be told apart
    assert m.fit() is None
    for i in range(40):
        m.observe(1 + i % 30, T0 + T1 * (1 + i % 30))
    t0, t1 = m.fit()
    assert t1 == pytest.approx(T1, rel=0.05) and t0 == pytest.approx(T0, rel=0.1)
    assert StepCostModel().fit() is None         # nothing observed: no decision
    for _ in range(400):                         # the machine got slower: old steps are forgotten
        m.observe(1, 2 * T0 + T1)
        m.observe(30, 2 * T0 + 30 * T1)
    assert m.fit()[0] == pytest.approx(2 * T0, rel=0.01)


def test_a_slope_too_steep_for_the_mean_gives_the_line_through_zero_and_the_mean():
    """Draft depths with noisy samples can regress to a slope whose line crosses zero above depth 0:
    clamping t0 at 0 under that slope priced every depth above the mean (EAGLE-3 1.32 ms a depth where its
    proposes averaged 0.93), and the costlier-looking drafter was not chosen again to correct it. The line
    then goes through zero and the mean: every depth priced at the mean cost per depth."""
    m = StepCostModel()
    samples = [(1, 0.0005), (4, 0.0044), (1, 0.0006), (4, 0.0045)] * 5      # (depth, seconds)
    for depth, secs in samples:
        m.observe(depth, secs)
    w = m.w
    slope = (m.snt / w - m.sn / w * m.st / w) / (m.snn / w - (m.sn / w) ** 2)
    mean_n, mean_t = m.sn / w, m.st / w
    assert slope * mean_n > mean_t                 # the raw line's intercept is negative
    t0, t1 = m.fit()
    assert t0 == pytest.approx(0.0, abs=1e-12) and t1 == pytest.approx(mean_t / mean_n) and t1 < slope


def test_calibration_prior_gives_a_fit_at_once_and_online_steps_move_it():
    """A lone request at constant k never spreads N; the start-up samples do, and they do not decay away."""
    m = StepCostModel()
    m.set_prior([(n, T0 + T1 * n) for n in (1, 3, 5, 7, 4, 20, 8, 40)])
    t0, t1 = m.fit()
    assert t0 == pytest.approx(T0, rel=1e-6) and t1 == pytest.approx(T1, rel=1e-6)
    for _ in range(500):  # the server is really 10 ms slower per step than calibrated
        m.observe(5, T0 + 0.010 + T1 * 5)
    t0, t1 = m.fit()  # still a fit: the prior keeps its spread after 500 steps
    moved = (t0 + t1 * 5) - (T0 + T1 * 5)  # the prediction where the server runs moves most of
    assert 0.0067 < moved <= 0.010  # the 10 ms toward what it observes (prior: 16 steps' worth)
    assert 0 < t1 < 2 * T1


def test_the_start_up_prior_tilts_the_line_but_the_steps_seen_set_its_level():
    """Start-up samples time the forward alone; a served step also schedules, samples and builds outputs.
    A lone request at constant k gives no slope of its own, so the prior's slope stays, but the line passes
    through the steps really seen: a plain step is not read 2 ms cheaper than it is."""
    m = StepCostModel()
    m.set_prior([(n, T0 + T1 * n) for n in (1, 5, 9, 40)])
    for _ in range(MIN_FIT_STEPS + 10):
        m.observe(5, T0 + 0.002 + T1 * 5)                 # every real step 2 ms dearer than its forward
    t0, t1 = m.fit()
    assert t1 == pytest.approx(T1, rel=0.05)
    assert t0 + t1 * 5 == pytest.approx(T0 + 0.002 + T1 * 5, rel=1e-6)


def test_the_slope_is_not_read_from_the_offset_between_served_steps_and_the_prior():
    """Served steps cost their forward plus ~2 ms of sampling and outputs, and crowd the small sizes; the
    start-up forwards spread wide. The slope comes from each group's own spread, so that offset is not read
    as a flatter line (it was: 0.1 ms a row where the forwards measured 0.2)."""
    m = StepCostModel()
    m.set_prior([(n, T0 + T1 * n) for n in (1, 3, 5, 7, 4, 20, 8, 40)])
    for i in range(200):                               # plain steps and short verifications, 2 ms dearer
        n = 1 if i % 3 else 1 + i % 9
        m.observe(n, T0 + 0.002 + T1 * n)
    t0, t1 = m.fit()
    assert t1 == pytest.approx(T1, rel=1e-6)
    assert t0 == pytest.approx(T0 + 0.002, rel=1e-6)


def test_the_step_line_is_kept_between_samples_and_follows_each_new_one():
    model = StepCostModel()
    model.set_prior([(1, 0.010), (9, 0.018)])
    first = model.fit()
    assert model.fit() is first                       # read again: the same line, not a new fit
    for _ in range(20):
        model.observe(5, 0.030)
    moved = model.fit()
    assert moved != first and moved[0] + 5 * moved[1] == pytest.approx(0.030)
    model.set_prior([(1, 0.001), (9, 0.017)])         # a new prior's slope: a new line
    assert model.fit() != moved
    model.forget()                           # back to the start-up prior alone: two samples, too few to fit
    assert model.steps == 0 and model.fit() is None
    model.set_prior([(n, 0.001 * n) for n in (1, 3, 5, 7, 9, 11, 13, 15)])
    for _ in range(20):
        model.observe(5, 0.030)
    model.forget()
    assert model.fit() == pytest.approx((0.0, 0.001))


def test_best_stop_keeps_the_prefix_with_the_most_tokens_per_second_once_blocks_are_paid():
    picks = [(2, 1.6, 0.0003), (4, 1.2, 0.0006)]
    assert best_stop(30, 16.0, 0.010, picks, block_s=0.003) == 1        # the second pick's block does not pay
    assert best_stop(30, 16.0, 0.010, picks, block_s=0.0) == 2
    assert best_stop(20, 16.0, 0.010, picks, block_s=0.003) == 2        # no boundary crossed
    assert best_stop(31, 16.0, 0.010, [(2, 0.1, 0.0003)], block_s=0.003) == 0
