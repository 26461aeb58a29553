"""Speculative sampling is lossless: emitted tokens follow the processed target distribution exactly.

A 6-token "target model" maps a context to logits through its last two tokens, so the distribution
of the 2nd emitted token depends on the 1st. For each configuration we generate the first two
tokens of 20k sequences the way the engine would (k cycling 0..3 in one ragged batch, drafts
verified, a second step for sequences that got only one token) and compare the joint histogram of
(token 1, token 2) with the exact joint probability P(t1) * P(t2 | t1), computed below by hand
from the processed target (penalties, bias, min_tokens, temperature, min_p, top_k, top_p).

The test is shown to have teeth: with the draft prefix dropped from the penalties, or with the
recovered token drawn from the target instead of the residual, the p-value collapses.

Seeded sequences (coupled sampling, sampling/coupled.py: each sequence its own seed, so the noise
differs between sequences) must follow the same joint distribution; uniform noise in place of Gumbel
noise fails it.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

import specserve.sampling.penalties as penalties
from specserve.sampling import coupled
from specserve.sampling.draft_distribution import DraftDistribution
from specserve.sampling.outputs import SeqSamplingInput
from specserve.sampling.params import SamplingParams
from specserve.sampling.rejection import RejectionSampler

torch.set_num_threads(1)
VOCAB = 6
EOS = 5
PROMPT = [0, 3]
NUM_SEQUENCES = 20_000
BUG_SEQUENCES = 5_000    # the planted bugs are blatant: a quarter of the samples already gives p < 1e-20
DRAFTS_PER_SEQUENCE = (0, 1, 2, 3)   # sequence i speculates k = DRAFTS_PER_SEQUENCE[i % 4]

_tables = torch.Generator().manual_seed(2024)
# target logits = LAST[ctx[-1]] + SECOND_LAST[ctx[-2]]; the diagonal makes repeats likely, which is
# exactly what the penalties fight (and what a sampler forgetting the draft prefix gets wrong).
LAST = (torch.randn(VOCAB, VOCAB, generator=_tables) + 1.5 * torch.eye(VOCAB)).double()
SECOND_LAST = (0.8 * torch.randn(VOCAB, VOCAB, generator=_tables)).double()
DRAFTER = 1.5 * torch.randn(VOCAB, VOCAB, generator=_tables)   # draft logits = DRAFTER[ctx[-1]]

CONFIGS = {
    "plain": SamplingParams(temperature=1.0),
    "truncated": SamplingParams(temperature=0.8, top_k=4, top_p=0.85),
    "penalised": SamplingParams(temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.9,
                                presence_penalty=0.6),
    "everything": SamplingParams(temperature=1.2, top_k=5, top_p=0.9, min_p=0.05, min_tokens=1,
                                 repetition_penalty=1.2, frequency_penalty=0.7, presence_penalty=0.3,
                                 logit_bias={2: 1.0}),
}


# ----------------------------------------------------------------------------- exact distribution
def reference_probs(context: list[int], generated: list[int], params: SamplingParams) -> list[float]:
    """The processed next-token distribution after `context`, whose last `generated` are output."""
    counts = Counter(generated)
    scores = []
    for token in range(VOCAB):
        x = float(LAST[context[-1], token] + SECOND_LAST[context[-2], token])
        if token in set(context):   # context = prompt + generated
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        x -= params.frequency_penalty * counts[token] + params.presence_penalty * (counts[token] > 0)
        x += (params.logit_bias or {}).get(token, 0.0)
        if len(generated) < params.min_tokens and token == EOS:
            x = -math.inf
        scores.append(x / params.temperature)

    def normalised(xs: list[float]) -> list[float]:
        weights = [math.exp(x) for x in xs]
        return [w / sum(weights) for w in weights]

    probs = normalised(scores)
    scores = [x if p >= params.min_p * max(probs) else -math.inf for x, p in zip(scores, probs)]
    if 0 < params.top_k < VOCAB:
        kth = sorted(scores, reverse=True)[params.top_k - 1]
        scores = [x if x >= kth else -math.inf for x in scores]
    probs, mass = normalised(scores), 0.0
    for token in sorted(range(VOCAB), key=lambda t: -scores[t]):
        if mass >= params.top_p and params.top_p < 1.0:
            scores[token] = -math.inf
        mass += probs[token]
    return normalised(scores)


def exact_joint(params: SamplingParams) -> torch.Tensor:
    """[VOCAB * VOCAB] float64: P(t1, t2) = P(t1 | prompt) * P(t2 | prompt + t1)."""
    first = reference_probs(PROMPT, [], params)
    joint = [first[t1] * p2 for t1 in range(VOCAB) for p2 in reference_probs(PROMPT + [t1], [t1], params)]
    return torch.tensor(joint, dtype=torch.float64)


# ----------------------------------------------------------------------------- simulated engine
def propose(contexts: list[list[int]], ks: list[int], random_drafts: bool, generator: torch.Generator):
    """Drafts from the draft model: sampled (with draft_probs) or its argmax (draft_probs None).

    Returns drafts [M, max_k] (padded), the per-sequence draft lists and draft_probs [k_i, vocab].
    """
    max_k = max(ks)
    last = torch.tensor([c[-1] for c in contexts])                            # [M]
    drafts = torch.zeros(len(contexts), max_k, dtype=torch.long)               # [M, max_k]
    probs = torch.zeros(len(contexts), max_k, VOCAB)                           # [M, max_k, vocab]
    for j in range(max_k):
        probs[:, j] = DRAFTER[last].softmax(dim=-1)
        last = (torch.multinomial(probs[:, j], 1, generator=generator).squeeze(1) if random_drafts
                else probs[:, j].argmax(dim=-1))
        drafts[:, j] = last
    token_ids = [d[:k] for d, k in zip(drafts.tolist(), ks)]
    valid = torch.arange(max_k)[None, :] < torch.tensor(ks)[:, None]          # [M, max_k]
    draft_probs = probs[valid].split(ks) if random_drafts else [None] * len(ks)   # [k_i, vocab] each
    return drafts, token_ids, draft_probs


def target_rows(contexts: list[list[int]], drafts: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """[sum(k + 1), vocab] float32: row j of a sequence is the target after context + drafts[:j]."""
    tails = torch.cat([torch.tensor([c[-2:] for c in contexts]), drafts], dim=1)   # [M, 2 + max_k]
    nrows = torch.tensor(ks) + 1
    seq_of_row = torch.repeat_interleave(torch.arange(len(ks)), nrows)             # [R]
    j = torch.arange(seq_of_row.numel()) - (torch.cumsum(nrows, 0) - nrows)[seq_of_row]
    # the context of row j ends with tails[j : j + 2]
    return (SECOND_LAST[tails[seq_of_row, j]] + LAST[tails[seq_of_row, j + 1]]).float()


def sample_pairs(params: SamplingParams, random_drafts: bool, seed: int,
                 num_sequences: int = NUM_SEQUENCES, seeded: bool = False) -> torch.Tensor:
    """[num_sequences] long: t1 * VOCAB + t2 for each sequence's first two emitted tokens.

    seeded: sequence i is a seeded request (its own seed), verified by coupled sampling."""
    torch.manual_seed(seed)
    draft_generator = torch.Generator().manual_seed(seed + 1)
    sampler = RejectionSampler(eos_token_ids=[EOS])
    outputs: list[list[int]] = [[] for _ in range(num_sequences)]
    pending = list(range(num_sequences))
    while pending:
        contexts = [PROMPT + outputs[i] for i in pending]
        ks = [DRAFTS_PER_SEQUENCE[i % len(DRAFTS_PER_SEQUENCE)] for i in pending]
        drafts, draft_lists, draft_probs = propose(contexts, ks, random_drafts, draft_generator)
        seqs = [SeqSamplingInput(dataclasses.replace(params, seed=seed * 10**6 + i) if seeded else params,
                                 PROMPT, outputs[i], d, draft_probs=p)
                for i, d, p in zip(pending, draft_lists, draft_probs)]
        results = sampler(target_rows(contexts, drafts, ks), seqs)
        for i, out in zip(pending, results):
            outputs[i] = outputs[i] + out.token_ids   # the engine would truncate at max_tokens here
        pending = [i for i in pending if len(outputs[i]) < 2]
    return torch.tensor([o[0] * VOCAB + o[1] for o in outputs])


def chi_square_p_value(pairs: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of the observed cell counts against `probs`; impossible outcomes give 0."""
    observed = torch.bincount(pairs, minlength=probs.numel()).double()
    expected = probs * pairs.numel()
    if observed[expected == 0].sum() > 0:
        return 0.0
    # Cells expected below 5 are pooled into one, the usual validity rule for the chi-square law.
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    obs = torch.cat([observed[big], observed[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    statistic = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("random_drafts", [False, True], ids=["one-hot-drafts", "sampled-drafts"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_speculative_output_matches_target_distribution(config, random_drafts):
    params = CONFIGS[config]
    p_value = chi_square_p_value(sample_pairs(params, random_drafts, seed=7), exact_joint(params))
    assert p_value > 1e-3, f"{config}: p = {p_value:.2e}"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_coupled_output_matches_target_distribution(config):
    params = CONFIGS[config]
    pairs = sample_pairs(params, random_drafts=True, seed=8, seeded=True)
    p_value = chi_square_p_value(pairs, exact_joint(params))
    assert p_value > 1e-3, f"{config}: p = {p_value:.2e}"


def test_coupled_statistic_has_power_against_non_gumbel_noise(monkeypatch):
    # Uniform noise in place of Gumbel noise: still an argmax of a perturbed score, the wrong law.
    def uniform(keys, vocab):
        return torch.rand(keys.shape[0], vocab, dtype=torch.float64)
    monkeypatch.setattr(coupled, "gumbel_noise", uniform)
    params = CONFIGS["plain"]
    pairs = sample_pairs(params, random_drafts=True, seed=8, num_sequences=BUG_SEQUENCES, seeded=True)
    p_value = chi_square_p_value(pairs, exact_joint(params))
    assert p_value < 1e-6, f"p = {p_value:.2e}"


def test_statistic_has_power_against_forgetting_the_draft_prefix(monkeypatch):
    monkeypatch.setattr(penalties, "add_draft_prefix", lambda *args: None)
    params = CONFIGS["penalised"]
    pairs = sample_pairs(params, random_drafts=False, seed=7, num_sequences=BUG_SEQUENCES)
    p_value = chi_square_p_value(pairs, exact_joint(params))
    assert p_value < 1e-6, f"p = {p_value:.2e}"


def test_statistic_has_power_against_recovering_from_the_target(monkeypatch):
    # The classic bug: at a rejection, sample from target_probs instead of the residual.
    monkeypatch.setattr(DraftDistribution, "residual", lambda self, target_probs, num_accepted: target_probs)
    params = CONFIGS["plain"]
    pairs = sample_pairs(params, random_drafts=True, seed=7, num_sequences=BUG_SEQUENCES)
    p_value = chi_square_p_value(pairs, exact_joint(params))
    assert p_value < 1e-6, f"p = {p_value:.2e}"


def test_chi_square_helper_against_known_values():
    # 95th percentile of chi-square with 1 degree of freedom is 3.841: two cells, 50/50 expected,
    # observed 5098 / 4902 of 10000 gives statistic 2 * 98**2 / 5000 = 3.8416 -> p = 0.05.
    pairs = torch.cat([torch.zeros(5098, dtype=torch.long), torch.ones(4902, dtype=torch.long)])
    probs = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert chi_square_p_value(pairs, probs) == pytest.approx(0.05, abs=1e-3)
    # exact sampling passes, a 2% shift of mass fails, an impossible outcome gives 0
    generator = torch.Generator().manual_seed(0)
    joint = exact_joint(CONFIGS["truncated"])
    assert chi_square_p_value(torch.multinomial(joint, NUM_SEQUENCES, True, generator=generator), joint) > 1e-3
    shifted = joint.clone()
    shifted[joint.argmax()] -= 0.02
    shifted[torch.where(joint > 0, joint, 1.0).argmin()] += 0.02   # a possible cell: no shortcut
    assert chi_square_p_value(torch.multinomial(shifted, NUM_SEQUENCES, True, generator=generator), joint) < 1e-6
