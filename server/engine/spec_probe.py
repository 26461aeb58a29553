"""Start-up acceptance probe: every loaded model drafter drafts a few dozen tokens before the first request.

`auto` rates a drafter by what the server has seen it accept (spec_policy.GoodputPolicy.request_alpha).
A fresh server has seen nothing, so its first requests explore: in one benchmark's first 8 requests at
T = 0.8, 92 of their 413 steps went to the two weakest drafters. And a drafter's first calls are its
slowest (EAGLE-3's first follow-up observe: 3.5 ms beside a steady 1.1 ms). The probe pays both before
traffic: each model drafter (registry.MODEL_DRAFTERS that are loaded) continues four built-in texts, two
pieces of code and two paragraphs of prose, greedy and then at T = 0.8 (seeded), `tokens` new tokens each,
at k = the server's largest (--max-speculative-tokens, 8 by default), through the engine's own step: a
round per text and temperature, every drafter's request at once, so each drafter's forward has one row as
a lone request's has (with a row per text, four at once, EAGLE-3's follow-up read 1.59 ms where traffic
then measured 1.0 ms, and `auto` at T = 0.8 drafted with the draft model, the slowest of the three alone).

What each drafter accepted is its probe value per band (AcceptanceHistory.set_probe): the paired
comparison `auto` ranks the drafters by, scaled by the level the server's traffic then shows
(AcceptanceHistory.rating). In its history it stays as a prior worth at most PRIOR_POSITIONS positions
per (method, band) (AcceptanceHistory.cap), too little to be the baseline the collapse signal compares
real traffic with (it needs 20 positions). With one text of each kind the ranking followed the texts: MTP
0.70 against EAGLE-3 0.63 greedy, where the code and prose benchmark sets measure EAGLE-3 0.77 / 0.69 and
MTP 0.74 / 0.72; with two of each, 0.68 against 0.65. At k = 4 and 32 tokens the sampled round rated
EAGLE-3 and MTP 0.606 and 0.600, and `auto` drafted with MTP; at k = 8 and 64 tokens, four seeds of it
rated EAGLE-3 above MTP in each (0.628-0.665 against 0.586-0.653), as eight code prompts at T = 0.8
measure them (0.68 against 0.63; EAGLE-3 alone 1.13x plain, MTP 1.08x). Then one longer text (probe_long.txt,
a Python module) cut to 384 tokens, at both temperatures, `tokens` / 2 new tokens: each drafter's value at
that context bucket (AcceptanceHistory.set_probe_context). The embedded draft model, trained on 256-token
sequences, accepted 0.32-0.38 a position at T = 0.8 on agentic turns of 367-563 tokens where EAGLE-3 accepted
0.50 (0.56-0.59 and 0.59-0.66 under 256: loadtest/depth_acceptance.py --by-prompt), and `auto` had drafted
half of them with it.

Last, each drafter drafts alone, a request at a time, at each depth of COST_DEPTHS up to k (adaptive off,
COST_TOKENS new tokens), and the median propose at each depth starts its cost line (DraftCosts.set_draft_prior):
`auto` prices a drafter it seldom takes by that line until traffic re-levels it. The acceptance rounds' own
proposes cannot give it: they are all of depth k but the last few of each request, many of them after a
prompt catch-up, and the line they left read EAGLE-3 at 1.82 ms a depth where its mean per depth was 1.09
(`auto` then rated every drafter below plain decoding at T = 0.8); their mean per depth spreads a propose's
fixed part over 8 depths and priced the draft model's depth 1 at 3.1 ms where it costs 4.6.

Every request of the probe first reads its prompt (a head from the target's state stash, the draft model its
own forward over it), at 40-400 rows: the same forward as an `auto` request's switch to a drafter, which those
reads start the catch-up line of (DraftCosts.set_catch_up_prior), so that `auto` prices a switch by its rows
from the first (one draft forward for any rows, before: MTP's 5-8 ms first uses on agentic turns read ~0.9 ms).

The probe leaves nothing behind but that history and the drafters' costs: the propose lines, follow-up and
catch-up. Not the step-time fit: its steps (every drafter's request at once, k + 1 rows each)
are not traffic's shape, and a line centred on such steps read a lone request's step as 1.3 ms + 0.73 ms
a row where it costs 6 ms + 0.14 ms, so every draft looked dear.
Its requests finish and free their blocks (their prompt blocks stay in the prefix cache, evictable like
any), none carries a suffix-cache scope, and no metric counts them (the server's loop starts after it).
"""
from __future__ import annotations

import importlib.resources
import itertools
import logging
import time

from specserve.sampling.params import SamplingParams
from specserve.server.engine.acceptance import CONTEXT_BASE, context_bucket
from specserve.speculators import registry
from specserve.speculators.base import SpecParams

log = logging.getLogger(__name__)

PRIOR_POSITIONS = 12.0
PROBE_K = 8
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
PROBE_SEED = 0
# the longer contexts: one text (a Python module, probe_long.txt) cut to the middle of context buckets
# b = 1..PROBE_CONTEXT_BUCKETS (384 tokens), those that fit the context window with the new tokens
PROBE_CONTEXT_BUCKETS = 1
COST_DEPTHS = (1, 2, 4, 8)   # the depths each drafter's propose is timed at (those up to the server's k)
COST_TOKENS = 16             # new tokens of each of those requests


