"""TreeVerifier: exact verification of a draft tree (speculators/draft_tree.py) in one target forward.

A tree request owns N + 1 logits rows: row 0 after the known tokens, row 1 + j after node j's path (its
ancestors' tokens and its own). Each row is processed as its own one-row request whose output is the known
output plus that node's path, so penalties, logit_bias, the min_tokens ban, temperature, min-p/top-k/top-p
and the grammar mask all see that node's prefix (sampler.py); the walk then goes down from the root:

- greedy: the child equal to the row's argmax, while there is one; that argmax is emitted either way;
- seeded sampling (sampling/coupled.py): the same with argmax(log p + g), g keyed by (seed, position),
  so the text equals plain seeded decoding whatever the tree;
- unseeded sampling with sampled children (a model drafter: draft_probs row j is the q node j was drawn
  from, without replacement with its siblings): recursive rejection sampling over the children in the
  order drawn (sampling/recursive_rejection.py), the emitted token distributed as the row's p;
- unseeded sampling with deterministic children (the lookups: no draft_probs): with p the row's
  distribution, child x (in order) is accepted with probability p(x) / sum(p); a rejected x is removed
  from p (p(x) = 0) before the next sibling; when every child is rejected, the token is drawn from what is
  left of p. Output ~ p: P(first child) = p(x1), P(second) = (1 - p(x1)) * p(x2) / (1 - p(x1)) = p(x2),
  and so on (recursive rejection sampling with one-hot q);
- a leaf's row draws its bonus token from p.

Worked example (deterministic children), row 0 p = [0.5, 0.3, 0.2], children tokens [0, 1], uniforms 0.7, 0.4:
  0.7 < 0.5 fails -> p = [0, 0.3, 0.2]; 0.4 * 0.5 = 0.2 < 0.3 -> accept token 1 and walk on to its row.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sampling import coupled, recursive_rejection
from specserve.sampling.batch import SamplingBatch
from specserve.sampling.logprobs import collect_logprobs
from specserve.sampling.outputs import SeqSamplingInput, SeqSamplingOutput
from specserve.sampling.rng import inverse_cdf
from specserve.sampling.sampler import Sampler


@dataclass
class TreeInput:
    seq: SeqSamplingInput    # draft_token_ids: the nodes' tokens; grammar_mask [N + 1, vocab] per node row;
                             # draft_probs [N, vocab]: row j the q node j was drawn from (None: deterministic)
    parents: list[int]       # parents[j] < j, -1: the root; siblings in the order they were drawn


@dataclass
class TreeOutput:
    out: SeqSamplingOutput   # the emitted tokens: the accepted path's tokens, then the final token
    path: list[int]          # accepted node indices, root to leaf (len == out.num_accepted)


def _reject(p: torch.Tensor, token: int) -> None:
    """Remove a rejected sibling from the row's distribution (the next sibling sees p without it)."""
    p[token] = 0.0


def node_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """Per row (0: root, 1 + j: node j) the tokens after the known ones. Example: tokens [5, 6, 7],
    parents [-1, -1, 0] -> [[], [5], [6], [5, 7]]."""
    paths: list[list[int]] = [[]]
    for tok, parent in zip(tokens, parents):
        paths.append([*paths[parent + 1], tok])
    return paths


