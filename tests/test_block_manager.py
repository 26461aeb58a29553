"""Block manager: allocation, freeing, prefix cache. No torch."""
from specserve.sampling.params import SamplingParams
from specserve.server.engine.request import Request
from specserve.server.kv.block_manager import BlockManager


def req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=8))


def test_allocate_and_free_returns_all_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = req("a", list(range(10)))
    assert bm.ensure_slots(r, 10)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 7
    assert bm.ensure_slots(r, 12) and len(r.block_ids) == 3      # still fits in 3 blocks
    assert bm.ensure_slots(r, 13) and len(r.block_ids) == 4
    bm.free(r)
    assert bm.num_free_blocks == 10 and r.block_ids == []
    assert bm.usage == 0.0


def test_ensure_slots_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    r = req("a", [1])
    assert not bm.ensure_slots(r, 13)          # needs 4 blocks
    assert r.block_ids == [] and bm.num_free_blocks == 3


def test_prefix_cache_hits_full_blocks_and_survives_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))
    assert bm.allocate_cached_prefix(a) == 0
    assert bm.ensure_slots(a, 10)
    a.num_computed_tokens = 10
    bm.cache_computed_blocks(a)
    assert len(a.block_hashes) == 2                 # two full blocks
    a_blocks = list(a.block_ids)
    bm.free(a)
    b = req("b", list(range(8)) + [42, 43])
    assert bm.allocate_cached_prefix(b) == 8
    assert b.block_ids == a_blocks[:2]
    # a different second block stops the match after the first
    c = req("c", [0, 1, 2, 3, 9, 9, 9, 9, 1])
    assert bm.allocate_cached_prefix(c) == 4
    assert bm.ref_counts[c.block_ids[0]] == 2       # shared with b


def test_prefix_cache_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", list(range(8)))
    bm.ensure_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_computed_blocks(a)
    b = req("b", list(range(8)))
    assert bm.allocate_cached_prefix(b) == 4        # block 2 would cover the last token: recompute it


def test_evicted_cached_block_is_not_reused():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = req("a", list(range(5)))
    bm.ensure_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_computed_blocks(a)
    bm.free(a)
    other = req("o", [7] * 8)
    assert bm.ensure_slots(other, 8)                # takes both blocks, evicting a's hash
    bm.free(other)
    b = req("b", list(range(5)))
    assert bm.allocate_cached_prefix(b) == 0


def test_no_prefix_caching_flag():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3])
    bm.ensure_slots(a, 3)
    a.num_computed_tokens = 3
    bm.cache_computed_blocks(a)
    bm.free(a)
    assert bm.allocate_cached_prefix(req("b", [1, 2, 3])) == 0
