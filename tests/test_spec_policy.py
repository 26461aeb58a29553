"""The goodput policy (server/engine/spec_policy.py): cost fit, optimal k choice, what it must never touch."""
import itertools

import pytest

from specserve.sampling.params import SamplingParams
from specserve.server.engine.request import Request
from specserve.server.engine.scheduler import ScheduledSeq
from specserve.server.engine.spec_policy import (
    CALIBRATION_SHAPES,
    MIN_T1_RATIO,
    PROBE_EVERY,
    GoodputPolicy,
    StepCostModel,
)
from specserve.speculators.base import SpecParams

T0, T1 = 0.025, 0.0015        # a 2-core CPU step: 25 ms to stream the weights, 1.5 ms per query token


def fitted_policy(t0=T0, t1=T1) -> GoodputPolicy:
    p = GoodputPolicy()
    for i in range(64):
        n = 1 + (i * 7) % 80
        p.observe_step(n, t0 + t1 * n)
    return p


def seq(rid: str, k: int, accepted: int = 0, attempted: int = 0, method="ngram", **sampling) -> ScheduledSeq:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 64, **sampling})
    req = Request(rid, [1, 2, 3], params, SpecParams(method, k))
    req.num_computed_tokens = 2
    req.spec_stats.num_accepted_tokens, req.spec_stats.num_attempted_positions = accepted, attempted
    return ScheduledSeq(req, 1, k)


def test_a_slope_flattened_by_noise_is_floored_and_the_policy_still_cuts():
    import random
    rng = random.Random(0)
    p = GoodputPolicy()
    for i in range(200):
        n = 1 + (i * 7) % 80
        # other work on the machine: big jitter that hides the per-token cost, larger on small steps
        p.observe_step(n, T0 + T1 * n + rng.uniform(0, 0.4) * (80 - n) / 80)
    naive = StepCostModel()
    naive.w, naive.sn, naive.snn, naive.st, naive.snt, naive.steps = (
        p.cost.w, p.cost.sn, p.cost.snn, p.cost.st, p.cost.snt, p.cost.steps)
    w = naive.w
    slope = (naive.snt / w - naive.sn / w * naive.st / w) / (naive.snn / w - (naive.sn / w) ** 2)
    assert slope < 0                              # the raw regression says extra tokens are free
    t0, t1 = p.cost.fit()
    assert t1 == pytest.approx(MIN_T1_RATIO * t0)
    mean_n, mean_t = p.cost.sn / p.cost.w, p.cost.st / p.cost.w
    assert t0 + t1 * mean_n == pytest.approx(mean_t)  # the floored line still passes through the mean
    poor = [seq(f"p{i}", 4, accepted=2, attempted=100) for i in range(16)]     # alpha ~0.04
    assert p.trim(poor) == 16 and all(s.num_draft_slots == 0 for s in poor)
    alone = seq("a", 4, accepted=60, attempted=100)
    assert p.trim([alone]) == 0 and alone.num_draft_slots == 4


def test_no_cut_before_the_cost_model_is_trusted():
    s = seq("a", 4, accepted=0, attempted=50)   # hopeless acceptance, but the step cost is unknown
    assert GoodputPolicy().trim([s]) == 0 and s.num_draft_slots == 4


def test_batch_one_keeps_drafting_and_a_full_batch_of_poor_acceptors_stops():
    p = fitted_policy()
    alone = seq("a", 4, accepted=60, attempted=100)           # alpha ~0.6
    assert p.trim([alone]) == 0 and alone.num_draft_slots == 4
    crowd = [seq(f"r{i}", 4, accepted=60, attempted=100) for i in range(16)]
    assert p.trim(crowd) == 16
    assert all(s.num_draft_slots < 4 for s in crowd)
    assert all(s.request.spec_stats.num_steps_k_reduced == 1 for s in crowd)
    poor = [seq(f"p{i}", 4, accepted=2, attempted=100) for i in range(16)]     # alpha ~0.04
    p.trim(poor)
    assert all(s.num_draft_slots == 0 for s in poor)


