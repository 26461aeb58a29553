"""How `auto` prices its candidates (server/engine/method_choice.py): each at its best depth, a model drafter's
forward shared by the group that really forms, catch-ups spread over the runs they serve, probes that cost no more
than a share of the step."""
import pytest
from test_spec_policy import T0, T1, fitted_policy, seq

from specserve.server.engine.acceptance import CONTEXT_BASE
from specserve.server.engine.method_choice import MethodChoice
from specserve.server.engine.scheduler import ScheduledSeq
from specserve.server.engine.spec_policy import PROBE_EVERY, GoodputPolicy
from specserve.speculators.auto import LOOKUPS


def test_auto_rates_each_method_at_its_best_depth():
    """A model drafter at depth 8 pays 8 draft forwards; at its best depth it beats a lookup that the
    full-depth rating would prefer."""
    p = fitted_policy()
    p.observe_propose("draft", 0.004, 1)
    alphas = {"draft": 0.85, "ngram": 0.62}
    p.request_alpha = lambda request, method, explore=False, level=None: alphas[method]
    lengths = {"draft": 8, "ngram": 4}

    def rate(m, n):
        d = p.draft_step_s.get(m, 0.0)
        return sum(alphas[m] ** j for j in range(n + 1)) / (T0 + T1 * (1 + n) + d * n)
    at_length = max(lengths, key=lambda m: rate(m, lengths[m]))
    at_best = max(lengths, key=lambda m: max(rate(m, n) for n in range(1, lengths[m] + 1)))
    assert (at_length, at_best) == ("ngram", "draft")              # the two ratings disagree here
    assert p.choose_method(seq("r", 8).request, 8, lengths) == "draft"


def test_auto_prices_a_model_drafter_shared_by_the_batch_that_chooses_it():
    """16 requests, each with a weak lookup draft (alpha 0.45, 2 tokens) and a model drafter (alpha 0.7,
    2.6 ms per depth). Priced alone the lookup wins; in the batch each request's share of the step is small
    and the drafter's forward is paid once by all 16, so the drafter wins; at batch 1 both agree."""
    t0, t1 = 0.0126, 0.00057
    p = fitted_policy(t0, t1)
    p.observe_propose("eagle3", 0.0026, 1)
    alphas = {"eagle3": 0.7, "ngram": 0.45}
    p.request_alpha = lambda request, method, explore=False, level=None: alphas[method]
    lengths = {"eagle3": 8, "ngram": 2}
    reqs = [seq(f"r{i}", 8).request for i in range(16)]
    assert p.choose_method(reqs[0], 8, lengths) == "ngram"
    assert p.choose_methods(reqs[:1], [8], [lengths], num_seqs=1) == ["ngram"]
    assert p.choose_methods(reqs, [8] * 16, [lengths] * 16, num_seqs=16) == ["eagle3"] * 16


