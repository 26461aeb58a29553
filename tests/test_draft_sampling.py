"""speculators/draft_sampling.py: drafts drawn at T > 0 follow the drafter's distribution exactly."""
import torch

from specserve.sampling.params import SamplingParams
from specserve.speculators.draft_sampling import draft_generator, sample_drafts


def test_draws_follow_the_probabilities_and_never_pick_zero_probability_tokens():
    torch.manual_seed(0)
    target = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.125])
    logits = target.log().expand(4000, -1).contiguous()                       # 4000 rows, T = 1
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens, probs = sample_drafts(logits, params, [None] * 4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
    assert counts[2] == 0                                                      # probability 0: never
    expected = target.double() * 4000
    mask = expected > 0
    chi2 = float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())
    assert chi2 < 16.3                                                         # 3 dof, p = 0.001
    torch.testing.assert_close(probs[0], target)                               # the row it was drawn from


def test_seeded_rows_reproduce_and_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, seed=8)]

    def draw():
        gens = [draft_generator(p, torch.device("cpu")) for p in params]
        return [sample_drafts(logits, params, gens)[0] for _ in range(20)]

    first, again = draw(), draw()
    assert first == again                                                       # same seeds: same drafts
    assert all(row[1] == int(logits[1].argmax()) for row in first)             # greedy row: argmax
    assert len({row[0] for row in first}) > 1                                   # it is random within a stream