def probe_drafters(engine, tokens: int, k: int = PROBE_K) -> dict[tuple[str, str], float]:
    """Run the probe on `engine` (no request may be live) at `k` drafts a step (the server's largest: what
    `auto` requests draft up to) -> (method, band) -> acceptance per position."""
    methods = [m for m in registry.MODEL_DRAFTERS if m in engine.spec.methods]
    if tokens <= 0 or not methods:
        return {}
    start = time.perf_counter()
    room = engine.max_model_len // 2                     # a short context window: half for the prompt
    prompts = [engine.tokenizer.encode(text)[-room:] for text in PROBE_TEXTS]
    long_ids = engine.tokenizer.encode(long_text())
    lengths = [3 * CONTEXT_BASE * 2 ** (b - 1) // 2 for b in range(1, PROBE_CONTEXT_BUCKETS + 1)]
    prompts += [long_ids[:n] for n in lengths
                if n <= len(long_ids) and n + tokens + k + 1 <= engine.max_model_len]
    learner = engine.spec.learner
    learner.catch_up_log = []            # each request's prompt read, at its prompt's rows: set_catch_up_prior
    try:
        ids = run_rounds(engine, methods, prompts, tokens, k)
        counts = {key: (row[0], row[1]) for key, row in learner.history.traffic.items()}   # before the cost round
        lines = time_drafters(engine, methods, prompts[0], k)
        catch_ups = {m: learner.set_catch_up_prior(m, learner.catch_up_log) for m in methods}
    finally:
        learner.catch_up_log = None
    learner.cost.forget()            # its steps' shape (every drafter's requests at once) is not traffic's
    history = learner.history
    seen = {}
    for method in methods:
        for band in ("greedy", "sampled"):
            acc, att = counts.get((method, band, 0), (0.0, 0.0))      # the short texts'
            if att:
                seen[(method, band)] = acc / att
                history.set_probe(method, band, acc, att)
            history.cap(method, band, PRIOR_POSITIONS)
    for band in ("greedy", "sampled"):
        for bucket in sorted({context_bucket(len(p)) for p in prompts} - {0}):
            history.set_probe_context(band, bucket, {m: counts.get((m, band, bucket), (0.0, 0.0)) for m in methods})
    log.info("speculation probe (%d requests x %d tokens, %.1f s): acceptance per position %s; at longer "
             "contexts %s; propose %s; catch-up %s", len(ids), tokens, time.perf_counter() - start,
             ", ".join(f"{m} {b} {a:.2f}" for (m, b), a in sorted(seen.items())),
             ", ".join(f"{m} {b} {CONTEXT_BASE << (c - 1)}+ {a:.2f}"
                       for (m, b, c), a in sorted(history.probed_context.items())) or "none",
             ", ".join(f"{m} {e0 * 1e3:.2f} + {e1 * 1e3:.2f} ms x depth" for m, (e0, e1) in lines.items()) or "untimed",
             ", ".join(f"{m} {c[0] * 1e3:.2f} ms + {c[1] * 1e6:.1f} µs x row" for m, c in catch_ups.items() if c)
             or "untimed")
    return seen


def run_rounds(engine, methods: list[str], prompts: list[list[int]], tokens: int, k: int) -> list[str]:
    """The acceptance rounds: each prompt at each temperature, every drafter's request at once. Returns the ids
    of the requests added."""
    ids = []
    for t, (j, prompt) in itertools.product(PROBE_TEMPERATURES, enumerate(prompts)):
        for method in methods:        # a round per text and temperature: a drafter's forward has one row
            new = min(tokens if j < len(PROBE_TEXTS) else tokens // 2, engine.max_model_len - len(prompt) - k - 1)
            params = SamplingParams(temperature=t, max_tokens=max(new, 1), ignore_eos=True,
                                    seed=PROBE_SEED if t else None)
            rid = f"probe-{method}-{t}-{j}"
            try:
                engine.add_request(rid, prompt, params, SpecParams(method, k, adaptive=False))
            except ValueError as exc:        # a KV cache too small for it: probe the rest
                log.info("speculation probe: %s skipped (%s)", rid, exc)
                continue
            ids.append(rid)
        while engine.has_work:
            engine.step()
    return ids


def time_drafters(engine, methods: list[str], prompt: list[int], k: int) -> dict[str, tuple[float, float]]:
    """Each drafter alone on `prompt`, a request at a time, at each depth of COST_DEPTHS up to k, adaptive off
    (T = 0.8, seeded: the band where the drafters' prices decide most): the median propose at each depth
    starts its cost line (DraftCosts.set_draft_prior), the acceptance rounds' lines dropped. -> method -> the
    line (e0, e1) set; a drafter timed at fewer than two depths (k = 1) keeps its mean per depth."""
    learner = engine.spec.learner
    learner.draft_fit.clear()        # the acceptance rounds' proposes: see the module's description
    depths = sorted({min(d, k) for d in COST_DEPTHS})
    new = min(COST_TOKENS, engine.max_model_len - len(prompt) - k - 1)
    if len(depths) < 2 or new < 2:
        return {}
    params = SamplingParams(temperature=PROBE_TEMPERATURES[-1], max_tokens=new, ignore_eos=True, seed=PROBE_SEED)
    learner.propose_log = []
    try:
        for method, depth in itertools.product(methods, depths):
            try:
                engine.add_request(f"probe-cost-{method}-{depth}", prompt, params,
                                   SpecParams(method, depth, adaptive=False))
            except ValueError:       # a KV cache too small for it: that drafter keeps its mean per depth
                continue
            while engine.has_work:
                engine.step()
        log_ = learner.propose_log
    finally:
        learner.propose_log = None
    learner.draft_fit.clear()        # the cost round's own samples, taken again as the prior below
    lines = {m: learner.set_draft_prior(m, log_) for m in methods}
    return {m: line for m, line in lines.items() if line is not None}


def long_text() -> str:
    """The probe's long text: a Python module of ~1,800 tokens of the embedded tokenizer."""
    return importlib.resources.files(__package__).joinpath("probe_long.txt").read_text(encoding="utf-8")
