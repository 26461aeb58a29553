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

Rating the model drafters against each other (`rating`): what a drafter accepted on traffic depends on the
text it was given as much as on the drafter, and each request drafts with one of them, so their traffic
histories are not comparable: at T = 0.8 one hard first request took EAGLE-3's history from 0.61 to 0.48,
and later requests drafted with MTP, which is slower on the same text (0.90x against 1.06x of the best
single method, by which drafter the band settled on). The start-up probe (spec_probe.py) is the one paired
comparison, every drafter on the same texts. So a probed drafter m in a band is rated p_m * L * r_m:
    p_m   its probe acceptance
    L     the band's traffic level, what all probed drafters accepted on traffic over what their probe
          values predict for the positions they drafted (one hard request lowers every drafter alike)
    r_m   m's own traffic over what p_m * L predicts for it, shrunk towards 1 by RATIO_WEIGHT positions:
          a drafter that does worse than its probe says, relative to the others, on the server's text
A drafter with much traffic is rated at its own traffic acceptance; one with none at its probe scaled by
the level. The level follows the text as it changes (METHOD_DECAY); r_m is a property of the drafter and
the server's kind of text, and each request's text moves it as much as the drafters differ (EAGLE-3 at
T = 0.8 on agentic turns accepted 0.22 to 0.68 a position per request), so it is counted over a longer
memory (RATIO_DECAY, ~1000 verifications) and needs several requests' positions (RATIO_WEIGHT, ~4 requests
at batch 1) to move far. With 40 positions over the short memory, the draft model's repeated-code requests
at T = 0.8 raised its rating level with EAGLE-3's, one hard agentic request lowered EAGLE-3's below MTP's,
and the band's next agentic requests took MTP, EAGLE-1 and the draft model (in a paired run, `auto` 0.92x
EAGLE-3 alone on those requests, none of them drafting with EAGLE-3; 0.95x with these weights).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from specserve.speculators.base import attempted_positions, count_depths

log = logging.getLogger(__name__)

