"""Suffix decoding (speculators/suffix.py, suffix_index.py): the index finds the longest earlier match and
its most frequent continuation; the cross-request cache is bounded and evicts the oldest first; one cache
scope's texts never draft for another; greedy output is unchanged at batch 1 and in a batch mixed with
other methods; a repeated request drafts its earlier answer."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_spec_draft_model import GREEDY, assert_no_leaks, encode, make_engine, write_llama

from specserve.sampling.params import SamplingParams
from specserve.server.api.params import cache_scope
from specserve.speculators import suffix_index
from specserve.speculators.base import SpecParams
from specserve.speculators.suffix import SuffixSpeculator
from specserve.speculators.suffix_index import LEVELS, SEPARATOR, SMALL, SuffixIndex, _hash, _hash_one


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


@pytest.mark.parametrize("capacity,growable", [(64, False), (1000, False), (16, True)])
def test_token_by_token_appends_find_what_bulk_ones_find(capacity, growable, monkeypatch):
    """A decode step appends a token or a few (the Python path); a finished answer many (numpy): the two
    must hash and chain identically, through separators, eviction (capacity 64) and growth (16)."""
    rng = np.random.default_rng(capacity)
    chunks = []
    for _ in range(40):
        chunk = rng.integers(0, 12, int(rng.integers(1, 3 * SMALL))).tolist()
        chunks.append(chunk + ([-1] if rng.random() < 0.2 else []))
    bulk, single = SuffixIndex(capacity, growable), SuffixIndex(capacity, growable)
    for chunk in chunks:
        bulk.extend(chunk, 3)
        for token in chunk:
            single.extend([token], 3)
    assert bulk.capacity == single.capacity and np.array_equal(bulk.tokens, single.tokens)
    if bulk.end <= bulk.capacity:     # nothing evicted: the very same chains (with eviction, a bulk append skips
        assert np.array_equal(bulk.head, single.head) and np.array_equal(bulk.prev, single.prev)   # dead windows)
    tails = [rng.integers(0, 12, int(rng.integers(2, 40))) for _ in range(200)]

    def matches(index):
        return [None if m is None else (m.length, m.ends.tolist()) for m in map(index.match, tails, [3] * 200)]
    found = matches(bulk)
    assert found == matches(single) and sum(m is not None for m in found) > 20
    monkeypatch.setattr(suffix_index, "SHORT_CHAIN", 0)              # every chain checked with numpy
    assert matches(bulk) == found
    for walk in (suffix_index.SHORT_WALK, 0):                        # 0: every length measured with numpy
        monkeypatch.setattr(suffix_index, "SHORT_WALK", walk)
        assert matches(bulk) == found
        for tail, full in zip(tails, found):                         # measured only up to `enough`
            short = bulk.match(tail, 3, enough=8)
            if full is not None:
                assert short.ends.tolist() == full[1]
                assert short.length == full[0] if full[0] < 8 else short.length >= 8
    windows = rng.integers(-1, 9000, (8, LEVELS[0]))
    for n in LEVELS:
        assert _hash(windows[:, -n:], n, 7).tolist() == [_hash_one(w[-n:].tolist(), n, 7) for w in windows]


def test_a_growable_index_hashes_its_own_end_as_a_lookup_would():
    """A request's index keeps prefix hashes: the hashes of its last n tokens (end_hashes) equal hashing the
    windows, and a lookup given them finds what one hashing its tail finds, in the index and in another."""
    rng = np.random.default_rng(5)
    own, other = SuffixIndex(16, growable=True), SuffixIndex(4096)
    other.extend(rng.integers(0, 6, 3000).tolist() + [-1], 2)
    checked = found = 0
    for _ in range(120):
        own.extend(rng.integers(0, 6, int(rng.integers(1, 2 * SMALL))).tolist() + ([-1] if rng.random() < 0.1 else []))
        tail = own.tokens[max(0, own.end - 64):own.end].astype(np.int64)
        hashes = own.end_hashes()
        clean = tail[np.flatnonzero(tail < 0)[-1] + 1:] if (tail < 0).any() else tail
        assert sorted(hashes) == sorted(n for n in LEVELS if n <= len(clean))
        for n, h in hashes.items():
            assert h == _hash_one(tail[-n:].tolist(), n, 0)               # scope 0: no salt
        for index, scope in ((own, 0), (other, 2)):
            plain, fast = index.match(tail, scope), index.match(tail, scope, hashes=hashes)
            assert (plain is None) == (fast is None)
            if plain is not None:
                assert (plain.length, plain.ends.tolist()) == (fast.length, fast.ends.tolist())
                found += 1
            checked += 1
    assert found > checked // 2


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


@pytest.mark.parametrize("short_chain", [8, 0])
def test_a_bucket_shared_with_another_scope_never_matches_its_text(short_chain, monkeypatch):
    """Scopes salt the hash, but buckets can still collide: the scope of each candidate is checked, in the
    Python check of short chains and in the numpy one."""
    monkeypatch.setattr(suffix_index, "SHORT_CHAIN", short_chain)
    text = [5, 6, 7, 8]
    index = SuffixIndex(64)
    mask = int(index.mask)
    other = next(s for s in range(2, 10_000)
                 if _hash_one(text[-2:], 2, s) & mask == _hash_one(text[-2:], 2, 1) & mask)
    index.extend([*text, 9, SEPARATOR], other)          # the other scope's copy, in the same bucket
    index.extend([*text, 4, SEPARATOR], 1)
    found = index.match(np.asarray([7, 8]), 1)
    assert found is not None and found.ends.tolist() == [index.end - 3]
    assert index.continuation(found, 1, 0.1)[0] == [4]
    assert index.match(np.asarray([7, 8]), other).ends.tolist() == [3]
