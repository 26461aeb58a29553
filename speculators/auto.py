"""`auto`: each step, each request drafts with the loaded method expected to pay most, or none.

The members are every other loaded method but `prediction` (it needs a request's own prediction) and
`hybrid` (its lookup and its drafter are members themselves).
Context lookups (suffix, ngram) draft first, in microseconds, so the choice knows whether they have a
draft and how long it is (a lookup draft that another one's continues is offered at the longer length:
continue_agreeing; a sampled request whose drafter is in step with it skips them on most steps:
spec_policy.skips_lookups); a model drafter (draft, eagle3, eagle, mtp) may draft up to k. A chooser
then picks per request from those lengths and what the request and the server have accepted per method
(a request whose last lookup draft was emitted whole and whose same lookup drafts all k again keeps it
without being priced: `choose`):
the engine's goodput policy (server/engine/method_choice.py `choose_methods`: expected tokens per second,
from the measured step cost and draft cost per depth, a model drafter's forward shared by the requests
choosing it), else `longest_lookup`. Only the chosen model
drafter runs; the lookups' drafts are reused. Of the model drafters a request uses one, the first it took
(method_choice.own_drafter): the start-up probe's paired comparison, scaled by the level the server's traffic
shows, says which drafter suits the target (acceptance.AcceptanceHistory.rating), and one request in
EXPLORE_EVERY takes the drafter with the least traffic so that the comparison keeps being measured on the
server's own text; each step the request still chooses between that drafter, the lookups and none.

Why it stays exact: the choice reads the context and past acceptance, never this step's target logits,
and each method's drafts come with that method's own draft distribution.

Keeping stateful members in sync: every member that observes target states (a draft model's KV, an
EAGLE-3 / MTP head) observes every step of every `auto` request, as under the hybrid; a head with a
state stash passes over the steps it did not draft and catches up from the stash, in one forward, when
it is next chosen (speculators/hidden_drafter.py). Every member forgets a released request, and the
suffix cache receives its finished output whichever method drafted it.

Worked example, k = 8: an agent repeats an earlier request -> suffix has 8 drafts (the earlier answer)
and wins; a step later the answer departs from the earlier one and no lookup matches -> a model drafter
if loaded and its acceptance pays for its draft forwards, else plain decoding for that step.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from specserve.speculators.base import (
    BuildContext,
    DraftProposal,
    SpecRequest,
    Speculator,
    VerifiedStep,
    count_depths,
)

LOOKUPS = ("suffix", "ngram")           # members whose draft is known before choosing (no model)
NOT_MEMBERS = ("prediction", "hybrid")   # hybrid: its lookup and its drafter are members
MIN_LOOKUP = 2                          # longest_lookup: drafts below this fall to a model drafter

# chooser(requests, ks, lengths: per request, method -> drafts it would verify) -> per request, a member's
# name or "none": all of a step's requests at once (a model drafter's forward is shared by those choosing it)
Chooser = Callable[[Sequence[SpecRequest], Sequence[int], list[dict[str, int]]], list[str]]


def longest_lookup(request: SpecRequest, k: int, lengths: dict[str, int]) -> str:
    """The chooser without a cost model: the longest lookup draft (>= MIN_LOOKUP), else the first model
    drafter, else the longest lookup draft, else none."""
    lookups = {m: n for m, n in lengths.items() if m in LOOKUPS and n > 0}
    best = max(lookups, key=lookups.get, default=None)
    if best is not None and lookups[best] >= MIN_LOOKUP:
        return best
    model = next((m for m in lengths if m not in LOOKUPS), None)
    return model or best or "none"


def each_longest_lookup(requests: Sequence[SpecRequest], ks: Sequence[int],
                        lengths: list[dict[str, int]]) -> list[str]:
    return [longest_lookup(r, k, n) for r, k, n in zip(requests, ks, lengths)]


def continue_agreeing(drafts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each lookup's draft continued by the longest other lookup draft it is a prefix of.

    Two lookups that agree predict the same text, and the one that stopped sooner only knew less of it:
    suffix cuts its draft where its match count says (a short match drafts a few tokens), n-gram drafts
    all k from its last occurrence. On fresh prose at T = 0 the two agreed on the first token in 72 of 74
    steps where both drafted, suffix's shorter draft was taken in 58 of them, and n-gram's longer one would
    have had 216 tokens accepted where suffix's had 173. The method keeps its name (its acceptance
    history then measures the drafts it is really verified with) and its draft stays deterministic."""
    out = dict(drafts)
    for m, draft in drafts.items():
        if draft:
            longer = max((d for o, d in drafts.items() if o != m and len(d) > len(draft)
                          and d[:len(draft)] == draft), key=len, default=None)
            if longer is not None:
                out[m] = list(longer)
    return out


