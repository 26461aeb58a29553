"""Routes each scheduled request to the speculator it chose and books speculation statistics.

Requests with different methods and k share the step; each method proposes once for its group.
A request whose speculator proposes fewer than its k (e.g. no n-gram match) verifies fewer drafts;
a step where it proposes none is a plain decode step for that request.

A head that keeps a state stash (`records_states`) passes over, in its own observe, the requests it has
not drafted for since it last observed them (e.g. the goodput policy cut them to no drafts) and catches
up from the stash, in one forward, the next time it drafts (speculators/hidden_drafter.py). Under load,
where the policy cuts most drafts, the heads then cost (almost) nothing.

`auto` requests (speculators/auto.py) get a method per step before the policy trims: the goodput
policy's `choose_method` picks it from the lookups' draft lengths, the request's acceptance per method and
the measured costs; the step is then booked under the chosen method (metrics' `method` label, the
request's `speculation.by_method`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from specserve.sampling.outputs import SeqSamplingOutput
from specserve.server.engine.acceptance import band_of
from specserve.server.engine.catch_up import CatchUpLedger
from specserve.server.engine.request import Request
from specserve.server.engine.scheduler import ScheduledSeq
from specserve.server.engine.spec_policy import GoodputPolicy
from specserve.server.engine.stats import SpecStepStats, StepStats
from specserve.speculators import registry
from specserve.speculators.base import Speculator, VerifiedStep, count_accepted_positions
from specserve.speculators.tree_shape import check_tree

# Every CALIBRATE_EVERY steps, each method with at least CALIBRATION_EVIDENCE positions of greedy history
# hands it to its drafter's tree score (Speculator.calibrate_trees); the start-up probe's 12 count
# (spec_probe.PRIOR_POSITIONS)
CALIBRATE_EVERY = 16
CALIBRATION_EVIDENCE = 12.0


def drafts_per_depth(method: str) -> bool:
    """Whether a method's drafting costs a forward per draft position (a model drafter, or the hybrid,
    which falls back to one) rather than one lookup per request whatever its length."""
    return method in registry.MODEL_DRAFTERS or method == "hybrid"


def validate_spec(spec, validator: Callable[[str], Callable[[dict], None]] = registry.validator) -> None:
    """ValueError for options the chosen method does not take; `validator(method)` -> its options check
    (the registry's, from the class, when no model is loaded: the engine process's front end)."""
    if spec.method == "none":
        registry.validator("none")(spec.options)
        return
    validator(spec.method)(spec.options)
    if spec.draft_tree is not None:
        check_tree(spec.draft_tree, spec.num_speculative_tokens, spec.method)


class SpecDispatcher:
    def __init__(self, speculators: dict[str, Speculator] | None = None, policy=None) -> None:
        self.speculators = dict(speculators or {})    # method -> Speculator
        self.policy = policy                          # GoodputPolicy or None: learns draft costs and acceptance
        self._auto_policy = GoodputPolicy()           # auto's estimates when the server runs no policy
        self._chosen: dict[str, str] = {}             # auto request id -> its method this step
        self._previous: dict[str, str] = {}           # auto request id -> its method the step before
        self.ledger = CatchUpLedger()                 # rows each model drafter is behind on each auto request
        self._updates = 0                             # steps booked (update calls): trees recalibrate every few
        self._drafted_methods: set[str] = set()       # methods (auto's members too) that drafted this step
        # per seq of the last propose: a draft tree's parents (speculators/draft_tree.py), or None (a chain)
        self.tree_parents: list[list[int] | None] = []
        self._tree_ids: set[str] = set()              # requests that verify a draft tree this step
        self.trees_allowed = True                     # False: a sharded target (builder.py)
        self.observe_s = 0.0                          # seconds the last observe spent in the speculators' own

    @property
    def learner(self) -> GoodputPolicy:
        """Where acceptance and draft costs are learned: the goodput policy, else auto's own."""
        return self.policy if self.policy is not None else self._auto_policy

    @property
    def methods(self) -> list[str]:
        return ["none", *self.speculators]

    def validate(self, spec) -> None:
        """Reject method options the chosen speculator does not understand (ValueError -> HTTP 400)."""
        validate_spec(spec, lambda method: self.speculators[method].validate)
        if spec.draft_tree is not None and spec.draft_tree.top_k > 1 and not self.trees_allowed:
            raise ValueError("draft trees are not available with --tensor-parallel-size > 1")

    def propose(self, seqs: list[ScheduledSeq], stats: StepStats
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        methods = self._choose(seqs)
        if self.policy is not None:          # cuts num_draft_slots where drafting does not pay; counted
            cut = self.policy.trim(seqs, methods)
            if cut:
                stats.spec_refused["load"] = stats.spec_refused.get("load", 0) + cut
        self.learner.note_drafting(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[torch.Tensor | None] = [None for _ in seqs]
        self.tree_parents = [None for _ in seqs]
        self._tree_ids = set()
        groups: dict[tuple[str, bool], list[int]] = {}     # (method, chosen by auto) -> seqs
        for i, seq in enumerate(seqs):
            if seq.num_draft_slots > 0:
                groups.setdefault((methods[i], seq.request.spec_params.method == "auto"), []).append(i)
        self._drafted_methods = {method for method, _ in groups}
        self._book_runs(seqs, methods)
        for (method, by_auto), idx in groups.items():
            ks = [seqs[i].num_draft_slots for i in idx]
            reqs = [seqs[i].request for i in idx]
            per_depth = drafts_per_depth(method)
            drafter = self._drafter(method, by_auto) if per_depth else None
            if drafter is not None:
                drafter.last_catch_up_s, drafter.last_catch_up_rows = 0.0, 0   # the hybrid's may not run
            t0 = time.perf_counter()
            if by_auto:
                proposal = self.speculators["auto"].drafts(method, reqs, ks)
            else:
                proposal = self.speculators[method].propose(reqs, ks)
            seconds = time.perf_counter() - t0
            if drafter is not None:             # a catch-up is no draft step's price
                self.learner.observe_propose(method, seconds - drafter.last_catch_up_s,
                                             max(_forwards(r, k) for r, k in zip(reqs, ks)))
                if by_auto:                     # what auto pays to switch a request to it, per row
                    rows = sum(self.ledger.behind(r, method, self._previous.get(r.request_id)) for r in reqs)
                    if rows and drafter.last_catch_up_s > 0.0:
                        self.learner.observe_catch_up(method, drafter.last_catch_up_s, rows)
                    for r in reqs:
                        self.ledger.drafted(r, method)
                elif self.learner.catch_up_log is not None and drafter.last_catch_up_rows > 0:
                    # the start-up probe's requests read their prompts: their catch-up line's prior
                    self.learner.catch_up_log.append((method, drafter.last_catch_up_rows, drafter.last_catch_up_s))
            elif not by_auto:                # auto's lookups ran before it chose (their drafts are reused)
                self.learner.observe_lookup(method, seconds, len(reqs))
            for j, i in enumerate(idx):
                k = seqs[i].num_draft_slots
                drafts[i] = list(proposal.token_ids[j][:k])
                p = proposal.draft_probs[j]
                probs[i] = p[:len(drafts[i])] if p is not None else None
                tree = proposal.parents[j] if proposal.parents is not None else None
                if tree is not None and drafts[i]:    # nodes come in depth order: any prefix is a tree
                    self.tree_parents[i] = list(tree[:len(drafts[i])])
                    self._tree_ids.add(seqs[i].request.request_id)
        self._drain_refusals(stats)
        return drafts, probs

    def _book_runs(self, seqs: list[ScheduledSeq], methods: list[str]) -> None:
        """Each `auto` request's run with a model drafter (steps in a row it drafted): a run that ends
        tells the policy how many steps one catch-up served (DraftCosts.observe_run)."""
        for seq, method in zip(seqs, methods):
            req = seq.request
            if req.spec_params.method != "auto" or seq.num_new_tokens > 1:
                continue
            drafter = method if seq.num_draft_slots > 0 and drafts_per_depth(method) else None
            ended = self.ledger.step(req.request_id, drafter)
            if ended is not None:
                self.learner.observe_run(*ended, band_of(req), req.request_id)

    def _drafter(self, method: str, by_auto: bool) -> Speculator:
        """The object whose drafting a propose for `method` runs (the hybrid's is its model drafter)."""
        spec = self.speculators["auto"].members[method] if by_auto else self.speculators[method]
        return getattr(spec, "fallback", spec)

    def _choose(self, seqs: list[ScheduledSeq]) -> list[str]:
        """Each seq's method this step: its own, or for `auto` the chosen one ("none": no drafts)."""
        methods = [seq.request.spec_params.method for seq in seqs]
        self._previous, self._chosen = self._chosen, {}
        auto = [i for i, m in enumerate(methods) if m == "auto" and "auto" in self.speculators]
        if not auto:
            return methods
        live = [i for i in auto if seqs[i].num_draft_slots > 0]
        learner, auto_spec = self.learner, self.speculators["auto"]
        auto_spec.on_scored = self._offer_scored
        choices = auto_spec.choose([seqs[i].request for i in live], [seqs[i].num_draft_slots for i in live],
                                   partial(learner.choose_methods, num_seqs=len(seqs), behind=self._behind),
                                   partial(learner.resting, num_seqs=len(seqs),
                                           lookups=auto_spec.lookups()),
                                   lambda r: learner.skips_lookups(r, self._previous.get(r.request_id))) \
            if live else []
        if live:                        # what resting weighs (the trim: already paid)
            for m, (seconds, num_requests) in auto_spec.lookup_seconds.items():
                learner.observe_lookup(m, seconds, num_requests)
            learner.observe_choice(*auto_spec.choice_seconds)
        chosen = dict(zip(live, choices))
        for i in auto:
            methods[i] = chosen.get(i, "none")
            if methods[i] == "none":
                seqs[i].num_draft_slots = 0
            self._chosen[seqs[i].request.request_id] = methods[i]
        return methods

    def _offer_scored(self, request, method: str, num_draft: int, num_accepted: int) -> None:
        self.learner.history.observe_offer(method, num_draft, num_accepted, band_of(request))

    def _calibrate_trees(self) -> None:
        """Hand each method its greedy acceptance per position, once the server has seen enough of it: a
        tree-drafting drafter scores its greedy nodes by it (speculators/tree_calibration.py)."""
        history = self.learner.history
        for name, spec in self.speculators.items():
            if history.attempted(name, "greedy") >= CALIBRATION_EVIDENCE:
                spec.calibrate_trees(self.learner.alpha(name, 0, 0, "greedy"))

    def _behind(self, request, method: str) -> int:
        return self.ledger.behind(request, method, self._previous.get(request.request_id))

    def _drain_refusals(self, stats: StepStats) -> None:
        """Model-based drafters count what they could not do (no KV room: no drafts this step, or a cached
        prompt prefix left unseen); it goes to spec_decode_refused_total by reason."""
        for spec in self.speculators.values():
            for reason, count in spec.drain_refusals().items():
                stats.spec_refused[reason] = stats.spec_refused.get(reason, 0) + count
        for method, count in self.learner.drain_collapses().items():
            stats.spec_collapsed[method] = stats.spec_collapsed.get(method, 0) + count

    def observe_step(self, seqs: list[ScheduledSeq], drafts: list[list[int]], seconds: float) -> None:
        """Step time for the policy's cost fit: pure decode/verify steps only (no prefill rows). `seconds`
        spans forward, sampling and observe; the speculators' own observes (observe_s) come off it: the
        policy prices them per method as follow-ups, and counted in the step line too they made every
        head's step look a follow-up dearer than it is (EAGLE-3 at T = 0.8: 1.24x predicted, 1.39x run)."""
        if self.policy is not None and all(s.num_new_tokens == 1 for s in seqs):
            self.policy.observe_step(sum(1 + len(d) for d in drafts), max(seconds - self.observe_s, 0.0))

    def update(self, requests: Sequence[Request], sampled: Sequence[SeqSamplingOutput],
               drafts: Sequence[list[int]], stats: StepStats) -> None:
        """Book per-request and per-step counters; let stateful speculators catch up.

        requests/sampled/drafts are aligned: the requests that sampled this step.
        """
        self._updates += 1
        if self._updates % CALIBRATE_EVERY == 0:
            self._calibrate_trees()
        for req, out, d in zip(requests, sampled, drafts):
            method = self._chosen.get(req.request_id, req.spec_params.method)
            req.spec_stats.record(len(d), out.num_accepted)
            if req.request_id in self._chosen:
                req.spec_stats.record_method(method, len(d), out.num_accepted)
            self.learner.observe_acceptance(method, len(d), out.num_accepted, band_of(req), req.num_tokens)
            spec = self.speculators.get(method) if d else None
            drafter = spec.drafter_of(req) if spec is not None else None
            if drafter is not None:     # the same drafter's acceptance: what `auto` rates it by
                self.learner.observe_acceptance(drafter, len(d), out.num_accepted, band_of(req), req.num_tokens)
            if d:
                st = stats.spec.setdefault(method, SpecStepStats())
                self._book_step(st, len(d), out.num_accepted)
                is_tree = req.request_id in self._tree_ids
                st.accepted_depths.append(("tree" if is_tree else "chain", out.num_accepted))
                st.num_tree_nodes += len(d) if is_tree else 0

    def observe(self, seqs: list[ScheduledSeq], computed_before: list[int], accepted: list[int],
                result) -> None:
        """Hand each stateful speculator the target states of its requests from this forward; first let
        the heads that stash states per KV slot record every row (speculators/state_stash.py)."""
        batch = result.batch
        everything = None
        for spec in self.speculators.values():
            if spec.records_states:
                everything = everything or VerifiedStep(
                    requests=[], num_computed_before=[], token_offsets=[], query_lens=[], valid_lens=[],
                    num_accepted=[], sampled=[], hidden=result.hidden, prenorm_hidden=result.prenorm_hidden,
                    aux_hidden=result.aux_hidden)
                spec.record(everything, batch.attn.slot_mapping)
        groups: dict[str, list[int]] = {}
        decode_only = all(s.num_new_tokens == 1 for s in seqs)
        self.observe_s = 0.0
        for i, seq in enumerate(seqs):
            method = seq.request.spec_params.method
            if method in self.speculators and not seq.request.is_finished:
                groups.setdefault(method, []).append(i)
        for method, idx in groups.items():
            start = time.perf_counter()
            self.speculators[method].observe(VerifiedStep(
                requests=[seqs[i].request for i in idx],
                num_computed_before=[computed_before[i] for i in idx],
                token_offsets=[batch.token_offsets[i] for i in idx],
                query_lens=[batch.query_lens[i] for i in idx],
                valid_lens=[seqs[i].num_new_tokens + accepted[i] for i in idx],
                num_accepted=[accepted[i] for i in idx],
                sampled=[seqs[i].samples for i in idx],
                hidden=result.hidden, prenorm_hidden=result.prenorm_hidden, aux_hidden=result.aux_hidden))
            seconds = time.perf_counter() - start
            self.observe_s += seconds
            self._book_observe(method, seconds, decode_only)

    def _book_observe(self, method: str, seconds: float, decode_only: bool) -> None:
        """A head observes the rows of the requests it drafted for: a forward each step it drafts, booked
        to the policy as that method's follow-up cost (auto books each member's own). Only steps where
        the method drafted, without prefill rows (a prompt's first observe is no per-step cost)."""
        if not decode_only:
            return
        if method == "auto":
            for member, secs in self.speculators["auto"].observe_seconds.items():
                if member in self._drafted_methods:
                    self.learner.observe_follow_up(member, secs)
        elif method in self._drafted_methods and drafts_per_depth(method):
            self.learner.observe_follow_up(method, seconds)

    @staticmethod
    def _book_step(st: SpecStepStats, num_draft: int, num_accepted: int) -> None:
        st.num_drafts += 1
        st.num_draft_tokens += num_draft
        st.num_accepted_tokens += num_accepted
        count_accepted_positions(st.accepted_per_pos, num_draft, num_accepted)
        st.tokens_per_step.append(num_accepted + 1)

    def release(self, request: Request) -> None:
        ended = self.ledger.forget(request.request_id)
        if ended is not None:                   # its last run served the steps to the end
            self.learner.observe_run(*ended, band_of(request))
        self.learner.forget_runs(request.request_id)
        spec = self.speculators.get(request.spec_params.method)
        if spec is not None:
            spec.release(request)


def _forwards(request: Request, k: int) -> int:
    """Draft forwards a model drafter runs for a request drafting k positions: one per chain position, one per
    tree depth (a tree of k = 8 nodes and depth 3 costs 3 forwards, not 8)."""
    tree = request.spec_params.draft_tree
    return min(k, tree.depth) if tree is not None else k
