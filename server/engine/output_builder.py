"""Builds RequestOutput values and request timings from engine state."""
from __future__ import annotations

import copy

import torch

from specserve.sampling.outputs import TokenLogprob
from specserve.server.engine.model_runner import StepBatch
from specserve.server.engine.outputs import RequestOutput
from specserve.server.engine.request import Request
from specserve.server.engine.scheduler import ScheduledSeq
from specserve.server.engine.stats import RequestTimings


def build_output(req: Request, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None,
                 finished: bool = False, prompt_logprobs=None) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id, token_ids=token_ids, text=text, logprobs=logprobs,
        finished=finished, finish_reason=req.finish_reason if finished else None,
        stop_reason=req.stop_reason if finished else None,
        num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_prompt_tokens,
        spec_stats=copy.deepcopy(req.spec_stats) if finished else req.spec_stats,
        prompt_logprobs=prompt_logprobs)


def request_timings(req: Request, now: float) -> RequestTimings:
    queued = (req.first_scheduled_time or now) - req.arrival_time
    ttft = req.first_token_time - req.arrival_time if req.first_token_time is not None else None
    return RequestTimings(
        finish_reason=req.finish_reason or "abort", num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens, queue_time=queued, ttft=ttft,
        e2e_latency=now - req.arrival_time, inter_token_latencies=list(req.itl),
        method=req.spec_params.method)


def prompt_logprobs_rows(req: Request, seq: ScheduledSeq, batch: StepBatch, i: int,
                         logits: torch.Tensor) -> list[TokenLogprob | None]:
    """Logprobs of the prompt tokens this chunk predicts (raw model distribution).

    Row r of the chunk (position start + r) predicts the token at position start + r + 1.
    The very first prompt token has no logprob (None), as in OpenAI's echo output.
    """
    n = batch.num_prompt_rows[i]
    start = req.num_computed_tokens
    rows = logits[batch.row_starts[i]:batch.row_starts[i] + n]            # [n, vocab]
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    targets = torch.tensor(req.prompt_token_ids[start + 1:start + 1 + n], device=rows.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    top_n = req.sampling_params.logprobs or 0
    top_vals, top_ids = (logprobs.topk(top_n, dim=-1) if top_n else (None, None))
    out: list[TokenLogprob | None] = [None] if start == 0 else []
    for r in range(n):
        top = list(zip(top_ids[r].tolist(), top_vals[r].tolist())) if top_n else []
        out.append(TokenLogprob(int(targets[r]), float(chosen[r]), top))
    if start + n + 1 >= req.num_prompt_tokens:
        req.needs_prompt_logprobs = False       # collected; do not recompute after a preemption
    return out
