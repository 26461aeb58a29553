"""Recursive rejection sampling: verify the sampled children of one draft-tree node (Jeon et al. 2024,
"Recursive Speculative Decoding": SpecInfer's multi-draft residual rule, with the drafts drawn without
replacement).

The children x_1 .. x_m of a node were drawn without replacement from the draft distribution q
(speculators/tree_children.py: Gumbel-top-K); target_probs p is the target's processed distribution at the
node. With p_1 = p and q_1 = q:

  for i = 1 .. m: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on rejection
                  p_{i+1} = norm(max(p_i - q_i, 0))        (the residual, as for a chain's recovered token)
                  q_{i+1} = norm(q_i without x_i)          (what x_{i+1} was drawn from)
  all rejected:   emit a token drawn from p_{m+1}.

Why the emitted token is distributed as p: it is enough that round i, with x_i ~ q_i, emits a token
distributed as p_i whenever what follows a rejection emits one distributed as p_{i+1} (the last "round"
draws from p_{m+1} directly). P(accept, emit v) = q_i(v) min(1, p_i(v) / q_i(v)) = min(p_i(v), q_i(v));
P(reject) = 1 - sum_v min(p_i(v), q_i(v)) = sum_v max(p_i(v) - q_i(v), 0); so
P(emit v) = min(p_i(v), q_i(v)) + max(p_i(v) - q_i(v), 0) = p_i(v). The residual p_{i+1} does not depend
on which x_i was rejected, and round i + 1 is exact for any proposal as long as x_{i+1} was drawn from
the q_{i+1} it is tested against: which is why q_{i+1} must drop x_i and be renormalised. A rejected x_i
has p_i(x_i) < q_i(x_i), so p_{i+1}(x_i) = 0: it cannot be emitted later. Children that are one fixed
token each (the lookups: no q) are the case q_i = one-hot(x_i), which sampling/tree_verify.py keeps as
its own path: accept with p_i(x_i), then p_i without x_i.

Worked example, p = [0.5, 0.3, 0.2], q = [0.2, 0.7, 0.1], children [1, 0] (drawn in that order),
uniforms 0.6, 0.9:
  x_1 = 1: p/q = 0.3 / 0.7 = 0.43 < 0.6: rejected -> p_2 = norm([0.3, 0, 0.1]) = [0.75, 0, 0.25],
           q_2 = norm([0.2, 0, 0.1]) = [0.67, 0, 0.33]
  x_2 = 0: p_2/q_2 = 0.75 / 0.67 >= 1: accepted (any uniform) -> emit token 0.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.sampling.rng import inverse_cdf


def residual(target_probs: torch.Tensor,   # [vocab] float64, sums to 1: p_i
             draft_probs: torch.Tensor,    # [vocab] float64, sums to 1: q_i
             ) -> torch.Tensor:
    """[vocab] p_{i+1} = norm(max(p_i - q_i, 0)). Empty only when p_i == q_i up to rounding, where a rejection
    had probability ~0: p_i is then kept."""
    rest = (target_probs - draft_probs).clamp_(min=0.0)
    total = float(rest.sum())
    return rest / total if total > 0 else target_probs


def without(draft_probs: torch.Tensor,    # [vocab] float64, sums to 1: q_i
            token: int) -> torch.Tensor:
    """[vocab] q_{i+1}: q_i with the rejected `token` removed, renormalised (what the next sibling was drawn
    from)."""
    rest = draft_probs.clone()
    rest[token] = 0.0
    total = float(rest.sum())
    return rest / total if total > 0 else rest


def verify_children(target_probs: torch.Tensor,   # [vocab] the target's processed distribution at the node
                    draft_probs: torch.Tensor,    # [vocab] the q the children were drawn from
                    tokens: Sequence[int],        # the children, in the order they were drawn
                    ) -> tuple[int | None, int]:
    """(index of the accepted child, or None when all were rejected; the emitted token). Both rows are
    distributions (softmax outputs): the first test reads them as they are, the residuals are float64."""
    target, draft = target_probs, draft_probs                                    # p_1, q_1
    uniforms = torch.rand(len(tokens), dtype=torch.float64).tolist()
    for i, tok in enumerate(tokens):
        if uniforms[i] * float(draft[tok]) < float(target[tok]):     # u < p/q: probability min(1, p/q)
            return i, tok
        if i == 0:                                                   # the first rejection: float64 from here
            target, draft = target.double(), draft.double()
            target, draft = target / target.sum(), draft / draft.sum()
        target = residual(target, draft)
        draft = without(draft, tok)
    final = torch.rand(1, dtype=torch.float64, device=target.device)
    return None, int(inverse_cdf(target[None], final)[0])                        # from p_{m+1}
