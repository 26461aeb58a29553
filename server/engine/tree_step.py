"""What a step does differently for requests that verify a draft tree (speculators/draft_tree.py).

1. layout (`apply_tree_layout`): the request's query is [last token, node 0 .. node N-1], as for a chain,
   so node j's K/V land in the slot of context position base + 1 + j (its own slot); its RoPE position is
   base + depth(j) and its row sees the context and its ancestors only (server/models/tree_attention.py).
2. verification (sampling/tree_verify.py) accepts a root-to-leaf path n_1 .. n_a.
3. compaction (`compact_tree_kv`): the accepted nodes' K/V move to the slots of positions base + 1 ..
   base + a, one gather and one scatter per layer for the whole batch, so the sequence holds exactly the
   accepted path, as after a chain step, and rollback stays bookkeeping. Node n_i sits at index >= i - 1
   (nodes come in depth order), so a chain's accepted path never moves and a tree's moves only its
   branches. The alternative, keeping each request's tree slots and remapping positions in every later
   step, would make every later attention call read through an indirection; the copy is a few KiB per
   layer per step (docs/benchmarks.md measures it).
4. the target's hidden rows are reordered the same way (`chain_rows`), so speculators observe states in
   context order, exactly what a chain step hands them.
"""
from __future__ import annotations

import dataclasses

import torch

from specserve.server.models.attention import build_attention_metadata
from specserve.server.models.tree_attention import ancestor_rows, node_depths, restrict_rows


def apply_tree_layout(batch, seqs, parents: list[list[int] | None], block_size: int,
                      device: torch.device) -> None:
    """Rewrite batch.attn (SDPA plan) for the tree requests: per-depth positions, ancestor masks."""
    attn = batch.attn
    if attn.backend != "sdpa":
        attn = batch.attn = build_attention_metadata(
            batch.query_lens, list(attn.seq_lens_cpu), [s.request.block_ids for s in seqs], block_size,
            device, backend="sdpa")
    positions = attn.positions.clone()
    for i, tree in enumerate(parents):
        if tree is None:
            continue
        q, seq_len, n = batch.query_lens[i], attn.seq_lens_cpu[i], len(tree)
        root = seq_len - 1 - n                                   # key index (= position) of the last known token
        allowed = torch.ones(q, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q)   # [q, seq_len] causal
        allowed[q - n - 1:, root:] = ancestor_rows(tree)
        restrict_rows(attn, i, allowed)
        depth = torch.tensor(node_depths(tree), dtype=torch.long)
        off = batch.token_offsets[i] + q - n
        positions[off:off + n] = (root + depth).to(positions.device)
    attn.positions = positions


def accepted_moves(batch, seqs, paths: dict[int, list[int]]) -> tuple[list[int], list[int]]:
    """(token rows whose K/V and states move, the rows they move to): node n_i of an accepted path goes to
    the row of depth i. Rows are indices into the step's token dimension; paths: seq index -> its path."""
    src, dst = [], []
    for i, path in paths.items():
        first = batch.token_offsets[i] + seqs[i].num_new_tokens      # row of node 0
        for depth, node in enumerate(path):
            if node != depth:
                src.append(first + node)
                dst.append(first + depth)
    return src, dst


def compact_tree_kv(kv_caches, batch, src: list[int], dst: list[int]) -> None:
    """Copy K/V of token rows src into the slots of rows dst, in every layer (gather first: no overlap
    hazards). kv_caches: per layer ([num_blocks, block_size, kv_heads, head_dim],) * 2."""
    if not src:
        return
    slots = batch.attn.slot_mapping
    src_slots = slots[torch.tensor(src, device=slots.device)]
    dst_slots = slots[torch.tensor(dst, device=slots.device)]
    for layer in kv_caches:
        for cache in layer:
            flat = cache.view(-1, *cache.shape[2:])              # [slots, kv_heads, head_dim]
            flat.index_copy_(0, dst_slots, flat.index_select(0, src_slots))


def chain_rows(result, src: list[int], dst: list[int]):
    """The step result with hidden rows dst replaced by rows src (states in context order)."""
    if not src:
        return result
    n = result.hidden.shape[0]
    order = torch.arange(n)
    order[torch.tensor(dst)] = torch.tensor(src)
    order = order.to(result.hidden.device)
    return dataclasses.replace(
        result, hidden=result.hidden.index_select(0, order),
        prenorm_hidden=None if result.prenorm_hidden is None else result.prenorm_hidden.index_select(0, order),
        aux_hidden=[a.index_select(0, order) for a in result.aux_hidden])
