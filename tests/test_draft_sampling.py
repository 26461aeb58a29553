"""speculators/draft_sampling.py: drafts drawn at T > 0 follow the drafter's distribution exactly;
seeded drafts are the coupled choice of their position (the target's own rule when the two agree)."""
import torch

from specserve.sampling import coupled
from specserve.sampling.params import SamplingParams
from specserve.speculators.draft_sampling import sample_drafts


def test_draws_follow_the_probabilities_and_never_pick_zero_probability_tokens():
    torch.manual_seed(0)
    target = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.125])
    logits = target.log().expand(4000, -1).contiguous()                       # 4000 rows, T = 1
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens, probs = sample_drafts(logits, params, [0] * 4000, [0] * 4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
    assert counts[2] == 0                                                      # probability 0: never
    expected = target.double() * 4000
    mask = expected > 0
    chi2 = float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())
    assert chi2 < 16.3                                                         # 3 dof, p = 0.001
    torch.testing.assert_close(probs[0], target)                               # the row it was drawn from


def test_seeded_rows_are_their_positions_coupled_choice_and_greedy_rows_the_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, seed=8)]
    tokens, probs = sample_drafts(logits, params, [10, 10, 10], [0, 0, 2])
    assert probs[1] is None and tokens[1] == int(logits[1].argmax())          # greedy: the argmax
    torch.testing.assert_close(probs[0], (logits[0] / 0.9).softmax(-1))    # what it was chosen from
    torch.manual_seed(5)                                     # the global RNG plays no part
    assert sample_drafts(logits, params, [10, 10, 10], [0, 0, 2])[0] == tokens
    # the target's decision at the same position with the same distribution: the same token
    for row, pos in ((0, 10), (2, 12)):
        p = (logits[row] / 0.9).softmax(-1)[None]
        keys = coupled.noise_keys(torch.tensor([params[row].seed]), torch.tensor([pos]))
        assert tokens[row] == int(coupled.coupled_choice(p, keys))
    # other positions draw other noise
    row0 = {sample_drafts(logits[:1], params[:1], [10], [j])[0][0] for j in range(20)}
    assert len(row0) > 3
