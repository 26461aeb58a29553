"""Scheduler: budgets, chunked prefill, draft slots, preemption by recompute. No torch."""
from specserve.sampling.params import SamplingParams
from specserve.server.engine.request import Request, RequestStatus
from specserve.server.engine.scheduler import Scheduler
from specserve.server.kv.block_manager import BlockManager
from specserve.speculators.base import SpecParams


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=256, caching=True):
    return Scheduler(BlockManager(num_blocks, block_size, caching), max_seqs, budget, max_len)


def req(rid, n_prompt, max_tokens=8, k=0, first=0):
    spec = SpecParams("ngram", k) if k else SpecParams()
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens), spec)


def run_step(s, emitted=None):
    """Pretend the model ran: every sampled seq emits one token (or `emitted[rid]`)."""
    out = s.schedule()
    for seq in out.seqs:
        toks = (emitted or {}).get(seq.request.request_id, [7]) if seq.samples else []
        s.update(seq, max(0, len(toks) - 1) if seq.samples else 0, toks)
    return out


def test_prefill_then_decode_one_token_per_step():
    s = make()
    r = req("a", 10)
    s.add(r)
    out = run_step(s)
    assert [(x.num_new_tokens, x.num_draft_slots) for x in out.seqs] == [(10, 0)]
    assert out.seqs[0].samples and r.num_computed_tokens == 10 and r.output_token_ids == [7]
    out = run_step(s)
    assert [(x.num_new_tokens, x.num_draft_slots) for x in out.seqs] == [(1, 0)]
    assert r.num_computed_tokens == 11


def test_long_prompt_is_chunked_to_the_budget():
    s = make(budget=16)
    r = req("a", 40)
    s.add(r)
    sizes = []
    while not r.output_token_ids:
        out = run_step(s)
        sizes.append(out.seqs[0].num_new_tokens)
        assert out.num_tokens <= 16
    assert sizes == [16, 16, 8]
    assert r.num_computed_tokens == 40


def test_budget_shared_decode_first_then_new_prefills():
    s = make(budget=12)
    a = req("a", 4)
    s.add(a)
    run_step(s)
    b = req("b", 30, first=100)
    s.add(b)
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.seqs] == [("a", 1), ("b", 11)]


def test_draft_slots_reserved_and_capped_by_max_tokens():
    s = make()
    r = req("a", 4, max_tokens=4, k=5)
    s.add(r)
    run_step(s)                            # prefill, 1 output
    out = s.schedule()
    seq = out.seqs[0]
    assert seq.num_new_tokens == 1 and seq.num_draft_slots == 2     # 4 - 1 emitted - 1 bonus
    assert len(r.block_ids) * 4 >= r.num_computed_tokens + 1 + 2
    # accept both drafts + bonus: computed advances by 1 + 2
    s.update(seq, 2, [1, 2, 3])
    assert r.num_computed_tokens == 4 + 1 + 2 and r.num_output_tokens == 4


def test_rejected_drafts_are_rolled_back_by_the_counter_alone():
    s = make()
    r = req("a", 4, max_tokens=20, k=3)
    s.add(r)
    run_step(s)
    seq = s.schedule().seqs[0]
    assert seq.num_draft_slots == 3
    blocks_before = list(r.block_ids)
    s.update(seq, 0, [9])                  # all rejected, one recovered token
    assert r.num_computed_tokens == 5 and r.output_token_ids == [7, 9]
    assert r.block_ids == blocks_before    # nothing freed or copied


def test_token_budget_cuts_k_and_counts_it():
    s = make(budget=3)
    r = req("a", 2, max_tokens=20, k=4)
    s.add(r)
    run_step(s)
    out = s.schedule()
    assert out.seqs[0].num_draft_slots == 2 and out.spec_reduced == {"token_budget": 1}


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=4, block_size=4, budget=64)
    a = req("a", 7, max_tokens=20)
    b = req("b", 7, max_tokens=20, first=50)
    s.add(a)
    s.add(b)
    run_step(s)                              # both prefilled: 2 blocks each, all 4 used
    assert s.bm.num_free_blocks == 0
    run_step(s)                              # a needs slot 8 -> fits in block; b too
    out = run_step(s)                        # slot 9 needs a 3rd block: b (newest) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert s.waiting[0] is b and s.num_preemptions == 1
    assert b.output_token_ids == [7, 7]      # outputs are kept and recomputed later


def test_preempted_request_recomputes_prompt_and_outputs():
    s = make(num_blocks=6, block_size=4, budget=64, caching=False)
    a = req("a", 7, max_tokens=3)
    s.add(a)
    run_step(s)
    run_step(s)
    s._preempt(a, s.schedule())
    out = s.schedule()
    assert out.seqs[0].num_new_tokens == 9 and out.seqs[0].samples


def test_abort_frees_blocks_and_queues():
    s = make()
    a, b = req("a", 5), req("b", 5, first=10)
    s.add(a)
    run_step(s)
    s.add(b)
    s.abort(a)
    s.abort(b)
    assert not s.running and not s.waiting and s.bm.num_free_blocks == 64
    assert a.finish_reason == "abort"


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for i in range(3):
        s.add(req(str(i), 3, first=10 * i))
    out = run_step(s)
    assert len(out.seqs) == 2 and len(s.waiting) == 1


def test_prefix_cache_hit_on_second_identical_prompt():
    s = make()
    a = req("a", 9)
    s.add(a)
    run_step(s)
    b = req("b", 9)
    s.add(b)
    out = run_step(s)
    seq_b = [x for x in out.seqs if x.request is b][0]
    assert b.num_cached_prompt_tokens == 8 and seq_b.num_new_tokens == 1
