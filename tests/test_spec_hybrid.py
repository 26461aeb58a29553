"""Hybrid speculator (speculators/hybrid.py): lookup drafts where the context repeats, the model drafter
elsewhere. Routing on a fake drafter; greedy equality, both sources used and no leaks on a tiny random
target with a random EAGLE-3 head; registered only when a model drafter is loaded."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_spec_draft_model import (
    GREEDY,
    assert_no_leaks,
    assert_same_proposals,
    encode,
    make_engine,
)
from test_spec_eagle3 import eagle_weights, write_eagle_original, write_target

from specserve.sampling.params import SamplingParams
from specserve.speculators.base import DraftProposal, SpecParams, VerifiedStep
from specserve.speculators.hybrid import HybridSpeculator


class FakeRequest(SimpleNamespace):
    def token_slice(self, a, b):
        return self.all_token_ids[a:b]


def fake(rid, tokens, **options):
    return FakeRequest(request_id=rid, all_token_ids=tokens, num_tokens=len(tokens),
                       spec_params=SpecParams("hybrid", 4, options))


def verified(requests):
    """A step where request i verified 3 rows at offset 3 i and kept 2."""
    rows = torch.zeros(3 * len(requests), 4)
    n = len(requests)
    return VerifiedStep(requests=list(requests), num_computed_before=[r.num_tokens - 2 for r in requests],
                        token_offsets=[3 * i for i in range(n)], query_lens=[3] * n, valid_lens=[2] * n,
                        num_accepted=[1] * n, sampled=[True] * n, hidden=rows, prenorm_hidden=rows, aux_hidden=[])


class FakeDrafter:
    def __init__(self):
        self.asked, self.released, self.observed = [], [], []

    def propose(self, requests, ks):
        self.asked.append([r.request_id for r in requests])
        return DraftProposal([[7] * k for k in ks], [torch.full((k, 10), 0.1) for k in ks])

    def observe(self, step):
        self.observed.append(step)

    def release(self, request):
        self.released.append(request.request_id)


def test_lookup_first_then_the_model_drafter_for_the_rest():
    head = FakeDrafter()
    hybrid = HybridSpeculator(head, "eagle3")
    repeats = fake("a", [1, 2, 3, 9, 1, 2, 3])         # suffix [2, 3] (and [1, 2, 3]) seen before -> 9, 1, 2, 3
    single = fake("b", [5, 6, 8, 4, 6])                 # only the last token (6) repeats: n = 1 < 2
    fresh = fake("c", [1, 2, 3, 4])
    loose = fake("d", [5, 6, 8, 4, 6], prompt_lookup_min=1)   # the request lowers the bar: 6 -> 8, 4, 6
    out = hybrid.propose([repeats, single, fresh, loose], [4, 3, 2, 4])
    assert out.token_ids == [[9, 1, 2, 3], [7, 7, 7], [7, 7], [8, 4, 6]]
    assert out.draft_probs[0] is None and out.draft_probs[3] is None          # lookup drafts: point masses
    assert out.draft_probs[1].shape == (3, 10) and out.draft_probs[2].shape == (2, 10)
    assert head.asked == [["b", "c"]] and hybrid.drafted_by == {"ngram": 2, "eagle3": 2}
    step = verified([repeats, single, fresh, loose])
    hybrid.observe(step)                                # a draft model (no stash) observes every step
    hybrid.release(repeats)
    assert head.observed == [step] and head.released == ["a"]
    assert HybridSpeculator.over({"ngram": object()}) is None
    assert HybridSpeculator.over({"draft": head, "mtp": object()}).fallback_name == "mtp"
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        HybridSpeculator.validate({"prompt_lookup_min": 0})
    with pytest.raises(ValueError, match="unknown"):
        HybridSpeculator.validate({"fallback": "draft"})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    target = write_target(root / "target")
    return make_engine(target, eagle3=str(write_eagle_original(root / "head", eagle_weights(seed=7))))


def test_greedy_equals_plain_and_both_sources_draft(engine):
    assert "hybrid" in engine.engine.spec.speculators
    hybrid = engine.engine.spec.speculators["hybrid"]
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=32)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    before = dict(hybrid.drafted_by)
    outs = engine.generate(prompts, params, [SpecParams("hybrid", 4), SpecParams("eagle3", 2),
                                             SpecParams("hybrid", 3, {"prompt_lookup_min": 1})])
    assert [o.token_ids for o in outs] == refs
    assert hybrid.drafted_by["ngram"] > before["ngram"] and hybrid.drafted_by["eagle3"] > before["eagle3"]
    assert outs[0].spec_stats.num_draft_tokens > 0
    assert_no_leaks(engine)


def test_seeded_sampling_reproduces(engine):
    prompts = encode(engine)[:2]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    first = [o.token_ids for o in engine.generate(prompts, params, SpecParams("hybrid", 3))]
    again = [o.token_ids for o in engine.generate(prompts, params, SpecParams("hybrid", 3))]
    assert first == again
    assert_no_leaks(engine)


def test_not_offered_without_a_model_drafter(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    assert "hybrid" not in eng.engine.spec.speculators and "hybrid" not in eng.engine.spec.methods


def test_skipping_observes_drafts_what_observing_every_step_drafts(tmp_path):
    """Prefix caching on: the head keeps a stash and rests through the steps the lookup drafted; off: it
    observes every step. Same drafts and draft probabilities at every propose, greedy and sampled."""
    target = write_target(tmp_path / "target")
    head = str(write_eagle_original(tmp_path / "head", eagle_weights(seed=9)))
    engines = [make_engine(target, eagle3=head, enable_prefix_caching=on) for on in (True, False)]
    prompts = encode(engines[0])
    for params in (SamplingParams(**GREEDY, max_tokens=24), SamplingParams(temperature=1.0, seed=4, max_tokens=24)):
        assert_same_proposals(engines, "hybrid", prompts, params, SpecParams("hybrid", 3), atol=1e-5, rtol=1e-4)
    # greedy, the random target loops: the lookup drafted part of the steps, the head the rest
    assert min(engines[0].engine.spec.speculators["hybrid"].drafted_by.values()) >= 2
    # with the stash the head rested through the lookup's steps; without it, it observed every one
    rested = [eng.engine.spec.speculators["eagle3"].drafter.num_rested for eng in engines]
    assert rested[0] > 0 and rested[1] == 0
