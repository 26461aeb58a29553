"""The step-cost line of the goodput policy: seconds of a decode/verify forward against its query tokens.

    T(N) = t0 + t1 * N          N = query tokens in the forward (decode rows + verified drafts)

fitted by least squares over exponentially forgotten steps, plus a fixed prior of forwards timed at
start-up (a lone request at a constant k only ever produces steps of one size, from which t0 and t1
cannot be told apart: MIN_SPREAD). The prior tilts the line, it does not set its level: once
MIN_FIT_STEPS steps were seen, the line passes through their mean. A start-up sample times the forward
alone, a served step also schedules, samples and builds outputs (~2 ms at batch 1 on a 2-core CPU, a fifth
of the step): with the prior in the level, a plain step read 9.7 ms against 12.4 ms measured and every
draft looked dearer beside it.
"""
from __future__ import annotations

from specserve.server.models.linear import BF16_ROW_BLOCK

FIT_DECAY = 0.98          # per step, for the step-time regression
MIN_FIT_STEPS = 16        # steps observed before the cost model is trusted
MIN_SPREAD = 1.0          # variance of N (tokens^2) the regression needs to tell t1 from t0
PRIOR_SAMPLE_WEIGHT = 2.0  # steps' worth of evidence each start-up calibration sample counts for
# Least t1 / t0 the fit may report. Step times jittered by other work on the machine can flatten the line
# to t1 ~ 0 ("one more token is free"), after which the policy never cuts. A quiet 2-core CPU measures
# t1 / t0 ~ 0.045 in fp32; a GPU at small batch is far flatter, so the floor only catches a collapse.
MIN_T1_RATIO = 1.0 / 64
# step cost assumed by `auto` before the fit is usable: a CPU decode step where one more verified row
# costs 5 %
NOMINAL_COST = (1.0, 0.05)


_STALE = object()


class StepCostModel:
    """Least-squares fit of step seconds against query tokens, exponentially forgetting old steps.

    fit() computes the line on its first read after a sample and keeps it until the next one: the goodput
    policy and `auto` read it for every request and candidate of every step."""

    def __init__(self, decay: float = FIT_DECAY, floor_n: int = 0, min_spread: float = MIN_SPREAD,
                 min_steps: int = MIN_FIT_STEPS) -> None:
        """floor_n: the least N the line prices (0 for a forward; a draft's depth starts at 1): its t0 may fall
        below 0 as long as the line is not negative there. min_spread: the variance of N the fit needs.
        min_steps: the samples it needs (prior included) before it fits."""
        self.decay = decay
        self.floor_n = floor_n
        self.min_spread = min_spread
        self.min_steps = min_steps
        self.w = self.sn = self.snn = self.st = self.snt = 0.0
        self.steps = 0
        self.prior = (0.0, 0.0, 0.0, 0.0, 0.0)   # (w, sn, snn, st, snt) of the calibration; never decays
        self._line: object = _STALE              # fit()'s last answer until observe / set_prior

    def set_prior(self, samples: list[tuple[int, float]], weight: float = PRIOR_SAMPLE_WEIGHT) -> None:
        """Fixed (num_tokens, seconds) samples, e.g. timed at start-up, each counting as `weight` steps."""
        self.prior = (weight * len(samples), weight * sum(n for n, _ in samples),
                      weight * sum(n * n for n, _ in samples), weight * sum(t for _, t in samples),
                      weight * sum(n * t for n, t in samples))
        self._line = _STALE

    def forget(self) -> None:
        """Drop the steps observed so far (the start-up prior stays): they were of a shape the traffic
        will not have (the acceptance probe's 16 sequences at once) and would set the line's level."""
        self.w = self.sn = self.snn = self.st = self.snt = 0.0
        self.steps = 0
        self._line = _STALE

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.sn = self.sn * d + num_tokens
        self.snn = self.snn * d + num_tokens * num_tokens
        self.st = self.st * d + seconds
        self.snt = self.snt * d + num_tokens * seconds
        self.steps += 1
        self._line = _STALE

    def fit(self) -> tuple[float, float] | None:
        """(t0, t1) seconds, or None while the data cannot separate them."""
        if self._line is _STALE:
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[float, float] | None:
        pw, psn, psnn, pst, psnt = self.prior
        if self.steps + pw < self.min_steps:
            return None
        w = self.w + pw
        mean_n, mean_t = (self.sn + psn) / w, (self.st + pst) / w
        # The slope from the spread within each group (start-up prior, steps seen) about its own mean: the
        # groups' levels differ by what a served step adds to its forward (~2 ms at batch 1), and one
        # regression over both read that offset as slope (served steps crowd the low sizes): 0.09-0.12 ms a
        # row where forwards of 1-9 rows measure ~0.2, so every lookup draft looked half its price.
        ss_p, sp_p = _centered(pw, psn, psnn, pst, psnt)
        ss_o, sp_o = _centered(self.w, self.sn, self.snn, self.st, self.snt)
        if (ss_p + ss_o) / w < self.min_spread:
            return None
        t1 = max((sp_p + sp_o) / (ss_p + ss_o), 1e-7)
        if self.steps >= self.min_steps:          # the level of what was really seen
            mean_n, mean_t = self.sn / self.w, self.st / self.w
        # A slope steeper than the mean allows: the line through 0 at floor_n and the mean (a clamped t0 under
        # the fitted slope priced every size above it: EAGLE-3's drafts read 1.32 ms a depth against a 0.93 ms
        # mean).
        span = mean_n - self.floor_n
        if span > 0 and t1 * span > mean_t:
            t1 = mean_t / span
        t0 = max(mean_t - t1 * mean_n, -t1 * self.floor_n)
        if t1 < MIN_T1_RATIO * t0:          # a collapsed slope: keep the mean, tilt the line to the floor
            t1 = MIN_T1_RATIO * mean_t / (1.0 + MIN_T1_RATIO * mean_n)
            t0 = mean_t - t1 * mean_n
        return t0, t1


