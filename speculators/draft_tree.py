"""Dynamic draft trees (EAGLE-2): which nodes a drafter proposes when a request asks for a tree.

A request's `"draft_tree": {"top_k": K, "depth": D}` with num_speculative_tokens N: starting from the
drafter's distribution after the last known token, the frontier (first: the K best first tokens) is
expanded by the K best children of every node, each scored (greedy requests) by its cumulative draft
log-probability (the sum along its path); the K best of those K * K become the next frontier, D times in all. Then every
candidate of every depth is ranked by its score and the best N are verified. A parent scores at least as
high as its children (log-probabilities are <= 0, ties go to the shallower node), so the kept nodes always
form a tree. The drafter's own attention at depth s sees the context and the node's ancestors only
(server/models/tree_attention.py), each node at RoPE position base + depth in a KV slot of its own.

Sampled requests (T > 0) get sampled children instead of the top K (speculators/tree_children.py): a
seeded request's are the K best of the draft's coupled scores log q + g at the children's position (the first
is the chain's coupled draft), an unseeded request's K draws without replacement from q, scored by their
perturbed log-probability relative to the node's best (0 for the first child) rather than by log q, so the
verifier's recursive rejection sampling stays exact (sampling/recursive_rejection.py); each node then carries
the q it was drawn from (the proposal's draft_probs row).

K = 1 is the chain: such a request never reaches this module (SpecParams.draft_tree top_k 1 drafts the
chain code, bit for bit).

Worked example, K = 2, D = 2, N = 3: first tokens a (-0.1), b (-0.7); children of a: c (-0.1 - 0.2),
d (-0.1 - 1.0); of b: e (-0.7 - 0.1), f (-0.7 - 0.9). Ranked: a -0.1, c -0.3, b -0.7, e -0.8, ...
-> nodes [a, b, c] with parents [-1, -1, 0].
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.server.models.attention import build_attention_metadata
from specserve.server.models.tree_attention import restrict_rows
from specserve.speculators.base import DraftTree
from specserve.speculators.tree_calibration import ScoreCalibration
from specserve.speculators.tree_children import Children, draw_children
from specserve.speculators.tree_shape import as_tree, check_tree

__all__ = ["HeadTreeBuilder", "as_tree", "best_nodes", "check_tree"]

@dataclass
class Candidate:
    token: int
    score: float          # the path's summed child scores (greedy: its cumulative draft log-probability)
    parent: int           # index into the candidate list, -1: the last known token
    depth: int            # 1: a first draft token
    probs: torch.Tensor | None = None   # [V] the draft distribution it was drawn from (sampled children)


# (tokens, parents, probs): per node its token and parent (-1: the root), and [n, V] the q each was drawn from
# (None: top-K children); nodes in depth order, parents[j] < j
Tree = tuple[list[int], list[int], torch.Tensor | None]


def best_nodes(cands: Sequence[Candidate], n: int) -> Tree:
    """The n best candidates as a tree. Siblings keep their drawn order (their scores fall along it)."""
    ranked = sorted(range(len(cands)), key=lambda i: (-cands[i].score, cands[i].depth, i))[:n]
    keep = sorted(ranked, key=lambda i: (cands[i].depth, i))
    where = {c: j for j, c in enumerate(keep)}
    tokens = [cands[c].token for c in keep]
    parents = [-1 if cands[c].parent < 0 else where[cands[c].parent] for c in keep]
    rows = [cands[c].probs for c in keep]
    return tokens, parents, None if any(r is None for r in rows) else torch.stack(rows)


def add_children(cands: list[Candidate], parent: int, kids: Children, depth: int) -> list[int]:
    """Append candidate `parent`'s children (-1: the root's) at `depth` -> their candidate indices."""
    first, base = len(cands), cands[parent].score if parent >= 0 else 0.0
    cands.extend(Candidate(tok, base + v, parent, depth, kids.probs) for tok, v in kids)
    return list(range(first, len(cands)))


def children_of_rows(logits: torch.Tensor,   # [rows, V] drafter logits: each work item's rows in turn
                     work: Sequence[tuple], s: int, calibration: ScoreCalibration | None = None) -> list[Children]:
    """Per row the children of its node at depth s (0: the root). work: (request, rows) pairs."""
    params, positions, top_ks = [], [], []
    for request, rows in work:
        params += [request.sampling_params] * rows
        positions += [request.num_tokens + s] * rows           # the children's absolute position
        top_ks += [request.spec_params.draft_tree.top_k] * rows
    return draw_children(logits, params, positions, top_ks, calibration)


@dataclass
class _Growing:
    """One request's tree while it is built."""
    tree: DraftTree
    base: int                        # num_tokens - 1: the last known token's position
    kv_start: int                    # the drafter KV's first position (DraftSeq.start)
    cands: list[Candidate]
    frontier: list[int]              # candidate indices to expand next
    states: dict[int, torch.Tensor]  # candidate -> [H] the state its children's logits came from (parent row)
    row_key: dict[int, int]          # expanded candidate -> relative KV index of its drafter row


