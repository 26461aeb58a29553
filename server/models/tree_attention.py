"""Tree attention: the query rows of one sequence attend to an explicit set of keys (a draft tree's
ancestors and the context before it) instead of everything before them.

A draft tree's nodes are verified (or drafted) as consecutive query rows of their sequence: node j sits at
key index `first + j` of the paged context, so its K/V land in a slot of its own, but its RoPE position is
its depth. The row of node j may see the context keys and the rows of its ancestors only, which is what
`restrict_rows` writes into the SDPA plan (attention_metadata.ShortGroup.allowed). Causality still
applies on top (a node comes after its ancestors), so a chain's mask is unchanged: every earlier row is
an ancestor.

Only the SDPA backend's padded short-query path carries such masks: callers build their metadata with
backend "sdpa" and keep a tree within SHORT_QUERY_MAX query rows.
"""
from __future__ import annotations

import torch

from specserve.server.models.attention_metadata import SHORT_QUERY_MAX, AttentionMetadata


def ancestor_rows(parents: list[int]) -> torch.Tensor:
    """parents[j] (-1: the root row, else an earlier node) -> [N + 1, N + 1] bool: row r (0 the root, 1 + j
    node j) may see row c. Example: parents [-1, -1, 0] -> node 2 sees the root, node 0 and itself."""
    n = len(parents)
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for j, parent in enumerate(parents):
        if parent >= j:
            raise ValueError(f"tree node {j} has parent {parent}: parents must come first")
        if parent >= 0:
            allowed[1 + j] = allowed[1 + parent]
        allowed[1 + j, 1 + j] = True
    return allowed


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node (1: a child of the root). Example: [-1, -1, 0, 2] -> [1, 1, 2, 3]."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def restrict_rows(attn: AttentionMetadata, seq: int, allowed: torch.Tensor) -> None:
    """Sequence `seq`'s query rows see only the keys `allowed` marks: [q, seq_len] bool, row i for its
    i-th query row, column c for the key at index c of its context (metadata indices, from 0)."""
    if attn.backend != "sdpa":
        raise ValueError("tree attention needs the SDPA backend's metadata")
    for group in attn.short_groups:
        if seq not in group.seq_ids:
            continue
        j = group.seq_ids.index(seq)
        q, length = allowed.shape
        if q > SHORT_QUERY_MAX or q > group.max_q or length > group.num_keys:
            raise ValueError(f"a tree of {q} rows over {length} keys does not fit its attention group")
        if group.allowed is None:
            group.allowed = torch.ones(group.num_seqs, group.max_q, group.num_keys, dtype=torch.bool,
                                       device=group.q_pos.device)
        rows = allowed.to(group.allowed.device)
        group.allowed[j, :q, :length] = rows
        group.allowed[j, q:, :length] = rows[-1]          # padded rows repeat the last query's row
        group.masks.clear()
        return
    raise ValueError(f"sequence {seq} is not a short query of this step")
