"""Which children a draft-tree node gets (speculators/draft_tree.py grows the tree from them): per drafter row,
the node's K children, in the order the verifier tries them, each with a score, and the distribution q
they were drawn from.

- greedy requests: the K most probable tokens, scored by log q (EAGLE-2; a path's score is their sum) at the
  drafter's calibrated temperature (speculators/tree_calibration.py), no q: the verifier follows the target's
  argmax and needs none;
- seeded requests: the K best of log q + g, g the coupled Gumbel noise of the children's absolute position
  (sampling/coupled.py) and q the drafter's distribution at the request's temperature and truncation
  (speculators/draft_sampling.py): the first child is exactly the chain's coupled draft there. The text
  never depends on the children (the verifier follows the target's coupled choice);
- unseeded sampled requests: K tokens sampled without replacement from q with the global RNG, with the law
  (tokens and perturbed scores) of the top K of log q + g for fresh Gumbel noise g (Gumbel-top-K), drawn
  top-down so that no vocabulary-wide noise is needed. The verifier's recursive rejection sampling
  (sampling/recursive_rejection.py) is exact for exactly that: x_i drawn from q without x_1 .. x_{i-1}.

A sampled child's score is G(x) - max G with G = log q + g its perturbed score: 0 for the first child,
below 0 for the rest, summed along a path like the greedy log-probabilities, so a parent still outranks its
children and the kept nodes form a tree. Why not log q: whether a child is verified must not depend on which
token was drawn, else the verified child is no draw from q and its acceptance test is biased (a tree keeping
children by log q would try the likely draws more often than q says). The value of the i-th largest
perturbed score is independent of which token holds it, given the i - 1 before it (Gumbel-max: the max and
the argmax of independent Gumbels are independent, also below a threshold), so ranking by it only is exact.

Worked example (sampled), q = [0.5, 0.3, 0.2], K = 2, g = [0.1, 0.9, -0.2]: G = log q + g =
[-0.593, -0.304, -1.809] -> children [1, 0] with scores [0, -0.289] and q for both.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specserve.sampling import coupled
from specserve.sampling.params import SamplingParams
from specserve.sampling.rng import inverse_cdf
from specserve.speculators.draft_sampling import drafter_probs
from specserve.speculators.tree_calibration import ScoreCalibration


@dataclass
class Children:
    tokens: list[int]                 # in the order the verifier tries them
    scores: list[float]               # <= 0: log q (greedy), G - max G (sampled)
    probs: torch.Tensor | None        # [vocab] the q they were drawn from; None: the top K (greedy)

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return iter(zip(self.tokens, self.scores))


def top_children(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """logprobs [V] -> the k best (token, log-probability), best first (-inf tokens never)."""
    vals, ids = logprobs.topk(min(k, logprobs.shape[0]))
    return [(t, v) for t, v in zip(ids.tolist(), vals.tolist()) if v > float("-inf")]


def draw_children(logits: torch.Tensor,                 # [r, vocab] float32 drafter logits (-inf: impossible)
                  params: Sequence[SamplingParams],     # [r] the row's request's
                  positions: Sequence[int],             # [r] absolute position of the row's children
                  top_ks: Sequence[int],                # [r] children per node
                  calibration: ScoreCalibration | None = None,
                  ) -> list[Children]:
    """Per row its node's children (the module docstring). calibration: the drafter's greedy score
    (speculators/tree_calibration.py); None: log q."""
    out: list[Children | None] = [None] * logits.shape[0]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]           # [g, vocab]
        logprobs = rows.log_softmax(dim=-1) if calibration is None else calibration.log_probs(rows)
        for j, i in enumerate(greedy):
            found = top_children(logprobs[j], top_ks[i])
            out[i] = Children([t for t, _ in found], [v for _, v in found], None)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        sub = [params[i] for i in sampled]
        probs = drafter_probs(logits.index_select(0, index).float(), sub)         # [m, vocab]
        ks = [top_ks[i] for i in sampled]
        seeded = [j for j, p in enumerate(sub) if p.coupled]
        fresh = [j for j, p in enumerate(sub) if not p.coupled]
        found = {}
        if seeded:
            found.update(_coupled_top(probs, seeded, sub, [positions[i] for i in sampled], ks))
        if fresh:
            found.update(_without_replacement(probs, fresh, ks))
        for j, i in enumerate(sampled):
            out[i] = Children(*found[j], probs[j])
    return out


def _coupled_top(probs: torch.Tensor,   # [m, vocab] rows sum to 1
                 rows: list[int], params: list[SamplingParams], positions: list[int], ks: list[int],
                 ) -> dict[int, tuple[list[int], list[float]]]:
    """Seeded rows -> (the K best of log q + g, g the coupled noise of (seed, position); their scores)."""
    index = torch.tensor(rows, dtype=torch.long, device=probs.device)
    keys = coupled.noise_keys(torch.tensor([params[j].seed for j in rows], dtype=torch.long),
                              torch.tensor([positions[j] for j in rows], dtype=torch.long))
    scores = coupled.coupled_scores(probs.index_select(0, index), keys.to(probs.device))   # [s, vocab] float64
    vals, ids = scores.topk(min(max(ks[j] for j in rows), probs.shape[1]), dim=-1)
    out = {}
    for j, row_vals, row_ids in zip(rows, vals.tolist(), ids.tolist()):
        kept = [(t, v) for t, v in zip(row_ids[:ks[j]], row_vals[:ks[j]]) if v > float("-inf")]
        out[j] = ([t for t, _ in kept], [v - kept[0][1] for _, v in kept])
    return out


def _without_replacement(probs: torch.Tensor,   # [m, vocab] rows sum to 1
                         rows: list[int], ks: list[int]) -> dict[int, tuple[list[int], list[float]]]:
    """Unseeded rows -> (K draws without replacement from q; their scores), with the global RNG.

    The same law as the top K of log q + g for fresh Gumbel noise g, without vocab-wide noise: draw i is an
    inverse-CDF draw from q with the earlier draws removed (remaining mass R_i), and its perturbed score G_i
    the largest of the remaining Gumbels, which is a Gumbel of location log R_i truncated below G_{i-1},
    drawn independently of the token (Gumbel-max): G_1 = log R_1 - log E_1, G_i = -log(exp(-G_{i-1}) +
    E_i / R_i), E_i ~ Exp(1). Example: R_1 = 1, E_1 = 1 -> G_1 = 0; q(x_1) = 0.5, E_2 = 0.5 -> R_2 = 0.5,
    G_2 = -log(1 + 1) = -0.69: the second child scores -0.69.
    """
    index = torch.tensor(rows, dtype=torch.long, device=probs.device)
    work = probs.index_select(0, index)                   # [f, vocab] q, each drawn token zeroed after its draw
    remaining = work.sum(dim=-1, dtype=torch.float64)     # [f] R_i
    tokens: list[list[int]] = [[] for _ in rows]
    scores: list[list[float]] = [[] for _ in rows]
    perturbed = torch.zeros(len(rows), dtype=torch.float64, device=probs.device)       # [f] G_i
    wanted = torch.tensor([ks[j] for j in rows], device=probs.device)                  # [f] K per row
    for i in range(max(ks[j] for j in rows)):
        live = ((remaining > 0) & (wanted > i)).nonzero().flatten()        # rows with mass left and K not reached
        if live.numel() == 0:
            break
        drawn = inverse_cdf(work.index_select(0, live), torch.rand(live.numel(), device=probs.device))
        exp = torch.empty(live.numel(), dtype=torch.float64, device=probs.device).exponential_()
        exp.clamp_(min=1e-300)                                             # E_i ~ Exp(1), > 0
        mass = remaining.index_select(0, live)
        value = mass.log() - exp.log() if i == 0 else -torch.log(
            torch.exp(-perturbed.index_select(0, live)) + exp / mass)
        perturbed.index_copy_(0, live, value)
        work.index_put_((live, drawn), torch.zeros((), dtype=work.dtype, device=work.device))
        remaining = work.sum(dim=-1, dtype=torch.float64)
        for r, tok, v in zip(live.tolist(), drawn.tolist(), value.tolist()):
            tokens[r].append(tok)
            scores[r].append(v)
    return {j: (tokens[r], [v - scores[r][0] for v in scores[r]]) for r, j in enumerate(rows)}
