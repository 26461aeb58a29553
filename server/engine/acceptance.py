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
          values predict for the positions they drafted (one hard request lowers every drafter alike), at
          the request's context bucket (below)
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

Context length: a drafter trained on shorter sequences than the target serves falls apart on long requests
while the heads, which read the target's own states, hold up. So p_m is the probe value at the request's
context bucket (context_bucket: one per doubling from CONTEXT_BASE tokens; the probe measures one long text,
set_probe_context), each traffic position is predicted at the probe value of the context it was drafted at
(the third count of `traffic` and `long`, kept per bucket), and L is the level of the request's bucket: the
server's long requests may be harder text than its short ones, and with the drafters chosen by context a
single level would charge the long requests' text to the drafter that drafts them (in a paired run, the
draft model then took 165 of the next code requests' steps at T = 0.8 where it had taken 44).
"""
from __future__ import annotations

import logging
import statistics
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
CONTEXT_BASE = 256        # context buckets (context_bucket): [0, 256), [256, 512), [512, 1024), ... tokens
# A request's own positions against its prior, for a model drafter the probe rated, when sampling. At T = 0.8 a
# drafter's acceptance differs little between requests of a kind: EAGLE-3 over 8 prompts x 2 rounds (~150
# positions each) spread 0.56-0.75 on code and 0.57-0.66 on prose, SD 0.06 and 0.03, of which sampling alone
# explains ~0.04 (loadtest/depth_acceptance.py --by-prompt), so a request's first dozen positions say little of
# its own level. Shrunk by PRIOR_WEIGHT, an agentic turn whose EAGLE-3 accepted 2 of its first 13 drafts was
# priced at 0.26, below plain decoding, and plain-decoded or took lookups for 80 of its 90 steps, slower than
# EAGLE-3 alone on the same text (1.93 s against 1.76).
SAMPLED_DRAFTER_WEIGHT = 32.0
CONTEXT_WEIGHT = 16.0     # positions the probe's shift of every drafter at a longer context counts for in a
#                           drafter's probe value there (AcceptanceHistory.set_probe_context)


def context_bucket(num_tokens: int) -> int:
    """The context-length bucket of a request of `num_tokens` tokens: 0 below CONTEXT_BASE, then one per
    doubling (1: 256-511 tokens, 2: 512-1023, ...)."""
    return max(int(num_tokens) // CONTEXT_BASE, 0).bit_length()


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
        # (method, band, context bucket >= 1) -> its probe acceptance at that context (set_probe_context)
        self.probed_context: dict[tuple[str, str, int], float] = {}
        # (method, band, context bucket) -> [accepted, attempted, probe-predicted] positions since the probe:
        # slow's memory (traffic, the levels) and RATIO_DECAY's (long, a drafter's ratio)
        self.traffic: dict[tuple[str, str, int], list[float]] = {}
        self.long: dict[tuple[str, str, int], list[float]] = {}
        self._long_buckets: dict[tuple[str, str], list[int]] = {}    # (method, band) -> its buckets in `long`
        self._rated: dict[tuple[str, str, int], float | None] = {}   # rating()'s answers until the next count
        self._raw: dict[str, dict[int, float]] = {}      # band -> bucket -> long's unshrunk level (_raw_levels)
        self._levels: dict[tuple[str, int], float] = {}   # level()'s answers until the next count
        # (lookup, band) -> [reached, accepted] per depth of the drafts `auto` offered (observe_offer)
        self.depths: dict[tuple[str, str], list[list[float]]] = {}
        self._depth_rated: dict[tuple[str, str, int], list[float]] = {}   # depth_alphas' until the next count
        self.sampled_drafter_weight = SAMPLED_DRAFTER_WEIGHT     # alpha()'s prior weight for those requests

    def observe(self, method: str, num_draft: int, num_accepted: int, band: str = "greedy",
                watch: bool = True, context: int = 0) -> None:
        """context: the request's length in tokens (its context bucket's probe value predicts the step).
        watch: whether a fall of this method's acceptance is a collapse (not for context lookups, whose
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
        self._counted(method, band)
        bucket = context_bucket(context)
        predicted = attempted * (self.probe_at(method, band, bucket) or 0.0)
        if (method, band, bucket) not in self.long:
            self._long_buckets.setdefault(key, []).append(bucket)
        for counts, decay in ((self.traffic, METHOD_DECAY), (self.long, RATIO_DECAY)):
            seen = counts.setdefault((method, band, bucket), [0.0, 0.0, 0.0])
            seen[0] = seen[0] * decay + num_accepted
            seen[1] = seen[1] * decay + attempted
            seen[2] = seen[2] * decay + predicted
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
        for counts in (self.traffic, self.long):
            for key in [key for key in counts if key[:2] == (method, band)]:
                del counts[key]
        self._long_buckets.pop((method, band), None)
        self._forget()
        self._depth_rated.clear()

    def set_probe_context(self, band: str, bucket: int, counts: dict[str, tuple[float, float]]) -> None:
        """The probe's (accepted, attempted) positions of each probed drafter at context bucket `bucket` (>= 1)
        of `band`, all on one text. The text is harder or easier for every drafter alike (the shift: the
        median of their ratios to their short-context probe values), and one drafter may fall apart there (a
        draft model trained on shorter sequences than the target serves: the embedded one, trained on
        256-token sequences, accepted 0.32-0.38 a position at T = 0.8 on 367-563-token agentic turns where
        EAGLE-3 accepted 0.50, and 0.56-0.59 on turns under 256 tokens, EAGLE-3 0.59-0.66). Each
        drafter's value there is its short-context value times the shift, lowered to its own acceptance
        (shrunk by CONTEXT_WEIGHT positions towards that) where that is lower: one text's few dozen positions
        may demote a drafter that falls apart, never reorder the rest (at 32 tokens it measured EAGLE-1 above
        EAGLE-3, 0.61 against 0.63 where their short texts say 0.52 against 0.64)."""
        probed = {m: (a, n) for m, (a, n) in counts.items() if n > 0 and (m, band) in self.probed}
        if not probed:
            return
        shift = statistics.median((a + PRIOR_WEIGHT * PRIOR_ALPHA) / (n + PRIOR_WEIGHT) / self.probed[(m, band)]
                                  for m, (a, n) in probed.items())       # each shrunk as set_probe does
        for m, (a, n) in probed.items():
            prior = self.probed[(m, band)] * shift
            self.probed_context[(m, band, bucket)] = min((a + CONTEXT_WEIGHT * prior) / (n + CONTEXT_WEIGHT), prior)
        self._forget()

    def probe_at(self, method: str, band: str, bucket: int) -> float | None:
        """`method`'s probe value in `band` at context bucket `bucket`: the longest probed bucket up to it (a
        context longer than the probe reached is rated as its longest), else the short-context probe."""
        for b in range(bucket, 0, -1):
            p = self.probed_context.get((method, band, b))
            if p is not None:
                return p
        return self.probed.get((method, band))

    def level(self, band: str, bucket: int = 0) -> float:
        """The traffic level of the band's requests at context bucket `bucket`: accepted positions of the
        probed drafters on recent traffic there over what their probe values predict for the positions they
        attempted, shrunk towards 1 by LEVEL_WEIGHT (1 with no traffic there yet). Per bucket: the server's
        long requests may be harder text than its short ones (agentic turns against completions), and
        which drafter drafts them depends on the context, so one level would charge a long request's harder
        text to the drafter that drafts long requests. Kept until the next count: every drafter's rating
        reads it."""
        if (band, bucket) not in self._levels:
            accepted = expected = 0.0
            for (m, b, c), row in self.traffic.items():
                if b == band and c == bucket and (m, b) in self.probed:
                    accepted += row[0]
                    expected += row[2]
            self._levels[(band, bucket)] = _shrunk_level(accepted, expected)
        return self._levels[(band, bucket)]

    def traffic_positions(self, method: str, band: str) -> float:
        """The positions `method` drafted in `band` since the probe, over the ratio's memory (all contexts)."""
        return sum(row[1] for (m, b, _), row in self.long.items() if (m, b) == (method, band))

    def request_level(self, by_method: dict[str, list], band: str, context: int = 0) -> float:
        """level() for one request (`by_method`: its SpecStats rows): what it accepted from the probed
        drafters it drafted with over what their ratings predict for those positions, shrunk towards 1 by
        LEVEL_WEIGHT (when sampling, by as many as alpha() shrinks its drafter's own: a request whose drafter
        is estimated at x its rating is expected at x the others' too). A probed drafter the request has not
        drafted with is expected at its rating times
        this (GoodputPolicy.request_alpha): at T = 0.8 on an agentic turn where every drafter lost to plain
        decoding, a request that left the draft model (3 of 23 accepted) met EAGLE-3 and MTP at their
        server ratings, switched to each in turn and accepted 25 of 88."""
        accepted = expected = attempted = 0.0
        for method, row in by_method.items():
            rating = self.rating(method, band, context) if row[3] else None
            if rating is not None:
                accepted += row[2]
                expected += row[3] * rating
                attempted += row[3]
        if band == "sampled" and attempted:    # as alpha() shrinks its drafter's own: SAMPLED_DRAFTER_WEIGHT
            return _shrunk_level(accepted, expected, self.sampled_drafter_weight * expected / attempted)
        return _shrunk_level(accepted, expected)

    def rating(self, method: str, band: str, context: int = 0) -> float | None:
        """A probed drafter's acceptance per position in `band` at a context of `context` tokens (see the
        module's description: p_m is its probe value at that context's bucket); None for a method the probe
        did not measure. Its ratio is taken to the level as measured, not as shrunk: with
        one drafter drafting all of a band's traffic the ratio is exactly 1, and the drafters keep the
        probe's order (a shrunk level would lend every drafter without traffic a few per cent, as much as
        the probe's gap between EAGLE-3 and MTP). Kept until the next count: `auto` reads it for every
        request and candidate of a step."""
        key = (method, band, context_bucket(context))
        if key not in self._rated:
            self._rated[key] = self._rating(*key)
        return self._rated[key]

    def _rating(self, method: str, band: str, bucket: int) -> float | None:
        p = self.probe_at(method, band, bucket)
        if p is None:
            return None
        raw = self._raw_levels(band)
        acc = predicted = 0.0
        for c in self._long_buckets.get((method, band), ()):   # each bucket's positions at its level there, unshrunk
            row = self.long[(method, band, c)]
            acc += row[0]
            predicted += row[2] * raw[c]
        ratio = (acc + RATIO_WEIGHT) / (predicted + RATIO_WEIGHT)
        return min(max(p * self.level(band, bucket) * ratio, 0.01), 0.999)

    def _raw_levels(self, band: str) -> dict[int, float]:
        """Per context bucket, the band's level over the ratio's memory, unshrunk (1 where nothing was
        predicted): what a drafter's own ratio is taken to. Kept until the next count."""
        if band not in self._raw:
            sums: dict[int, list[float]] = {}
            for (m, b, c), row in self.long.items():
                if b == band:
                    total = sums.setdefault(c, [0.0, 0.0])
                    if (m, b) in self.probed:
                        total[0] += row[0]
                        total[1] += row[2]
            self._raw[band] = {c: a / e if e > 0 else 1.0 for c, (a, e) in sums.items()}
        return self._raw[band]

    def _forget(self) -> None:
        """Drop the ratings kept until the next count."""
        self._rated.clear()
        self._raw.clear()
        self._levels.clear()

    def _counted(self, method: str, band: str) -> None:
        """Drop what a count of (method, band) changes: every rating where the method is probed (the levels
        sum the probed drafters' traffic), else none (an unprobed method is rated by no one: a lookup's
        counts move only its own acceptance), and the method's own depth_alphas in `band` (those of a probed
        drafter follow its rating, so all of them where it is probed). At batch 1 most steps count a lookup
        alone, and each recomputed every drafter's rating for the next choice."""
        if (method, band) in self.probed:
            self._forget()
            self._depth_rated.clear()
        else:
            for key in [key for key in self._depth_rated if key[:2] == (method, band)]:
                del self._depth_rated[key]

    def observe_offer(self, method: str, num_draft: int, num_accepted: int, band: str = "greedy") -> None:
        """A context lookup's draft that `auto` offered, chosen or not, scored against the tokens the request
        went on to emit (AutoSpeculator.score_offers): counted per depth, decayed by METHOD_DECAY. The
        offers, not the verified drafts: a lookup is verified only where it was chosen, and trimmed there,
        so its deep depths are seldom verified (on prose at T = 0, 8 `auto` requests: n-gram verified at
        depth 4 7 times, offered there 24 times; each depth's acceptance about the same in both)."""
        if num_draft > 0:
            count_depths(self.depths.setdefault((method, band), [[], []]), num_draft, num_accepted, METHOD_DECAY)
            self._counted(method, band)

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

    def alpha(self, method: str, accepted: float, attempted: float, band: str = "greedy",
              context: int = 0) -> float:
        """A request's acceptance estimate: its own counts, shrunk towards its method's history in its band,
        which is itself shrunk towards PRIOR_ALPHA (for a probed drafter, its rating instead). Never 0 after
        a few rejections: a cut request brings no new evidence, so an estimate of 0 would cut its method for
        good (one rejected first draft once stopped ngram at batch 1 for every later step: 0.96x plain
        against 2.09x with k fixed)."""
        prior = self.rating(method, band, context)
        weight = PRIOR_WEIGHT
        if prior is None:
            acc, att = self.slow.get((method, band), (0.0, 0.0))
            prior = (acc + PRIOR_WEIGHT * PRIOR_ALPHA) / (att + PRIOR_WEIGHT)
        elif band == "sampled":          # a probed drafter: see SAMPLED_DRAFTER_WEIGHT
            weight = self.sampled_drafter_weight
        return min((accepted + weight * prior) / (attempted + weight), 0.999)


def _shrunk_level(accepted: float, expected: float, weight: float = LEVEL_WEIGHT) -> float:
    """Accepted over expected positions, shrunk towards 1 by `weight` expected positions."""
    return (accepted + weight) / (expected + weight)
