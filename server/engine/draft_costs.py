"""What each speculation method's drafting costs, as the goodput policy learns it (GoodputPolicy's base).

    draft        e0 + e1 * D   a model drafter's propose of depth D (one forward per depth, plus a part that
                               does not grow with it: gathering the requests' inputs, its own bookkeeping;
                               below 0 for a head, whose first draft its follow-up computed)
    follow-up    o_m           a head's observe of the rows its drafts were verified in, once per step
    catch-up     c0 + c1 * rows   a model drafter reading the rows it skipped for an `auto` request
    lookup       c_m           a context lookup (suffix, ngram) per request, whatever its length
    choice       c_a           `auto`'s choice for one request besides its lookups (scoring its offers, pricing)

Each line is a StepCostModel, whose fit is kept between samples: `auto` and the trim read these costs for
every request and candidate of every step.
"""
from __future__ import annotations

import statistics

from specserve.server.engine.step_cost import MIN_FIT_STEPS, StepCostModel

# A draft-cost sample counts for at most this multiple of the estimate (see observe_propose): a prompt
# catch-up divided by the depth once priced the embedded draft model at 10.7 ms per depth, EAGLE-3 at 2.3.
MAX_DRAFT_RISE = 2.0
# Variance of the depths (depth^2) a drafter's cost line needs. A propose's time is its own forwards, steadier
# than a step's, and traffic's depths vary little: EAGLE-3 on an agentic turn at T = 0.8 drafted depths 1-4
# at a variance of ~0.35, under the step line's MIN_SPREAD, and was priced at its mean per depth.
DRAFT_MIN_SPREAD = 0.25
# A catch-up is paid once for the steps that follow it: once caught up, the drafter stays in step with the
# request for as long as it keeps drafting, and a request that leaves it pays it again only if it ever
# comes back, whichever method it takes meanwhile. So `auto` spreads it over the steps the request has left
# at that method's expected tokens per step, at most this many (a max_tokens far beyond the real answer
# must not make a long catch-up look free). Charged whole each step, a fresh request's prompt catch-up
# (~300 rows, 28 ms beside a 10 ms step) kept EAGLE-3 from ever being chosen for a request on which it
# accepted 74 % of drafts at T = 0.8, and its 2 ms fixed part kept a request that once took a lookup on
# lookups: auto's T = 0.8 tokens per step were 1.29 against the hybrid's 2.18.
AMORTIZE_MAX_STEPS = 32
# ... and at most the steps a catch-up has served on this server: the runs a model drafter drafts in a row for
# an `auto` request, averaged over the last runs (RUN_DECAY per run). At T = 0 on prose, EAGLE-3 drafted runs
# of 1.5 steps between lookup drafts: each return paid a 1.6 ms catch-up beside a 10 ms step, priced as if
# spread over 32 steps, and `auto` with EAGLE-3 ran 1.71x plain decoding where it ran 1.84x without it.
RUN_DECAY = 0.95
RUN_PRIOR = 2.0           # runs the server's mean counts for beside a request's own ended runs
# A drafter's cost line from the probe's timed depths (set_draft_prior) counts for this many proposes in all,
# so that it stands before any traffic (MIN_FIT_STEPS) and later proposes set its level, not its slope.
DRAFT_PRIOR_PROPOSES = float(MIN_FIT_STEPS)
# Catch-ups a drafter's catch-up line needs before it prices by rows (until then: one draft forward), and what
# the start-up probe's prompt catch-ups count for as its prior (set_catch_up_prior). A drafter `auto` seldom
# switches to never reached MIN_FIT_STEPS: after 16 agentic turns at T = 0 MTP had one catch-up booked, was
# priced at ~0.9 ms for first uses of 200-600 rows (5-8 ms), and its 23 steps took 15.6 ms each beside 9.3 for
# suffix's.
CATCH_UP_MIN_STEPS = 6