def test_auto_prices_catching_a_request_up_by_the_rows_it_skipped():
    """A drafter auto did not use for a request last step must first read the rows it skipped (stash read,
    unseen tokens) in one forward, c0 + c1 * rows, paid once for every later step: it is spread over the steps
    the request has left at the drafter's tokens per step (at most AMORTIZE_MAX_STEPS). So a request far
    behind with its reply ahead of it takes the head, the same request one token from its end takes the
    lookup, and a max_tokens far beyond the reply does not make the rows free. Before the fit has samples, a
    catch-up costs one draft forward."""
    p = fitted_policy()
    p.observe_propose("eagle3", 0.001, 1)
    alphas = {"eagle3": 0.8, "ngram": 0.6}
    p.request_alpha = lambda request, method, explore=False, level=None: alphas[method]
    lengths = {"eagle3": 8, "ngram": 3}
    r = seq("r", 8).request                          # max_tokens 64, nothing generated yet
    assert p.choose_method(r, 8, lengths) == "eagle3"
    assert p.catch_up_s("eagle3", 500) == pytest.approx(0.001) and p.catch_up_s("eagle3", 0) == 0.0
    for i in range(40):
        rows = 1 + (i * 37) % 400
        p.observe_catch_up("eagle3", 0.002 + 0.0002 * rows, rows)    # 2 ms + 0.2 ms per row
    assert p.catch_up_s("eagle3", 100) == pytest.approx(0.022, rel=1e-3)
    assert p.catch_up_s("eagle3", 100, steps=10) == pytest.approx(0.0022, rel=1e-3)
    rows = {"far": 300, "near": 4, "drafting": 0}
    behind = {name: (lambda request, method, n=n: n if method == "eagle3" else 0) for name, n in rows.items()}
    assert [p.choose_method(r, 8, lengths, behind=behind[n]) for n in rows] == ["eagle3", "eagle3", "eagle3"]
    assert p.choose_methods([r], [8], [lengths], behind=behind["far"]) == ["eagle3"]
    ending = seq("ending", 8).request
    ending.output_token_ids = [5] * 63               # one token left: the 300 rows would serve one step
    assert [p.choose_method(ending, 8, lengths, behind=behind[n]) for n in rows] == ["ngram", "eagle3", "eagle3"]
    # 300 rows = 62 ms: spread over 64 tokens (~15 steps at 4.3 tokens a step) they pay, over 32 steps at
    # most they pay too; a catch-up of 3000 rows (602 ms) spread over 32 steps (19 ms a step) does not,
    # however large max_tokens is
    huge = seq("huge", 8, max_tokens=100_000).request
    assert p.choose_method(huge, 8, lengths, behind=lambda request, method: 3000 * (method == "eagle3")) == "ngram"
    assert p.choose_method(huge, 8, lengths, behind=behind["far"]) == "eagle3"


def test_a_catch_up_is_spread_over_no_more_steps_than_the_drafters_runs_have_lasted():
    """A catch-up serves the steps the drafter then drafts in a row: where its runs for `auto` requests end
    after a step or two (a lookup drafts between them), a return is priced at about the whole catch-up, not
    spread over the request's remaining steps. The ledger hands each ended run to the policy."""
    from specserve.server.engine.catch_up import CatchUpLedger
    ledger = CatchUpLedger()
    assert ledger.step("a", "eagle3") is None and ledger.step("a", "eagle3") is None
    assert ledger.step("a", None) == ("eagle3", 2)                    # a lookup ended the run
    assert ledger.step("a", "eagle3") is None
    assert ledger.forget("a") == ("eagle3", 1) and ledger.forget("a") is None

    p = fitted_policy()
    p.observe_propose("eagle3", 0.001, 1)
    alphas = {"eagle3": 0.8, "ngram": 0.6}
    p.request_alpha = lambda request, method, explore=False, level=None: alphas[method]
    for i in range(40):
        rows = 1 + (i * 37) % 400
        p.observe_catch_up("eagle3", 0.002 + 0.0002 * rows, rows)    # 2 ms + 0.2 ms per row
    lengths = {"eagle3": 8, "ngram": 3}
    r = seq("r", 8).request
    behind = lambda request, method: 300 if method == "eagle3" else 0  # noqa: E731 (62 ms to catch up)
    assert p.run_steps("eagle3", "greedy") is None
    assert p.choose_method(r, 8, lengths, behind=behind) == "eagle3"  # spread over the request's steps
    for steps in (1, 2, 1, 2):
        p.observe_run("eagle3", steps, "greedy")
    assert p.run_steps("eagle3", "greedy") == pytest.approx(1.5, rel=0.05)
    assert p.choose_method(r, 8, lengths, behind=behind) == "ngram"   # priced over 1.5 steps
    assert p.run_steps("eagle3", "sampled") is None                   # per band
    # a request's own runs count beside the server's mean (RUN_PRIOR runs of it): a request whose text
    # keeps the drafter for 30 steps at a time is priced for long runs on a server of short ones
    long = seq("long", 8).request
    for _ in range(4):
        p.observe_run("eagle3", 30, "greedy", "long")
    assert p.run_steps("eagle3", "greedy", "long") == pytest.approx((120 + 2 * p.run_steps("eagle3", "greedy"))
                                                                     / 6, rel=1e-6)
    assert p.choose_method(long, 8, lengths, behind=behind) == "eagle3"
    short = seq("short", 8).request                                   # and the other way round
    for _ in range(6):
        p.observe_run("eagle3", 1, "greedy", "short")
    assert p.run_steps("eagle3", "greedy", "short") < 4.0
    assert p.choose_method(short, 8, lengths, behind=behind) == "ngram"
    p.forget_runs("long")
    assert p.run_steps("eagle3", "greedy", "long") == p.run_steps("eagle3", "greedy")


