"""sampling/coupled.py: the noise is standard Gumbel and a function of (seed, position, token) alone, and a
seeded request verified with any drafts emits exactly its plain (k = 0) decoding, for every parameter
the processed distribution has (penalties, logit_bias, min_tokens ban, temperature, min-p/top-k/top-p).

The toy target is test_rejection_stats.py's (logits from the last two tokens), so these runs take
milliseconds; tests/test_seeded_matrix.py does the same through the whole engine.
"""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from test_rejection_stats import CONFIGS, EOS, LAST, PROMPT, SECOND_LAST, VOCAB

from specserve.sampling import coupled
from specserve.sampling.outputs import SeqSamplingInput
from specserve.sampling.params import SamplingParams
from specserve.sampling.rejection import RejectionSampler


def test_noise_is_standard_gumbel_keyed_by_seed_and_position():
    keys = coupled.noise_keys(torch.full((64,), 1234), torch.arange(64))
    g = coupled.gumbel_noise(keys, 4096)                                        # [64, 4096]
    assert g.mean().item() == pytest.approx(0.5772, abs=0.01)                  # Euler-Mascheroni
    assert g.var().item() == pytest.approx(math.pi ** 2 / 6, abs=0.02)
    # its CDF exp(-exp(-x)) at a few points
    for x in (-1.0, 0.0, 1.0, 3.0):
        assert (g <= x).double().mean().item() == pytest.approx(math.exp(-math.exp(-x)), abs=0.005)
    again = coupled.gumbel_noise(coupled.noise_keys(torch.tensor([1234]), torch.tensor([5])), 4096)
    assert torch.equal(again[0], g[5])                                          # a function of the key
    assert len(set(keys.tolist())) == 64                                        # positions differ
    other_seed = coupled.noise_keys(torch.tensor([1235]), torch.tensor([5]))
    assert other_seed.item() != keys[5].item()
    # rows are not correlated with each other (a key collision or weak mixing would show here)
    corr = torch.corrcoef(g[:8])
    assert (corr - torch.eye(8)).abs().max().item() < 0.06


def target_rows(context: list[int], drafts: list[int]) -> torch.Tensor:
    """[k + 1, VOCAB] float32: the toy target after context + drafts[:j]."""
    seq = context + drafts
    return torch.stack([(SECOND_LAST[seq[j - 2]] + LAST[seq[j - 1]]).float()
                        for j in range(len(context), len(seq) + 1)])


def decode(params: SamplingParams, num_tokens: int, rng: random.Random | None = None,
           truth: list[int] | None = None) -> list[int]:
    """num_tokens of a seeded request; rng None = plain decoding, else k in 0..4 per step with drafts
    drawn at random, each replaced by the plain text's token (`truth`) with probability 0.7."""
    sampler = RejectionSampler(eos_token_ids=[EOS])
    out: list[int] = []
    while len(out) < num_tokens:
        k = 0 if rng is None else rng.randint(0, 4)
        drafts = [rng.randrange(VOCAB) for _ in range(k)] if rng is not None else []
        if truth is not None:
            drafts = [t if rng.random() < 0.7 else d for t, d in zip(truth[len(out):], drafts)]
        step = sampler(target_rows(PROMPT + out, drafts), [SeqSamplingInput(params, PROMPT, list(out), drafts)])
        out += step[0].token_ids
    return out[:num_tokens]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_speculative_coupled_decoding_equals_plain_with_any_drafts(config):
    rng = random.Random(config)
    for seed in range(12):
        params = dataclasses.replace(CONFIGS[config], seed=seed - 6, min_tokens=3)
        plain = decode(params, 14)
        for _ in range(3):
            assert decode(params, 14, rng, truth=plain) == plain, (config, seed)
        assert EOS not in plain[:3]                                             # the min_tokens ban binds


def test_the_equality_has_power_against_noise_keyed_by_step(monkeypatch):
    monkeypatch.setattr(coupled, "absolute_positions", lambda first, offset: first)
    params = dataclasses.replace(CONFIGS["plain"], seed=3)
    plain = decode(params, 14)                                                  # one row per step: unaffected
    rng = random.Random(0)
    assert any(decode(params, 14, rng, truth=plain) != plain for _ in range(5))


def test_seeded_requests_differ_between_seeds_and_positions():
    params = CONFIGS["plain"]
    texts = {tuple(decode(dataclasses.replace(params, seed=s), 10, None)) for s in range(20)}
    assert len(texts) > 15
