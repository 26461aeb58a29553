"""Goodput policy: how many of its k draft slots each request really uses this step.

A request's k is what it may draft, not what pays off. Verifying a draft token costs the same whether it
is accepted or not, and the price of a token in the verification forward grows with the batch: at batch 1
a CPU step is weight-streaming bound (one more row is nearly free), at batch 16 each row costs real
compute. The policy keeps a draft position only where it is expected to raise the batch's tokens per
second:

    step time        T(N) = t0 + t1 * N          (N = query tokens in the forward; fitted online)
    draft step       d_m  seconds per draft step of method m (model-based drafters, one forward per depth),
                          plus e_m once per propose (its inputs and bookkeeping; part of depth 1's price)
    lookup           c_m  seconds per request of a context lookup (suffix, ngram), paid once whatever its length
    follow-up        o_m  seconds of a head's observe of the rows its drafts were verified in: once per step
                          the method drafts in, whatever the depth (part of depth 1's price)
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

The line is not the whole cost where the target's linears run in blocks of rows (bf16 on CPU: row_block, 16
on the AMX tile kernel and 32 through oneDNN, linear.row_block):
a forward one row past a block's end costs a block more (block_s, timed at start-up). The greedy choice above
prices rows at t1; where it crosses a block boundary, the trim keeps the prefix of its choices (in the order
taken) with the most tokens per second once each block begun is paid (step_cost.best_stop).

A request cut to no drafts brings no evidence, so every PROBE_EVERY steps without drafts it drafts one
position: an estimate that fell low once (a batch of rejected first drafts) can recover.

Calibration (server/engine/step_cost.py): a lone request at a constant k only ever produces steps of one
size, from which t0 and t1 cannot be told apart (MIN_SPREAD). So the engine times a few verification
forwards of different sizes at start-up (ModelRunner.time_verify_step, CALIBRATION_SHAPES) and hands them
to `calibrate()`: they stay in the fit as a fixed prior worth PRIOR_SAMPLE_WEIGHT steps each, while the
decaying online observations move the line to what the server really sees.

On by default (`--speculation-policy fixed` drafts every k asked for); docs/benchmarks.md compares the two.
"""
from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Sequence

from specserve.server.engine.acceptance import PRIOR_WEIGHT, AcceptanceHistory, band_of
from specserve.server.engine.draft_costs import DraftCosts
from specserve.server.engine.method_choice import MethodChoice
from specserve.server.engine.scheduler import ScheduledSeq
from specserve.server.engine.step_cost import (
    MIN_FIT_STEPS,
    MIN_T1_RATIO,
    ROW_BLOCK,
    StepCostModel,
    best_stop,
    blocks,
)
from specserve.server.models.linear import row_block
from specserve.speculators.auto import LOOKUPS

__all__ = ["CALIBRATION_SHAPES", "MIN_FIT_STEPS", "MIN_T1_RATIO", "GoodputPolicy", "StepCostModel",
           "calibrated_policy"]

log = logging.getLogger(__name__)

# (sequences, query tokens per sequence) timed at start-up: decode and verify shapes at a few batch sizes
CALIBRATION_SHAPES = ((1, 1), (1, 3), (1, 5), (1, 7), (4, 1), (4, 5), (8, 1), (8, 5))
CALIBRATION_CONTEXT = 128  # tokens before the verified ones in each calibration sequence
# A request whose drafts were all cut (or for which `auto` chose none) PROBE_EVERY - 1 steps in a row drafts one
# position: a cut request brings no evidence, so without a probe an estimate that fell low once (a
# rejected first draft) would stay low for the rest of the request and, through the method's history,
# for every later one. Costs at most one verified row per PROBE_EVERY steps.
PROBE_EVERY = 8
# An `auto` request that drafted nothing last step (it chose none, or the trim cut it) rests: it plain-decodes
# without running the lookups or the choice, while those lookups cost more than REST_SHARE of its share of
# the step (a crowded step: at 16 requests the lookups and the choice were ~20 % of the step; alone they are
# ~4 %, and a lookup that matches again, e.g. a repeated answer, is worth 8 tokens a step). A resting request
# re-chooses every RECHOOSE_EVERY-th step without drafts and on its probe: its choice changes with the load
# or the context, and a request that does not draft gains no evidence of its own.
REST_SHARE = 0.10
RECHOOSE_EVERY = 4
_DRY_KEEP = 256           # requests the dry-step table keeps beyond those in the current step
# methods whose acceptance follows the text, not the target: no collapse signal (acceptance.py)
UNWATCHED = (*LOOKUPS, "hybrid", "prediction")
EXPLORE_Z = 1.0           # `auto`: standard errors of a method's history added to rate one not yet tried


