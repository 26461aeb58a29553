"""`auto`'s choice of method: for each request of a step, the speculation method (a lookup, its model drafter,
or none) expected to give the most tokens per second (`MethodChoice.choose_methods`).

A mixin of the goodput policy (server/engine/spec_policy.py GoodputPolicy), whose step-cost fit (`cost`),
acceptance history and estimates (`history`, `request_alpha`, `is_collapsed`), probe schedule (`probing`) and
drafting costs (draft_costs.DraftCosts: `draft_cost`, `follow_up_s`, `catch_up_s`, `draft_step_s`) it prices
with. The policy then trims each request's depth (GoodputPolicy.trim); this module decides only which method.

Which model drafter: a request keeps the first it took (own_drafter, kept_drafter); the start-up probe's paired
comparison, scaled by the traffic level (acceptance.AcceptanceHistory.rating), ranks them, and one request in
EXPLORE_EVERY explores (explorer).
"""
from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable, Sequence

from specserve.server.engine.acceptance import band_of, context_bucket
from specserve.server.engine.draft_costs import steps_left
from specserve.server.engine.step_cost import NOMINAL_COST
from specserve.speculators.auto import LOOKUPS

EXPLORE_EVERY = 16        # `auto`: one request in this many takes the probed drafter with the least traffic
EXPLORE_Z_RATIO = 1.0     # of those whose rating + this many standard errors of it reaches the best
# positions an explored drafter's probe counts for in that standard error: with no traffic a drafter within
# ~13 % of the best is tried (the probe's texts are not the server's), after ~300 positions one within ~5 %
EXPLORE_PRIOR = 40.0
MAX_PASSES = 4            # `auto`: pricing passes over a step's requests (choose_methods)
# A request that drafted nothing for PROBE_EVERY - 1 steps probes a model drafter only if the drafter's forward
# for it alone costs at most this x the request's share of a step (so at most 1 / PROBE_EVERY more): in a full
# step of 16 fresh code requests (share 0.6 ms) each probe of the draft model cost a 2.9 ms forward with its
# catch-up, two requests a step probed, and 0.9 ms a step went on ~100 accepted tokens in 270 steps.
PROBE_SHARE = 1.0
ABANDON_RATIO = 0.5       # `auto`: a request leaves its drafter when it accepts less than this x another's
KEEP_RATIO = 0.75         # or when the server rates it below this x another at the request's context now