def _crowd(alphas: list[float]):
    """16 auto requests whose only candidate is the draft model (4 ms a depth), on a 12.6 ms + 0.57 ms/row step."""
    t0, t1 = 0.0126, 0.00057
    p = fitted_policy(t0, t1)
    p.observe_propose("draft", 0.004, 1)
    reqs = [seq(f"r{i}", 8).request for i in range(len(alphas))]
    by_id = {r.request_id: a for r, a in zip(reqs, alphas)}
    p.request_alpha = lambda request, method, explore=False, level=None: by_id[request.request_id]
    return p, reqs, t0 / len(reqs)


def test_auto_prices_a_shared_drafter_at_the_group_that_really_forms():
    """Priced as if the whole step shared it, the draft model draws 8 of 16 requests; priced at those 8, 4
    stay; a two-pass choice stopped there and those 4 paid a forward that, split four ways, does not pay
    for them. The passes go on until no choice changes: the result prices every request at its final group."""
    from collections import Counter
    p, reqs, base = _crowd([0.3 + 0.65 * i / 15 for i in range(16)])
    lengths = [{"draft": 8}] * 16
    first = [p.choose_method(r, 8, n, base, 16) for r, n in zip(reqs, lengths)]
    groups = Counter(first)
    second = [p.choose_method(r, 8, n, base, {"draft": groups["draft"] + (mine != "draft")})
              for r, n, mine in zip(reqs, lengths, first)]
    assert first.count("draft") == 8 and second.count("draft") == 4
    assert [p.choose_method(r, 8, n, base, 4) for r, n, m in zip(reqs, lengths, second) if m == "draft"] \
        == ["none"] * 4                                              # at 4 the forward does not pay
    chosen = p.choose_methods(reqs, [8] * 16, lengths, num_seqs=16)
    final = Counter(chosen)
    assert [p.choose_method(r, 8, n, base, {"draft": final["draft"] + (m != "draft")})
            for r, n, m in zip(reqs, lengths, chosen)] == chosen      # a fixed point
    assert chosen == ["none"] * 16
    # where the group pays at its own size, it forms and stays
    p, reqs, base = _crowd([0.85] * 16)
    assert p.choose_methods(reqs, [8] * 16, lengths, num_seqs=16) == ["draft"] * 16


def test_a_probe_takes_a_model_drafter_only_where_its_forward_is_cheap_beside_the_step():
    """A request that drafted nothing for PROBE_EVERY - 1 steps drafts one position. A lookup's probe costs a
    row; a model drafter's a forward of its own: alone (a 13 ms step) the 4 ms forward is taken, in a step of
    16 (a 1.4 ms share) it is not, and a lookup's draft is probed there instead."""
    p, reqs, base = _crowd([0.3] * 16)
    r = reqs[0]
    p.dry[r.request_id] = PROBE_EVERY - 1
    assert p.choose_method(r, 8, {"draft": 8}) == "draft"                        # batch 1
    assert p.choose_method(r, 8, {"draft": 8}, base, 16) == "none"               # crowded
    assert p.choose_method(r, 8, {"draft": 8, "ngram": 2}, base, 16) == "ngram"
    p.dry[r.request_id] = 0
    assert p.choose_method(r, 8, {"draft": 8, "ngram": 2}, base, 16) == "none"   # not probing: none pays most


