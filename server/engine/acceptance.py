"""What the server has seen each speculation method accept, and when a method's acceptance collapses.

Acceptance is kept per (method, band): greedy requests and sampled ones accept very differently (at
T = 0.8 a lookup's drafts are accepted a third as often as at T = 0), so a server that moves from greedy
to sampled traffic must not read the change as a broken drafter, and a greedy request's prior must not
come from sampled ones. Counts are positions: accepted drafts over attempted positions (the accepted
ones plus the first rejected one), the acceptance at a position given the earlier ones were accepted.

Collapse: a (method, band) whose recent acceptance (FAST_DECAY, about the last 30 verifications) falls
below COLLAPSE_RATIO x its longer history (METHOD_DECAY) is reported once per COLLAPSE_WINDOW_S (a
warning and spec_decode_acceptance_collapse_total{method}) and not chosen by `auto` for that window; it
needs COLLAPSE_MIN_ATTEMPTED positions of evidence in both. Watched: the model drafters, whose acceptance
falls when they stop matching the target; a context lookup's follows the text it is given.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from specserve.speculators.base import attempted_positions

log = logging.getLogger(__name__)

PRIOR_ALPHA = 0.5         # acceptance assumed for a method never seen
PRIOR_WEIGHT = 4.0        # attempted positions the prior counts for in a request's estimate
METHOD_DECAY = 0.995      # per observed step, for the per-method acceptance history
FAST_DECAY = 0.97
COLLAPSE_RATIO = 0.3
COLLAPSE_MIN_BASELINE = 0.2
COLLAPSE_MIN_ATTEMPTED = 20.0
COLLAPSE_WINDOW_S = 60.0
BANDS = ("greedy", "sampled")


def band_of(request) -> str:
    """The acceptance band of a request: greedy (temperature 0) or sampled."""
    temperature = getattr(request.sampling_params, "temperature", 0.0) or 0.0
    return "greedy" if temperature <= 0.0 else "sampled"


class AcceptanceHistory:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.slow: dict[tuple[str, str], list[float]] = {}        # (method, band) -> [accepted, attempted]
        self.fast: dict[tuple[str, str], list[float]] = {}        # the same, FAST_DECAY
        self.collapsed_until: dict[tuple[str, str], float] = {}   # (method, band) -> end of its window
        self.collapses: dict[str, int] = {}                       # method -> reports not yet drained

    def observe(self, method: str, num_draft: int, num_accepted: int, band: str = "greedy",
                watch: bool = True) -> None:
        """watch: whether a fall of this method's acceptance is a collapse (not for context lookups, whose
        acceptance follows the text: a move from repeated to fresh prompts took n-gram from 0.57 to 0.17,
        was reported as a drafter that no longer matches the target, and kept `auto` off n-gram for a
        window)."""
        if num_draft <= 0:
            return
        key = (method, band)
        attempted = attempted_positions(num_draft, num_accepted)
        acc = self.slow.setdefault(key, [0.0, 0.0])
        baseline = acc[0] / acc[1] if acc[1] >= COLLAPSE_MIN_ATTEMPTED else None   # before this step
        acc[0] = acc[0] * METHOD_DECAY + num_accepted
        acc[1] = acc[1] * METHOD_DECAY + attempted
        fast = self.fast.setdefault(key, [0.0, 0.0])
        fast[0] = fast[0] * FAST_DECAY + num_accepted
        fast[1] = fast[1] * FAST_DECAY + attempted
        if (watch and baseline is not None and baseline >= COLLAPSE_MIN_BASELINE
                and fast[1] >= COLLAPSE_MIN_ATTEMPTED and fast[0] / fast[1] < COLLAPSE_RATIO * baseline):
            self._collapse(key, fast[0] / fast[1], baseline)

    def _collapse(self, key: tuple[str, str], recent: float, baseline: float) -> None:
        now = self.clock()
        if now < self.collapsed_until.get(key, -1.0):
            return                                              # reported in this window already
        self.collapsed_until[key] = now + COLLAPSE_WINDOW_S
        method, band = key
        self.collapses[method] = self.collapses.get(method, 0) + 1
        log.warning("speculation method %s (%s requests): acceptance collapsed to %.2f (recent) from %.2f; "
                    "auto will not choose it for %.0f s (a drafter that no longer matches the target?)",
                    method, band, recent, baseline, COLLAPSE_WINDOW_S)

    def is_collapsed(self, method: str, band: str | None = None) -> bool:
        """Whether auto should skip `method` for requests of `band` now (None: for any band)."""
        now = self.clock()
        bands = BANDS if band is None else (band,)
        return any(now < self.collapsed_until.get((method, b), -1.0) for b in bands)

    def cap(self, method: str, band: str, positions: float) -> None:
        """Scale (method, band)'s counts down to at most `positions` attempted positions, its acceptance
        kept: evidence that should rank the methods but weigh no more than a few steps (the start-up
        probe's, server/engine/spec_probe.py). The short-memory counts are cleared: the collapse signal
        compares real traffic with real traffic."""
        acc = self.slow.get((method, band))
        if acc is not None and acc[1] > positions:
            scale = positions / acc[1]
            acc[0], acc[1] = acc[0] * scale, positions
        self.fast.pop((method, band), None)

    def attempted(self, method: str, band: str = "greedy") -> float:
        """The (decayed) positions of evidence behind `method`'s history in `band`."""
        return self.slow.get((method, band), (0.0, 0.0))[1]

    def drain_collapses(self) -> dict[str, int]:
        out, self.collapses = self.collapses, {}
        return out

    def alpha(self, method: str, accepted: float, attempted: float, band: str = "greedy") -> float:
        """A request's acceptance estimate: its own counts, shrunk towards its method's history in its band,
        which is itself shrunk towards PRIOR_ALPHA. Never 0 after a few rejections: a cut request brings no
        new evidence, so an estimate of 0 would cut its method for good (one rejected first draft once
        stopped ngram at batch 1 for every later step: 0.96x plain against 2.09x with k fixed)."""
        acc, att = self.slow.get((method, band), (0.0, 0.0))
        prior = (acc + PRIOR_WEIGHT * PRIOR_ALPHA) / (att + PRIOR_WEIGHT)
        return min((accepted + PRIOR_WEIGHT * prior) / (attempted + PRIOR_WEIGHT), 0.999)
