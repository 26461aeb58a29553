"""Continuous-batching scheduler: which requests run this step and how many tokens each. No torch.

Every running request is scheduled as "compute `num_new_tokens` known tokens, then verify up to
`num_draft_slots` draft tokens". A prefill chunk is num_new_tokens = chunk, drafts 0; a plain decode
step is num_new_tokens = 1 (the last emitted token), drafts 0; a speculative step is 1 + k. One code path.

Order of business each step:
  1. running requests in arrival order: reserve slots for their tokens (+ k draft slots); when blocks run
     out, preempt the most recently arrived running request (free its blocks, recompute later);
  2. waiting requests in arrival order while the token budget, max_num_seqs and free blocks allow,
     reusing prefix-cached blocks; long prompts are chunked to the remaining budget.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from specserve.server.engine.request import Request, RequestStatus
from specserve.server.kv.block_manager import BlockManager


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int        # known tokens computed this step, from all_token_ids[num_computed_tokens:]
    num_draft_slots: int = 0   # k reserved for drafts; the speculator may fill fewer
    # True when this step reaches the end of the known tokens, so its last rows are sampled.
    # Fixed at schedule time (update() moves the counters it is computed from).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        r = self.request
        self.samples = r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec_reduced: dict[str, int] = field(default_factory=dict)   # reason -> requests whose k was cut

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft_slots for s in self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if request.status is RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.finish(request, "abort")

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and free blocks. The request may still be in `running` (update removes it)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
        self.bm.free(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:      # preempted earlier in this loop
                continue
            seq = self._schedule_running(req, budget, out)
            if seq is None:
                continue
            out.seqs.append(seq)
            budget -= seq.num_new_tokens + seq.num_draft_slots
        if not out.preempted:          # memory is short: admitting now would only thrash
            self._admit_waiting(budget, out)
        return out

    def _schedule_running(self, req: Request, budget: int, out: SchedulerOutput) -> ScheduledSeq | None:
        if budget <= 0:
            return None
        need = req.num_tokens - req.num_computed_tokens
        num_new = min(need, budget)
        k = self._draft_slots(req, num_new, need, budget - num_new, out)
        while not self.bm.ensure_slots(req, req.num_computed_tokens + num_new + k):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return None
        return ScheduledSeq(req, num_new, k)

    def _draft_slots(self, req: Request, num_new: int, need: int, budget_left: int,
                     out: SchedulerOutput) -> int:
        """k for this step: drafts only on pure decode steps; never past max_tokens or the context."""
        asked = req.spec_params.k
        if asked == 0 or num_new != need or need != 1:
            return 0
        remaining = req.sampling_params.max_tokens - req.num_output_tokens - 1
        room = self.max_model_len - req.num_tokens
        k = max(0, min(asked, remaining, room))
        # Cutting k is safe for every request: greedy and seeded sampled text do not depend on it
        # (sampling/coupled.py), unseeded sampled text keeps its distribution.
        if budget_left < k:
            out.spec_reduced["token_budget"] = out.spec_reduced.get("token_budget", 0) + 1
            req.spec_stats.cut("token_budget")
            k = max(0, budget_left)
        return k

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.block_ids and not req.needs_prompt_logprobs:
                req.num_computed_tokens = self.bm.allocate_cached_prefix(req)
                if req.num_output_tokens == 0:
                    req.num_cached_prompt_tokens = req.num_computed_tokens
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.bm.ensure_slots(req, req.num_computed_tokens + num_new):
                # Wait for blocks. Give the cached-prefix blocks back (they stay hashed in the free
                # list) so a waiting request never holds blocks that running ones need.
                self.bm.free(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, num_new, 0))
            budget -= num_new

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Preempt by recompute: forget the KV cache, requeue at the front."""
        self.running.remove(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        out.seqs[:] = [s for s in out.seqs if s.request is not req]

    # -- after the forward -------------------------------------------------------------------------
    def update(self, seq: ScheduledSeq, num_accepted: int, new_token_ids: list[int]) -> None:
        """Advance the computed-token count and append the emitted tokens.

        A sampled step computed [known tokens..., d_1..d_k]; KV for the known tokens and the accepted
        drafts d_1..d_a is valid, the rest is forgotten (rollback is this counter alone).
        """
        req = seq.request
        req.num_computed_tokens += seq.num_new_tokens + (num_accepted if seq.samples else 0)
        req.output_token_ids.extend(new_token_ids)
        self.bm.cache_computed_blocks(req)

    def remove_finished(self) -> None:
        self.running = [r for r in self.running if r.status is not RequestStatus.FINISHED]
