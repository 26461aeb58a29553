"""Dynamic draft trees (EAGLE-2): which nodes a drafter proposes when a request asks for a tree.

A request's `"draft_tree": {"top_k": K, "depth": D}` with num_speculative_tokens N: starting from the
drafter's distribution after the last known token, the frontier (first: the K best first tokens) is
expanded by the K best children of every node, each scored by its cumulative draft log-probability (the
sum along its path); the K best of those K * K become the next frontier, D times in all. Then every
candidate of every depth is ranked by its score and the best N are verified. A parent scores at least as
high as its children (log-probabilities are <= 0, ties go to the shallower node), so the kept nodes always
form a tree. The drafter's own attention at depth s sees the context and the node's ancestors only
(server/models/tree_attention.py), each node at RoPE position base + depth in a KV slot of its own.

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
from specserve.speculators.tree_shape import as_tree, check_tree

__all__ = ["HeadTreeBuilder", "as_tree", "best_nodes", "check_tree"]

@dataclass
class Candidate:
    token: int
    score: float          # cumulative draft log-probability of the path root -> this node
    parent: int           # index into the candidate list, -1: the last known token
    depth: int            # 1: a first draft token


def best_nodes(cands: Sequence[Candidate], n: int) -> tuple[list[int], list[int]]:
    """The n best candidates as a tree: (tokens, parents) in depth order, parents[j] < j (-1: root)."""
    ranked = sorted(range(len(cands)), key=lambda i: (-cands[i].score, cands[i].depth, i))[:n]
    keep = sorted(ranked, key=lambda i: (cands[i].depth, i))
    where = {c: j for j, c in enumerate(keep)}
    tokens = [cands[c].token for c in keep]
    parents = [-1 if cands[c].parent < 0 else where[cands[c].parent] for c in keep]
    return tokens, parents


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


def top_children(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """logprobs [V] -> the k best (token, log-probability), best first (-inf tokens never)."""
    vals, ids = logprobs.topk(min(k, logprobs.shape[0]))
    return [(t, v) for t, v in zip(ids.tolist(), vals.tolist()) if v > float("-inf")]


class HeadTreeBuilder:
    """Builds trees with a one-layer hidden-state head (EAGLE-3): speculators/hidden_drafter.py drives it.

    drafter: the HiddenStateDrafter (its head, KV cache and per-request state).
    """

    def __init__(self, drafter) -> None:
        self.d = drafter
        self.build_seconds = 0.0         # time spent building trees (the benchmark reports it per step)
        self.num_built = 0               # trees built (requests x steps)
        self.num_calls = 0               # propose calls that built >= 1 tree

    def kv_end(self, n_tok: int, tree: DraftTree) -> int:
        """Drafter KV positions a tree needs: the context up to the last known token plus one row per
        expanded node (K per depth after the first)."""
        return n_tok - 1 + tree.top_k * (tree.depth - 1)

    def build(self, items: list) -> list[tuple[list[int], list[int]]]:
        """items: the drafter's _Live entries (request, seq, k) of tree requests, their KV reserved to
        kv_end -> per item (tokens, parents)."""
        head = self.d.head
        grow: list[_Growing] = []
        first = torch.cat([item.seq.carry[0][-1:] for item in items])               # [a, H] = g^0_{N-2}
        logprobs = head.logits(0, first).log_softmax(dim=-1)                          # [a, V]
        for item, row, lp in zip(items, first, logprobs):
            tree = item.request.spec_params.draft_tree
            g = _Growing(tree, item.request.num_tokens - 1, item.seq.kv.start, [], [], {}, {})
            for tok, v in top_children(lp, tree.top_k):
                g.states[len(g.cands)] = row
                g.cands.append(Candidate(tok, v, -1, 1))
            g.frontier = list(range(len(g.cands)))
            grow.append(g)
        for s in range(1, max(g.tree.depth for g in grow)):
            self._expand(s, [(item, g) for item, g in zip(items, grow) if g.tree.depth > s and g.frontier])
        return [best_nodes(g.cands, item.k) for item, g in zip(items, grow)]

    def _expand(self, s: int, work: list[tuple]) -> None:
        """One depth: a drafter row per frontier node (its state, its token, position base + s - 1... the
        chain's alignment: hidden_drafter.py), then the K best children of each, the K best overall kept."""
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
        logprobs = d.head.logits(0, out).log_softmax(dim=-1)                          # [rows, V]
        row = 0
        for _, g in work:
            children: list[int] = []
            for c in g.frontier:
                for tok, v in top_children(logprobs[row], g.tree.top_k):
                    g.states[len(g.cands)] = out[row]
                    children.append(len(g.cands))
                    g.cands.append(Candidate(tok, g.cands[c].score + v, c, s + 1))
                row += 1
            g.frontier = sorted(children, key=lambda i: (-g.cands[i].score, i))[:g.tree.top_k]

    @staticmethod
    def _mask(g: _Growing, seq_len: int) -> torch.Tensor:
        """[frontier, seq_len] bool: the context before the tree, and each frontier node's ancestors' rows."""
        ctx = g.base - g.kv_start                       # relative keys [0, ctx): the observed context
        allowed = torch.zeros(len(g.frontier), seq_len, dtype=torch.bool)
        allowed[:, :ctx] = True
        for r, c in enumerate(g.frontier):
            node = c
            while node >= 0:
                allowed[r, g.row_key[node]] = True
                node = g.cands[node].parent
        return allowed