class DraftCosts:
    def __init__(self) -> None:
        self.draft_step_s: dict[str, float] = {}              # model drafter -> EMA seconds per draft step
        self.draft_fit: dict[str, StepCostModel] = {}         # model drafter -> propose s = e0 + e1 * depth
        self.lookup_s: dict[str, float] = {}                  # lookup -> EMA seconds per request and step
        self.choice_s = 0.0                                   # `auto`'s choice: EMA seconds per request and step
        self.follow_up_s: dict[str, float] = {}               # model drafter -> EMA seconds of its observe
        self.catch_up: dict[str, StepCostModel] = {}          # model drafter -> catch-up s = c0 + c1 * rows
        self.runs: dict[tuple[str, str], list[float]] = {}    # (drafter, band) -> decayed [steps, runs]
        self.request_runs: dict[str, dict[str, list[int]]] = {}   # request id -> drafter -> [steps, runs]
        self.propose_log: list[tuple[str, int, float]] | None = None   # (method, depth, s) while recording
        self.catch_up_log: list[tuple[str, int, float]] | None = None  # (method, rows, s) while recording

    def observe_propose(self, method: str, seconds: float, steps: int) -> None:
        """A model drafter's propose call: `steps` draft forwards (its depth) took `seconds`. A call whose
        first forward caught up on many rows (a draft model reading a whole prompt, a head back from rest)
        is no draft step's price: each sample moves the estimate by at most MAX_DRAFT_RISE x."""
        if steps > 0:
            if self.propose_log is not None:
                self.propose_log.append((method, steps, seconds))
            _cost_ema(self.draft_step_s, method, seconds / steps)
            fit = self.draft_fit.setdefault(method, StepCostModel(floor_n=1, min_spread=DRAFT_MIN_SPREAD))
            line = fit.fit()
            cap = MAX_DRAFT_RISE * max(line[0] + line[1] * steps, line[1]) if line is not None else seconds
            fit.observe(steps, min(seconds, cap))

    def draft_cost(self, method: str) -> tuple[float, float]:
        """(e0, e1): a propose of depth D costs e0 + e1 * D. A propose has a part that does not grow with its
        depth (gathering the requests' inputs, the drafter's own bookkeeping): priced per depth alone, one
        EAGLE-3 depth read 2.0 ms where four cost 1.35 ms each, and deep drafts looked dearer than they are.
        e0 may be negative, the line only kept from falling below 0 at depth 1: a head's first draft comes
        from its follow-up observe, so its propose of depth 1 only samples it, and each further depth is a
        forward (EAGLE-3 on an agentic turn at T = 0.8: 1.2 ms at depth 1, 4.2 at 2, 7.2 at 3). Held
        through 0, the line priced it at 2.5 ms a depth, depths 1 and 2 at 2.5 and 5.0 ms and each depth
        beyond them below its 3 ms, and `auto` took the draft model (priced right, ~3.2 ms a depth) for
        713 of 1154 steps there, at 0.91x EAGLE-3 alone. Until the depths seen spread enough to fit the
        line, (0, the EMA per depth)."""
        model = self.draft_fit.get(method)
        line = model.fit() if model is not None else None
        return line if line is not None else (0.0, self.draft_step_s.get(method, 0.0))

    def set_draft_prior(self, method: str, log: list[tuple[str, int, float]]) -> tuple[float, float] | None:
        """Start `method`'s propose line from proposes timed at several depths (the start-up probe's, from
        propose_log): the median at each depth, together worth DRAFT_PRIOR_PROPOSES proposes, which never
        decay. Traffic's proposes then set the line's level (StepCostModel) while their few depths barely move
        its slope. Without it a drafter `auto` seldom takes is priced per depth at its probe's depth-8 proposes,
        whose fixed part is spread over 8 depths: the embedded draft model read 3.1 ms a depth where depth 1
        costs 4.6 ms and depth 2 7.4 (MTP 2.2 ms a depth: 6.6 at depth 2), and at the 1-2 depths of a sampled
        request `auto` drafted 3 of 16 code requests with it, two of them far slower than with EAGLE-3. Returns
        the line, or None (and changes nothing) with fewer than two depths timed."""
        times: dict[int, list[float]] = {}
        for m, depth, seconds in log:
            if m == method:
                times.setdefault(depth, []).append(seconds)
        if len(times) < 2:
            return None
        samples = [(depth, statistics.median(t)) for depth, t in sorted(times.items())]
        model = StepCostModel(floor_n=1, min_spread=DRAFT_MIN_SPREAD)
        model.set_prior(samples, DRAFT_PRIOR_PROPOSES / len(samples))
        self.draft_fit[method] = model
        return model.fit()

    def observe_follow_up(self, method: str, seconds: float) -> None:
        """A head's observe after a step it drafted in: one more forward over the verified rows, paid once
        per step by the group that drafted with it (part of depth 1's price)."""
        _cost_ema(self.follow_up_s, method, seconds)

    def observe_catch_up(self, method: str, seconds: float, rows: int) -> None:
        """A model drafter caught `auto` requests up on `rows` rows it had skipped (a head reading its state
        stash, a draft model its unseen tokens) in `seconds` (server/engine/catch_up.py): one forward, so
        fitted as c0 + c1 * rows like a step, from CATCH_UP_MIN_STEPS of them (set_catch_up_prior's included)."""
        if rows > 0:
            self.catch_up.setdefault(method, StepCostModel(min_steps=CATCH_UP_MIN_STEPS)).observe(rows, seconds)

    def set_catch_up_prior(self, method: str, log: list[tuple[str, int, float]]) -> tuple[float, float] | None:
        """Start `method`'s catch-up line from catch-ups timed at several row counts (the start-up probe's
        requests reading their prompts, from catch_up_log), together worth CATCH_UP_MIN_STEPS catch-ups, which
        never decay: `auto` prices a first switch by rows at once, and once it has switched that often its own
        catch-ups set the line's level (a probe request's prompt read took 1.5 ms + 22 µs a row with EAGLE-3,
        an `auto` request's first switch ~5 ms at 300 rows where the line says 8). Returns the line, or None
        (and changes nothing) where the rows timed do not spread."""
        samples = [(rows, seconds) for m, rows, seconds in log if m == method and rows > 0]
        if len({rows for rows, _ in samples}) < 2:
            return None
        model = StepCostModel(min_steps=CATCH_UP_MIN_STEPS)
        model.set_prior(samples, CATCH_UP_MIN_STEPS / len(samples))
        line = model.fit()
        if line is not None:
            self.catch_up[method] = model
        return line

    def observe_run(self, method: str, steps: int, band: str, request_id: str | None = None) -> None:
        """An `auto` request's run with model drafter `method` ended after `steps` steps in a row."""
        run = self.runs.setdefault((method, band), [0.0, 0.0])
        run[0] = run[0] * RUN_DECAY + steps
        run[1] = run[1] * RUN_DECAY + 1.0
        if request_id is not None:
            own = self.request_runs.setdefault(request_id, {}).setdefault(method, [0, 0])
            own[0] += steps
            own[1] += 1

    def forget_runs(self, request_id: str) -> None:
        self.request_runs.pop(request_id, None)

    def run_steps(self, method: str, band: str, request_id: str | None = None) -> float | None:
        """The steps a run of `method` lasts on average: the request's own ended runs, shrunk towards the
        server's mean in `band` by RUN_PRIOR runs (None before any run ended). Per request because the text
        sets it: on code EAGLE-3 ran 20-25 steps a request between lookup drafts, on prose runs of 1-2, and
        a prose request priced at the server's mean after code kept paying short runs' catch-ups."""
        run = self.runs.get((method, band))
        server = run[0] / run[1] if run is not None and run[1] > 0 else None
        own = self.request_runs.get(request_id, {}).get(method) if request_id is not None else None
        if not own:
            return server
        if server is None:
            return own[0] / own[1]
        return (own[0] + RUN_PRIOR * server) / (own[1] + RUN_PRIOR)

    def catch_up_s(self, method: str, rows: int, steps: float = 1.0) -> float:
        """The price per step of catching a request up on `rows` rows, spread over `steps`: (c0 + c1 * rows)
        / steps once the fit has enough spread, else one draft forward (what a catch-up of a few rows
        costs) / steps."""
        if rows <= 0:
            return 0.0
        model = self.catch_up.get(method)
        fit = model.fit() if model is not None else None
        whole = fit[0] + fit[1] * rows if fit is not None else self.draft_step_s.get(method, 0.0)
        return whole / max(steps, 1.0)

    def observe_lookup(self, method: str, seconds: float, num_requests: int) -> None:
        """A context lookup's propose call for `num_requests` requests: its cost does not grow with depth."""
        if num_requests > 0:
            _ema(self.lookup_s, method, seconds / num_requests)

    def observe_choice(self, seconds: float, num_requests: int) -> None:
        """`auto`'s choice for `num_requests` requests took `seconds` besides their lookups."""
        if num_requests > 0:
            self.choice_s = _moved(self.choice_s or None, seconds / num_requests)


