"""Engine: one synchronous step = schedule -> propose -> verify forward -> sample -> update. No asyncio.

Plain decoding is the k = 0 case of the same step: a request without speculation verifies zero drafts.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from specserve.grammar.compiler import GrammarCompiler
from specserve.sampling.outputs import SeqSamplingInput, SeqSamplingOutput
from specserve.sampling.params import SamplingParams
from specserve.sampling.tree_verify import TreeInput, TreeVerifier, node_paths
from specserve.server.engine.detokenizer import IncrementalDetokenizer
from specserve.server.engine.model_runner import ModelRunner, StepResult
from specserve.server.engine.output_builder import (
    build_output,
    prompt_logprobs_rows,
    request_timings,
)
from specserve.server.engine.outputs import RequestOutput
from specserve.server.engine.request import Request
from specserve.server.engine.request_checks import RequestChecks
from specserve.server.engine.scheduler import ScheduledSeq, Scheduler
from specserve.server.engine.spec_dispatch import SpecDispatcher
from specserve.server.engine.stats import SpecStepStats, StepStats
from specserve.server.engine.tokenizer import Tokenizer
from specserve.server.engine.tree_step import accepted_moves, apply_tree_layout, chain_rows, compact_tree_kv
from specserve.speculators.base import SpecParams

log = logging.getLogger(__name__)


def node_grammar_masks(grammar, tokens: list[int], parents: list[int]) -> tuple[torch.Tensor, int]:
    """([N + 1, vocab] bool, N): the grammar's allowed tokens after each tree row's own path. A row whose
    path the grammar forbids or completes is never verified from, so it allows everything."""
    masks = []
    for path in node_paths(tokens, parents):
        mask = grammar.draft_mask(path)
        masks.append(mask)
    vocab = next(m for m in masks if m is not None).shape[0]        # the root's path is always allowed
    full = torch.ones(vocab, dtype=torch.bool)
    return torch.stack([full if m is None else m for m in masks]), len(tokens)


@dataclass
class _Live:
    """Engine-side state of a request that the scheduler does not need."""
    request: Request
    detok: IncrementalDetokenizer
    stop_ids: frozenset[int]
    last_emit_time: float | None = None


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer: Tokenizer, sampler,
                 spec: SpecDispatcher, max_model_len: int, grammars: GrammarCompiler | None = None) -> None:
        self.runner = runner
        self.grammars = grammars      # compiles structured-output constraints; None: they are refused
        self._mask_pool: ThreadPoolExecutor | None = None
        self._trees: TreeVerifier | None = None     # verifies draft trees (built on first use)
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.spec = spec
        self.max_model_len = max_model_len
        self.live: dict[str, _Live] = {}
        self._aborted: list = []      # RequestTimings of aborts, reported with the next step's stats

    # -- requests --------------------------------------------------------------------------------
    @property
    def checks(self) -> RequestChecks:
        bm = self.scheduler.bm
        return RequestChecks(self.runner.cfg.vocab_size, self.max_model_len, bm.block_size, bm.num_blocks)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.checks.validate(prompt_token_ids, params)
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("structured outputs are not available on this engine")
            self.grammars.compile(params.structured)   # GrammarError (a ValueError) names the problem

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    spec: SpecParams, prediction_token_ids: list[int] | None = None,
                    prompt_logprobs: bool = False) -> None:
        if request_id in self.live:
            raise ValueError(f"duplicate request id {request_id}")
        self.validate(prompt_token_ids, params)
        if spec.draft_tree is not None and spec.draft_tree.top_k > 1 and not self.spec.trees_allowed:
            raise ValueError("draft trees are not available with --tensor-parallel-size > 1")
        req = Request(request_id, list(prompt_token_ids), params, spec,
                      prediction_token_ids=prediction_token_ids, needs_prompt_logprobs=prompt_logprobs)
        if params.structured is not None:
            req.grammar = self.grammars.start(params.structured)   # a cache hit: validate compiled it
        # A seeded request carries no generator: its noise is keyed by position (sampling/coupled.py), so
        # nothing about it has to survive a preemption or depend on how many drafts a step verified.
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.eos_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer, list(params.stop), params.include_stop_str_in_output)
        self.live[request_id] = _Live(req, detok, frozenset(stop_ids))
        self.scheduler.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        live = self.live.pop(request_id, None)
        if live is None:
            return None
        self.scheduler.abort(live.request)
        self.spec.release(live.request)
        self._aborted.append(request_timings(live.request, time.monotonic()))
        return build_output(live.request, [], "", None, finished=True)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepStats]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        stats = StepStats(num_preemptions=len(sched.preempted), spec_refused=dict(sched.spec_reduced))
        stats.finished, self._aborted = self._aborted, []
        for req in sched.preempted:
            self.spec.release(req)
        outputs: list[RequestOutput] = []
        if not sched.seqs and not self.scheduler.running and self.scheduler.waiting:
            # Nothing runs and the head cannot be admitted with every block free: it can never run.
            # Admission checks make this unreachable; fail the request rather than spin forever.
            head = self.scheduler.waiting[0]
            log.error("request %s cannot fit in the KV cache; aborting it", head.request_id)
            out = self.abort(head.request_id)
            outputs = [out] if out is not None else []
        if sched.seqs:
            t0 = time.perf_counter()
            drafts, draft_probs = self.spec.propose(sched.seqs, stats)
            proposing = time.perf_counter() - t0
            trees = self.spec.tree_parents            # per seq: a draft tree's parents, or None (a chain)
            masks = self._start_masks(sched.seqs, drafts, trees)
            batch = self.runner.prepare(sched.seqs, drafts)
            if any(t is not None for t in trees):
                apply_tree_layout(batch, sched.seqs, trees, self.runner.block_size, self.runner.device)
            result = self.runner.execute(batch)
            outputs = self._sample_and_update(sched.seqs, drafts, draft_probs, result, stats,
                                              masks.result() if masks is not None else {}, trees)
        self.scheduler.remove_finished()
        if sched.seqs:
            # the whole step but the drafting (priced per method): scheduling, forward, sampling, outputs
            # (the sampler's host copy makes this honest on CUDA too)
            self.spec.observe_step(sched.seqs, drafts, time.perf_counter() - start - proposing)
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)
        stats.kv_cache_usage = self.scheduler.bm.usage
        return outputs, stats

    def _sample_and_update(self, seqs: list[ScheduledSeq], drafts: list[list[int]], draft_probs: list,
                           result: StepResult, stats: StepStats, masks: dict,
                           trees: list[list[int] | None] | None = None) -> list[RequestOutput]:
        batch = result.batch
        trees = trees or [None] * len(seqs)
        computed_before = [s.request.num_computed_tokens for s in seqs]
        inputs: dict[int, SeqSamplingInput] = {}
        rows: dict[int, torch.Tensor] = {}
        for i, seq in enumerate(seqs):
            if not seq.samples:
                continue
            req = seq.request
            start = batch.row_starts[i] + batch.num_prompt_rows[i]
            rows[i] = torch.arange(start, start + 1 + len(drafts[i]))
            inputs[i] = SeqSamplingInput(
                params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids, draft_token_ids=drafts[i],
                draft_probs=draft_probs[i],
                grammar_mask=self._grammar_mask(req, masks.get(i), len(drafts[i]), stats))
        sampling = list(inputs)
        found, paths = self._verify(result, inputs, rows, trees)
        # Stops and max_tokens first: the counters below must see what is really kept (an accepted run can
        # cross a stop token, and its later drafts are then neither output nor valid KV).
        sampled = [self._truncate(seqs[i], found[i]) for i in sampling]
        if paths:
            kept = {i: paths[i][:out.num_accepted] for i, (out, _) in zip(sampling, sampled) if i in paths}
            for i, path in kept.items():
                seqs[i].request.spec_stats.record_tree(len(drafts[i]), len(path))
            src, dst = accepted_moves(batch, seqs, kept)
            compact_tree_kv(self.runner.kv_caches, batch, src, dst)
            result = chain_rows(result, src, dst)
        self.spec.update([seqs[i].request for i in sampling], [out for out, _ in sampled],
                         [drafts[i] for i in sampling], stats)
        outputs: list[RequestOutput] = []
        accepted = [0] * len(seqs)
        it = iter(sampled)
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            req = seq.request
            if req.num_computed_tokens < req.num_prompt_tokens:
                stats.num_prompt_tokens += min(seq.num_new_tokens, req.num_prompt_tokens - req.num_computed_tokens)
            plp = prompt_logprobs_rows(req, seq, batch, i, result.logits) if batch.num_prompt_rows[i] else None
            if seq.samples:
                sample, reason = next(it)
                accepted[i] = sample.num_accepted
                out = self._emit(seq, sample, reason, now, plp, stats)
                stats.num_generation_tokens += len(out.token_ids)
                outputs.append(out)
            else:
                self.scheduler.update(seq, 0, [])
                if plp:
                    outputs.append(build_output(req, [], "", None, prompt_logprobs=plp))
        self.spec.observe(seqs, computed_before, accepted, result)
        return outputs

    def _verify(self, result: StepResult, inputs: dict[int, SeqSamplingInput], rows: dict[int, torch.Tensor],
                trees: list[list[int] | None]) -> tuple[dict[int, SeqSamplingOutput], dict[int, list[int]]]:
        """Chains through the rejection sampler, draft trees through the tree verifier (one batch each):
        seq index -> its output, and seq index -> the accepted tree path (tree requests only)."""
        found: dict[int, SeqSamplingOutput] = {}
        paths: dict[int, list[int]] = {}
        for tree_part in (False, True):
            idx = [i for i in inputs if (trees[i] is not None) == tree_part]
            if not idx:
                continue
            logits = result.logits.index_select(0, torch.cat([rows[i] for i in idx]).to(result.logits.device))
            if not tree_part:
                found.update(zip(idx, self.sampler(logits, [inputs[i] for i in idx])))
                continue
            if self._trees is None:
                self._trees = TreeVerifier(self.sampler.sampler)
            for i, t in zip(idx, self._trees(logits, [TreeInput(inputs[i], trees[i]) for i in idx])):
                found[i], paths[i] = t.out, t.path
        return found, paths

    def _start_masks(self, seqs: list[ScheduledSeq], drafts: list[list[int]],
                     trees: list[list[int] | None] | None = None) -> Future | None:
        """Structured outputs' masks for this step's rows, computed on a worker thread while the target's
        forward runs (the grammar library releases the GIL): seq index -> (mask, leading valid drafts).
        A draft tree's rows get the mask after each node's own path (node_grammar_masks)."""
        trees = trees or [None] * len(seqs)
        work = [(i, s.request.grammar, drafts[i], trees[i]) for i, s in enumerate(seqs)
                if s.samples and s.request.grammar is not None]
        if not work:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-masks")
        return self._mask_pool.submit(lambda: {
            i: grammar.row_masks(d) if tree is None else node_grammar_masks(grammar, d, tree)
            for i, grammar, d, tree in work})

    @staticmethod
    def _grammar_mask(req: Request, found: tuple[torch.Tensor, int] | None, num_drafts: int,
                      stats: StepStats) -> torch.Tensor | None:
        """[num_drafts + 1, vocab] bool: the grammar's allowed tokens at each verification row (None: free
        text). A draft the grammar forbids is counted; the verifier rejects it at its position."""
        if found is None:
            return None
        mask, n_valid = found
        if n_valid < num_drafts:
            req.spec_stats.grammar_rejected += 1
            method = req.spec_params.method
            stats.spec.setdefault(method, SpecStepStats()).num_grammar_rejected += 1
        return mask

    @staticmethod
    def _grammar_finished(req: Request, tok: int) -> bool:
        """Advance the request's grammar over an emitted token; True once the constraint is complete (the
        grammar admits nothing but the end, so the request ends without spending a step on EOS)."""
        if req.grammar is None:
            return False
        req.grammar.commit([tok])
        return req.grammar.is_finished

    def _truncate(self, seq: ScheduledSeq, out: SeqSamplingOutput) -> tuple[SeqSamplingOutput, str | None]:
        """The tokens the request keeps (up to its first stop token, stop string or length limit) and why it
        ends, if it does. num_accepted counts only the kept drafts: the last kept token has no valid KV."""
        req = seq.request
        live = self.live[req.request_id]
        params = req.sampling_params
        emitted: list[int] = []
        reason = None
        for tok in out.token_ids:
            emitted.append(tok)
            n_out = req.num_output_tokens + len(emitted)
            # min_tokens gates stop ids and stop strings alike: the first min_tokens tokens never end it
            may_stop = n_out > params.min_tokens
            stop_str = live.detok.append(tok, may_stop)
            if may_stop and tok in live.stop_ids:
                reason, req.stop_reason = "stop", tok
            elif stop_str is not None:
                reason, req.stop_reason = "stop", stop_str
            elif self._grammar_finished(req, tok):
                reason = "stop"
            elif n_out >= params.max_tokens or req.num_tokens + len(emitted) >= self.max_model_len:
                reason = "length"
            if reason:
                break
        logprobs = out.logprobs[:len(emitted)] if out.logprobs is not None else None
        kept = SeqSamplingOutput(token_ids=emitted, num_accepted=min(out.num_accepted, len(emitted) - 1),
                                 logprobs=logprobs)
        return kept, reason

    def _emit(self, seq: ScheduledSeq, out: SeqSamplingOutput, reason: str | None, now: float, plp,
              stats: StepStats) -> RequestOutput:
        """Book the kept tokens `out` (from _truncate), finish the request if `reason`, build its output."""
        req = seq.request
        live = self.live[req.request_id]
        emitted, logprobs = out.token_ids, out.logprobs
        self.scheduler.update(seq, out.num_accepted, emitted)
        if req.first_token_time is None:
            req.first_token_time = now
        elif live.last_emit_time is not None:
            req.itl.append(now - live.last_emit_time)
        live.last_emit_time = now
        if reason:
            self.scheduler.finish(req, reason)
            self.live.pop(req.request_id, None)
            self.spec.release(req)
            stats.finished.append(request_timings(req, now))
        text = live.detok.delta(finished=reason is not None)
        return build_output(req, emitted, text, logprobs, finished=reason is not None, prompt_logprobs=plp)
