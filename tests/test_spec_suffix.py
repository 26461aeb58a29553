"""Suffix decoding (speculators/suffix.py, suffix_index.py): the index finds the longest earlier match and
its most frequent continuation; the cross-request cache is bounded and evicts the oldest first; one cache
scope's texts never draft for another; greedy output is unchanged at batch 1 and in a batch mixed with
other methods; a repeated request drafts its earlier answer."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from test_spec_draft_model import GREEDY, assert_no_leaks, encode, make_engine, write_llama

from specserve.sampling.params import SamplingParams
from specserve.server.api.params import cache_scope
from specserve.speculators.base import SpecParams
from specserve.speculators.suffix import SuffixSpeculator
from specserve.speculators.suffix_index import LEVELS, MAX_MATCH, SEPARATOR, SuffixIndex
from specserve.speculators.suffix_kernels import hash_window


class FakeRequest(SimpleNamespace):
    def token_slice(self, a, b):
        return self.all_token_ids[a:b]

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


def fake(rid, prompt, output=(), scope=None, finished=False, **options):
    return FakeRequest(request_id=rid, all_token_ids=list(prompt) + list(output), output_token_ids=list(output),
                       is_finished=finished, spec_params=SpecParams("suffix", 8, options, cache_scope=scope))


# ------------------------------------------------------------------------- the index
def test_longest_match_and_most_frequent_continuation():
    ix = SuffixIndex(64)
    ix.extend([5, 1, 2, 3, -1, 9, 1, 2, 3, 7, -1, 4, 1, 2, 3, 7])
    found = ix.match(np.array([8, 1, 2, 3]))
    assert sorted(found.ends.tolist()) == [3, 8, 14] and found.length == 3
    draft, expected = ix.continuation(found, 4, 0.1)
    # after "1 2 3": 7 twice (8 -> 9, 14 -> 15), the end of a document once; after "1 2 3 7": -1 and the end
    assert draft == [7] and expected == pytest.approx(2 / 3)
    assert ix.match(np.array([6, 6])) is None
    # the last occurrence has no token after it: it is never a candidate
    assert ix.match(np.array([3, 7]), before=15).ends.tolist() == [9]


def test_match_ignores_windows_across_documents_and_other_scopes():
    ix = SuffixIndex(64)
    ix.extend([1, 2, -1], scope=1)
    ix.extend([3, 4, 5], scope=2)
    assert ix.match(np.array([2, 3])) is None and ix.match(np.array([2, 3]), scope=2) is None
    assert ix.match(np.array([3, 4]), scope=1) is None
    assert ix.match(np.array([3, 4]), scope=2).ends.tolist() == [4]


def test_bounded_memory_evicts_the_oldest_first():
    ix = SuffixIndex(100)
    before = ix.nbytes()
    old = list(range(1000, 1040))
    ix.extend([*old, -1])
    assert ix.match(np.array(old[:10])) is not None
    rng = np.random.default_rng(0)
    for _ in range(5):                                      # 5 x 21 tokens: the first document is overwritten
        ix.extend([*rng.integers(0, 500, 20).tolist(), -1])
    assert ix.size == 100 and ix.nbytes() == before
    assert ix.match(np.array(old[:10])) is None
    recent = ix.tokens[np.arange(ix.end - 21, ix.end - 1) % ix.capacity].astype(np.int64)
    assert ix.match(recent[:8]).ends.tolist() == [ix.end - 21 + 7]


def reference_match(index, tail, scope, enough=MAX_MATCH):
    """The lookup by brute force over the held tokens: the longest level n whose last n tail tokens occur
    (no separator, written by `scope`, a token after them), every such end newest first, and the longest
    match among them measured up to min(len(tail), MAX_MATCH, enough)."""
    held = {p: (int(index.tokens[p % index.capacity]), int(index.scope[p % index.capacity]))
            for p in range(index.oldest, index.end)}
    tail = [int(t) for t in tail]
    for n in LEVELS:
        if len(tail) < n:
            continue
        ends = [e for e in range(index.end - 2, index.oldest + n - 2, -1)
                if held[e][1] == scope and [held[p][0] for p in range(e - n + 1, e + 1)] == tail[-n:]]
        if not ends:
            continue
        if n >= enough:
            return n, ends
        m, best = min(len(tail), MAX_MATCH, enough), n
        for e in ends:
            got = n
            while got < m and e - got in held and held[e - got][0] == tail[-1 - got]:
                got += 1
            best = max(best, got)
        return best, ends
    return None


def reference_continuation(index, ends, max_len, min_prob):
    rows = [[int(index.tokens[p % index.capacity]) if p < index.end else SEPARATOR
             for p in range(e + 1, e + 1 + max_len)] for e in ends]
    out, prob, expected = [], 1.0, 0.0
    for j in range(max_len):
        counts = Counter(r[j] for r in rows if r[j] != SEPARATOR)
        if not counts:
            break
        top = max(counts.values())
        prob *= top / len(rows)
        if prob < min_prob:
            break
        token = next(r[j] for r in rows if counts.get(r[j]) == top)           # ties: the newest
        out.append(token)
        expected += prob
        rows = [r for r in rows if r[j] == token]
    return out, expected


@pytest.mark.parametrize("capacity,growable", [(64, False), (1000, False), (16, True)])
def test_lookups_find_what_a_brute_force_search_finds(capacity, growable):
    """Through separators, two scopes, eviction (capacity 64) and growth (16): the compiled chain walk finds
    the longest match, all its occurrences and their most frequent continuation as a search of every held
    position does; token-by-token appends (a decode step's) build the very same chains as bulk ones."""
    rng = np.random.default_rng(capacity)
    bulk, single = SuffixIndex(capacity, growable), SuffixIndex(capacity, growable)
    for _ in range(40):
        chunk = rng.integers(0, 12, int(rng.integers(1, 40))).tolist() + ([-1] if rng.random() < 0.2 else [])
        scope = 3 if growable else int(rng.integers(3, 5))
        bulk.extend(chunk, scope)
        for token in chunk:
            single.extend([token], scope)
    assert bulk.capacity == single.capacity and np.array_equal(bulk.tokens, single.tokens)
    if bulk.end <= bulk.capacity:     # nothing evicted: the very same chains (with eviction, a bulk append skips
        assert np.array_equal(bulk.head, single.head) and np.array_equal(bulk.prev, single.prev)   # dead windows)
    else:                             # ... and the lookups still agree
        for tail in (rng.integers(0, 12, 40) for _ in range(100)):
            a, b = (index.match(tail, 3) for index in (bulk, single))
            assert (a is None) == (b is None)
            assert a is None or (a.length, a.ends.tolist()) == (b.length, b.ends.tolist())
    found = 0
    for _ in range(300):
        tail = rng.integers(0, 12, int(rng.integers(2, 70)))
        scope = 3 if growable else int(rng.integers(3, 5))
        enough, k, min_prob = int(rng.integers(2, 70)), int(rng.integers(1, 9)), float(rng.choice([0.01, 0.2, 0.5]))
        want = reference_match(bulk, tail, scope, enough)
        got = bulk.match(tail, scope, enough=enough)
        assert (None if got is None else (got.length, got.ends.tolist())) == want
        if want is None:
            assert bulk.draft(tail, scope, k, 1.0, min_prob) == ([], 0.0)
            continue
        found += 1
        draft, expected = bulk.continuation(got, k, min_prob)
        ref_draft, ref_expected = reference_continuation(bulk, want[1], k, min_prob)
        assert draft == ref_draft and expected == pytest.approx(ref_expected)
        full = reference_match(bulk, tail, scope, int(np.ceil(k / 0.5)))           # draft(): cap from the match
        cap = min(k, max(1, int(0.5 * full[0])))
        ref = reference_continuation(bulk, full[1], cap, min_prob)
        draft, expected = bulk.draft(tail, scope, k, 0.5, min_prob)
        assert draft == ref[0] and expected == pytest.approx(ref[1])
    assert found > 50


def test_the_compiled_hash_is_the_documented_one():
    """Every window is pushed on the chain of the bucket its hash (suffix_kernels.hash_window) names."""
    index = SuffixIndex(256)
    text = np.random.default_rng(2).integers(0, 50_000, 100).tolist()
    index.extend(text, 7)
    mask = int(index.mask)
    for li, n in enumerate(LEVELS):
        for end in (n - 1, 50, 99):
            bucket = hash_window(text[end - n + 1:end + 1], n, 7) & mask
            chain, p = [], int(index.head[li, bucket])
            while p >= 0:
                chain.append(p)
                p = int(index.prev[li, p])
            assert end in chain


def test_growable_index_keeps_everything():
    ix = SuffixIndex(16, growable=True)
    seq = list(range(100, 160))
    ix.extend(seq)
    ix.extend(seq[:5])
    assert ix.capacity >= 65 and ix.match(np.array(seq[:5])).ends.tolist() == [4]


# ------------------------------------------------------------------------- the speculator
def test_draft_length_grows_with_the_match():
    spec = SuffixSpeculator(1000, "global")
    body = list(range(200, 220))
    short = fake("a", [*body, 7, 8, 9, 1, 2])             # "1 2" never occurred before: no draft
    assert spec.propose([short], [8]).token_ids == [[]]
    two = fake("b", [1, 2, 50, 51, 52, 53, 54, 55, 1, 2])  # match length 2 -> at most 2 drafts (spec_factor 1)
    assert spec.propose([two], [8]).token_ids == [[50, 51]]
    long = fake("c", [*body, 60, 61, 62, 63, 64, 65, 66, 67, 68, *body])
    assert spec.propose([long], [8]).token_ids == [[60, 61, 62, 63, 64, 65, 66, 67]]
    assert spec.propose([long], [3]).token_ids == [[60, 61, 62]]


def test_a_finished_answer_drafts_for_a_repeat_of_its_prompt():
    spec = SuffixSpeculator(1000, "global")
    prompt, answer = list(range(300, 330)), list(range(400, 420))
    spec.propose([fake("r1", prompt)], [8])
    spec.release(fake("r1", prompt, answer, finished=True))
    assert spec.propose([fake("r2", prompt)], [8]).token_ids == [answer[:8]]
    spec.release(fake("r3", prompt, [1, 2, 3]))             # preempted, not finished: not cached
    assert spec.shared.end == len(prompt) + len(answer) + 1


def test_one_scope_never_drafts_for_another():
    spec = SuffixSpeculator(1000, "user")
    prompt, answer = list(range(300, 330)), list(range(400, 420))
    alice, bob = cache_scope(None, "alice"), cache_scope(None, "bob")
    assert alice != bob and alice == cache_scope(None, "alice") and cache_scope(None, None) is None
    assert cache_scope("key", None) != cache_scope("other", None)
    spec.release(fake("a1", prompt, answer, scope=alice, finished=True))
    assert spec.propose([fake("b1", prompt, scope=bob)], [8]).token_ids == [[]]
    assert spec.propose([fake("n1", prompt, scope=None)], [8]).token_ids == [[]]
    assert spec.propose([fake("a2", prompt, scope=alice)], [8]).token_ids == [answer[:8]]
    spec.release(fake("n2", prompt, answer, scope=None, finished=True))   # anonymous: not cached
    assert spec.shared.end == len(prompt) + len(answer) + 1
    nobody = SuffixSpeculator(1000, "request")
    nobody.release(fake("a1", prompt, answer, scope=alice, finished=True))
    assert nobody.propose([fake("a2", prompt, scope=alice)], [8]).token_ids == [[]]


def test_options_are_checked():
    SuffixSpeculator.validate({"min_token_prob": 0.5, "spec_factor": 2})
    for bad in ({"min_token_prob": 0}, {"spec_factor": "1"}, {"depth": 3}, {"min_token_prob": True}):
        with pytest.raises(ValueError):
            SuffixSpeculator.validate(bad)
    with pytest.raises(ValueError, match="scope"):
        SuffixSpeculator(10, "everyone")


# ------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    target = write_llama(tmp_path_factory.mktemp("suffix") / "target", seed=0)
    return make_engine(target, suffix_scope="global")


def test_greedy_equals_plain_alone_and_mixed_with_other_methods(engine):
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=24)
    refs = [engine.generate([p], params)[0].token_ids for p in prompts]
    single = engine.generate([prompts[0]], params, SpecParams("suffix", 8))[0]
    assert single.token_ids == refs[0]
    specs = [SpecParams("suffix", 8), SpecParams("ngram", 4), SpecParams(), SpecParams("suffix", 3)]
    mixed = engine.generate(prompts, params, [specs[i % len(specs)] for i in range(len(prompts))])
    assert [o.token_ids for o in mixed] == refs
    again = engine.generate([prompts[0]], params, SpecParams("suffix", 8))[0]   # drafts the cached answer
    assert again.token_ids == refs[0]
    assert again.spec_stats.num_accepted_tokens >= len(refs[0]) // 2
    assert again.spec_stats.num_accepted_tokens > single.spec_stats.num_accepted_tokens
    assert_no_leaks(engine)