def test_the_best_depth_search_stops_at_the_first_fall_and_finds_the_same_best_as_every_depth():
    """_best_rate ends its search where the rate first falls (tokens concave, cost linear in the depth): on
    random acceptances, lengths and costs it gives the best over every depth."""
    import random

    from specserve.server.engine.method_choice import MethodChoice

    def every_depth(a, n, t0, t1, d, follow_up):
        tokens, term, best = 1.0, 1.0, 0.0
        for depth in range(1, n + 1):
            term *= a
            tokens += term
            best = max(best, tokens / (t0 + t1 * (1 + depth) + d * depth + follow_up))
        return best
    rng = random.Random(7)
    for _ in range(5000):
        args = (rng.random(), rng.randint(1, 12), rng.uniform(1e-4, 0.02), rng.uniform(0.0, 2e-3),
                rng.uniform(0.0, 3e-3), rng.uniform(0.0, 3e-3))
        assert MethodChoice._best_rate(*args) == pytest.approx(every_depth(*args), rel=1e-12)


def test_a_lookup_is_priced_by_its_acceptance_at_each_depth():
    """A lookup's draft is copied text: wrong from its first token, or right for many. Here the server's
    n-gram drafts of 8 were either rejected at once or accepted whole, and an `auto` request's
    first three n-gram offers missed. Per depth, its next 8-token draft has a fair chance at depth 1 and
    then little chance of a miss: it beats a head (alpha 0.75, 2 ms a depth) and is verified whole. Priced at
    one acceptance per position from the same counts (0.5), the head would win and the trim would cut it."""
    p = fitted_policy()
    p.observe_propose("eagle3", 0.002, 1)
    for i in range(20):
        p.observe_acceptance("ngram", 8, 8 * (i % 2))
        p.history.observe_offer("ngram", 8, 8 * (i % 2))
    real = p.request_alpha
    p.request_alpha = lambda request, method, explore=False, level=None: (0.75 if method == "eagle3"
                                                                          else real(request, method))
    r = seq("r", 8, method="auto").request
    r.spec_stats.lookup_depths["ngram"] = [[3], [0]]          # three offers, each missed at its first token
    survive = p.request_survival(r, "ngram", 8)
    assert survive[0] == pytest.approx(0.32, abs=0.02) and survive[7] > 0.75 * survive[0]
    alpha = p.request_alpha(r, "ngram")
    assert alpha == pytest.approx(0.5, abs=0.02)
    head = MethodChoice._best_rate(0.75, 8, T0, T1, 0.002)
    assert MethodChoice._best_rate(survive, 8, T0, T1, 0.0) > head > MethodChoice._best_rate(alpha, 8, T0, T1, 0.0)
    assert p.choose_method(r, 8, {"eagle3": 8, "ngram": 8}) == "ngram"
    s = ScheduledSeq(r, 1, 8)
    p.trim([s], ["ngram"])
    assert s.num_draft_slots == 8
    plain = seq("plain", 8).request                      # not `auto`: no offers scored, one acceptance
    assert p.request_survival(plain, "ngram", 3) == pytest.approx([real(plain, "ngram") ** d for d in (1, 2, 3)])