class AutoSpeculator(Speculator):
    name = "auto"

    def __init__(self, loaded: dict[str, Speculator]) -> None:
        # the engine's table of loaded speculators, read when used: methods registered after this one
        # (a plugin's) are members too
        self._loaded = loaded
        self._seen: tuple[int, ...] = ()
        self.members: dict[str, Speculator] = {}
        self.synced: list[Speculator] = []       # distinct members that observe target states
        self._synced_names: list[str] = []
        self.observe_seconds: dict[str, float] = {}   # member -> seconds its last observe took
        self.chooser: Chooser = each_longest_lookup
        self._lookup_drafts: dict[str, dict[str, list[int]]] = {}    # request id -> method -> draft
        self.lookup_seconds: dict[str, tuple[float, int]] = {}    # lookup -> (seconds, requests) of the last choose
        self.choice_seconds: tuple[float, int] = (0.0, 0)   # the last choose besides its lookups, requests not resting
        # request id -> (position, lookup, draft) offered and not yet scored (score_offers)
        self._offered: dict[str, list[tuple[int, str, list[int]]]] = {}
        # request id -> the lookups whose draft offered at its latest offering step it went on to emit whole
        self._whole: dict[str, tuple[str, ...]] = {}
        # told of each offer scored: (request, lookup, draft length, accepted); the engine's acceptance
        # history per depth (AcceptanceHistory.observe_offer)
        self.on_scored: Callable[[SpecRequest, str, int, int], None] | None = None
        self._refresh()

    def _refresh(self) -> None:
        now = tuple(id(s) for s in self._loaded.values())
        if now == self._seen:
            return
        self._seen = now
        self.members = {m: s for m, s in self._loaded.items() if m not in NOT_MEMBERS and s is not self}
        synced: dict[int, tuple[str, Speculator]] = {}
        for name, spec in self.members.items():
            spec = getattr(spec, "fallback", spec)          # the hybrid's drafter is a member's object
            if type(spec).observe is not Speculator.observe:
                synced.setdefault(id(spec), (name, spec))
        self.synced = [spec for _, spec in synced.values()]
        self._synced_names = [name for name, _ in synced.values()]

    @classmethod
    def build(cls, ctx: BuildContext) -> AutoSpeculator:
        return cls(ctx.loaded)

    def choose(self, requests: Sequence[SpecRequest], ks: Sequence[int], chooser: Chooser | None = None,
               resting: Callable[[SpecRequest], bool] | None = None,
               no_lookups: Callable[[SpecRequest], bool] | None = None) -> list[str]:
        """The method each request drafts with this step ("none": plain decoding). Requests `resting` says
        to leave alone plain-decode without running a lookup (the goodput policy's: recently cut ones);
        requests `no_lookups` says choose between the model drafters and none without running the lookups
        (the policy's: sampled requests whose drafter is in step with them, on most steps).

        A request that emitted the whole of a lookup's latest draft and whose same lookup now drafts all of
        its k keeps that lookup, the other lookups not run, without the chooser pricing it: a lookup's draft costs
        nothing more to verify than any other draft of that length, and a model drafter would have to beat
        an acceptance the request has just shown while paying for its forwards. Copying text (a repeated
        answer, an edited file) chains such steps: at batch 1 on repeated requests, `auto` ran 0.96-0.97x
        suffix alone at the same 8.09 tokens a step, its pricing ~0.1 ms of a ~12 ms step.

        Its own time besides the lookups goes to choice_seconds, with the requests it did not leave resting."""
        start = time.perf_counter()
        self._refresh()
        for r in requests:
            self.score_offers(r)
        chooser = chooser or self.chooser
        live = [i for i, (r, k) in enumerate(zip(requests, ks)) if k > 0 and not (resting and resting(r))]
        reqs, live_ks = [requests[i] for i in live], [ks[i] for i in live]
        looked = [j for j, r in enumerate(reqs) if not (no_lookups and no_lookups(r))]
        lookups = self.lookups()
        found: dict[str, list[list[int]]] = {m: [[] for _ in reqs] for m in lookups}
        self.lookup_seconds = {m: (0.0, 0) for m in lookups}
        kept: dict[int, str] = {}               # request -> the lookup it keeps unpriced
        whole = {j: w for j in looked if (w := self._whole.get(reqs[j].request_id))}
        for m in lookups if whole else ():      # the lookups emitted whole first: one drafting all k is kept
            first = [j for j, w in whole.items() if m in w and j not in kept]
            self._run_lookup(m, reqs, live_ks, first, found[m])
            kept.update((j, m) for j in first if len(found[m][j]) >= live_ks[j] > 0)
        for m in lookups:
            self._run_lookup(m, reqs, live_ks, [j for j in looked if j not in kept and m not in whole.get(j, ())],
                             found[m])
        lengths, looked_set = [], set(looked)
        for j, (req, k) in enumerate(zip(reqs, live_ks)):
            drafts = {m: found[m][j] for m in found}
            drafts = drafts if j in kept else continue_agreeing(drafts)
            self._lookup_drafts[req.request_id] = drafts
            if j in looked_set:
                self._offer(req, drafts)
            if j not in kept:
                lengths.append({m: (len(drafts[m]) if m in drafts else k) for m in self.members})
        priced = [j for j in range(len(reqs)) if j not in kept]
        chosen = iter(chooser([reqs[j] for j in priced], [live_ks[j] for j in priced], lengths) if priced else [])
        choices = ["none"] * len(requests)
        for j, i in enumerate(live):
            choices[i] = kept[j] if j in kept else next(chosen)
        looking = sum(seconds for seconds, _ in self.lookup_seconds.values())
        self.choice_seconds = (max(time.perf_counter() - start - looking, 0.0), len(reqs))
        return choices

    def _run_lookup(self, method: str, reqs: Sequence[SpecRequest], ks: Sequence[int], idx: list[int],
                    out: list[list[int]]) -> None:
        """Lookup `method`'s drafts for reqs[idx] into out[idx]; its time goes to lookup_seconds."""
        if not idx:
            return
        start = time.perf_counter()
        got = self.members[method].propose([reqs[j] for j in idx], [ks[j] for j in idx]).token_ids
        seconds, asked = self.lookup_seconds[method]
        self.lookup_seconds[method] = (seconds + time.perf_counter() - start, asked + len(idx))
        for j, ids in zip(idx, got):
            out[j] = ids

    def _offer(self, request: SpecRequest, drafts: dict[str, list[int]]) -> None:
        offered = [(request.num_tokens, m, d) for m, d in drafts.items() if d]
        if offered:
            self._offered.setdefault(request.request_id, []).extend(offered)

    def score_offers(self, request: SpecRequest) -> None:
        """Score the lookup drafts offered to `request` at earlier steps, chosen or not, against the tokens it
        emitted since, once each outcome is known (a mismatch, or the whole draft matched): attempted and
        accepted positions per lookup and depth in `spec_stats.lookup_depths` (over all depths:
        `lookup_score`), as verification would have counted them (a deterministic draft token is accepted
        exactly when it is the token the target emits, greedy or sampled). Counted from the drafts verified
        only, a lookup was measured on the steps the other one had no draft, the hard ones: on prose at
        T = 0, n-gram, taken at 4 such steps, accepted 0 of its 19 drafts and was not chosen again in that
        request, where alone it ran 2.9x plain decoding against suffix's 2.6x. Reads only tokens already
        emitted: the choice stays exact."""
        pending = self._offered.get(request.request_id)
        self._whole.pop(request.request_id, None)
        if not pending:
            return
        end, depths, keep, whole = request.num_tokens, request.spec_stats.lookup_depths, [], []
        first, latest = min(pos for pos, _, _ in pending), max(pos for pos, _, _ in pending)
        emitted = request.token_slice(first, end)          # one slice for all of the request's offers
        for pos, method, draft in pending:
            got = emitted[pos - first:pos - first + len(draft)]
            accepted = 0
            while accepted < len(got) and got[accepted] == draft[accepted]:
                accepted += 1
            if accepted == len(got) and accepted < len(draft):
                keep.append((pos, method, draft))          # matched so far: the rest is still to come
                continue
            count_depths(depths.setdefault(method, [[], []]), len(draft), accepted)
            if self.on_scored is not None:
                self.on_scored(request, method, len(draft), accepted)
            if accepted == len(draft) and pos == latest:
                whole.append(method)
        self._offered[request.request_id] = keep
        if whole:
            self._whole[request.request_id] = tuple(whole)

    def lookups(self) -> list[str]:
        """The loaded members that `choose` runs for every request it does not leave resting."""
        self._refresh()
        return [m for m in LOOKUPS if m in self.members]

    def drafts(self, method: str, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        """Member `method`'s drafts for requests that chose it: a lookup's from `choose`, else its own."""
        if method in LOOKUPS:
            ids = [self._lookup_drafts.get(r.request_id, {}).get(method, [])[:k] for r, k in zip(requests, ks)]
            return DraftProposal(ids, [None] * len(ids))
        return self.members[method].propose(requests, ks)

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        choices = self.choose(requests, ks)
        ids: list[list[int]] = [[] for _ in requests]
        probs: list = [None] * len(requests)
        for method in dict.fromkeys(choices):
            if method == "none":
                continue
            idx = [i for i, m in enumerate(choices) if m == method]
            got = self.drafts(method, [requests[i] for i in idx], [ks[i] for i in idx])
            for j, i in enumerate(idx):
                ids[i], probs[i] = got.token_ids[j], got.draft_probs[j]
        return DraftProposal(ids, probs)

    def observe(self, step: VerifiedStep) -> None:
        self._refresh()
        self.observe_seconds = {}
        for name, spec in zip(self._synced_names, self.synced):
            start = time.perf_counter()
            spec.observe(step)
            self.observe_seconds[name] = time.perf_counter() - start

    def release(self, request: SpecRequest) -> None:
        self._lookup_drafts.pop(request.request_id, None)
        self._offered.pop(request.request_id, None)
        self._whole.pop(request.request_id, None)
        for spec in self.members.values():
            spec.release(request)