class HeadTreeBuilder:
    """Builds trees with a one-layer hidden-state head (EAGLE-3): speculators/hidden_drafter.py drives it.

    drafter: the HiddenStateDrafter (its head, KV cache and per-request state).
    """

    def __init__(self, drafter) -> None:
        self.d = drafter
        self.calibration = ScoreCalibration()   # greedy nodes' scores (speculators/tree_calibration.py)
        self.build_seconds = 0.0         # time spent building trees (the benchmark reports it per step)
        self.num_built = 0               # trees built (requests x steps)
        self.num_calls = 0               # propose calls that built >= 1 tree

    def kv_end(self, n_tok: int, tree: DraftTree) -> int:
        """Drafter KV positions a tree needs: the context up to the last known token plus one row per
        expanded node (K per depth after the first)."""
        return n_tok - 1 + tree.top_k * (tree.depth - 1)

    def build(self, items: list) -> list[Tree]:
        """items: the drafter's _Live entries (request, seq, k) of tree requests, their KV reserved to
        kv_end -> per item its tree."""
        grow: list[_Growing] = []
        first = torch.cat([item.seq.carry[0][-1:] for item in items])               # [a, H] = g^0_{N-2}
        kids = children_of_rows(self.d.head.logits(0, first), [(item.request, 1) for item in items], 0,
                                self.calibration)
        for item, row, node_kids in zip(items, first, kids):
            g = _Growing(item.request.spec_params.draft_tree, item.request.num_tokens - 1, item.seq.kv.start,
                         [], [], {}, {})
            g.frontier = add_children(g.cands, -1, node_kids, 1)
            g.states.update(dict.fromkeys(g.frontier, row))
            grow.append(g)
        for s in range(1, max(g.tree.depth for g in grow)):
            self._expand(s, [(item, g) for item, g in zip(items, grow) if g.tree.depth > s and g.frontier])
        return [best_nodes(g.cands, item.k) for item, g in zip(items, grow)]

    def _expand(self, s: int, work: list[tuple]) -> None:
        """One depth: a drafter row per frontier node (its state, its token, position base + s - 1... the
        chain's alignment: hidden_drafter.py), then the K children of each, the K best overall kept."""
        if not work:
            return
        d = self.d
        q_lens, seq_lens, tables, hidden, tokens, positions = [], [], [], [], [], []
        for item, g in work:
            first_key = g.base - g.kv_start + (s - 1) * g.tree.top_k     # relative KV index of this depth's rows
            for r, c in enumerate(g.frontier):
                g.row_key[c] = first_key + r
                hidden.append(g.states[c])
                tokens.append(g.cands[c].token)
                positions.append(g.base + s - 1)
            q_lens.append(len(g.frontier))
            seq_lens.append(first_key + len(g.frontier))
            tables.append(item.seq.kv.block_ids)
        attn = build_attention_metadata(q_lens, seq_lens, tables, d.cache.block_size, d.device, backend="sdpa")
        for i, (_, g) in enumerate(work):
            restrict_rows(attn, i, self._mask(g, seq_lens[i]))
        out = d.head.layer(0, torch.stack(hidden), torch.tensor(tokens, dtype=torch.long, device=d.device),
                           torch.tensor(positions, dtype=torch.long, device=d.device),
                           max(positions) + 1, attn, d.cache.caches[0])              # [rows, H]
        logits = d.head.logits(0, out)                                                # [rows, V]
        kids = iter(children_of_rows(logits, [(item.request, len(g.frontier)) for item, g in work], s,
                                     self.calibration))
        row = 0
        for _, g in work:
            children: list[int] = []
            for c in g.frontier:
                added = add_children(g.cands, c, next(kids), s + 1)
                g.states.update(dict.fromkeys(added, out[row]))
                children += added
                row += 1
            g.frontier = sorted(children, key=lambda i: (-g.cands[i].score, i))[:g.tree.top_k]

    @staticmethod
    def _mask(g: _Growing, seq_len: int) -> torch.Tensor:
        """[frontier, seq_len] bool: the context before the tree, and each frontier node's ancestors' rows."""
        return ancestor_mask(g.frontier, g.cands, g.row_key, g.base - g.kv_start, seq_len)


def ancestor_mask(frontier: Sequence[int], cands: Sequence[Candidate], key: dict[int, int], context: int,
                  seq_len: int) -> torch.Tensor:
    """[len(frontier), seq_len] bool: what each frontier node's drafter row may attend to: the relative keys
    [0, context) of the observed context, and the rows (`key`: candidate -> relative key) of the node itself
    and its ancestors. Example: context 3, a node (key 4) whose parent sits at key 3 -> [1, 1, 1, 1, 1, 0...]."""
    allowed = torch.zeros(len(frontier), seq_len, dtype=torch.bool)
    allowed[:, :context] = True
    for r, c in enumerate(frontier):
        node = c
        while node >= 0:
            allowed[r, key[node]] = True
            node = cands[node].parent
    return allowed