def test_a_drafter_that_cannot_lead_even_without_a_catch_up_is_not_priced_for_one():
    """A catch-up only lowers a model drafter's rate, so a drafter below the best candidate without one is
    left there: its rows behind are never read. One that could lead is priced with its catch-up, which can
    still cost it the lead. On its probe step a request still prices a drafter that could be its probe."""
    p = fitted_policy()
    p.observe_propose("eagle3", 0.001, 1)
    for i in range(40):
        rows = 1 + (i * 37) % 400
        p.observe_catch_up("eagle3", 0.002 + 0.0002 * rows, rows)    # 2 ms + 0.2 ms per row
    alphas = {"eagle3": 0.3, "ngram": 0.6}
    p.request_alpha = lambda request, method, explore=False, level=None: alphas[method]
    lengths = {"ngram": 3, "eagle3": 8}
    asked = []

    def behind(request, method):
        asked.append(method)
        return 3000 if method == "eagle3" else 0
    r = seq("r", 8).request
    assert p.choose_method(r, 8, lengths, behind=behind) == "ngram" and asked == []
    alphas["eagle3"] = 0.95                        # leads without its catch-up, not with 3000 rows of it
    assert p.choose_method(r, 8, lengths, behind=behind) == "ngram" and asked == ["eagle3"]
    assert p.choose_method(r, 8, lengths, behind=lambda request, method: 0) == "eagle3"
    alphas["eagle3"], asked[:] = 0.01, []
    weak = {"eagle3": 8}                           # below plain decoding even without a catch-up
    assert p.choose_method(r, 8, weak, behind=behind) == "none" and asked == []
    p.dry[r.request_id] = PROBE_EVERY - 1          # its probe step: the drafter is priced, and probes
    assert p.choose_method(r, 8, weak, behind=behind) == "eagle3" and asked == ["eagle3"]


def test_the_drafters_fresh_requests_have_not_used_are_priced_once_a_step_for_all_of_them():
    """The fresh `auto` requests of a step at one context bucket expect each model drafter at its rating times
    the same level (1: no drafter seen): its survival is computed once a step per bucket, not once a request,
    and the step's choices are the ones pricing every request on its own gives."""
    class PerRequest(GoodputPolicy):
        def _survival(self, request, method, n, band, memo):
            level = None if method in LOOKUPS else self._level(request, band, memo)
            return (request.request_id, method), self.request_survival(request, method, n, explore=True, level=level)

    def policy(cls):
        p = cls()
        for i in range(64):
            n = 1 + (i * 7) % 80
            p.observe_step(n, 0.0126 + 0.00057 * n)
        for m, accepted in (("eagle3", 290.0), ("mtp", 270.0), ("draft", 230.0)):
            p.history.set_probe(m, "greedy", accepted, 400.0)
            p.observe_propose(m, 0.0026, 1)
        return p

    fresh = [seq(f"fresh{i}", 8, method="auto").request for i in range(12)]
    long_ = seq("long", 8, method="auto").request
    long_.prompt_token_ids = [1] * (2 * CONTEXT_BASE)
    used = seq("used", 8, method="auto").request
    used.spec_stats.by_method["eagle3"] = [4, 12, 3, 7]           # steps, drafts, accepted, attempted
    reqs = [*fresh, long_, used]
    lengths = [{"ngram": 4 * (i % 2), "eagle3": 8, "mtp": 8, "draft": 8} for i in range(len(reqs))]
    shared, alone = policy(GoodputPolicy), policy(PerRequest)
    priced = []
    survival = shared.request_survival
    shared.request_survival = lambda r, m, *a, **kw: priced.append((r.request_id, m)) or survival(r, m, *a, **kw)
    chosen = shared.choose_methods(reqs, [8] * len(reqs), lengths, num_seqs=len(reqs))
    assert chosen == alone.choose_methods(reqs, [8] * len(reqs), lengths, num_seqs=len(reqs))
    assert set(chosen) >= {"eagle3", "ngram"}, chosen
    drafters = [(r, m) for r, m in priced if m != "ngram"]
    assert len([r for r, _ in drafters if r.startswith("fresh")]) == 3          # 36 priced one by one
    assert len([r for r, _ in drafters if r == "long"]) == 3                     # its own bucket
    assert [m for r, m in drafters if r == "used"] == ["eagle3"]                 # its own counts
