"""Sampler and LogitsProcessor against slow per-row references written out by hand below.

Each reference walks one row token by token in float64, straight from the definitions (HF/vLLM
repetition penalty, OpenAI presence/frequency penalties and logit_bias, min_tokens, temperature,
min_p -> top_k -> top_p). Row j of a request sees prompt + output + drafts[:j].
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import specserve.sampling.penalties as penalties
import specserve.sampling.truncation as truncation
from specserve.sampling.batch import SamplingBatch
from specserve.sampling.logits_processor import LogitsProcessor
from specserve.sampling.outputs import SeqSamplingInput
from specserve.sampling.params import SamplingParams
from specserve.sampling.rejection import RejectionSampler
from specserve.sampling.sampler import Sampler

torch.set_num_threads(1)
NEG_INF = float("-inf")
EOS = 11


# ----------------------------------------------------------------------------- slow references
def reference_scores(raw: list[float], params: SamplingParams, prompt: list[int],
                     generated: list[int], eos_ids: list[int]) -> list[float]:
    """Penalties, bias and min_tokens ban for one row whose generated history is `generated`."""
    counts = Counter(generated)
    seen = set(prompt) | set(generated)
    scores = []
    for token, x in enumerate(raw):
        if token in seen:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        x -= params.frequency_penalty * counts[token]
        x -= params.presence_penalty * (1.0 if counts[token] > 0 else 0.0)
        x += (params.logit_bias or {}).get(token, 0.0)
        scores.append(x)
    if len(generated) < params.min_tokens:
        for token in list(params.stop_token_ids) + ([] if params.ignore_eos else eos_ids):
            scores[token] = NEG_INF
    return scores


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) if x != NEG_INF else 0.0 for x in xs]
    return [e / sum(exps) for e in exps]


def reference_probs(scores: list[float], params: SamplingParams) -> list[float]:
    x = [s / params.temperature for s in scores]
    if params.min_p > 0:
        probs = softmax(x)
        x = [xi if p >= params.min_p * max(probs) else NEG_INF for xi, p in zip(x, probs)]
    if 0 < params.top_k < len(x):
        kth = sorted(x, reverse=True)[params.top_k - 1]
        x = [xi if xi >= kth else NEG_INF for xi in x]
    if params.top_p < 1:
        probs = softmax(x)
        keep, mass = set(), 0.0
        for token in sorted(range(len(x)), key=lambda t: (-x[t], t)):
            if mass < params.top_p:
                keep.add(token)
            mass += probs[token]
        x = [xi if t in keep else NEG_INF for t, xi in enumerate(x)]
    return softmax(x)


def row_histories(seqs: list[SeqSamplingInput]):
    """(seq, generated history) for each row of the batch, in row order."""
    for seq in seqs:
        for j in range(len(seq.draft_token_ids) + 1):
            yield seq, list(seq.output_token_ids) + list(seq.draft_token_ids[:j])


def processed_scores(logits: torch.Tensor, seqs: list[SeqSamplingInput]) -> torch.Tensor:
    batch = SamplingBatch.build(seqs, logits)
    return LogitsProcessor(eos_token_ids=[EOS])(logits, batch)


def expected_scores(logits: torch.Tensor, seqs: list[SeqSamplingInput]) -> torch.Tensor:
    rows = [reference_scores(logits[r].tolist(), seq.params, list(seq.prompt_token_ids), gen, [EOS])
            for r, (seq, gen) in enumerate(row_histories(seqs))]
    return torch.tensor(rows, dtype=torch.float32)


def seq(prompt=(1, 2), output=(), drafts=(), **params) -> SeqSamplingInput:
    return SeqSamplingInput(SamplingParams(**params), list(prompt), list(output), list(drafts))


def random_logits(rows: int, vocab: int = 12, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale   # [rows, vocab], both signs


# ----------------------------------------------------------------------------- penalties
PENALTY_BATCH = [
    # repetition only; the draft prefix brings new tokens (7, 9) into later rows
    dict(prompt=(1, 2, 3), output=(4, 4), drafts=(7, 9, 7), repetition_penalty=1.7),
    # frequency + presence over output + draft prefix only (prompt tokens 0, 5 stay untouched)
    dict(prompt=(0, 5), output=(6, 6, 2), drafts=(2, 8), frequency_penalty=0.9, presence_penalty=1.3),
    dict(prompt=(3,), output=(), drafts=(), temperature=0.0),   # no penalties: raw scores
    # all three, negative presence (encourages repeats), k = 1
    dict(prompt=(10, 1), output=(1,), drafts=(10,), repetition_penalty=0.6, frequency_penalty=-0.5,
         presence_penalty=-1.1),
]


def _penalty_case():
    seqs = [seq(**kw) for kw in PENALTY_BATCH]
    logits = random_logits(sum(len(s.draft_token_ids) + 1 for s in seqs))
    return seqs, logits


def test_penalties_match_reference_with_draft_prefix():
    seqs, logits = _penalty_case()
    torch.testing.assert_close(processed_scores(logits, seqs), expected_scores(logits, seqs))


def test_reference_catches_a_sampler_that_forgets_the_draft_prefix(monkeypatch):
    # Guard on the test above: with the prefix dropped, rows j >= 1 must disagree with the reference.
    monkeypatch.setattr(penalties, "add_draft_prefix", lambda *args: None)
    seqs, logits = _penalty_case()
    got, want = processed_scores(logits, seqs), expected_scores(logits, seqs)
    assert not torch.allclose(got, want)
    assert torch.allclose(got[0], want[0])   # row 0 has no prefix: still right


def test_penalties_do_not_modify_raw_logits_and_skip_unpenalised_rows():
    seqs, logits = _penalty_case()
    before = logits.clone()
    scores = processed_scores(logits, seqs)
    assert torch.equal(logits, before)
    unpenalised_row = 4 + 3   # rows of requests 0 and 1 come first
    assert torch.equal(scores[unpenalised_row], logits[unpenalised_row])


def test_repetition_penalty_direction_by_sign():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    scores = processed_scores(logits, [seq(prompt=(0,), output=(1,), repetition_penalty=2.0)])
    assert scores.tolist() == [[1.0, -4.0, 1.0, -1.0]]


# ----------------------------------------------------------------------------- bias and min_tokens
def test_logit_bias_added_on_every_row_after_penalties():
    seqs = [seq(drafts=(3, 4), logit_bias={0: 5.0, 7: -100.0}), seq(logit_bias={2: 0.5}),
            seq(drafts=(1,), frequency_penalty=1.0, logit_bias={1: 2.0}),
            # the multiplicative penalty sees the model's score, then the bias is added
            seq(prompt=(1,), drafts=(3,), repetition_penalty=1.5, logit_bias={1: 3.0, 3: -4.0})]
    logits = random_logits(8)
    torch.testing.assert_close(processed_scores(logits, seqs), expected_scores(logits, seqs))


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_stop_ids_until_reached(ignore_eos):
    logits = torch.zeros(5, 12)
    logits[:, EOS] = 9.0                      # EOS would win greedy decoding everywhere
    seqs = [seq(output=(5,), drafts=(6, 7, 8), min_tokens=3, max_tokens=10, stop_token_ids=[3],
                ignore_eos=ignore_eos, temperature=0.0),
            seq(output=(5, 5, 5), min_tokens=3, max_tokens=10)]          # already long enough
    scores = processed_scores(logits, seqs)
    torch.testing.assert_close(scores, expected_scores(logits, seqs))
    # rows 0, 1 have 1 and 2 generated tokens < 3: banned; rows 2, 3 and request 1 are free
    assert torch.isinf(scores[:2, 3]).all() and torch.isfinite(scores[2:, 3]).all()
    assert torch.isinf(scores[:2, EOS]).all() == (not ignore_eos)
    first_token = RejectionSampler(eos_token_ids=[EOS])(logits, seqs)[0].token_ids[0]
    assert (first_token == EOS) == ignore_eos


def test_min_tokens_without_stop_ids_changes_nothing():
    logits = random_logits(1)
    out = processed_scores(logits, [seq(min_tokens=2, ignore_eos=True)])
    assert out is logits   # nothing to ban: no copy was made


# ----------------------------------------------------------------------------- temperature, truncation
TRUNCATION_PARAMS = [
    dict(temperature=1.0),
    dict(temperature=0.4),
    dict(temperature=2.5),
    dict(temperature=1.0, top_k=3),
    dict(temperature=0.7, top_k=1),
    dict(temperature=1.0, top_k=-1),
    dict(temperature=1.0, top_k=50),            # >= vocab: off
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.0, top_p=1e-6),          # only the argmax survives
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.8, min_p=0.3, top_k=5, top_p=0.8),
    dict(temperature=1.2, top_k=6, top_p=0.7, frequency_penalty=0.7, repetition_penalty=1.2),
]


@pytest.mark.parametrize("candidates", [1024, 4, 1])
def test_truncation_and_temperature_match_reference_in_one_mixed_batch(monkeypatch, candidates):
    # 1024 >= vocab: the full sort; 4 and 1: the partial top-p search, with its fallback on flat rows
    monkeypatch.setattr(truncation, "TOP_P_CANDIDATES", candidates)
    seqs = [seq(output=(1, 4), drafts=(4, 9)[: i % 3], **kw) for i, kw in enumerate(TRUNCATION_PARAMS)]
    seqs.insert(3, seq(drafts=(2,), temperature=0.0))   # a greedy request in the middle
    logits = random_logits(sum(len(s.draft_token_ids) + 1 for s in seqs), seed=1, scale=1.5)
    batch = SamplingBatch.build(seqs, logits)
    target_probs = Sampler(eos_token_ids=[EOS])(logits, batch).target_probs
    expected = [reference_probs(reference_scores(logits[r].tolist(), s.params, list(s.prompt_token_ids),
                                                 gen, [EOS]), s.params)
                for r, (s, gen) in enumerate(row_histories(seqs)) if s.params.temperature > 0]
    torch.testing.assert_close(target_probs, torch.tensor(expected, dtype=torch.float32),
                               atol=1e-6, rtol=1e-5)


def test_all_greedy_batch_computes_no_probabilities():
    seqs = [seq(drafts=(1, 2), temperature=0.0), seq(temperature=0.0)]
    logits = random_logits(4)
    rows = Sampler()(logits, SamplingBatch.build(seqs, logits))
    assert rows.target_probs.shape == (0, 12)
    assert rows.greedy_token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_greedy_uses_penalised_and_biased_scores():
    # Raw argmax is token 0 on every row; the penalty (with the draft prefix) and bias move it.
    logits = torch.tensor([[5.0, 4.0, 3.5, 0.0]] * 4)
    seqs = [seq(output=(0,), drafts=(1, 2), frequency_penalty=2.0, temperature=0.0),
            seq(logit_bias={3: 6.0}, temperature=0.0)]
    want_argmax = [max(range(4), key=row.__getitem__) for row in expected_scores(logits, seqs).tolist()]
    # row 0 [3, 4, 3.5, 0] -> 1; row 1 [3, 2, 3.5, 0] -> 2; row 2 [3, 2, 1.5, 0] -> 0; biased -> 3
    assert want_argmax == [1, 2, 0, 3]
    outputs = RejectionSampler()(logits, seqs)
    # Both drafts match the penalised argmax; a sampler forgetting draft 1 in row 1 would reject it.
    assert outputs[0].token_ids == [1, 2, 0] and outputs[0].num_accepted == 2
    assert outputs[1].token_ids == [3] and outputs[1].num_accepted == 0


# ----------------------------------------------------------------------------- logprobs
def _raw_logprobs(row: torch.Tensor) -> list[float]:
    return torch.log_softmax(row.double(), dim=-1).tolist()


def test_logprobs_are_raw_with_top_alternatives():
    logits = random_logits(4, seed=3)
    seqs = [seq(drafts=(1, 2), temperature=0.6, top_k=2, frequency_penalty=1.0, logprobs=3),
            seq(temperature=0.0, logit_bias={5: 50.0}, logprobs=0)]
    outputs = RejectionSampler()(logits, seqs)
    for out, request, start in zip(outputs, seqs, (0, 3)):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for j, entry in enumerate(out.logprobs):
            raw = _raw_logprobs(logits[start + j])
            assert entry.token_id == out.token_ids[j]
            assert entry.logprob == pytest.approx(raw[entry.token_id], abs=1e-5)
            want_top = sorted(range(12), key=lambda t: -raw[t])[: request.params.logprobs]
            assert [t for t, _ in entry.top] == want_top
            assert [v for _, v in entry.top] == pytest.approx([raw[t] for t in want_top], abs=1e-5)
    assert outputs[1].token_ids == [5] and outputs[1].logprobs[0].top == []


def test_speculative_and_plain_logprobs_are_identical():
    logits = random_logits(4, seed=4)
    params = dict(temperature=0.0, repetition_penalty=1.5, logprobs=2)
    # drafts = what greedy picks on each row, so all three are accepted
    drafts = []
    for j in range(3):
        probe = seq(output=(7,), drafts=drafts, **params)
        drafts.append(RejectionSampler()(logits[: j + 1], [probe])[0].token_ids[-1])
    spec = RejectionSampler()(logits, [seq(output=(7,), drafts=drafts, **params)])[0]
    assert spec.num_accepted == 3
    for j in range(4):
        plain = RejectionSampler()(logits[j:j + 1], [seq(output=(7, *drafts[:j]), **params)])[0]
        assert plain.token_ids == [spec.token_ids[j]]
        assert plain.logprobs == [spec.logprobs[j]]   # exact equality, values and alternatives


# ----------------------------------------------------------------------------- seeds
def _seeded_run(seed: int, others: int, steps: int = 5) -> list[list[int]]:
    """Five steps of one seeded request with k = 2 drafts, next to `others` unseeded requests."""
    mine = random_logits(3, vocab=1000, seed=5, scale=0.1)                 # flat: many likely tokens
    logits = torch.cat([random_logits(others, vocab=1000, seed=6, scale=0.1), mine])   # same rows for me
    emitted, output = [], []
    for _ in range(steps):
        me = SeqSamplingInput(SamplingParams(temperature=1.0, seed=seed), [1], list(output), [3, 4])
        crowd = [seq(temperature=1.0) for _ in range(others)]
        emitted.append(RejectionSampler()(logits, [*crowd, me])[-1].token_ids)
        output += emitted[-1]
    return emitted


def test_seeded_request_is_reproducible_regardless_of_batch():
    first = _seeded_run(seed=1234, others=0)
    torch.manual_seed(99)   # the global RNG must not matter to a seeded request
    assert _seeded_run(seed=1234, others=3) == first
    assert _seeded_run(seed=1235, others=0) != first
    assert len({tuple(t) for t in first}) > 1     # later positions draw other noise


def test_negative_and_large_seeds_are_accepted():
    logits = random_logits(1, vocab=1000, seed=5, scale=0.1)
    for s in (-(2**63), -1, 0, 2**63 - 1):
        out = RejectionSampler()(logits, [SeqSamplingInput(SamplingParams(temperature=1.0, seed=s), [1], [])])
        assert 0 <= out[0].token_ids[0] < 1000
