"""With a seed, speculation changes nothing: a seeded sampled request emits plain seeded decoding's tokens,
token for token, whatever the method, k, batch, token budget, preemption or prefix cache (coupled
sampling, sampling/coupled.py).

The matrix: methods none, ngram, prediction, draft, eagle3, mtp, hybrid, suffix, auto (the server default)
x k in {1, 4} (17 cells: none has no k) x five conditions: alone (batch 1), all cells at once (17 concurrent),
a token budget of 6 per
step (chunked prefills, k cut to the budget, 1-token final chunks), a KV cache so small that requests
are preempted mid-request and recomputed, and a prefix-cache hit. Each cell's request has its own seed
and prompt, T = 0.8, top-p 0.9 and a presence penalty; its reference is the same request decoded plainly
(method none) alone. The target is a tiny random 8-layer Llama with two MTP layers that also serves as
its own draft model (so coupled drafts are often accepted); the EAGLE-3 head is random. The goodput
policy runs in the prefix-cache condition, so its cuts of seeded requests are covered too.

A planted bug (noise keyed by the step's first position instead of each row's) must break the matrix.
"""
from __future__ import annotations

import pytest
from test_spec_draft_model import encode, make_engine
from test_spec_eagle3 import eagle_weights, write_eagle_original
from test_spec_mtp import write_mtp_target

from specserve.sampling import coupled
from specserve.sampling.params import SamplingParams
from specserve.server.api.params import choice_seed
from specserve.speculators.base import SpecParams

METHODS = ("ngram", "prediction", "draft", "eagle3", "mtp", "hybrid", "suffix", "auto")
CELLS = [("none", 0)] + [(m, k) for m in METHODS for k in (1, 4)]
MAX_TOKENS = 16
TEXTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n",
         "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
         "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2,"]


def params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5, max_tokens=MAX_TOKENS,
                          ignore_eos=True, seed=seed)


def cell_seed(c: int) -> int:
    return 1000 + 7919 * c


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeded")
    return {"target": write_mtp_target(root / "target", "deepseek_v3", num_mtp=2),
            "eagle3": write_eagle_original(root / "eagle3", eagle_weights(seed=9))}


def spec_engine(dirs, **kw):
    kw.setdefault("speculation_policy", "fixed")
    return make_engine(dirs["target"], draft_model=str(dirs["target"]), eagle3=str(dirs["eagle3"]),
                       max_speculative_tokens=4, **kw)


@pytest.fixture(scope="module")
def engines(dirs):
    # 16 x 16 KiB (an 8-layer fp32 target block) shared with the drafters' mirrored caches leaves 6 target
    # blocks: 13 requests of ~40 + 16 tokens (4 blocks each) are preempted over and over, mid-request
    return {"base": spec_engine(dirs, enable_prefix_caching=False),
            "prefix": spec_engine(dirs, speculation_policy="goodput"),
            "budget": spec_engine(dirs, max_num_batched_tokens=6, enable_prefix_caching=False),
            "small": spec_engine(dirs, kv_gb=16 * 16384 / 2**30, enable_prefix_caching=False)}


@pytest.fixture(scope="module")
def prompts(engines):
    return encode(engines["base"], TEXTS)


@pytest.fixture(scope="module")
def references(engines, prompts) -> list[list[int]]:
    """Per cell: its request decoded plainly and alone."""
    eng = engines["base"]
    return [eng.generate([prompts[c % 3]], params(cell_seed(c)))[0].token_ids for c in range(len(CELLS))]


def prediction(ref: list[int]) -> list[int]:
    """The plain text with two wrong tokens: accepted runs, a rejection, then re-alignment."""
    wrong = list(ref)
    for i in (3, 9):
        wrong[i] = (wrong[i] + 1) % 100
    return wrong


def run(eng, prompts, refs, cells: list[int], together: bool):
    """Generate the given cells' requests (all in one batch, or one by one) -> completions in cell order."""
    reqs = [(prompts[c % 3], params(cell_seed(c)), SpecParams(*CELLS[c]),
             prediction(refs[c]) if CELLS[c][0] == "prediction" else None) for c in cells]
    if together:
        return eng.generate([r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs], [r[3] for r in reqs])
    return [eng.generate([p], sp, sc, [pr])[0] for p, sp, sc, pr in reqs]