def _centered(w: float, sn: float, snn: float, st: float, snt: float) -> tuple[float, float]:
    """(sum of squares of N, sum of N x T products) about the group's own means, from its running sums."""
    if w <= 0.0:
        return 0.0, 0.0
    mean_n = sn / w
    return max(snn - w * mean_n * mean_n, 0.0), snt - mean_n * st


# A bf16 forward on CPU runs the linears in blocks of rows (server/models/linear.py: oneDNN's ROW_BLOCK, or the
# AMX kernel's 16-row tiles, linear.row_block; the policy keeps the one its target uses): one row past a
# multiple of it runs one more block. Measured, bf16, the embedded target, one sequence: 31 rows 7.6 ms,
# 32 rows 8.0, 33 rows 10.2, 34 rows 10.2; 64 rows 13.8, 65 rows 14.9. In fp32 no step: 14.7 / 14.5 ms at 32 / 33.
ROW_BLOCK = BF16_ROW_BLOCK


def blocks(rows: int, block: int = ROW_BLOCK) -> int:
    return -(-rows // block)


def best_stop(base_rows: int, base_tokens: float, base_seconds: float, picks: list[tuple[int, float, float]],
              block_s: float, block: int = ROW_BLOCK) -> int:
    """How many of `picks` (rows, expected tokens, seconds of each, in the order taken) to keep when each
    block of `block` rows begun beyond the base's costs `block_s` more: the prefix with the most tokens per
    second. Example: base 30 rows, 16 tokens, 10 ms; picks (2, 1.6, 0.3 ms) then (4, 1.0, 0.6 ms), a block
    3 ms: both -> 18.6 / 13.9 ms = 1.34; the first -> 17.6 / 10.3 ms = 1.71; none -> 1.6: keep 1."""
    best, best_rate = 0, base_tokens / base_seconds
    rows, tokens, seconds = base_rows, base_tokens, base_seconds
    for n, (r, g, c) in enumerate(picks, 1):
        rows, tokens, seconds = rows + r, tokens + g, seconds + c
        rate = tokens / (seconds + block_s * (blocks(rows, block) - blocks(base_rows, block)))
        if rate > best_rate:
            best, best_rate = n, rate
    return best