def test_choice_is_the_best_allocation_by_brute_force():
    # The step model: verifying costs T1 per token; a draft model's step costs 4 ms per depth it drafts to,
    # however many of its requests draft at that depth (one batched forward); ngram drafts are free.
    p = fitted_policy()
    p.observe_propose("draft", 0.004, 1)
    d = p.draft_step_s["draft"]
    stats = [(90, 100, "ngram"), (50, 100, "ngram"), (70, 100, "draft"), (30, 100, "draft")]
    for size in (4, 12):
        rows = stats * (size // 4)
        seqs = [seq(f"{size}-{i}", 3, a, n, m) for i, (a, n, m) in enumerate(rows)]
        p.trim(seqs)
        chosen = [s.num_draft_slots for s in seqs]
        alphas = [p.alpha(m, a, n) for a, n, m in rows]
        is_draft = [m == "draft" for *_, m in rows]

        def rate(ks, alphas=alphas, is_draft=is_draft):
            tokens = len(ks) + sum(sum(a ** j for j in range(1, k + 1)) for a, k in zip(alphas, ks))
            depth = max((k for k, dm in zip(ks, is_draft) if dm), default=0)
            return tokens / (T0 + T1 * (len(ks) + sum(ks)) + d * depth)
        if size == 4:
            best = max(itertools.product(range(4), repeat=4), key=rate)
            assert rate(chosen) == pytest.approx(rate(best), rel=1e-6)
        # no single +-1 change of one request's k does better (local optimality at the larger size)
        for i in range(len(chosen)):
            for step in (-1, 1):
                ks = list(chosen)
                ks[i] += step
                if 0 <= ks[i] <= 3:
                    assert rate(ks) <= rate(chosen) * (1 + 1e-9)


def test_a_draft_models_depth_is_paid_once_so_few_takers_do_not_open_it():
    # 16 draft-model requests: 2 accept well, 14 poorly. Charged d / 16 each (the old model), the two good
    # ones looked worth a 4 ms draft forward; paid in full, 2 x T1-priced tokens do not cover it.
    p = fitted_policy()
    p.observe_propose("draft", 0.004, 1)
    crowd = [seq(f"g{i}", 2, 90, 100, "draft") for i in range(2)] + \
            [seq(f"p{i}", 2, 2, 100, "draft") for i in range(14)]
    p.trim(crowd)
    assert [s.num_draft_slots for s in crowd] == [0] * 16
    # the same two good acceptors with free drafts (ngram) keep drafting
    mixed = [seq(f"n{i}", 2, 90, 100, "ngram") for i in range(2)] + \
            [seq(f"q{i}", 2, 2, 100, "draft") for i in range(14)]
    p.trim(mixed)
    assert [s.num_draft_slots for s in mixed[:2]] == [2, 2] and all(s.num_draft_slots == 0 for s in mixed[2:])


def test_seeded_sampling_is_cut_like_any_request_and_opt_out_keeps_its_k():
    # seeded text does not depend on k (coupled sampling: tests/test_seeded_matrix.py), so no exemption
    p = fitted_policy()
    poor = {"accepted": 2, "attempted": 100}
    seeded = seq("s", 4, temperature=0.8, seed=7, **poor)
    unseeded = seq("u", 4, temperature=0.8, **poor)
    req = Request("o", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8), SpecParams("ngram", 4, adaptive=False))
    req.num_computed_tokens = 2
    opted_out = ScheduledSeq(req, 1, 4)
    crowd = [seq(f"c{i}", 4, **poor) for i in range(14)]
    p.trim([seeded, unseeded, opted_out, *crowd])
    assert opted_out.num_draft_slots == 4
    assert seeded.num_draft_slots == unseeded.num_draft_slots == 0
    assert seeded.request.spec_stats.cuts == {"load": 1}


def test_acceptance_prior_comes_from_the_method_history():
    p = GoodputPolicy()
    assert p.alpha("ngram", 0, 0) == pytest.approx(0.5)        # never seen: the default prior
    for _ in range(200):
        p.observe_acceptance("ngram", 4, 4)                    # always all accepted: attempted 4, accepted 4
    assert p.alpha("ngram", 0, 0) > 0.99
    for _ in range(200):
        p.observe_acceptance("mtp", 4, 0)                      # always the first rejected: 0 of 1 attempted
    assert p.alpha("mtp", 0, 0) < 0.02
    assert p.alpha("mtp", 30, 40) == pytest.approx((30 + 4 * p.alpha("mtp", 0, 0)) / 44)


