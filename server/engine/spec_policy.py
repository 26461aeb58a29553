"""Goodput policy: how many of its k draft slots each request really uses this step.

A request's k is what it may draft, not what pays off. Verifying a draft token costs the same whether it
is accepted or not, and the price of a token in the verification forward grows with the batch: at batch 1
a CPU step is weight-streaming bound (one more row is nearly free), at batch 16 each row costs real
compute. The policy keeps a draft position only where it is expected to raise the batch's tokens per
second:

    step time        T(N) = t0 + t1 * N          (N = query tokens in the forward; fitted online)
    draft step       d_m  seconds per draft step of method m (model-based drafters; 0 for ngram/prediction)
    request i        alpha_i = its observed acceptance at a drafted position, given the ones before it
                     were accepted (accepted / attempted positions; a prior from its method's history)
    position j       expected extra tokens alpha_i ** j, extra cost t1 (verifying it)
    depth j of m     d_m > 0: one draft forward for every request of m that drafts to depth j, paid once

Choices are added greedily, best gain / cost first, while gain / cost > S / T (tokens per second of the
step so far): a position of a request whose method drafts for free, or a depth of a model-based method,
opened for those of its requests whose own position still pays (alpha_i ** j / t1 > S / T). Charging a
depth d_m / n_m per request instead, as if all n_m of them drafted, opened depths for a few good acceptors
among many and paid the whole forward for their tokens: at concurrency 16, EAGLE-3 / MTP under this policy
ran at 0.68-0.79x plain against 0.84-1.08x with k fixed; with depths paid once, 0.85-1.17x.

What it never changes: any request's text. k never changes what a greedy request emits, nor what a seeded
sampled one emits (coupled sampling, sampling/coupled.py: tests/test_seeded_matrix.py shows it for every
method, both k and token-budget cuts), so it may cut those too. It only cuts
k, never raises it, and each cut is counted: `spec_decode_refused_total{reason="load"}` and the response's
`speculation.cuts["load"]` (also `num_steps_k_reduced`). Requests opt out with `"adaptive": false` in their
`speculation`.

Calibration: a lone request at a constant k only ever produces steps of one size, from which t0 and t1
cannot be told apart (MIN_SPREAD). So the engine times a few verification forwards of different sizes at
start-up (ModelRunner.time_verify_step, CALIBRATION_SHAPES) and hands them to `calibrate()`: they stay in
the fit as a fixed prior worth PRIOR_SAMPLE_WEIGHT steps each, while the decaying online observations
move the line to what the server really sees.

On by default (`--speculation-policy fixed` drafts every k asked for); docs/benchmarks.md compares the two.
"""
from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

from specserve.server.engine.scheduler import ScheduledSeq
from specserve.speculators.base import attempted_positions

log = logging.getLogger(__name__)

PRIOR_ALPHA = 0.5         # acceptance assumed for a method never seen
PRIOR_WEIGHT = 4.0        # attempted positions the prior counts for in a request's estimate
METHOD_DECAY = 0.995      # per observed step, for the per-method acceptance history
FIT_DECAY = 0.98          # per step, for the step-time regression
MIN_FIT_STEPS = 16        # steps observed before the cost model is trusted
MIN_SPREAD = 1.0          # variance of N (tokens^2) the regression needs to tell t1 from t0
PRIOR_SAMPLE_WEIGHT = 2.0  # steps' worth of evidence each start-up calibration sample counts for
# Least t1 / t0 the fit may report. Step times jittered by other work on the machine can flatten the line
# to t1 ~ 0 ("one more token is free"), after which the policy never cuts. A quiet 2-core CPU measures
# t1 / t0 ~ 0.045 in fp32; a GPU at small batch is far flatter, so the floor only catches a collapse.
MIN_T1_RATIO = 1.0 / 64
# (sequences, query tokens per sequence) timed at start-up: decode and verify shapes at a few batch sizes
CALIBRATION_SHAPES = ((1, 1), (1, 3), (1, 5), (1, 7), (4, 1), (4, 5), (8, 1), (8, 5))
CALIBRATION_CONTEXT = 128  # tokens before the verified ones in each calibration sequence


