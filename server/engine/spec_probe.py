"""Start-up acceptance probe: every loaded model drafter drafts a few dozen tokens before the first request.

`auto` rates a drafter by what the server has seen it accept (spec_policy.GoodputPolicy.request_alpha).
A fresh server has seen nothing, so its first requests explore: in one benchmark's first 8 requests at
T = 0.8, 92 of their 413 steps went to the two weakest drafters. And a drafter's first calls are its
slowest (EAGLE-3's first follow-up observe: 3.5 ms beside a steady 1.1 ms). The probe pays both before
traffic: each model drafter (registry.MODEL_DRAFTERS that are loaded) continues four built-in texts, two
pieces of code and two paragraphs of prose, greedy and then at T = 0.8 (seeded), `tokens` new tokens each,
k = 4, one batch per temperature through the engine's own step. What the drafters accepted is then kept as
a prior worth at most PRIOR_POSITIONS positions per (method, band) (AcceptanceHistory.cap): enough to rank
the drafters, too little to be the baseline the collapse signal compares real traffic with (it needs 20
positions). With one text of each kind the ranking followed the texts: MTP 0.70 against EAGLE-3 0.63 greedy,
where the code and prose benchmark sets measure EAGLE-3 0.77 / 0.69 and MTP 0.74 / 0.72, and `auto` drafted
fresh code with MTP at 0.9x the speed EAGLE-3 gives it; with two of each, 0.68 against 0.65.

The probe leaves nothing behind but that history and the drafters' cost estimates. Not the step-time
fit: its steps (16 sequences of 5 rows) are not traffic's shape, and a line centred on them read a lone
request's step as 1.3 ms + 0.73 ms a row where it costs 6 ms + 0.14 ms, so every draft looked dear.
Its requests finish and free their blocks (their prompt blocks stay in the prefix cache, evictable like
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
    "class LineCounter:\n"
    "    \"\"\"Count the lines, words and characters of a text file.\"\"\"\n\n"
    "    def __init__(self, path, encoding=\"utf-8\"):\n"
    "        self.path = path\n"
    "        self.encoding = encoding\n\n"
    "    def count(self):\n",
    "The harbour was quiet in the early morning. Fishing boats rocked gently at their moorings, and the "
    "smell of salt and tar hung in the cool air. Along the quay, the first",
    "To install the package, first create a virtual environment and activate it. Then run the installer "
    "with the name of the package and the version you need. If the installation fails, check that",
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
    for t in PROBE_TEMPERATURES:            # a round per temperature: a drafter's forward has a row per text
        for method in methods:
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
    learner = engine.spec.learner
    learner.cost.forget()            # its steps' shape (every drafter's requests at once) is not traffic's
    history = learner.history
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