class MethodChoice:
    def choose_methods(self, requests: Sequence, ks: Sequence[int], lengths: list[dict[str, int]],
                       num_seqs: int | None = None,
                       behind: Callable[[object, str], int] | None = None) -> list[str]:
        """`auto` for one step's requests: choose_method for each, priced inside the batch.

        In a step of B sequences (num_seqs, all methods) a request's share of the step is (t0 + t1 B) / B,
        and a model drafter's forward per depth is paid once by the requests that draft with it: a first
        pass prices it as if every auto request of the step shared it, a second at the groups the first
        formed. Example, B = 16, t0 = 12.6 ms, t1 = 0.57 ms, EAGLE-3 d = 2.6 ms: alone, a request pays the
        full 2.6 ms per depth beside a 1.36 ms share of the step, and a weak lookup looks better; shared
        by 12, 0.22 ms each. Passes repeat, each at the groups the last formed, until no choice changes
        (at most MAX_PASSES): priced as if all 16 shared it, the draft model drew 1-2 requests of a full
        step of fresh code, which then paid its whole 1.2 ms forward (and catch-ups) for a token or two;
        a third pass prices it at the group it really has and they leave. `behind(request, method)`: the
        rows a model drafter would first have to catch the request up on (see choose_method).
        """
        t0, t1 = self.step_line()
        num_seqs = max(num_seqs or len(requests), 1)
        base = (t0 + t1 * num_seqs) / num_seqs - t1        # base + t1 (1 + L): the request's share
        memo: dict = {}         # what the second pass would compute again (kept drafter, acceptance estimates)
        first = [self.choose_method(r, k, n, base, len(requests), behind, memo)
                 for r, k, n in zip(requests, ks, lengths)]
        chosen = first
        for _ in range(MAX_PASSES - 1):
            if len(requests) == 1 or all(m in LOOKUPS or m == "none" for m in chosen):
                return chosen       # a later pass only re-prices model drafters, none of them chosen
            groups = Counter(chosen)
            again = [self.choose_method(r, k, n, base, {m: groups[m] + (m != mine) for m in n}, behind, memo)
                     for r, k, n, mine in zip(requests, ks, lengths, chosen)]
            if again == chosen:
                break
            chosen = again
        return chosen

    def step_line(self, base: float | None = None) -> tuple[float, float]:
        """(t0, t1) of a step, the fitted line or NOMINAL_COST before it fits; `base`, where given, in place of
        t0 (a request's share of a batched step)."""
        fit = self.cost.fit()
        t0, t1 = fit if fit is not None else NOMINAL_COST
        return (t0 if base is None else base), t1

    def choose_method(self, request, k: int, lengths: dict[str, int], base: float | None = None,
                      sharing: int | dict[str, int] | None = None,
                      behind: Callable[[object, str], int] | None = None, memo: dict | None = None) -> str:
        """`auto`: the candidate with the most expected tokens per second this step, or "none".

        lengths: method -> how many drafts it would verify (a context lookup knows, and has already
        drafted: 0 when nothing matches; a model drafter could draft up to k). Method m verifying L drafts
        with acceptance a_m yields 1 + a_m + ... + a_m ** L tokens (a scored lookup: 1 + its chances of
        surviving to each depth, request_survival) for a step of t0 + t1 (1 + L) + d_m L
        seconds (d_m = 0 for a lookup, whose drafts are already paid for); each method is rated at its
        best L <= its length, the depth the trim would keep, not at its longest. Plain decoding yields 1
        token for t0 + t1. In a batch (choose_methods) t0 is the request's share of the step (`base`) and
        d_m is split among the `sharing` requests (one count, or per method: the group it would join). A
        model drafter that did not draft for the request last step first catches it up on the rows it
        skipped (`behind`; a head reads them from its stash, a draft model runs them): that forward's
        measured cost (catch_up_s) joins the step's cost, spread over the steps the request has left
        (steps_left: a catch-up serves every later step; a request near its end does not switch). A
        request that drafted nothing for PROBE_EVERY - 1 steps takes the best candidate even when none
        rates higher (a model drafter only where its forward is cheap beside the step: PROBE_SHARE). Of
        the model drafters, only the request's own (kept_drafter) is a candidate once it
        has drafted with one. The choice reads the context and past acceptance only, never this step's target,
        and no request's text depends on it: greedy and seeded (coupled) sampling emit the same tokens
        whatever the drafts, unseeded sampling keeps the target's distribution. `memo`: a dict shared by
        the calls of one step (choose_methods), which keeps what does not depend on the pricing.
        """
        band = band_of(request)
        t0, t1 = self.step_line(base)
        memo = {} if memo is None else memo
        rid = request.request_id
        if (rid, None) not in memo:
            memo[(rid, None)] = self.kept_drafter(request, lengths, t0, self._level(request, band, memo))
        drafter = memo[(rid, None)]
        leave = self.leave_s(request, drafter, behind)
        if leave and sharing:               # the catch-up forward is shared by the drafter's group
            leave /= max(sharing.get(drafter, 1) if isinstance(sharing, dict) else sharing, 1)
        best, best_rate = "none", 1.0 / (t0 + t1 + leave)
        probe, probe_rate, probing = "none", 0.0, self.probing(request)
        for method, n in lengths.items():
            n = min(n, k)
            if n <= 0 or (method not in LOOKUPS and drafter not in (None, method)):
                continue
            collapsed, fixed, per_depth, follow = self._method_costs(method, band, memo)
            if collapsed:
                continue
            share = sharing.get(method, 1) if isinstance(sharing, dict) else (sharing or 1)
            share = max(share, 1)
            if (rid, method) not in memo:
                memo[(rid, method)] = self._survival(request, method, n, band, memo)
            key, survive = memo[(rid, method)]
            if behind is None or method not in self.draft_step_s:
                switch = leave              # a lookup reads the context as it is
                rate = self._best_rate(survive, n, t0, t1, per_depth / share, (fixed + follow) / share + switch)
            else:
                # a catch-up only lowers the rate: a drafter that would not lead or probe without one is
                # not priced further (its catch-up reads the ledger and the request's run); its rate without
                # one is the same for every request with the same survival (`key`) and share
                if (key, share) not in memo:
                    memo[(key, share)] = self._best_rate(survive, n, t0, t1, per_depth / share,
                                                         (fixed + follow) / share)
                rate = memo[(key, share)]
                if rate <= (min(best_rate, probe_rate) if probing else best_rate):
                    continue
                if (rid, method, None) not in memo:
                    memo[(rid, method, None)] = self._catch_up(request, method, n, band, behind, survive)
                switch = memo[(rid, method, None)]
                if switch:
                    rate = self._best_rate(survive, n, t0, t1, per_depth / share, (fixed + follow) / share + switch)
            if rate > best_rate:
                best, best_rate = method, rate
            # a probe drafts one position at its own cost, unshared: a lookup's row, or a model drafter's
            # forward when that costs no more than the request's share of the step (see PROBE_SHARE)
            if rate > probe_rate and (method in LOOKUPS or fixed + per_depth + follow + switch
                                      <= PROBE_SHARE * (t0 + t1)):
                probe, probe_rate = method, rate
        return probe if best == "none" and probing else best

    def _method_costs(self, method: str, band: str, memo: dict) -> tuple[bool, float, float, float]:
        """(collapsed in `band`, propose line's fixed part and per depth, follow-up) of `method`: the same for
        every request of a step, so kept in the step's memo."""
        key = (None, method, band)
        if key not in memo:
            fixed, per_depth = self.draft_cost(method)
            memo[key] = (self.is_collapsed(method, band), fixed, per_depth, self.follow_up_s.get(method, 0.0))
        return memo[key]

    def _survival(self, request, method: str, n: int, band: str, memo: dict) -> tuple[tuple, list[float]]:
        """(key, survival of `method`'s draft to depths 1..n for the request (request_survival)): what
        choose_method reads on every pass of a step whatever the pricing. The request's traffic level
        (AcceptanceHistory.request_level), the same for each of its model drafters, is kept in `memo`. A model
        drafter the request has not drafted with is expected at its rating (at the request's context bucket)
        times that level: the same survival for each such request of the step, kept once in `memo` under
        the key returned (at 16 fresh code requests a step, pricing each drafter for each request was a
        third of the choice); else the key is the request's own."""
        if method in LOOKUPS:
            return (request.request_id, method), self.request_survival(request, method, n, explore=True)
        level = self._level(request, band, memo)
        if method in request.spec_stats.by_method or request.spec_params.method == method:
            return (request.request_id, method), self.request_survival(request, method, n, explore=True, level=level)
        key = (None, method, band, context_bucket(request.num_tokens), level, n)
        if key not in memo:
            memo[key] = self.request_survival(request, method, n, explore=True, level=level)
        return key, memo[key]

    def _level(self, request, band: str, memo: dict) -> float:
        """The request's traffic level (AcceptanceHistory.request_level), kept in the step's `memo`."""
        key = (request.request_id, "level")
        if key not in memo:
            memo[key] = self.history.request_level(request.spec_stats.by_method, band, request.num_tokens)
        return memo[key]

    def _catch_up(self, request, method: str, n: int, band: str, behind: Callable[[object, str], int],
                  survive: list[float]) -> float:
        """A model drafter's catch-up for the request, per step it serves (catch_up_s over steps_left): 0 where
        it is in step with the request."""
        rows = behind(request, method)
        if not rows:
            return 0.0
        alpha = survive[0] if survive else 0.0          # a model drafter's survival is alpha ** d
        return self.catch_up_s(method, rows, steps_left(request, alpha, n, self.run_steps(
            method, band, request.request_id)))

    def leave_s(self, request, drafter: str | None, behind: Callable[[object, str], int] | None) -> float:
        """What a step without the request's own model drafter costs it later. A drafter in step with the
        request (it drafted last step) skips the steps it is not chosen for and, when next chosen, first
        catches up on them in a forward of its own (c0 + c1 * rows); staying costs its follow-up observe of
        the step's rows instead (already in its rate). The difference is charged whole to the step that
        leaves (a lookup or plain decoding), not spread over the steps the request has left like a first
        catch-up: it is paid on every return. A head's catch-up costs about its follow-up (MTP 1.8 ms +
        0.07 ms a row against 1.9 ms), so it leaves nearly free; the draft model, with no follow-up, pays
        a 1.2 ms forward on each return beside a 10 ms step."""
        if drafter is None or behind is None or drafter not in self.draft_step_s or behind(request, drafter):
            return 0.0
        return max(self.catch_up_s(drafter, 1) - self.follow_up_s.get(drafter, 0.0), 0.0)

    def kept_drafter(self, request, lengths: dict[str, int], base: float | None = None,
                     level: float | None = None) -> str | None:
        """The request's own drafter (own_drafter), None (free choice) while it is collapsed or while the
        request accepts from it less than ABANDON_RATIO x what another candidate drafter is expected to
        accept (a drafter that does not suit this request's text). While the server rates it below
        KEEP_RATIO x another at the request's context now, the best rated there: a request that grew into
        the contexts where its drafter falls apart (acceptance.AcceptanceHistory.set_probe_context; an
        agentic turn of 222 tokens took the embedded draft model, which accepted 0.57 a position to 0.59 for
        EAGLE-3 there, and kept it past 300 tokens, where it accepts 0.3-0.4). Not a free choice: the request's
        own counts with its drafter were taken at the shorter contexts and would keep it. A request that
        has not drafted with a model drafter yet and is an explorer gets the one explorer() names (`base`: the
        request's share of the step it prices with; `level`: its request_level, where the caller has it)."""
        drafter, band = own_drafter(request), band_of(request)
        if drafter is None:
            return self.explorer(request, lengths, base)
        if self.is_collapsed(drafter, band):
            return None
        others = [m for m in lengths if m not in LOOKUPS and m != drafter and not self.is_collapsed(m, band)]
        if not others:
            return drafter
        if (self.request_alpha(request, drafter, level=level)
                < ABANDON_RATIO * max(self.request_alpha(request, m, level=level) for m in others)):
            return None
        rated = {m: self.history.rating(m, band, request.num_tokens) or 0.0 for m in (drafter, *others)}
        best = max(others, key=rated.get)
        return best if 0.0 < rated[drafter] < KEEP_RATIO * rated[best] else drafter

    def explorer(self, request, lengths: dict[str, int], base: float | None = None) -> str | None:
        """The drafter an exploring request takes: one request in EXPLORE_EVERY (by a hash of its id, so the
        same request always is or is not one) takes, of the candidate probed drafters that could still lead,
        the one with the least traffic in its band, so that each drafter's traffic ratio
        (AcceptanceHistory.rating) is measured on the server's own text. A drafter could still lead while,
        at its rating plus EXPLORE_Z_RATIO standard errors of its traffic ratio, it would give as many
        tokens per second as the best does at its rating, each priced with its own propose and follow-up
        costs at its best depth (_best_rate at the request's share `base` of the step): with no traffic a
        drafter at 0.9 of the best is tried (~13 % at 0.6 acceptance) where it costs the same, after ~100
        of its positions it is not, and the explorers stop paying for a question the traffic has answered
        (at T = 0.8 one explorer on the draft model accepted 3 of 18 drafts and plain-decoded or took a
        lookup on 66 of its 86 steps). Rated on acceptance alone, MTP (probe level with EAGLE-3, 1.5 ms a
        depth dearer) was explored on one code request in 16, each 10-15 % slower than on EAGLE-3, though
        at no acceptance its probe allowed could it have led. None for the rest: they take the best rated.
        The probe replaces an upper confidence bound for probed drafters: rated at their probe plus a bound,
        untried drafters took the first requests of a band, one of them EAGLE-1 (probe 0.47, bound 0.60),
        which accepted 2 of 8 and plain-decoded 40 of its 79 steps."""
        if zlib.crc32(request.request_id.encode()) % EXPLORE_EVERY:
            return None
        band = band_of(request)
        rated = {m: self.history.rating(m, band, request.num_tokens) for m in lengths if m not in LOOKUPS}
        rated = {m: r for m, r in rated.items() if r is not None and not self.is_collapsed(m, band)}
        if len(rated) < 2:
            return None
        t0, t1 = self.step_line(base)
        k = max(max(lengths[m] for m in rated), 1)              # the depth a model drafter could draft

        def rate(m: str, alpha: float) -> float:
            fixed, per_depth = self.draft_cost(m)
            return self._best_rate(alpha, k, t0, t1, per_depth, fixed + self.follow_up_s.get(m, 0.0))
        best = max(rate(m, r) for m, r in rated.items())

        def seen(m: str) -> float:
            return self.history.traffic_positions(m, band)

        def could_lead(m: str, r: float) -> bool:
            spread = ((1.0 - r) / (r * (seen(m) + EXPLORE_PRIOR))) ** 0.5     # relative, of its traffic ratio
            return rate(m, r * (1.0 + EXPLORE_Z_RATIO * spread)) >= best
        candidates = [m for m, r in rated.items() if could_lead(m, r)]
        if len(candidates) < 2:
            return None
        return min(candidates, key=seen)

    @staticmethod
    def _best_rate(a: float | Sequence[float], n: int, t0: float, t1: float, d: float,
                   follow_up: float = 0.0) -> float:
        """max over L in 1..n of (1 + s_1 + ... + s_L) / (t0 + t1 (1 + L) + d L + follow_up), s_j the chance
        the draft survives to depth j: a's entries (request_survival), or a ** j for one acceptance a.
        Concave tokens (s_j never grows) over a cost that grows linearly: the ratio rises to its peak and
        then falls, so the first fall ends the search."""
        survive = None if isinstance(a, (int, float)) else a
        tokens, term, best = 1.0, 1.0, 0.0
        for depth in range(1, n + 1):
            term = term * a if survive is None else survive[depth - 1]
            tokens += term
            rate = tokens / (t0 + t1 * (1 + depth) + d * depth + follow_up)
            if rate <= best:
                break
            best = rate
        return best


def own_drafter(request) -> str | None:
    """The model drafter an `auto` request drafts with when it does not take a lookup: the one it drafted
    with most, normally the first it chose (GoodputPolicy.kept_drafter). Which drafter suits the target is
    the server's question, answered over many requests; per request, a few dozen noisy positions per
    drafter at T = 0.8 had `auto` flip between drafters, each flip a catch-up forward, and accept fewer
    tokens per step than its best drafter alone (1.72 against 2.2)."""
    rows = [(row[0], m) for m, row in request.spec_stats.by_method.items() if m not in LOOKUPS and m != "none"]
    return max(rows)[1] if rows else None
