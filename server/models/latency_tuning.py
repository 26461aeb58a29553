"""Drafter linears on the fastest CPU kernel for a few rows, measured at load time.

The target runs every Linear through the packed oneDNN kernel (server/models/linear.py) because its rows
must be bit-identical whatever the batch: greedy speculation compares a token decoded alone with the same
token verified among drafts. A drafter has no such duty: the target verifies every draft, and a sampled
draft is checked against the draft_probs it was actually drawn from, so the drafter's numbers may come
from any kernel. What a drafter needs is latency at 1-16 rows, where the packed oneDNN call is dominated
by its fixed cost (~20 us per call on the 2-core Xeon, whatever the size: a 192x192 bf16 product costs 23
us packed, 5 us through MKL's fp32 sgemv with the casts). The embedded draft model makes 13 such calls per
draft step; off the packed kernel its forward took ~0.9-1.0 ms instead of 1.3-1.8 (bf16, batch 1).

`tune_for_latency(module)` times, for every packed Linear under `module`, the packed kernel against
F.linear on an fp32 copy of the weight (MKL on CPU; the input is cast to fp32 and the result back), at
the row counts a draft step sees, and keeps the fp32 route where it is clearly faster (by FAST_MARGIN).
Large products (an 8192-row lm_head) usually stay packed: there bf16's halved weight bytes win.
Each shape is timed once per process and the answer reused, so two engines built in one process (tests
compare them) make the same choice.

Used for the draft model (speculators/draft_model.py). The EAGLE-3 and MTP heads were measured with it too
and gained nothing (their 512-wide linears are bandwidth-bound: docs/benchmarks.md, 2026-12-01 AMX Xeon),
so they keep the packed kernels. Never call it on a target model or on a module shared with one.
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.server.models.linear import Linear

log = logging.getLogger(__name__)

TUNE_ROWS = (1, 4)        # a decode row and a small batch of them
FAST_MARGIN = 0.9         # switch only when the fp32 route takes < 90 % of the packed kernel's time
TRIALS = 7                # best-of timing per route and row count
CALLS_PER_TRIAL = 5

_decided: dict[tuple, str] = {}     # (out, in, bias, dtype, device) -> "packed" | "fp32"


def _best_time(fn, x: torch.Tensor) -> float:
    fn(x)                                                           # first call: primitive creation, caches
    best = float("inf")
    for _ in range(TRIALS):
        start = time.perf_counter()
        for _ in range(CALLS_PER_TRIAL):
            fn(x)
        best = min(best, time.perf_counter() - start)
    return best


def route_times(linear: Linear) -> tuple[float, float]:
    """(packed, fp32) seconds for TRIALS-best calls summed over TUNE_ROWS."""
    weight = linear.weight
    fast = weight.detach().float().contiguous()
    bias = None if linear.bias is None else linear.bias.detach().float()
    packed = fp32 = 0.0
    with torch.inference_mode():
        for rows in TUNE_ROWS:
            x = torch.randn(rows, linear.in_features, dtype=weight.dtype, device=weight.device)
            packed += _best_time(linear.run_packed, x)
            fp32 += _best_time(lambda t: torch.nn.functional.linear(t.float(), fast, bias).to(t.dtype), x)
    return packed, fp32


def is_latency_tuned(module: torch.nn.Module) -> bool:
    """Whether any Linear under `module` runs on the fp32 route."""
    return any(isinstance(m, Linear) and m.fp32_weight is not None for m in module.modules())


def tune_for_latency(module: torch.nn.Module, label: str = "drafter") -> dict[str, str]:
    """Pick packed or fp32 per packed Linear under `module`; returns {name: "packed" | "fp32"}."""
    chosen: dict[str, str] = {}
    for name, sub in module.named_modules():
        if not isinstance(sub, Linear) or sub.packed is None:
            continue
        key = (sub.out_features, sub.in_features, sub.bias is not None, sub.weight.dtype, sub.weight.device)
        if key not in _decided:
            packed, fp32 = route_times(sub)
            _decided[key] = "fp32" if fp32 < FAST_MARGIN * packed else "packed"
            log.debug("%s %s [%d x %d]: packed %.1f us, fp32 %.1f us -> %s", label, name, sub.out_features,
                      sub.in_features, packed * 1e6 / CALLS_PER_TRIAL, fp32 * 1e6 / CALLS_PER_TRIAL, _decided[key])
        chosen[name] = _decided[key]
        if chosen[name] == "fp32":
            sub.use_fp32_route()
    if chosen:
        log.info("%s linears on the fp32 route: %d of %d", label, sum(v == "fp32" for v in chosen.values()),
                 len(chosen))
    return chosen