def steps_left(request, alpha: float, n: int, run: float | None = None) -> float:
    """The steps `request` has left if it drafts n positions a step at acceptance alpha: its remaining
    max_tokens over the expected tokens per step (1 + alpha + ... + alpha ** n), in 1..AMORTIZE_MAX_STEPS,
    and at most `run` (DraftCosts.run_steps) where given."""
    left = request.sampling_params.max_tokens - request.num_output_tokens
    per_step = (1.0 - alpha ** (n + 1)) / (1.0 - alpha)
    cap = float(AMORTIZE_MAX_STEPS) if run is None else min(float(AMORTIZE_MAX_STEPS), run)
    return min(max(left / per_step, 1.0), max(cap, 1.0))


def _cost_ema(table: dict[str, float], key: str, value: float) -> None:
    """The EMA of a drafter's per-step cost, quick to fall and slow to rise: the same computation's time has
    a floor but outliers above it (a first call's warm-up, a catch-up folded into an observe). A sample
    above the estimate counts at most MAX_DRAFT_RISE x it at weight 0.1, one below it at weight 0.5. With
    both at 0.1, EAGLE-3's first follow-up observe (3.5 ms beside a steady 1.1 ms) held its estimate at
    2.7 ms, priced the head out of `auto`'s choices and so out of any sample that could correct it."""
    old = table.get(key)
    if old is None:
        table[key] = value
    elif value < old:
        table[key] = 0.5 * old + 0.5 * value
    else:
        table[key] = 0.9 * old + 0.1 * min(value, MAX_DRAFT_RISE * old)


def _ema(table: dict[str, float], key: str, value: float) -> None:
    table[key] = _moved(table.get(key), value)


def _moved(old: float | None, value: float) -> float:
    """An EMA (weight 0.1) moved by `value`; `value` itself where there is none yet."""
    return value if old is None else 0.9 * old + 0.1 * value