class TreeVerifier:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, target_logits: torch.Tensor,   # [sum_i (N_i + 1), vocab], not modified
                 trees: Sequence[TreeInput]) -> list[TreeOutput]:
        target_logits = target_logits.float()
        rows: list[SeqSamplingInput] = []
        for t in trees:
            mask = t.seq.grammar_mask
            for r, path in enumerate(node_paths(t.seq.draft_token_ids, t.parents)):
                rows.append(SeqSamplingInput(
                    params=t.seq.params, prompt_token_ids=t.seq.prompt_token_ids,
                    output_token_ids=[*t.seq.output_token_ids, *path],
                    grammar_mask=mask[r:r + 1] if mask is not None else None))
        batch = SamplingBatch.build(rows, target_logits)
        processed = self.sampler(target_logits, batch)
        greedy_ids = dict(zip(batch.greedy.rows.tolist(), processed.greedy_token_ids.tolist()))
        random_row = {row: j for j, row in enumerate(batch.random.rows.tolist())}
        outputs, first = [], 0
        for t in trees:
            outputs.append(self._walk(t, first, greedy_ids, random_row, processed.target_probs))
            first += len(t.parents) + 1
        return self._logprobs(target_logits, trees, outputs)

    def _walk(self, t: TreeInput, first: int, greedy_ids: dict[int, int], random_row: dict[int, int],
              probs: torch.Tensor) -> TreeOutput:
        """Root to leaf over the tree of one request whose rows start at global row `first`."""
        children: dict[int, list[int]] = {}
        for j, parent in enumerate(t.parents):
            children.setdefault(parent, []).append(j)
        tokens, params = t.seq.draft_token_ids, t.seq.params
        position = len(t.seq.prompt_token_ids) + len(t.seq.output_token_ids)   # of the token row 0 decides
        node, path, emitted = -1, [], []
        while True:
            row = first + 1 + node
            kids = children.get(node, [])
            if row in greedy_ids or params.coupled:
                if row in greedy_ids:
                    tok = greedy_ids[row]
                else:
                    keys = coupled.noise_keys(torch.tensor([params.seed]), torch.tensor([position + len(path)]))
                    tok = int(coupled.coupled_choice(probs[random_row[row]][None], keys.to(probs.device))[0])
                nxt = next((c for c in kids if tokens[c] == tok), None)
            else:
                q = t.seq.draft_probs[kids[0]] if t.seq.draft_probs is not None and kids else None   # [vocab]
                nxt, tok = self._sample(probs[random_row[row]], [tokens[c] for c in kids], q)
                nxt = None if nxt is None else kids[nxt]
            emitted.append(tok)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        return TreeOutput(SeqSamplingOutput(token_ids=emitted, num_accepted=len(path)), path)

    @staticmethod
    def _sample(row_probs: torch.Tensor, kid_tokens: list[int],
                draft_probs: torch.Tensor | None = None) -> tuple[int | None, int]:
        """(index of the accepted child or None, the emitted token) for a sampled row [vocab] whose children
        were drawn from draft_probs [vocab] (None: deterministic children)."""
        if draft_probs is not None:
            return recursive_rejection.verify_children(row_probs, draft_probs, kid_tokens)
        p = row_probs.clone()
        for i, tok in enumerate(kid_tokens):
            total = float(p.sum())
            if total > 0 and float(torch.rand(())) * total < float(p[tok]):
                return i, tok
            _reject(p, tok)
        # every child rejected: draw from the rest (a float-rounding empty rest falls back to the row)
        weights = p if float(p.sum()) > 0 else row_probs
        return None, int(inverse_cdf(weights[None], torch.rand(1, device=p.device))[0])

    @staticmethod
    def _logprobs(target_logits: torch.Tensor, trees: Sequence[TreeInput],
                  outputs: list[TreeOutput]) -> list[TreeOutput]:
        """The target's logprobs of the emitted tokens, each from the row that decided it."""
        rows, toks, top, owners, first = [], [], [], [], 0
        for t, o in zip(trees, outputs):
            if t.seq.params.logprobs is not None:
                rows.extend(first + 1 + node for node in [-1, *o.path])
                toks.extend(o.out.token_ids)
                top.extend([t.seq.params.logprobs] * len(o.out.token_ids))
                owners.append(o)
            first += len(t.parents) + 1
        if owners:
            found = iter(collect_logprobs(target_logits, rows, toks, top))
            for o in owners:
                o.out.logprobs = [next(found) for _ in o.out.token_ids]
        return outputs