def test_a_bucket_shared_with_another_scope_never_matches_its_text():
    """Scopes salt the hash, but buckets can still collide: the scope of each candidate is checked too."""
    text = [5, 6, 7, 8]
    index = SuffixIndex(64)
    mask = int(index.mask)
    other = next(s for s in range(2, 10_000)
                 if hash_window(text[-2:], 2, s) & mask == hash_window(text[-2:], 2, 1) & mask)
    index.extend([*text, 9, SEPARATOR], other)          # the other scope's copy, in the same bucket
    index.extend([*text, 4, SEPARATOR], 1)
    found = index.match(np.asarray([7, 8]), 1)
    assert found is not None and found.ends.tolist() == [index.end - 3]
    assert index.continuation(found, 1, 0.1)[0] == [4]
    assert index.match(np.asarray([7, 8]), other).ends.tolist() == [3]
    assert index.draft(np.asarray([7, 8]), 1, 1, 1.0, 0.1)[0] == [4]


def test_where_numba_cannot_cache_the_loops_compile_in_the_process(monkeypatch):
    """A read-only file system without a home leaves numba no cache directory: it refuses `cache=True` at
    decoration, and the import of the kernels must not fail for it."""
    import numba

    from specserve.speculators import jit
    real = numba.njit

    def refusing(*args, **kwargs):
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function 'add': no locator available for file 'add.py'")
        return real(*args, **kwargs)
    monkeypatch.setattr(jit.numba, "njit", refusing)

    def add(a, b):
        return a + b
    fast = jit.compiled(add)
    assert fast(2, 3) == 5 and fast.py_func is add and fast.signatures        # compiled, not left as Python
