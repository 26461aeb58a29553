"""Draft trees for a head of n > 1 layers (MTP next-n layers): draft_tree.py's frontier expansion over the
per-layer rows of speculators/hidden_drafter.py (its module docstring has the chain's alignment).

N = num_tokens; a node at depth e (1: a first draft token; 0: the root, the known context) stands at
position N-1+e. Layer m's row for node y at depth e sits at base N-2-m+e (the chain's step m runs layer m
over bases [N-1-m, N-1), whose tokens are the drafts d_1..d_m of one path):

  e <= m (computed at depth step m): input (layer m-1's output for y's parent, y's token); the root's
         layer m-1 output is the context's, g^{m-1} at base N-1-m, the last row of carry[m-1]
  e > m  (m = n-1 only, e >= n: chained beyond the depth, as the chain's step s >= n): input (layer
         n-1's output for y's parent, y's token), one base further per depth

So a row belongs to one (layer, node) and is shared by every path through that node. Depth step s
(expanding the frontier, all at depth s) runs ONE layer m = min(s, n-1), batched over every tree request:
for s < n layer s over the frontier and all its ancestors (at most K rows per depth, ancestors first), for
s >= n layer n-1 over the frontier alone. A row sees layer m's observed context and the rows of layer m
for its own ancestors (and itself), never a sibling's (server/models/tree_attention.py restrict_rows,
one mask per layer); each (layer, node) row has a KV slot of its own after layer m's context. The
frontier's rows give the children's logits (layer m's head), scored and pruned as in draft_tree.py.
Nothing here advances the head's `ends`: the next observe overwrites these speculative rows, as after a
chain (bases >= ends[m] are recomputed from the accepted tokens).

Worked example, n = 2, K = 2, D = 3, context t_0..t_4 (N = 5): g^0_3 (carry[0]) gives a, b (depth 1).
Step 1, layer 1: rows (g^0_3, a), (g^0_3, b) at base 3, each seeing layer 1's context [bases 0..2] and
itself -> children of a: c, d; of b: e, f; the frontier keeps the best two, say c, e. Step 2 (chained),
layer 1: rows (out(1, a), c), (out(1, b), e) at base 4, c seeing the context, a's row and itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.server.models.attention import build_attention_metadata
from specserve.server.models.attention_metadata import SHORT_QUERY_MAX
from specserve.server.models.tree_attention import restrict_rows
from specserve.speculators.base import DraftTree
from specserve.speculators.draft_tree import (
    Candidate,
    HeadTreeBuilder,
    Tree,
    add_children,
    best_nodes,
    children_of_rows,
)


@dataclass
class _Tree:
    """One request's tree while it is built."""
    tree: DraftTree
    request: object                  # the engine request (sampling params, num_tokens: its children's draw)
    seq: object                      # the drafter's _HeadSeq: kv, ends, carry (read only)
    n_tok: int                       # N
    cands: list[Candidate]
    frontier: list[int]              # candidate indices to expand next
    out: list[dict[int, torch.Tensor]]   # per layer: node -> its row's output [H]
    key: list[dict[int, int]]            # per layer: node -> relative KV index of its row
    used: list[int]                      # per layer: tree rows written after the layer's context

    def base(self, m: int, depth: int) -> int:
        return self.n_tok - 2 - m + depth

    def ctx(self, m: int) -> int:
        """Relative KV keys [0, ctx) of layer m hold its observed context."""
        return self.seq.ends[m] - self.seq.kv.start