def mismatches(condition: str, outs, refs, cells: list[int]) -> list[str]:
    """'condition method k=..: first differing position i' for every cell whose text is not the plain one."""
    bad = []
    for c, out in zip(cells, outs):
        ref = refs[c]
        if out.token_ids != ref:
            first = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b),
                         min(len(ref), len(out.token_ids)))
            bad.append(f"{condition} {CELLS[c][0]} k={CELLS[c][1]}: first mismatch at token {first}")
    return bad


def watch_preemptions(eng) -> list[int]:
    """Output lengths of the requests the scheduler preempts from now on."""
    seen: list[int] = []
    sched = eng.engine.scheduler
    original = sched._preempt

    def preempt(req, out):
        seen.append(req.num_output_tokens)
        original(req, out)
    sched._preempt = preempt
    return seen


ALL = list(range(len(CELLS)))


def test_alone_each_cell_equals_plain_seeded_decoding_and_speculates(engines, prompts, references):
    outs = run(engines["base"], prompts, references, ALL, together=False)
    assert mismatches("alone", outs, references, ALL) == []
    for (method, k), out in zip(CELLS, outs):
        if k and method not in ("ngram", "suffix"):     # sampled random text rarely repeats a span: lookups
                                                         # find nothing
            assert out.spec_stats.num_draft_tokens > 0, method
    accepted = {m: sum(o.spec_stats.num_accepted_tokens for (mm, _), o in zip(CELLS, outs) if mm == m)
                for m in ("prediction", "draft")}
    assert min(accepted.values()) > 4, accepted        # coupled drafts are accepted: bonus paths run
    assert len({tuple(r) for r in references}) == len(references)


@pytest.mark.parametrize("condition", ["concurrent", "budget", "small", "prefix"])
def test_every_condition_keeps_every_cells_text(engines, prompts, references, condition):
    eng = engines["base" if condition == "concurrent" else condition]
    bm = eng.engine.scheduler.bm
    preempted = watch_preemptions(eng) if condition == "small" else []
    if condition == "prefix":
        run(eng, prompts, references, ALL, together=True)            # warms the cache with every prompt
    hits_before = bm.num_cache_hits
    outs = run(eng, prompts, references, ALL, together=True)
    assert mismatches(condition, outs, references, ALL) == []
    if condition == "small":
        assert any(n > 0 for n in preempted), preempted              # preempted mid-request, recomputed
    if condition == "prefix":
        assert bm.num_cache_hits - hits_before >= 16 * len(ALL)
    if condition == "budget":
        assert sum(o.spec_stats.cuts.get("token_budget", 0) for o in outs) > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_n_choices_reproduce_and_differ(engines, prompts):
    base = engines["base"]
    seeds = [choice_seed(4242, i) for i in range(2)]                 # what the API gives choices 0 and 1
    refs = [base.generate([prompts[0]], params(s))[0].token_ids for s in seeds]
    assert refs[0] != refs[1]
    for spec in (SpecParams("draft", 4), SpecParams("hybrid", 4), SpecParams("mtp", 1)):
        outs = base.generate([prompts[0]] * 2, [params(s) for s in seeds], spec)
        assert [o.token_ids for o in outs] == refs, spec


def test_noise_keyed_by_step_instead_of_position_breaks_the_matrix(engines, prompts, references, monkeypatch):
    # The planted bug: every row of a step (target rows and drafts alike) gets the noise of the step's
    # first position. Plain decoding is unaffected (one row per step), speculation is not.
    monkeypatch.setattr(coupled, "absolute_positions", lambda first, offset: first)
    cells = [c for c, (m, k) in enumerate(CELLS) if k == 4 and m in ("prediction", "draft", "mtp")]
    bad = mismatches("alone", run(engines["base"], prompts, references, cells, together=False), references, cells)
    assert len(bad) >= 2, bad
    print("planted bug caught:", "; ".join(bad))
