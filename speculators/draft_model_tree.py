"""Draft trees for the draft model (a small LM, speculators/draft_model.py): draft_tree.py's frontier
expansion, one forward of the whole draft model per depth, batched over every tree request of the step.

N = num_tokens. The draft model's first forward of the step (batched with the chain requests) computes the
tokens it has not seen, up to t_{N-1}: its KV then holds the context at keys [0, N), and the last row's
distribution gives the K best first tokens (depth 1). Depth step s = 1 .. D-1 runs every frontier node (all
at depth s) as one row: its token, at RoPE position N-1+s (where it would stand in the text), its K/V at key
N + (s-1)K + r (r: its place in the frontier; a slot of its own), its attention restricted to the context and
to its ancestors' rows and its own (server/models/tree_attention.py restrict_rows) -- HeadTreeBuilder's row
layout with base N. The same metadata reaches every layer, so layer l's row for a node sees the context's
and the node's ancestors' layer-l K/V only: exactly the chain the draft would have run along that path. The
frontier rows' logits give the children, scored (cumulative log-probability) and pruned as in draft_tree.py.

The tree rows are never trusted later: after a tree step the draft's bookkeeping (draft_model.py) holds
num_confirmed = N and no speculative tokens, so the next propose recomputes the tokens the target kept from
position N (the accepted path and the bonus token, usually a few rows), overwriting those keys. Reading them as
a chain's rows would be wrong: key N + 1 holds the first node's sibling at position N, not its child.

At T > 0 the children are sampled from the draft's distribution q at the request's temperature and truncation
(speculators/tree_children.py: a seeded request's first child is its chain's coupled draft, an unseeded
request's children are drawn without replacement), and every node carries the q it was drawn from for the
verifier's recursive rejection sampling (sampling/recursive_rejection.py), as for the heads.

Worked example, K = 2, D = 3, context t_0..t_4 (N = 5): the first forward's last row gives a, b (depth 1).
Step 1: rows a, b at position 5, keys 5, 6, each seeing keys 0..4 and itself -> children of a: c, d; of b:
e, f; the frontier keeps the best two, say c, e. Step 2: rows c, e at position 6, keys 7, 8: c sees keys
0..4, 5 (a) and 7; e sees 0..4, 6 (b) and 8 -> their children; the N best candidates are verified.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.server.models.attention import build_attention_metadata
from specserve.server.models.tree_attention import restrict_rows
from specserve.speculators.base import DraftTree
from specserve.speculators.draft_tree import (
    Candidate,
    Tree,
    add_children,
    ancestor_mask,
    best_nodes,
    children_of_rows,
)
from specserve.speculators.tree_calibration import ScoreCalibration


@dataclass
class _Tree:
    """One request's tree while it is built."""
    tree: DraftTree
    request: object                  # the engine request (sampling params: its children's draw)
    n_tok: int                       # N: the context's keys are [0, N) (a draft model's KV starts at 0)
    block_ids: list[int]             # the draft KV blocks of the request
    cands: list[Candidate]
    frontier: list[int]              # candidate indices to expand next
    key: dict[int, int] = field(default_factory=dict)   # expanded candidate -> KV key of its row

    def first_key(self, s: int) -> int:
        """The key of depth step s's first row: after the context and the K rows of each earlier step."""
        return self.n_tok + (s - 1) * self.tree.top_k


class DraftModelTreeBuilder:
    """Builds trees with the draft model; DraftModelSpeculator drives it (draft_model.py).

    drafter: the DraftModelSpeculator (its KV cache and `logits_of_rows`).
    """

    def __init__(self, drafter) -> None:
        self.d = drafter
        self.calibration = ScoreCalibration()   # greedy nodes' scores (speculators/tree_calibration.py)
        self.build_seconds = 0.0         # time spent building trees (the benchmark reports it per step)
        self.num_built = 0               # trees built (requests x steps)
        self.num_calls = 0               # propose calls that built >= 1 tree

    @staticmethod
    def kv_end(n_tok: int, tree: DraftTree) -> int:
        """Draft KV positions a tree needs: the context [0, N) and K rows per depth step after the first."""
        return n_tok + tree.top_k * (tree.depth - 1)

    def build(self, items: list, logits: torch.Tensor,   # [a, target vocab] float32: the first forward's last rows
              ) -> list[Tree]:
        """items: the draft model's _Live entries (request, state, k) of tree requests, their context computed
        and their KV reserved to kv_end -> per item its tree."""
        grow: list[_Tree] = []
        for item, kids in zip(items, children_of_rows(logits, [(item.request, 1) for item in items], 0,
                                                      self.calibration)):
            g = _Tree(item.request.spec_params.draft_tree, item.request, item.request.num_tokens,
                      item.state.kv.block_ids, [], [])
            g.frontier = add_children(g.cands, -1, kids, 1)
            grow.append(g)
        for s in range(1, max(g.tree.depth for g in grow)):
            work = [g for g in grow if g.tree.depth > s and g.frontier]
            if work:
                self._expand(s, work)
        return [best_nodes(g.cands, item.k) for item, g in zip(items, grow)]

    def _expand(self, s: int, work: list[_Tree]) -> None:
        """Depth step s: one draft-model forward over every request's frontier rows, then the K children of
        each frontier node, the K best of those kept as the next frontier."""
        d = self.d
        q_lens, seq_lens, tokens, positions = [], [], [], []
        for g in work:
            first = g.first_key(s)
            for r, c in enumerate(g.frontier):
                g.key[c] = first + r
                tokens.append(g.cands[c].token)
            positions += [g.n_tok - 1 + s] * len(g.frontier)
            q_lens.append(len(g.frontier))
            seq_lens.append(first + len(g.frontier))
        attn = build_attention_metadata(q_lens, seq_lens, [g.block_ids for g in work], d.cache.block_size,
                                        d.device, backend="sdpa")
        for i, g in enumerate(work):
            restrict_rows(attn, i, self._mask(g, seq_lens[i]))
        # RoPE at the node's place in the text; the keys (slots, causality) stay the metadata's
        attn.positions = torch.tensor(positions, dtype=torch.long, device=attn.positions.device)   # [rows]
        logits = d.logits_of_rows(tokens, attn)                                       # [rows, V]
        kids = iter(children_of_rows(logits, [(g.request, len(g.frontier)) for g in work], s, self.calibration))
        for g in work:
            children: list[int] = []
            for c in g.frontier:
                children += add_children(g.cands, c, next(kids), s + 1)
            g.frontier = sorted(children, key=lambda i: (-g.cands[i].score, i))[:g.tree.top_k]

    @staticmethod
    def _mask(g: _Tree, seq_len: int) -> torch.Tensor:
        """[frontier, seq_len] bool: the context, and each frontier node's own and its ancestors' rows."""
        return ancestor_mask(g.frontier, g.cands, g.key, g.n_tok, seq_len)