PRIOR_ALPHA = 0.5         # acceptance assumed for a method never seen
PRIOR_WEIGHT = 4.0        # attempted positions the prior counts for in a request's estimate
METHOD_DECAY = 0.995      # per observed step, for the per-method acceptance history
RATIO_DECAY = 0.999       # the same, for the counts a probed drafter's traffic ratio is measured over (rating)
FAST_DECAY = 0.97
COLLAPSE_RATIO = 0.3
COLLAPSE_MIN_BASELINE = 0.2
COLLAPSE_MIN_ATTEMPTED = 20.0
COLLAPSE_WINDOW_S = 60.0
BANDS = ("greedy", "sampled")
LEVEL_WEIGHT = 8.0        # expected accepted positions the traffic level (1: as probed) counts for
RATIO_WEIGHT = 200.0      # the same, for a drafter's own ratio to the level (1: as probed): see _rating()


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
        self.probed: dict[tuple[str, str], float] = {}           # (method, band) -> probe acceptance
        self.traffic: dict[tuple[str, str], list[float]] = {}    # slow's counts since the probe
        self.long: dict[tuple[str, str], list[float]] = {}       # the same, RATIO_DECAY (a drafter's ratio)
        self._rated: dict[tuple[str, str], float | None] = {}   # rating()'s answers until the next count
        # (lookup, band) -> [reached, accepted] per depth of the drafts `auto` offered (observe_offer)
        self.depths: dict[tuple[str, str], list[list[float]]] = {}
        self._depth_rated: dict[tuple[str, str, int], list[float]] = {}   # depth_alphas' until the next count

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
        self._rated.clear()
        self._depth_rated.clear()
        seen = self.traffic.setdefault(key, [0.0, 0.0])
        seen[0] = seen[0] * METHOD_DECAY + num_accepted
        seen[1] = seen[1] * METHOD_DECAY + attempted
        long = self.long.setdefault(key, [0.0, 0.0])
        long[0] = long[0] * RATIO_DECAY + num_accepted
        long[1] = long[1] * RATIO_DECAY + attempted
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
        if not self.collapsed_until:        # the common case, asked for every request and candidate
            return False
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
        self._depth_rated.clear()

    def set_probe(self, method: str, band: str, accepted: float, attempted: float) -> None:
        """(method, band)'s start-up probe counts; its traffic counts start from here. Kept shrunk towards
        PRIOR_ALPHA by PRIOR_WEIGHT positions: a drafter that accepted nothing in the probe is rated low,
        not 0, so that what an explorer accepts with it can still raise it."""
        self.probed[(method, band)] = (accepted + PRIOR_WEIGHT * PRIOR_ALPHA) / (attempted + PRIOR_WEIGHT)
        self.traffic.pop((method, band), None)
        self.long.pop((method, band), None)
        self._rated.clear()
        self._depth_rated.clear()

    def level(self, band: str) -> float:
        """The band's traffic level: accepted positions of the probed drafters on recent traffic over what
        their probe values predict for the positions they attempted, shrunk towards 1 by LEVEL_WEIGHT (1 with
        no traffic yet)."""
        return _shrunk_level(*self._predicted(band, self.traffic))

    def _predicted(self, band: str, counts: dict[tuple[str, str], list[float]]) -> tuple[float, float]:
        """(accepted, probe-predicted) positions of the band's probed drafters in `counts` (traffic or long)."""
        accepted = expected = 0.0
        for (m, b), p in self.probed.items():
            if b == band and (m, b) in counts:
                acc, att = counts[(m, b)]
                accepted += acc
                expected += att * p
        return accepted, expected

    def request_level(self, by_method: dict[str, list], band: str) -> float:
        """level() for one request (`by_method`: its SpecStats rows): what it accepted from the probed
        drafters it drafted with over what their ratings predict for those positions, shrunk towards 1 by
        LEVEL_WEIGHT. A probed drafter the request has not drafted with is expected at its rating times
        this (GoodputPolicy.request_alpha): at T = 0.8 on an agentic turn where every drafter lost to plain
        decoding, a request that left the draft model (3 of 23 accepted) met EAGLE-3 and MTP at their
        server ratings, switched to each in turn and accepted 25 of 88."""
        accepted = expected = 0.0
        for method, row in by_method.items():
            rating = self.rating(method, band) if row[3] else None
            if rating is not None:
                accepted += row[2]
                expected += row[3] * rating
        return _shrunk_level(accepted, expected)

    def rating(self, method: str, band: str) -> float | None:
        """A probed drafter's acceptance per position in `band` (see the module's description); None for a
        method the probe did not measure. Its ratio is taken to the level as measured, not as shrunk: with
        one drafter drafting all of a band's traffic the ratio is exactly 1, and the drafters keep the
        probe's order (a shrunk level would lend every drafter without traffic a few per cent, as much as
        the probe's gap between EAGLE-3 and MTP). Kept until the next count: `auto` reads it for every
        request and candidate of a step."""
        key = (method, band)
        if key not in self._rated:
            self._rated[key] = self._rating(method, band)
        return self._rated[key]

    def _rating(self, method: str, band: str) -> float | None:
        p = self.probed.get((method, band))
        if p is None:
            return None
        accepted, expected = self._predicted(band, self.long)
        raw = accepted / expected if expected > 0 else 1.0          # the level the ratio is taken to, unshrunk
        acc, att = self.long.get((method, band), (0.0, 0.0))
        ratio = (acc + RATIO_WEIGHT) / (att * p * raw + RATIO_WEIGHT)
        return min(max(p * self.level(band) * ratio, 0.01), 0.999)

    def observe_offer(self, method: str, num_draft: int, num_accepted: int, band: str = "greedy") -> None:
        """A context lookup's draft that `auto` offered, chosen or not, scored against the tokens the request
        went on to emit (AutoSpeculator.score_offers): counted per depth, decayed by METHOD_DECAY. The
        offers, not the verified drafts: a lookup is verified only where it was chosen, and trimmed there,
        so its deep depths are seldom verified (on prose at T = 0, 8 `auto` requests: n-gram verified at
        depth 4 7 times, offered there 24 times; each depth's acceptance about the same in both)."""
        if num_draft > 0:
            count_depths(self.depths.setdefault((method, band), [[], []]), num_draft, num_accepted, METHOD_DECAY)
            self._depth_rated.clear()

    def depth_alphas(self, method: str, band: str, depth: int) -> list[float]:
        """`method`'s acceptance at depths 1..depth given the earlier ones were accepted, over the drafts
        `auto` offered (observe_offer), each shrunk by PRIOR_WEIGHT positions towards the method's
        acceptance over all depths (alpha(method, 0, 0)), which is all a depth not reached yet gets. Kept
        until the next count (of an offer or a verification): `auto` and the trim read it for every request
        of a step. Callers do not modify the list."""
        key = (method, band, depth)
        if key not in self._depth_rated:
            prior = self.alpha(method, 0, 0, band)
            reached, accepted = self.depths.get((method, band), ((), ()))
            self._depth_rated[key] = [(accepted[d] + PRIOR_WEIGHT * prior) / (reached[d] + PRIOR_WEIGHT)
                                      if d < len(reached) else prior for d in range(depth)]
        return self._depth_rated[key]

    def attempted(self, method: str, band: str = "greedy") -> float:
        """The (decayed) positions of evidence behind `method`'s history in `band`."""
        return self.slow.get((method, band), (0.0, 0.0))[1]

    def drain_collapses(self) -> dict[str, int]:
        out, self.collapses = self.collapses, {}
        return out

    def alpha(self, method: str, accepted: float, attempted: float, band: str = "greedy") -> float:
        """A request's acceptance estimate: its own counts, shrunk towards its method's history in its band,
        which is itself shrunk towards PRIOR_ALPHA (for a probed drafter, its rating instead). Never 0 after
        a few rejections: a cut request brings no new evidence, so an estimate of 0 would cut its method for
        good (one rejected first draft once stopped ngram at batch 1 for every later step: 0.96x plain
        against 2.09x with k fixed)."""
        prior = self.rating(method, band)
        if prior is None:
            acc, att = self.slow.get((method, band), (0.0, 0.0))
            prior = (acc + PRIOR_WEIGHT * PRIOR_ALPHA) / (att + PRIOR_WEIGHT)
        return min((accepted + PRIOR_WEIGHT * prior) / (attempted + PRIOR_WEIGHT), 0.999)


def _shrunk_level(accepted: float, expected: float) -> float:
    """Accepted over expected positions, shrunk towards 1 by LEVEL_WEIGHT."""
    return (accepted + LEVEL_WEIGHT) / (expected + LEVEL_WEIGHT)