class StepCostModel:
    """Least-squares fit of step seconds against query tokens, exponentially forgetting old steps."""

    def __init__(self, decay: float = FIT_DECAY) -> None:
        self.decay = decay
        self.w = self.sn = self.snn = self.st = self.snt = 0.0
        self.steps = 0
        self.prior = (0.0, 0.0, 0.0, 0.0, 0.0)   # (w, sn, snn, st, snt) of the calibration; never decays

    def set_prior(self, samples: list[tuple[int, float]], weight: float = PRIOR_SAMPLE_WEIGHT) -> None:
        """Fixed (num_tokens, seconds) samples, e.g. timed at start-up, each counting as `weight` steps."""
        self.prior = (weight * len(samples), weight * sum(n for n, _ in samples),
                      weight * sum(n * n for n, _ in samples), weight * sum(t for _, t in samples),
                      weight * sum(n * t for n, t in samples))

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.sn = self.sn * d + num_tokens
        self.snn = self.snn * d + num_tokens * num_tokens
        self.st = self.st * d + seconds
        self.snt = self.snt * d + num_tokens * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(t0, t1) seconds, or None while the data cannot separate them."""
        pw, psn, psnn, pst, psnt = self.prior
        if self.steps + pw < MIN_FIT_STEPS:
            return None
        w = self.w + pw
        mean_n, mean_t = (self.sn + psn) / w, (self.st + pst) / w
        var = (self.snn + psnn) / w - mean_n * mean_n
        if var < MIN_SPREAD:
            return None
        t1 = ((self.snt + psnt) / w - mean_n * mean_t) / var
        t1 = max(t1, 1e-7)
        t0 = max(mean_t - t1 * mean_n, 0.0)
        if t1 < MIN_T1_RATIO * t0:          # a collapsed slope: keep the mean, tilt the line to the floor
            t1 = MIN_T1_RATIO * mean_t / (1.0 + MIN_T1_RATIO * mean_n)
            t0 = mean_t - t1 * mean_n
        return t0, t1


class GoodputPolicy:
    def __init__(self) -> None:
        self.cost = StepCostModel()
        self.calibration: list[tuple[int, float]] = []        # start-up (num_tokens, seconds) samples
        self.draft_step_s: dict[str, float] = {}              # method -> EMA seconds per draft step
        self.method_acc: dict[str, list[float]] = {}           # method -> [accepted, attempted], decayed

    # -- learning ------------------------------------------------------------------------------------
    def calibrate(self, samples: list[tuple[int, float]]) -> None:
        """Start-up step timings (num_tokens, seconds) of different sizes: the fit is usable at once."""
        self.calibration = list(samples)
        self.cost.set_prior(samples)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A pure decode/verify step (no prefill rows): N query tokens took `seconds` (forward + sampling)."""
        self.cost.observe(num_tokens, seconds)

    def observe_propose(self, method: str, seconds: float, steps: int) -> None:
        if steps > 0:
            per = seconds / steps
            old = self.draft_step_s.get(method)
            self.draft_step_s[method] = per if old is None else 0.9 * old + 0.1 * per

    def observe_acceptance(self, method: str, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        acc = self.method_acc.setdefault(method, [0.0, 0.0])
        acc[0] = acc[0] * METHOD_DECAY + num_accepted
        acc[1] = acc[1] * METHOD_DECAY + attempted_positions(num_draft, num_accepted)

    def alpha(self, method: str, accepted: int, attempted: int) -> float:
        """A request's acceptance estimate: its own counts, shrunk towards its method's history, which is
        itself shrunk towards PRIOR_ALPHA. Never 0 after a few rejections: a cut request brings no new
        evidence, so an estimate of 0 would cut its method for good (one rejected first draft once stopped
        ngram at batch 1 for every later step: 0.96x plain against 2.09x with k fixed)."""
        acc, att = self.method_acc.get(method, (0.0, 0.0))
        prior = (acc + PRIOR_WEIGHT * PRIOR_ALPHA) / (att + PRIOR_WEIGHT)
        return min((accepted + PRIOR_WEIGHT * prior) / (attempted + PRIOR_WEIGHT), 0.999)

    # -- deciding ------------------------------------------------------------------------------------
    def trim(self, seqs: Sequence[ScheduledSeq]) -> int:
        """Lower num_draft_slots where drafting does not pay; returns how many requests were cut."""
        fit = self.cost.fit()
        if fit is None:
            return 0
        t0, t1 = fit
        adaptive = [s for s in seqs if s.num_draft_slots > 0 and _adaptive(s)]
        if not adaptive:
            return 0
        chosen = {id(s) for s in adaptive}
        n_tokens = sum(s.num_new_tokens + (0 if id(s) in chosen else s.num_draft_slots) for s in seqs)
        gained = float(sum(1 for s in seqs if s.samples))          # tokens per step without drafts
        seconds = t0 + t1 * n_tokens
        alphas = [self.alpha(s.request.spec_params.method, s.request.spec_stats.num_accepted_tokens,
                             s.request.spec_stats.num_attempted_positions) for s in adaptive]
        keep = [0] * len(adaptive)
        # Heap entries (-gain / cost, tiebreak, method or None, depth, members). A method whose drafting is a
        # forward per depth (d_m > 0) opens a depth for a group: one d_m however many of its requests draft
        # there. Per-request entries (d_m = 0: ngram, prediction) cost t1 per position.
        def cost_of(m: str | None, n: int) -> float:        # n positions verified, plus m's draft forward
            return n * t1 + (self.draft_step_s[m] if m is not None else 0.0)
        heap: list = []
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(adaptive):
            m = s.request.spec_params.method
            if self.draft_step_s.get(m, 0.0) > 0.0:
                groups.setdefault(m, []).append(i)
            else:
                heapq.heappush(heap, (-alphas[i] / t1, len(heap), None, 1, [i]))
        for m, members in groups.items():
            gain = sum(alphas[i] for i in members)
            heapq.heappush(heap, (-gain / cost_of(m, len(members)), len(heap), m, 1, members))
        serial = len(heap)
        while heap:
            _, _, m, depth, members = heapq.heappop(heap)
            # only members whose own verification pays at the rate reached so far (gained / seconds)
            members = [i for i in members if alphas[i] ** depth * seconds > t1 * gained]
            gain = sum(alphas[i] ** depth for i in members)
            cost = cost_of(m, len(members))
            if not members or gain * seconds <= cost * gained:      # gain / cost <= tokens per second so far
                continue
            for i in members:
                keep[i] = depth
            gained += gain
            seconds += cost
            deeper = [i for i in members if depth < adaptive[i].num_draft_slots]
            if deeper:
                nxt = sum(alphas[i] ** (depth + 1) for i in deeper)
                serial += 1
                heapq.heappush(heap, (-nxt / cost_of(m, len(deeper)), serial, m, depth + 1, deeper))
        cut = 0
        for s, k in zip(adaptive, keep):
            if k < s.num_draft_slots:
                s.num_draft_slots = k
                s.request.spec_stats.cut("load")
                cut += 1
        return cut


def calibrated_policy(runner, max_num_seqs: int) -> GoodputPolicy:
    """A GoodputPolicy whose step-cost fit starts from forwards timed now (call before any request:
    ModelRunner.time_verify_step borrows the first KV blocks). Shapes the cache or max_num_seqs
    cannot hold are skipped; with fewer than two sizes left the policy learns online only."""
    policy = GoodputPolicy()
    samples = []
    for num_seqs, query_len in CALIBRATION_SHAPES:
        if num_seqs > max_num_seqs:
            continue
        try:
            samples.append((num_seqs * query_len, runner.time_verify_step(num_seqs, query_len, CALIBRATION_CONTEXT)))
        except ValueError:      # a cache too small for this shape
            continue
    policy.calibrate(samples)
    fit = policy.cost.fit()
    if fit is None:
        log.warning("goodput policy: start-up calibration gave no usable step-cost fit (%d samples); "
                    "it will learn online", len(samples))
    else:
        log.info("goodput policy calibrated on %d step sizes: step = %.2f ms + %.3f ms per verified token",
                 len(samples), fit[0] * 1e3, fit[1] * 1e3)
    return policy


def _adaptive(seq: ScheduledSeq) -> bool:
    req = seq.request
    if not req.spec_params.adaptive:
        return False
    # No exemption for seeded sampled requests: their text does not depend on k (sampling/coupled.py).
    return True
