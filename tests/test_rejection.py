"""RejectionSampler on hand-built tables: every expected token below is worked out in the comments.

Logits rows are written as probability tables (log p, with -inf for 0), so target_probs are known
exactly and most outcomes are certain. Where they are not, the random draws are pinned.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specserve.sampling.rejection as rejection
from specserve.sampling.outputs import SeqSamplingInput
from specserve.sampling.params import SamplingParams
from specserve.sampling.rejection import RejectionSampler
from specserve.sampling.rng import RandomDraws

torch.set_num_threads(1)
VOCAB = 5
GREEDY = dict(temperature=0.0)
RANDOM = dict(temperature=1.0)


def row(probs: dict[int, float]) -> list[float]:
    """A logits row whose softmax is `probs` (tokens not listed get probability 0)."""
    return [math.log(probs[t]) if probs.get(t, 0) > 0 else float("-inf") for t in range(VOCAB)]


def peaked(token: int) -> list[float]:
    return row({token: 1.0})


def draft_row(probs: dict[int, float]) -> list[float]:
    return [probs.get(t, 0.0) for t in range(VOCAB)]


def request(drafts=(), draft_probs=None, **params) -> SeqSamplingInput:
    probs = None if draft_probs is None else torch.tensor([draft_row(p) for p in draft_probs])
    return SeqSamplingInput(SamplingParams(**params), [0], [], list(drafts), draft_probs=probs)


def run(rows: list[list[float]], seqs: list[SeqSamplingInput]):
    outputs = RejectionSampler()(torch.tensor(rows), seqs)
    return [(o.token_ids, o.num_accepted) for o in outputs]


# ----------------------------------------------------------------------------- greedy
GREEDY_TABLE = [
    # (argmax of each row, drafts, emitted, num_accepted)
    ([3], [], [3], 0),                         # k = 0: plain greedy
    ([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4], 3),  # all accepted + bonus from the last row
    ([1, 2, 3, 4], [0, 2, 3], [1], 0),         # first draft wrong: row 0's argmax instead
    ([1, 2, 3, 4], [1, 0, 3], [1, 2], 1),      # later match after a mismatch does not count
    ([1, 2, 3, 4], [1, 2, 0], [1, 2, 3], 2),   # last draft wrong
]


@pytest.mark.parametrize("path", ["__call__", "verify_batched"])
@pytest.mark.parametrize("argmax, drafts, emitted, accepted", GREEDY_TABLE)
def test_greedy_table(argmax, drafts, emitted, accepted, path):
    # __call__ takes the plain-greedy shortcut here; verify_batched is the general route.
    rows = [[0.0] * VOCAB for _ in argmax]
    for r, token in zip(rows, argmax):
        r[token] = 2.0
    outputs = getattr(RejectionSampler(), path)(torch.tensor(rows), [request(drafts, **GREEDY)])
    assert [(o.token_ids, o.num_accepted) for o in outputs] == [(emitted, accepted)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_plain_greedy_shortcut_equals_batched_route(ks, seed, dtype):
    # Coarse integer logits make ties common; drafts copy the argmax often enough to get long runs.
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (sum(k + 1 for k in ks), VOCAB), generator=gen).to(dtype)
    best = logits.float().argmax(dim=-1).tolist()
    seqs, row = [], 0
    for k in ks:
        drafts = [best[row + j] if torch.rand((), generator=gen) < 0.7 else int(torch.randint(0, VOCAB, (),
                  generator=gen)) for j in range(k)]
        seqs.append(request(drafts, **GREEDY))
        row += k + 1
    sampler = RejectionSampler()
    fast = [(o.token_ids, o.num_accepted, o.logprobs) for o in sampler(logits, seqs)]
    general = [(o.token_ids, o.num_accepted, o.logprobs) for o in sampler.verify_batched(logits, seqs)]
    assert fast == general


def test_shortcut_not_taken_when_something_edits_the_scores(monkeypatch):
    # min_tokens still banning EOS, a penalty, a bias or logprobs anywhere in the batch: the batched route.
    taken = []
    monkeypatch.setattr(rejection, "_verify_plain_greedy", lambda *a: taken.append(1) or [])
    rows = [[0.0, 0.0, 3.0, 0.0, 0.0]]
    for params in ({"min_tokens": 1, "max_tokens": 4}, {"presence_penalty": 0.5}, {"logit_bias": {1: 5.0}},
                   {"logprobs": 1}):
        outputs = RejectionSampler(eos_token_ids=[2])(torch.tensor(rows), [request([], **GREEDY, **params)])
        assert taken == [] and len(outputs) == 1
    assert RejectionSampler()(torch.tensor(rows), [request([], **GREEDY)]) == [] and taken == [1]


# ----------------------------------------------------------------------------- random, certain outcomes
RANDOM_TABLE = [
    # (target rows, drafts, draft_probs, emitted, num_accepted)
    # k = 0 plain sampling from a one-hot target
    ([peaked(2)], [], None, [2], 0),
    # deterministic drafts with target probability 1: accepted, bonus from the last row
    ([peaked(1), peaked(2), peaked(3), peaked(4)], [1, 2, 3], None, [1, 2, 3, 4], 3),
    # target gives draft 0 probability 0 at row 1: rejected; recovered = row 1 minus token 0 = 2
    ([peaked(1), peaked(2), peaked(3), peaked(4)], [1, 0, 3], None, [1, 2], 1),
    # draft_probs: ratio min(1, 1 / 0.5) = 1 at row 0 -> accept; bonus 4 from row 1
    ([peaked(1), peaked(4)], [1], [{1: 0.5, 3: 0.5}], [1, 4], 1),
    # draft_probs: target 0 at the draft -> reject; residual max([.5,0,.5] - [0,.5,.5], 0) = {0: .5}
    # (a one-hot draft would recover from {0: .5, 2: .5} instead)
    ([row({0: .5, 2: .5}), peaked(3)], [1], [{1: .5, 2: .5}], [0], 0),
    # target >= draft at the draft token (0.75 vs 0.5): always accepted
    ([row({1: .25, 2: .75}), peaked(0)], [2], [{1: .5, 2: .5}], [2, 0], 1),
]


@pytest.mark.parametrize("rows, drafts, draft_probs, emitted, accepted", RANDOM_TABLE)
def test_random_table(rows, drafts, draft_probs, emitted, accepted):
    for seed in range(5):   # certain outcomes: any randomness must give the same answer
        torch.manual_seed(seed)
        assert run(rows, [request(drafts, draft_probs, **RANDOM)]) == [(emitted, accepted)]


def pin_draws(monkeypatch, uniforms: list[list[float]], final: list[float] | None = None):
    def draw(seqs, max_drafts, device):
        return RandomDraws(uniforms=torch.tensor(uniforms).view(len(seqs), max_drafts),
                           final=torch.tensor(final) if final else torch.zeros(len(seqs)))
    monkeypatch.setattr(rejection.RandomDraws, "draw", staticmethod(draw))


def test_pinned_draws_worked_example(monkeypatch):
    # The rejection.py docstring: drafts [1, 2], uniforms [0.4, 0.7].
    rows = [row({0: .2, 1: .5, 2: .3}), row({0: .6, 1: .1, 2: .3}), peaked(4)]
    seqs = [request([1, 2], **RANDOM)]
    # 0.4 < 0.5 accepts 1; 0.7 >= 0.3 rejects 2; residual [.6, .1, 0]: final draw 0 -> token 0
    pin_draws(monkeypatch, [[0.4, 0.7]])
    assert run(rows, seqs) == [([1, 0], 1)]
    # final draw 0.9: 0.9 * 0.7 = 0.63, cumulative [.6, .7, .7]: token 1; token 2 (zeroed) never can
    pin_draws(monkeypatch, [[0.4, 0.7]], [0.9])
    assert run(rows, seqs) == [([1, 1], 1)]
    pin_draws(monkeypatch, [[0.4, 0.7]], [0.999999])
    assert run(rows, seqs) == [([1, 1], 1)]
    # uniforms [0.4, 0.2] accept both: bonus from row 2
    pin_draws(monkeypatch, [[0.4, 0.2]])
    assert run(rows, seqs) == [([1, 2, 4], 2)]


def test_pinned_draws_acceptance_ratio_with_draft_probs(monkeypatch):
    # target 0.5 vs draft 0.8 at token 3: accept iff uniform < 0.625
    rows = [row({3: .5, 4: .5}), peaked(1)]
    seqs = [request([3], [{3: .8, 0: .2}], **RANDOM)]
    pin_draws(monkeypatch, [[0.62]])
    assert run(rows, seqs) == [([3, 1], 1)]
    pin_draws(monkeypatch, [[0.63]])
    # rejected: residual max([0,0,0,.5,.5] - [.2,0,0,.8,0], 0) = {4: .5}
    assert run(rows, seqs) == [([4], 0)]


def test_pinned_draws_residual_uses_draft_probs(monkeypatch):
    rows = [row({0: .2, 1: .4, 2: .4}), peaked(3)]
    pin_draws(monkeypatch, [[0.9]])   # ratio .4 / .5 = .8 < .9: rejected
    # with the drafter's distribution the residual is {0: .2}; a one-hot draft would leave {0, 2}
    assert run(rows, [request([1], [{1: .5, 2: .5}], **RANDOM)]) == [([0], 0)]
    pin_draws(monkeypatch, [[0.9]], [0.9])   # residual {0: .2, 2: .4}: 0.9 * 0.6 = 0.54 > 0.2 -> token 2
    assert run(rows, [request([1], None, **RANDOM)]) == [([2], 0)]


def test_deterministic_draft_recovers_from_the_rest_of_the_target():
    # target {0: .5, 2: .5}, draft 2 (one-hot): accepted half the time; when rejected the
    # recovered token can only be 0. 400 copies in one call: both branches must occur.
    rows = [row({0: .5, 2: .5}), peaked(4)] * 400
    torch.manual_seed(0)
    outcomes = run(rows, [request([2], **RANDOM) for _ in range(400)])
    assert set(map(str, outcomes)) == {str(([2, 4], 1)), str(([0], 0))}


# ----------------------------------------------------------------------------- ragged mixed batch
def test_ragged_batch_mixing_k_and_modes():
    cases = [
        # (rows, request, expected)
        ([peaked(3)], request([], **GREEDY), ([3], 0)),                                   # k=0 greedy
        ([peaked(2), peaked(0)], request([2], **RANDOM), ([2, 0], 1)),                     # k=1 random
        ([peaked(1), peaked(2), peaked(3), peaked(4)], request([1, 0, 3], **GREEDY), ([1, 2], 1)),
        ([peaked(4), peaked(3), row({1: .5, 2: .5}), peaked(0)],                           # k=3 random
         request([4, 3, 0], [{4: 1.0}, {3: .5, 1: .5}, {0: .5, 1: .5}], **RANDOM), ([4, 3, 2], 2)),
        ([peaked(1)], request([], **RANDOM), ([1], 0)),                                    # k=0 random
        ([peaked(0), peaked(4)], request([0], **GREEDY), ([0, 4], 1)),                     # k=1 greedy
    ]
    # Request 3, row 2: draft 0 has target 0 -> rejected; residual max({1:.5,2:.5} - {0:.5,1:.5}, 0)
    # = {2: .5} -> recovered 2. Row 1: ratio min(1, 1/.5) = 1 -> accepted.
    rows = [r for rs, _, _ in cases for r in rs]
    seqs = [s for _, s, _ in cases]
    for seed in range(3):
        torch.manual_seed(seed)
        assert run(rows, seqs) == [want for _, _, want in cases]


def test_logits_are_not_modified_and_bad_shapes_are_errors():
    logits = torch.tensor([peaked(1), peaked(2)])
    before = logits.clone()
    RejectionSampler()(logits, [request([1], frequency_penalty=1.0, **RANDOM)])
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="sum"):
        RejectionSampler()(logits, [request([1, 2], **RANDOM)])
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler()(logits, [request([1], [{1: .5}, {1: .5}], **RANDOM)])


# ----------------------------------------------------------------------------- properties
_request_strategy = st.fixed_dictionaries({
    "output": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "drafts": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_k": st.sampled_from([0, 2]),
    "frequency_penalty": st.sampled_from([0.0, 1.5]),
    "repetition_penalty": st.sampled_from([1.0, 1.8]),
})


def _build(specs, logits_seed):
    seqs = [SeqSamplingInput(SamplingParams(temperature=s["temperature"], top_k=s["top_k"],
                                            frequency_penalty=s["frequency_penalty"],
                                            repetition_penalty=s["repetition_penalty"]),
                             [0, 1], s["output"], s["drafts"]) for s in specs]
    rows = sum(len(s["drafts"]) + 1 for s in specs)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(logits_seed)) * 2
    return seqs, logits


@settings(max_examples=40, deadline=None)
@given(st.lists(_request_strategy, min_size=1, max_size=4), st.integers(0, 2**16))
def test_speculative_greedy_equals_plain_greedy(specs, logits_seed):
    for s in specs:
        s["temperature"] = 0.0
    seqs, logits = _build(specs, logits_seed)
    outputs = RejectionSampler()(logits, seqs)
    start = 0
    for seq_in, out in zip(seqs, outputs):
        # plain greedy, one row at a time, fed its own previous tokens
        plain = []
        for j in range(out.num_accepted + 1):
            one = SeqSamplingInput(seq_in.params, seq_in.prompt_token_ids,
                                   list(seq_in.output_token_ids) + plain, [])
            plain += RejectionSampler()(logits[start + j:start + j + 1], [one])[0].token_ids
        assert out.token_ids == plain
        # and it stopped exactly at the first draft plain greedy disagrees with
        assert list(seq_in.draft_token_ids[:out.num_accepted]) == plain[:-1]
        if out.num_accepted < len(seq_in.draft_token_ids):
            assert seq_in.draft_token_ids[out.num_accepted] != plain[-1]
        start += len(seq_in.draft_token_ids) + 1


@settings(max_examples=40, deadline=None)
@given(st.lists(_request_strategy, min_size=1, max_size=4), st.integers(0, 2**16))
def test_emitted_tokens_are_drafts_then_one_possible_token(specs, logits_seed):
    seqs, logits = _build(specs, logits_seed)
    torch.manual_seed(logits_seed)
    outputs = RejectionSampler()(logits, seqs)
    start = 0
    for seq_in, out in zip(seqs, outputs):
        k = len(seq_in.draft_token_ids)
        assert 0 <= out.num_accepted <= k and len(out.token_ids) == out.num_accepted + 1
        assert out.token_ids[:-1] == list(seq_in.draft_token_ids[:out.num_accepted])
        if seq_in.params.top_k == 2 and seq_in.params.temperature > 0:
            # every emitted token, accepted or not, must be in its row's processed top 2
            for j, token in enumerate(out.token_ids):
                history = list(seq_in.output_token_ids) + list(seq_in.draft_token_ids[:j])
                scores = _penalised_row(logits[start + j], seq_in.params, [0, 1], history)
                assert token in torch.topk(torch.tensor(scores), 2).indices.tolist()
        start += k + 1


def _penalised_row(raw: torch.Tensor, params: SamplingParams, prompt: list[int], history: list[int]):
    scores = []
    for token, x in enumerate(raw.tolist()):
        if token in set(prompt) | set(history):
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        scores.append(x - params.frequency_penalty * history.count(token))
    return scores
