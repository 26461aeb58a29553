"""Hidden-state heads (EAGLE-3, MTP) on a target that serves prompts from its prefix cache.

The target computes nothing for cached positions, so a head sees their states only through the state
stash (speculators/state_stash.py). Check: after another request has cached the prompts, a head drafts
exactly what it drafts on an engine without prefix caching (same drafts, same draft probabilities at
T = 1), for a one-layer EAGLE-3 head and a two-layer MTP stack; without the stash the warm head would
start after the cached blocks and draft from less context. Also: the stash costs memory inside
--kv-cache-memory-gb, and nothing leaks.
"""
from __future__ import annotations

import pytest
import torch
from test_spec_draft_model import (
    GREEDY,
    TEXTS,
    assert_no_leaks,
    encode,
    make_engine,
    record_proposals,
)
from test_spec_eagle3 import eagle_weights, write_eagle_original
from test_spec_mtp import write_mtp_target

from specserve.sampling.params import SamplingParams
from specserve.server.engine.spec_policy import GoodputPolicy
from specserve.speculators.base import SpecParams

LONG = [TEXTS[0] * 3, TEXTS[2] * 3 + " 4]\n"]     # several 16-token blocks each


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    return {"target": write_mtp_target(root / "deepseek", "deepseek_v3", num_mtp=2),
            "eagle3": write_eagle_original(root / "eagle3", eagle_weights(seed=9))}


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_head_drafts_the_same_whether_the_prompt_was_cached_or_not(dirs, method):
    cold = make_engine(dirs["target"], eagle3=str(dirs["eagle3"]), enable_prefix_caching=False)
    warm = make_engine(dirs["target"], eagle3=str(dirs["eagle3"]))
    assert not cold.engine.spec.speculators[method].records_states
    assert warm.engine.spec.speculators[method].records_states
    prompts = encode(cold, LONG)
    assert min(len(p) for p in prompts) >= 40
    warm.generate(prompts, SamplingParams(**GREEDY, max_tokens=2))          # plain requests fill the cache
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    logs, outs = [], []
    for eng in (cold, warm):
        logs.append(record_proposals(eng, method))
        outs.append(eng.generate(prompts, params, SpecParams(method, 3)))
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert len(logs[0]) == len(logs[1]) > 6
    for (ctx_a, drafts_a, probs_a, _), (ctx_b, drafts_b, probs_b, _) in zip(*logs):
        assert ctx_a == ctx_b and drafts_a == drafts_b
        torch.testing.assert_close(probs_a, probs_b, atol=1e-5, rtol=0)
    # every warm request started after cached blocks and caught up from the stash
    assert warm.engine.spec.speculators[method].drafter.num_prefix_catch_ups == len(prompts)
    assert_no_leaks(warm)


def test_the_stash_is_paid_from_the_kv_budget(dirs):
    with_stash = make_engine(dirs["target"], eagle3=str(dirs["eagle3"]))
    without = make_engine(dirs["target"], eagle3=str(dirs["eagle3"]), enable_prefix_caching=False)
    # hidden 32 x 16 slots x fp32 = 2 KiB per block and head, against 8 layers of 2 x 2 x 8 x 16 x 4 B of K/V
    assert with_stash.engine.scheduler.bm.num_blocks < without.engine.scheduler.bm.num_blocks
    stash = with_stash.engine.spec.speculators["eagle3"].drafter.stash
    assert stash.states.shape == (with_stash.engine.scheduler.bm.num_blocks * 16, 32)


def test_no_room_for_the_prefix_falls_back_to_the_uncached_part(dirs):
    eng = make_engine(dirs["target"], eagle3=str(dirs["eagle3"]))
    prompts = encode(eng, LONG)
    params = SamplingParams(**GREEDY, max_tokens=12)
    refs = [o.token_ids for o in eng.generate(prompts, params)]            # plain; fills the prefix cache
    drafter = eng.engine.spec.speculators["mtp"].drafter
    reserve = drafter.cache.reserve
    drafter.cache.reserve = lambda seq, end: seq.start > 0 and reserve(seq, end)   # a "full" cache from 0
    refused: dict[str, int] = {}
    step = eng.engine.step

    def counting_step():
        outputs, stats = step()
        for reason, count in stats.spec_refused.items():
            refused[reason] = refused.get(reason, 0) + count
        return outputs, stats
    eng.engine.step = counting_step
    outs = eng.generate(prompts, params, SpecParams("mtp", 3))
    assert [o.token_ids for o in outs] == refs
    assert drafter.num_prefix_catch_ups == 0
    assert refused == {"prefix_unseen": len(prompts)}                       # said, not silent
    assert all(o.spec_stats.cuts == {"prefix_unseen": 1} for o in outs)    # and in each request's stats
    assert all(o.spec_stats.num_draft_tokens > 0 for o in outs)            # still drafting, from the cached end
    del drafter.cache.reserve
    assert_no_leaks(eng)