def test_one_rejected_first_draft_does_not_stop_a_method_at_batch_one():
    """The method history is shrunk towards the default prior: after a single rejection the estimate is
    (0 + 4 x 0.5) / (1 + 4) = 0.4, not 0, and a lone request keeps drafting where drafting is nearly free."""
    p = fitted_policy(t0=0.0025, t1=0.00015)                   # this project's bf16 target: 2.5 ms + 0.15 ms/token
    p.observe_acceptance("ngram", 1, 0)
    assert p.alpha("ngram", 0, 0) == pytest.approx(0.4)
    lone = seq("a", 2, accepted=0, attempted=1)
    assert p.trim([lone]) == 0 and lone.num_draft_slots == 2


def test_engine_cuts_drafts_when_verifying_costs_more_than_it_gains(tiny_model_dir):
    """On the real engine: a cost model where every verified token is expensive makes the policy cut every
    draft; greedy text is unchanged, each cut is counted per request and in the step stats ("load")."""
    from specserve.server.config import EngineConfig
    from specserve.server.engine.offline import OfflineEngine
    cfg = {"model": str(tiny_model_dir), "dtype": "float32", "device": "cpu", "num_threads": 1,
           "kv_cache_memory_gb": 0.02}
    fixed = OfflineEngine.from_config(EngineConfig(**cfg, speculation_policy="fixed"))
    assert fixed.engine.spec.policy is None
    eng = OfflineEngine.from_config(EngineConfig(**cfg, speculation_policy="goodput"))
    policy = eng.engine.spec.policy
    assert isinstance(policy, GoodputPolicy)
    policy.calibrate([(n, 1e-4 + 1.0 * n) for n in range(1, 41)])    # one second per query token
    for i in range(64):
        n = 1 + i % 40
        policy.observe_step(n, 1e-4 + 1.0 * n)
    prompt = eng.engine.tokenizer.encode("x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = fixed.generate([prompt], params, SpecParams("ngram", 4))[0]
    assert ref.spec_stats.num_drafts > 0 and ref.spec_stats.num_steps_k_reduced == 0
    e = eng.engine
    e.add_request("r", prompt, params, SpecParams("ngram", 4))
    refused, outs = 0, []
    while e.has_work:
        step_outs, stats = e.step()
        refused += stats.spec_refused.get("load", 0)
        outs += step_outs
    got = [t for o in outs for t in o.token_ids]
    assert got == ref.token_ids
    final = outs[-1].spec_stats
    # every draft was cut but the probes: one position every PROBE_EVERY dry steps
    assert final.num_draft_tokens == final.num_drafts <= len(got) // PROBE_EVERY
    assert final.num_steps_k_reduced == refused > 0


def test_engine_goodput_policy_is_calibrated_before_the_first_request(tiny_model_dir):
    from specserve.server.config import EngineConfig
    from specserve.server.engine.offline import OfflineEngine

    cfg = {
        "model": str(tiny_model_dir),
        "dtype": "float32",
        "device": "cpu",
        "num_threads": 1,
        "kv_cache_memory_gb": 0.02,
    }
    eng = OfflineEngine.from_config(EngineConfig(**cfg, speculation_policy="goodput"))
    policy = eng.engine.spec.policy
    assert [n for n, _ in policy.calibration] == [s * q for s, q in CALIBRATION_SHAPES]
    assert all(sec > 0 for _, sec in policy.calibration)
    t0, t1 = policy.cost.fit()  # usable before any step was observed
    assert policy.cost.steps == 0 and t0 >= 0 and t1 > 0
    # the calibration's scratch K/V must not leak into what requests see
    prompt = eng.engine.tokenizer.encode("def f(x):\n    return x + 1\n")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fixed = OfflineEngine.from_config(EngineConfig(**cfg))
    assert (
        eng.generate([prompt], params, SpecParams("ngram", 3))[0].token_ids
        == fixed.generate([prompt], params)[0].token_ids
    )
    assert eng.engine.scheduler.bm.num_free_blocks == eng.engine.scheduler.bm.num_blocks
    with pytest.raises(ValueError, match="KV blocks"):
        eng.engine.runner.time_verify_step(10**6, 1, 128)


def test_the_trim_stops_short_of_a_row_block_that_its_rows_do_not_pay_for():
    """16 requests at decode (16 rows) whose drafts pay at t1 a row: without a staircase the trim keeps
    drafts past 32 rows; with a block costing 30 rows' worth it keeps the best ones within 32."""
    def crowd():
        return [seq(f"r{i}", 4, accepted=80, attempted=100) for i in range(16)]    # alpha ~0.8
    flat, c = fitted_policy(t0=0.010, t1=0.0002), crowd()
    flat.trim(c)
    assert 16 + sum(s.num_draft_slots for s in c) > 32
    stepped, c = fitted_policy(t0=0.010, t1=0.0002), crowd()
    stepped.block_s = 0.0002 * 30
    stepped.trim(c)
    assert 16 < 16 + sum(s.num_draft_slots for s in c) <= 32


@pytest.mark.parametrize("block", [32, 16])      # oneDNN's bf16 row blocks, the AMX kernel's tiles
def test_a_probe_waits_for_a_step_where_its_row_does_not_begin_a_row_block(block):
    """A request cut for PROBE_EVERY - 1 steps drafts one position, unless that row would begin another row
    block (bf16 CPU): at 32 rows the 33rd costs the block; at 31 it fits (16 and 15 with 16-row blocks)."""
    p = fitted_policy(t0=0.010, t1=0.0002)
    p.block_s = 0.0002 * 30
    p.row_block = block

    def step(others: int) -> int:
        full = [seq(f"f{others}-{i}", 1) for i in range(others)]                  # decode rows, no drafts
        for s in full:
            s.num_draft_slots = 0
        probe = seq(f"p{others}", 4, accepted=0, attempted=100)                  # cut: alpha ~0
        p.dry[probe.request.request_id] = PROBE_EVERY - 1
        p.trim([*full, probe])
        return probe.num_draft_slots
    assert step(block - 1) == 0                  # a full block: a probe row would begin a second block
    assert step(block - 2) == 1                  # one row short of it: it fits in the first
    p.block_s = 0.0
    assert step(block - 1) == 1                  # no staircase: the probe is a row like any other


def test_the_row_block_step_is_timed_at_start_up_and_zero_where_the_cost_is_a_line():
    from types import SimpleNamespace

    from specserve.server.engine.spec_policy import ROW_BLOCK, row_block_step

    def runner(jump: float, block: int = ROW_BLOCK):
        return SimpleNamespace(time_verify_step=lambda seqs, q, ctx, reps=3:
                               0.005 + 0.0002 * seqs * q + (jump if seqs * q > block else 0.0))
    assert row_block_step(runner(0.002), (0.005, 0.0002)) == pytest.approx(0.002)
    assert row_block_step(runner(0.0), (0.005, 0.0002)) == 0.0
    assert row_block_step(runner(0.002), None) == 0.0
    assert row_block_step(runner(0.002, 16), (0.005, 0.0002), 16) == pytest.approx(0.002)   # 16-row tiles
    assert row_block_step(runner(0.002, 16), (0.005, 0.0002)) == 0.0      # timed at 32: no step there


def test_a_drafter_whose_first_depth_alone_does_not_pay_keeps_the_run_of_depths_that_does():
    """A model drafter's depth 1 carries its fixed part and its follow-up observe: 8 requests accepting 0.9
    pay 8 rows + 2 ms + 20 ms for 7.2 tokens, below the step's own rate, while depths 1-4 together pay.
    The trim takes the run of depths with the most tokens per second (a greedy per depth stopped at 0),
    the best uniform depth by brute force."""
    p = fitted_policy()
    for i in range(32):
        depth = 1 + i % 4
        p.observe_propose("eagle3", 0.010 + 0.002 * depth, depth)
    p.observe_follow_up("eagle3", 0.010)
    e0, e1 = p.draft_cost("eagle3")
    assert e0 == pytest.approx(0.010) and e1 == pytest.approx(0.002)
    seqs = [seq(f"e{i}", 4, 90, 100, "eagle3") for i in range(8)]
    alpha = p.request_alpha(seqs[0].request, "eagle3")

    def rate(depth: int) -> float:
        tokens = 8 * sum(alpha ** j for j in range(depth + 1))
        drafting = (e0 + 0.010 + e1 * depth) if depth else 0.0
        return tokens / (T0 + T1 * 8 * (1 + depth) + drafting)
    assert 8 * alpha / (8 * T1 + e0 + e1 + 0.010) < rate(0)          # depth 1 alone is below the step's rate
    p.trim(seqs)
    assert {s.num_draft_slots for s in seqs} == {max(range(5), key=rate)} != {0}