class GoodputPolicy(MethodChoice, DraftCosts):
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self.history = AcceptanceHistory(clock)
        self.cost = StepCostModel()
        self.calibration: list[tuple[int, float]] = []        # start-up (num_tokens, seconds) samples
        self.dry: dict[str, int] = {}                         # request id -> steps in a row without drafts
        self.block_s = 0.0          # a forward's extra cost per block of row_block rows begun (bf16 CPU linear)
        self.row_block = ROW_BLOCK  # rows per block of the target's linears (linear.row_block, set at calibration)

    # -- learning (the drafters' costs: DraftCosts) -----------------------------------------------------
    def calibrate(self, samples: list[tuple[int, float]]) -> None:
        """Start-up step timings (num_tokens, seconds) of different sizes: the fit is usable at once."""
        self.calibration = list(samples)
        self.cost.set_prior(samples)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A pure decode/verify step (no prefill rows): N query tokens took `seconds` (forward + sampling)."""
        self.cost.observe(num_tokens, seconds)

    def observe_acceptance(self, method: str, num_draft: int, num_accepted: int, band: str = "greedy",
                           context: int = 0) -> None:
        self.history.observe(method, num_draft, num_accepted, band, watch=method not in UNWATCHED, context=context)

    def note_drafting(self, seqs: Sequence[ScheduledSeq]) -> None:
        """After the step's cuts: count the steps in a row each speculating request drafted nothing. A
        prefill chunk (more than one new token) could not draft: it is no evidence either way."""
        for s in seqs:
            rid = s.request.request_id
            if s.request.spec_params.k <= 0 or not s.samples or s.num_new_tokens > 1:
                continue
            if s.num_draft_slots > 0:
                self.dry.pop(rid, None)
            else:
                self.dry[rid] = self.dry.get(rid, 0) + 1
        if len(self.dry) > len(seqs) + _DRY_KEEP:          # forget finished requests
            live = {s.request.request_id for s in seqs}
            self.dry = {r: n for r, n in self.dry.items() if r in live}

    def probing(self, request) -> bool:
        return self.dry.get(request.request_id, 0) >= PROBE_EVERY - 1

    def resting(self, request, num_seqs: int = 1, lookups: Sequence[str] = ()) -> bool:
        """`auto` skips this request's lookups and choice this step (it plain-decodes): it drafted nothing
        last step, this is neither a re-choice step nor its probe, and the `lookups` auto would run and the
        choice itself (choice_s: scoring the request's offers, pricing its candidates) cost more than
        REST_SHARE of the request's share of a step of `num_seqs` sequences.
        Example: t0 = 8 ms, t1 = 0.3 ms, suffix + ngram 0.4 ms a request: alone the share is 8.3 ms
        (5 %: never rests); at 16 sequences 0.8 ms (50 %: rests). The choice counts as much: with bf16
        on AMX tiles (a 16-sequence step of ~7 ms) it took ~0.1 ms a request beside ~0.06 ms of lookups,
        and with the lookups alone counted, `auto` ran 16 fresh code requests at 0.80-0.99x plain
        decoding, its choice 1.5-2.2 ms of each 11-14 ms step; with the choice counted, 1.15x (mixed
        repeated and fresh requests: 1.03x and 1.19x)."""
        dry = self.dry.get(request.request_id, 0)
        if dry == 0 or dry % RECHOOSE_EVERY == 0 or self.probing(request):
            return False
        t0, t1 = self.step_line()
        num_seqs = max(num_seqs, 1)
        share = (t0 + t1 * num_seqs) / num_seqs
        return sum(self.lookup_s.get(m, 0.0) for m in lookups) + self.choice_s > REST_SHARE * share

    def skips_lookups(self, request, last: str | None) -> bool:
        """`auto` chooses for this request without running its lookups this step: it samples (T > 0), its
        model drafter drafted for it last step (`last`), and this is not every RECHOOSE_EVERY-th step of
        its speculation. At T = 0.8 a lookup's draft was accepted 0.25-0.4 a position where EAGLE-3's was
        0.68, and letting `auto` take the lookups only on such steps changed nothing measurable (auto ÷
        EAGLE-3 alone 0.96 either way), while running them is ~2 % of a batch-1 step."""
        if last is None or last in LOOKUPS or last == "none" or band_of(request) != "sampled":
            return False
        return sum(row[0] for row in request.spec_stats.by_method.values()) % RECHOOSE_EVERY != 0

    def is_collapsed(self, method: str, band: str | None = None) -> bool:
        return self.history.is_collapsed(method, band)

    def drain_collapses(self) -> dict[str, int]:
        return self.history.drain_collapses()

    def alpha(self, method: str, accepted: float, attempted: float, band: str = "greedy",
              context: int = 0) -> float:
        return self.history.alpha(method, accepted, attempted, band, context)

    def request_alpha(self, request, method: str, explore: bool = False, level: float | None = None) -> float:
        """The request's acceptance estimate for `method`: its own counts with that method (`auto` keeps
        them per method chosen), shrunk towards the method's server history in the request's band.
        explore (`auto`'s choice, not the trim): a method the request has not drafted with and that the
        start-up probe did not rate (explorer() tries those) is rated at its history plus EXPLORE_Z
        standard errors of it, an upper confidence bound, so that a history that is short or empty gets
        tried: ranked by the histories as they were, the first drafter a band's
        traffic took kept it (at T = 0.8, the draft model for 303 steps and EAGLE-3, which accepts more
        for less, for 1). `level`: the request's request_level where the caller has it."""
        stats, band, context = request.spec_stats, band_of(request), request.num_tokens
        if request.spec_params.method == method:
            return self.alpha(method, stats.num_accepted_tokens, stats.num_attempted_positions, band, context)
        scored = stats.lookup_score(method)
        if scored and scored[1]:        # a lookup: every draft it offered, chosen or not (AutoSpeculator)
            return self.alpha(method, scored[0], scored[1], band)
        row = stats.by_method.get(method)
        if row:
            return self.alpha(method, row[2], row[3], band, context)
        alpha = self.alpha(method, 0, 0, band, context)
        if self.history.rating(method, band, context) is not None:
            alpha *= self.history.request_level(stats.by_method, band, context) if level is None else level
        elif explore:                                                   # probed drafters: explorer()
            seen = self.history.attempted(method, band)
            alpha += EXPLORE_Z * (alpha * (1.0 - alpha) / (seen + PRIOR_WEIGHT)) ** 0.5
        return min(alpha, 0.999)

    def request_survival(self, request, method: str, depth: int, explore: bool = False,
                         level: float | None = None) -> list[float]:
        """The chance that the request's draft of `method` is accepted through depth d, for d = 1..depth: the
        product of its acceptance at each depth given the earlier ones were. A context lookup whose offers
        `auto` has scored (spec_stats.lookup_depths) is measured per depth, each depth's counts shrunk by
        PRIOR_WEIGHT positions towards the server's acceptance there (AcceptanceHistory.depth_alphas):
        its drafts are copied text, either wrong from the first token or right for many. Over all of
        bench_auto's prose prompts at T = 0, n-gram's offers were accepted at depths 1-8 at 0.49, 0.66,
        0.62, 0.80, 0.85, 0.79, 1.00, 0.86: one acceptance per position (0.25-0.45 in a request's first
        steps) priced a step with its 8-token draft at ~1.4 tokens where those steps gave 2.5, and `auto`
        took a head instead (~19 ms against ~12 for the same tokens); an `auto` request that has no offers
        scored yet is priced at the server's depths. Else alpha ** d (request_alpha): a model drafter's
        acceptance per depth is near flat where it matters most, at T = 0.8 (EAGLE-3 at k = 8 untrimmed on
        code, depths 1-5: 0.66, 0.65, 0.68, 0.66, 0.66; the draft model 0.55-0.68), and a per-depth count
        of its drafts would see deep depths only where the trim let it draft deep, on the easier requests."""
        band = band_of(request)
        reached, accepted = request.spec_stats.lookup_depths.get(method) or ((), ())
        if not reached and not (request.spec_params.method == "auto" and (method, band) in self.history.depths):
            alpha = self.request_alpha(request, method, explore, level)
            return [alpha ** d for d in range(1, depth + 1)]
        server = self.history.depth_alphas(method, band, depth)
        out, s = [], 1.0
        for d in range(depth):
            own = (accepted[d], reached[d]) if d < len(reached) else (0, 0)
            s *= min((own[0] + PRIOR_WEIGHT * server[d]) / (own[1] + PRIOR_WEIGHT), 0.999)
            out.append(s)
        return out

    # -- deciding: `auto`'s method (MethodChoice), then each request's depth ------------------------
    def trim(self, seqs: Sequence[ScheduledSeq], methods: Sequence[str] | None = None) -> int:
        """Lower num_draft_slots where drafting does not pay; returns how many requests were cut.
        methods: the method each seq drafts with this step (default its own; `auto` chose one)."""
        fit = self.cost.fit()
        if fit is None:
            return 0
        t0, t1 = fit
        method_of = {id(s): m for s, m in zip(seqs, methods)} if methods is not None else {}
        adaptive = [s for s in seqs if s.num_draft_slots > 0 and _adaptive(s)]
        if not adaptive:
            return 0
        chosen = {id(s) for s in adaptive}
        n_tokens = sum(s.num_new_tokens + (0 if id(s) in chosen else s.num_draft_slots) for s in seqs)
        gained = float(sum(1 for s in seqs if s.samples))          # tokens per step without drafts
        seconds = t0 + t1 * n_tokens
        seq_methods = [method_of.get(id(s), s.request.spec_params.method) for s in adaptive]
        survive = [self.request_survival(s.request, m, s.num_draft_slots) for s, m in zip(adaptive, seq_methods)]
        keep = [0] * len(adaptive)
        # Heap entries (-gain / cost, tiebreak, method or None, depth, members, cost). A method whose drafting
        # is a forward per depth (d_m > 0) opens a depth for a group: one d_m however many of its requests
        # draft there. Per-request entries (lookups, prediction) cost t1 per position, plus, at depth 1, the
        # lookup's own cost where it has not run yet (`auto` ran its lookups before choosing).
        heap: list = []
        groups: dict[str, list[int]] = {}
        costs = {m: self.draft_cost(m) for m in set(seq_methods)}     # (e0, e1): e0 + follow-up at depth 1
        slots = [s.num_draft_slots for s in adaptive]
        for i, m in enumerate(seq_methods):
            if self.draft_step_s.get(m, 0.0) > 0.0:
                groups.setdefault(m, []).append(i)
            else:
                looked_up = adaptive[i].request.spec_params.method == "auto"
                cost = t1 + (0.0 if looked_up else self.lookup_s.get(m, 0.0))
                heapq.heappush(heap, (-survive[i][0] / cost, len(heap), None, 1, 1, [i], cost, survive[i][0]))

        def run(m: str, members: list[int], start: int) -> tuple[int, float, float]:
            """A group's best run of depths from `start`: (last depth, gain, cost) with the most gain per
            cost. Depth 1 carries the drafter's fixed part and its follow-up, so taken alone it rarely pays
            where the depths after it do (16 sequences: 7 EAGLE-3 requests at 0.8 pay 4.2 ms at depth 1
            for 5.6 tokens, then 2.75 ms a depth for 4.5, 3.6, ...)."""
            best, gain, cost = (start, 0.0, 0.0), 0.0, 0.0
            for depth in range(start, max(slots[i] for i in members) + 1):
                at = [i for i in members if slots[i] >= depth]
                gain += sum(survive[i][depth - 1] for i in at)
                cost += len(at) * t1 + costs[m][1] + \
                    (costs[m][0] + self.follow_up_s.get(m, 0.0) if depth == 1 else 0.0)
                if best[2] == 0.0 or gain * best[2] > best[1] * cost:
                    best = (depth, gain, cost)
            return best

        for m, members in groups.items():
            last, gain, cost = run(m, members, 1)
            heapq.heappush(heap, (-gain / cost, len(heap), m, 1, last, members, cost, gain))
        serial = len(heap)
        base = (n_tokens, gained, seconds)
        picks: list[tuple[dict[int, int], int, float, float]] = []   # ({member: depth}, rows, gain, cost) as taken
        while heap:
            _, _, m, depth, last, members, cost, gain = heapq.heappop(heap)
            # only members whose own verification pays at the rate reached so far (gained / seconds)
            kept = [i for i in members if survive[i][depth - 1] * seconds > t1 * gained]
            if m is not None and kept != members and kept:     # a group prices the members it has left
                last, gain, cost = run(m, kept, depth)
            if not kept or gain * seconds <= cost * gained:     # gain / cost <= tokens per second so far
                continue
            reached = {i: min(last, slots[i]) for i in kept}
            for i, d in reached.items():
                keep[i] = d
            picks.append((reached, sum(d - depth + 1 for d in reached.values()), gain, cost))
            gained += gain
            seconds += cost
            deeper = [i for i in kept if last < slots[i]]
            if deeper:
                serial += 1
                if m is None:
                    nxt = survive[deeper[0]][last]
                    heapq.heappush(heap, (-nxt / t1, serial, None, last + 1, last + 1, deeper, t1, nxt))
                else:
                    to, nxt, nxt_cost = run(m, deeper, last + 1)
                    heapq.heappush(heap, (-nxt / nxt_cost, serial, m, last + 1, to, deeper, nxt_cost, nxt))
        if self.block_s > 0.0 and picks:            # the rows' cost is a staircase: stop where it pays most
            stop = best_stop(*base, [(r, g, c) for _, r, g, c in picks], self.block_s, self.row_block)
            if stop < len(picks):
                keep = [0] * len(adaptive)
                for reached, _, _, _ in picks[:stop]:
                    for i, d in reached.items():
                        keep[i] = d
        rows = n_tokens + sum(keep)
        room = blocks(rows, self.row_block) * self.row_block - rows if self.block_s > 0.0 else len(adaptive)
        return self._apply(adaptive, keep, room)

    def _apply(self, adaptive: list[ScheduledSeq], keep: list[int], room: int) -> int:
        """Set the kept depths and count the cuts. A probing request keeps at least one while the step has
        `room`: rows left before a forward begins another row block (bf16 CPU). A probe that began one
        cost the whole block: at 16 sequences, 39 of 270 steps ran 33-34 rows, 2.7 ms more than at 32."""
        cut = 0
        for s, k in zip(adaptive, keep):
            if k == 0 and room > 0 and self.probing(s.request):
                k, room = 1, room - 1
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
    policy.row_block = row_block(runner.model)
    policy.block_s = row_block_step(runner, fit, policy.row_block)
    if fit is None:
        log.warning("goodput policy: start-up calibration gave no usable step-cost fit (%d samples); "
                    "it will learn online", len(samples))
    else:
        log.info("goodput policy calibrated on %d step sizes: step = %.2f ms + %.3f ms per verified token, "
                 "+ %.2f ms per block of %d rows begun", len(samples), fit[0] * 1e3, fit[1] * 1e3,
                 policy.block_s * 1e3, policy.row_block)
    return policy


def row_block_step(runner, fit: tuple[float, float] | None, block: int = ROW_BLOCK) -> float:
    """The extra seconds of a forward over block + 1 rows beyond one over `block` rows and the fit's
    one more row (one sequence each, best of three): a bf16 CPU forward runs its linears in blocks of
    rows (oneDNN: 1.3-2.2 ms more at 33 rows than at 32 on the embedded target), fp32 and CUDA do not
    (~0). The trim then stops short of a block boundary where the rows past it do not pay for the step."""
    if fit is None:
        return 0.0
    try:
        at, past = (min(runner.time_verify_step(1, rows, CALIBRATION_CONTEXT) for _ in range(3))
                    for rows in (block, block + 1))
    except ValueError:      # a cache too small for it
        return 0.0
    step = past - at - fit[1]
    return step if step > 2.0 * fit[1] else 0.0     # within the noise of a row or two: no staircase


def _adaptive(seq: ScheduledSeq) -> bool:
    req = seq.request
    if not req.spec_params.adaptive:
        return False
    # No exemption for seeded sampled requests: their text does not depend on k (sampling/coupled.py).
    return True