class LayeredTreeBuilder(HeadTreeBuilder):
    """Builds trees with a head of several layers; speculators/hidden_drafter.py drives it."""

    def kv_end(self, n_tok: int, tree: DraftTree) -> int:
        """Drafter KV positions the tree needs: the largest layer's context plus its tree rows (layer m < n-1:
        K per depth 1..m; layer n-1: K per depth 1..n-1 and per chained depth n..D-1)."""
        n, k, d = self.d.n, tree.top_k, tree.depth
        ends = [n_tok - 1]
        for m in range(1, min(n, d)):
            ends.append(n_tok - 1 - m + m * k + (k * (d - n) if m == n - 1 else 0))
        return max(ends)

    def build(self, items: list) -> list[Tree]:
        """items: the drafter's _Live entries (request, seq, k) of tree requests, their KV reserved to
        kv_end -> per item its tree."""
        n = self.d.n
        first = torch.cat([item.seq.carry[0][-1:] for item in items])               # [a, H] = g^0_{N-2}
        kids = children_of_rows(self.d.head.logits(0, first), [(item.request, 1) for item in items], 0,
                                self.calibration)
        grow: list[_Tree] = []
        for item, node_kids in zip(items, kids):
            g = _Tree(item.request.spec_params.draft_tree, item.request, item.seq, item.request.num_tokens, [], [],
                      [{} for _ in range(n)], [{} for _ in range(n)], [0] * n)
            g.frontier = add_children(g.cands, -1, node_kids, 1)
            grow.append(g)
        for s in range(1, max(g.tree.depth for g in grow)):
            self._expand(s, [g for g in grow if g.tree.depth > s and g.frontier])
        return [best_nodes(g.cands, item.k) for item, g in zip(items, grow)]

    def _expand(self, s: int, work: list[_Tree]) -> None:
        """Depth step s: layer min(s, n-1) over the rows the frontier needs (in rounds of at most
        SHORT_QUERY_MAX rows per request: a later round's rows see the earlier ones in the KV), then the K
        children of each frontier node, the K best overall kept."""
        if not work:
            return
        m = min(s, self.d.n - 1)
        todo = [(g, self._rows(g, s, m)) for g in work]
        while any(nodes for _, nodes in todo):
            self._forward(m, [(g, nodes[:SHORT_QUERY_MAX]) for g, nodes in todo if nodes])
            todo = [(g, nodes[SHORT_QUERY_MAX:]) for g, nodes in todo]
        states = torch.stack([g.out[m][c] for g in work for c in g.frontier])         # [rows, H]
        kids = iter(children_of_rows(self.d.head.logits(m, states), [(g.request, len(g.frontier)) for g in work], s,
                                     self.calibration))
        for g in work:
            children: list[int] = []
            for c in g.frontier:
                children += add_children(g.cands, c, next(kids), s + 1)
            g.frontier = sorted(children, key=lambda i: (-g.cands[i].score, i))[:g.tree.top_k]

    def _rows(self, g: _Tree, s: int, m: int) -> list[int]:
        """The nodes layer m runs at depth step s, ancestors first: the frontier (chained, s >= n), or the
        frontier and its ancestors whose base layer m has not observed (all of them but where the head's
        context starts later than N-1-m)."""
        if s >= self.d.n:
            return list(g.frontier)
        need: set[int] = set()
        for c in g.frontier:
            while c >= 0 and c not in need:
                need.add(c)
                c = g.cands[c].parent
        live = [c for c in need if g.base(m, g.cands[c].depth) >= g.seq.ends[m]]
        return sorted(live, key=lambda c: (g.cands[c].depth, c))

    @staticmethod
    def _hidden(g: _Tree, m: int, node: int) -> torch.Tensor:
        """[H] the hidden input of layer m's row for `node` (see the module docstring)."""
        cand = g.cands[node]
        if cand.depth > m:                       # chained beyond the depth: the last layer's parent row
            return g.out[m][cand.parent]
        if cand.parent < 0:                      # depth 1: layer m-1 at base N-1-m, from the context
            return g.seq.carry[m - 1][-1]
        return g.out[m - 1][cand.parent]

    def _forward(self, m: int, batch: list[tuple[_Tree, list[int]]]) -> None:
        """One forward of layer m over every request's rows (nodes in order), outputs into g.out[m]."""
        d = self.d
        q_lens, seq_lens, tables, hidden, tokens, positions = [], [], [], [], [], []
        for g, nodes in batch:
            first = g.ctx(m) + g.used[m]                 # relative KV index of this forward's first row
            for r, c in enumerate(nodes):
                g.key[m][c] = first + r
                hidden.append(self._hidden(g, m, c))
                tokens.append(g.cands[c].token)
                positions.append(g.base(m, g.cands[c].depth))
            g.used[m] += len(nodes)
            q_lens.append(len(nodes))
            seq_lens.append(first + len(nodes))
            tables.append(g.seq.kv.block_ids)
        attn = build_attention_metadata(q_lens, seq_lens, tables, d.cache.block_size, d.device, backend="sdpa")
        for i, (g, nodes) in enumerate(batch):
            restrict_rows(attn, i, self._mask(g, m, nodes, seq_lens[i]))
        out = d.head.layer(m, torch.stack(hidden), torch.tensor(tokens, dtype=torch.long, device=d.device),
                           torch.tensor(positions, dtype=torch.long, device=d.device),
                           max(positions) + 1, attn, d.cache.caches[m])             # [rows, H]
        pieces = iter(out)
        for g, nodes in batch:
            for c in nodes:
                g.out[m][c] = next(pieces)

    @staticmethod
    def _mask(g: _Tree, m: int, nodes: list[int], seq_len: int) -> torch.Tensor:
        """[rows, seq_len] bool: layer m's context, and each row's own and its ancestors' layer m rows."""
        allowed = torch.zeros(len(nodes), seq_len, dtype=torch.bool)
        allowed[:, :g.ctx(m)] = True
        for r, c in enumerate(nodes):
            node = c
            while node >= 0:
                if node in g.key[m]:
                    allowed[r, g.key[m][node]] = True
                node = g.cands[node].parent
        return allowed
