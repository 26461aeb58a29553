"""How a greedy draft tree scores its nodes: the drafter's log-probabilities at a calibrated temperature.

EAGLE-2 ranks a greedy tree's nodes by their cumulative draft log-probability, which is the chance that the
node's path is accepted only if the drafter's probabilities are calibrated: its first choice, given
probability p, right about p of the time. The embedded EAGLE-3 head is far less confident than it is
right (mean first-choice probability 0.25 on code_completion, while its first choice is accepted at 0.72
of the positions reached: `python -m loadtest.tree_bound`), so the cumulative score makes each level of
depth look ~3x less likely than it is and the best 8 nodes came out shallow: at T = 0 the trees verified
0.93x the chain's tokens per step on code_completion.

ScoreCalibration scores children by log softmax(logits / T) instead, with T per drafter chosen so that the
mean first-choice probability over its recent greedy draft rows equals the acceptance per position the
server measured for the drafter in the greedy band (the engine hands it over: set_target). T = 1 is
EAGLE-2's score, kept until there is a target and SAMPLE_ROWS rows; T is found by bisection on the rows
kept (their MAX_LOGITS largest logits: the tail beyond them holds a negligible share once T < 1).

Which nodes a greedy tree keeps never changes its text (the verifier follows the target's argmax), and
sampled requests' children are scored by their Gumbel draws, not by this (speculators/tree_children.py).

Worked example: a row with logits [2, 1, 0, 0] has first-choice probability 0.61 at T = 1; to match an
acceptance of 0.8, T falls to ~0.59 (first choice 0.80, second 0.15): a node one level deeper on the
first choice then scores log 0.8 = -0.22 instead of log 0.61 = -0.49.
"""
from __future__ import annotations

import torch

MAX_LOGITS = 64          # logits kept per row (the largest)
SAMPLE_ROWS = 32         # rows needed before T moves from 1
KEEP_ROWS = 512          # the most recent rows kept
T_RANGE = (0.05, 4.0)    # T is clamped to this


class ScoreCalibration:
    def __init__(self) -> None:
        self.temperature = 1.0
        self.target: float | None = None
        self._rows: torch.Tensor | None = None    # [KEEP_ROWS, m] ring of the recent rows' largest logits
        self._count = 0                           # rows written in all
        self._fitted_count = -1                   # _count when T was last fitted (-1: never)

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[r, vocab] drafter logits -> [r, vocab] the children's scores (log-probabilities at T); the rows
        join the sample T is fitted on (at once, the first time there are enough for a pending target)."""
        self._keep(logits.detach().float().topk(min(MAX_LOGITS, logits.shape[-1]), dim=-1).values)
        if self.target is not None and self._fitted_count < 0 and self._count >= SAMPLE_ROWS:
            self._fit()
        if self.temperature == 1.0:
            return logits.log_softmax(dim=-1)
        return (logits / self.temperature).log_softmax(dim=-1)

    def set_target(self, acceptance: float) -> None:
        """The drafter's greedy acceptance per position (0..1): refit T on the rows kept, if any came since
        the last fit or the target moved."""
        target = min(max(acceptance, 0.01), 0.99)
        moved = self.target is None or abs(target - self.target) > 1e-3
        self.target = target
        if self._count >= SAMPLE_ROWS and (moved or self._count > self._fitted_count):
            self._fit()

    def _keep(self, top: torch.Tensor) -> None:
        if self._rows is None:
            self._rows = top.new_empty(KEEP_ROWS, top.shape[1])
        top = top[-KEEP_ROWS:]
        slots = torch.arange(self._count, self._count + top.shape[0], device=top.device) % KEEP_ROWS
        self._rows[slots] = top
        self._count += top.shape[0]

    def _fit(self) -> None:
        self.temperature = fit_temperature(self._rows[:min(self._count, KEEP_ROWS)], self.target)
        self._fitted_count = self._count


def first_choice(rows: torch.Tensor, temperature: float) -> float:
    """Mean first-choice probability of [n, m] logits rows at `temperature`."""
    return float((rows / temperature).softmax(dim=-1).max(dim=-1).values.mean())


def fit_temperature(rows: torch.Tensor, target: float, steps: int = 30) -> float:
    """The T in T_RANGE whose mean first-choice probability over `rows` is `target` (it falls as T rises)."""
    lo, hi = T_RANGE
    if first_choice(rows, lo) <= target:
        return lo
    if first_choice(rows, hi) >= target:
        return hi
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        if first_choice(rows, mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5