def test_the_stash_queues_rows_and_a_reused_slot_keeps_the_later_row():
    from specserve.speculators.state_stash import TargetStateStash
    stash = TargetStateStash(8, 2, block_size=4, dtype=torch.float32, device="cpu",
                             project=lambda raw: raw[:, :2] + raw[:, 2:], max_pending_rows=5)
    first = torch.tensor([[1.0, 1, 10, 10], [2, 2, 20, 20]])          # slots 1, 2
    second = torch.tensor([[3.0, 3, 30, 30], [4, 4, 40, 40]])         # slots 2 (reused), 3
    stash.add(torch.tensor([1, 2]), first)
    stash.add(torch.tensor([2, 3]), second)
    assert stash.states.abs().sum() == 0                                # queued, not yet projected
    # block table [1, 0]: positions 0..3 live in slots 4..7, positions 4..7 in slots 0..3
    got = stash.read([1, 0], 5, 8)                                      # slots 1, 2, 3 -> flushes first
    torch.testing.assert_close(got, torch.tensor([[11.0, 11], [33, 33], [44, 44]]))
    stash.add(torch.tensor([4, 5, 6]), torch.ones(3, 4))
    stash.add(torch.tensor([7, 0]), torch.ones(2, 4))                   # 5 rows queued: flushed at once
    assert stash._pending_rows == 0 and stash.states[[4, 5, 6, 7, 0]].eq(2).all()


class _DraftOneStepInThree(GoodputPolicy):
    """The goodput policy with a fixed cut: each request drafts on its 1st, 4th, 7th... step only."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[str, int] = {}

    def trim(self, seqs, methods=None) -> int:
        cut = 0
        for s in seqs:
            if s.num_draft_slots > 0:
                n = self.steps[s.request.request_id] = self.steps.get(s.request.request_id, -1) + 1
                if n % 3:
                    s.num_draft_slots, cut = 0, cut + 1
        return cut


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_head_that_skipped_idle_steps_drafts_as_if_it_had_observed_them(dirs, method):
    """With a stash the engine does not observe requests the policy cut to no drafts; their head catches up
    from the stash before it drafts again, and drafts exactly what a head that observed every step drafts
    (one-layer EAGLE-3 and a two-layer MTP stack), with fewer observe calls and nothing leaked."""
    eager = make_engine(dirs["target"], eagle3=str(dirs["eagle3"]), enable_prefix_caching=False)   # no stash
    lazy = make_engine(dirs["target"], eagle3=str(dirs["eagle3"]))
    prompts = encode(eager, LONG)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    logs, outs, observed = [], [], []
    for eng in (eager, lazy):
        eng.engine.spec.policy = _DraftOneStepInThree()
        spec = eng.engine.spec.speculators[method]
        seen: list[str] = []
        observe = spec.observe
        spec.observe = lambda step, observe=observe, seen=seen: (seen.extend(r.request_id for r in step.requests),
                                                                   observe(step))
        logs.append(record_proposals(eng, method))
        rested = spec.drafter.num_rested
        outs.append(eng.generate(prompts, params, SpecParams(method, 3)))
        observed.append(len(seen) - (spec.drafter.num_rested - rested))     # what the head really observed
        del spec.observe, spec.propose
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert len(logs[0]) == len(logs[1]) >= 6
    for (ctx_a, drafts_a, probs_a, _), (ctx_b, drafts_b, probs_b, _) in zip(*logs):
        assert ctx_a == ctx_b and drafts_a == drafts_b
        torch.testing.assert_close(probs_a, probs_b, atol=1e-5, rtol=0)
    assert observed[1] < observed[0] * 0.6                 # two of three decode steps left out
    assert_no_leaks(lazy)
