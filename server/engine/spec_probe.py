"""Start-up acceptance probe: every loaded model drafter drafts a few dozen tokens before the first request.

`auto` rates a drafter by what the server has seen it accept (spec_policy.GoodputPolicy.request_alpha).
A fresh server has seen nothing, so its first requests explore: in one benchmark's first 8 requests at
T = 0.8, 92 of their 413 steps went to the two weakest drafters. And a drafter's first calls are its
slowest (EAGLE-3's first follow-up observe: 3.5 ms beside a steady 1.1 ms). The probe pays both before
traffic: each model drafter (registry.MODEL_DRAFTERS that are loaded) continues two built-in texts, a
piece of code and a paragraph of prose, greedy and at T = 0.8 (seeded), `tokens` new tokens each, k = 4,
all in one batch through the engine's own step. What the drafters accepted is then kept as a prior worth
at most PRIOR_POSITIONS positions per (method, band) (AcceptanceHistory.cap): enough to rank the drafters,
too little to be the baseline the collapse signal compares real traffic with (it needs 20 positions).

The probe leaves nothing behind but that history, the drafters' cost estimates and the step-time fit:
its requests finish and free their blocks (their prompt blocks stay in the prefix cache, evictable like
any), none carries a suffix-cache scope, and no metric counts them (the server's loop starts after it).
"""
from __future__ import annotations

import logging
import time

from specserve.sampling.params import SamplingParams
from specserve.speculators import registry
from specserve.speculators.base import SpecParams

log = logging.getLogger(__name__)

PRIOR_POSITIONS = 12.0
PROBE_K = 4
PROBE_TEXTS = (
    "def merge_sorted(left, right):\n"
    "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    result = []\n"
    "    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n",
    "The harbour was quiet in the early morning. Fishing boats rocked gently at their moorings, and the "
    "smell of salt and tar hung in the cool air. Along the quay, the first",
)
PROBE_TEMPERATURES = (0.0, 0.8)


def probe_drafters(engine, tokens: int) -> dict[tuple[str, str], float]:
    """Run the probe on `engine` (no request may be live) -> (method, band) -> acceptance per position."""
    methods = [m for m in registry.MODEL_DRAFTERS if m in engine.spec.methods]
    if tokens <= 0 or not methods:
        return {}
    start = time.perf_counter()
    room = engine.max_model_len // 2                     # a short context window: half for the prompt
    prompts = [engine.tokenizer.encode(text)[-room:] for text in PROBE_TEXTS]
    ids = []
    for method in methods:
        for t in PROBE_TEMPERATURES:
            for j, prompt in enumerate(prompts):
                new = min(tokens, engine.max_model_len - len(prompt) - PROBE_K - 1)
                params = SamplingParams(temperature=t, max_tokens=max(new, 1), ignore_eos=True,
                                        seed=0 if t else None)
                rid = f"probe-{method}-{t}-{j}"
                try:
                    engine.add_request(rid, prompt, params, SpecParams(method, PROBE_K, adaptive=False))
                except ValueError as exc:        # a KV cache too small for it: probe the rest
                    log.info("speculation probe: %s skipped (%s)", rid, exc)
                    continue
                ids.append(rid)
    while engine.has_work:
        engine.step()
    history = engine.spec.learner.history
    seen = {}
    for method in methods:
        for band in ("greedy", "sampled"):
            history.cap(method, band, PRIOR_POSITIONS)
            acc, att = history.slow.get((method, band), (0.0, 0.0))
            if att:
                seen[(method, band)] = acc / att
    log.info("speculation probe (%d requests x %d tokens, %.1f s): acceptance per position %s", len(ids), tokens,
             time.perf_counter() - start,
             ", ".join(f"{m} {b} {a:.2f}" for (m, b), a in sorted(seen.items())))
    return seen
