"""DraftKVCache: a drafter's own paged KV cache (draft model, EAGLE-3 head, MTP layers).

Why not the target's block tables: a drafter's context can differ from the target's. A hidden-state
head (EAGLE-3, MTP) cannot see positions the target served from its prefix cache (it never got their
hidden states), and a draft model computes the tokens it has not seen yet at its own pace. So each
drafter keeps per-request block lists in a BlockManager of its own (prefix caching off) and a flat
KV tensor per drafter layer in the engine's layout ([num_blocks, block_size, kv_heads, head_dim]).

Sizing (documented policy, see `mirror_target_blocks`): the drafter gets as many blocks as the target,
with the same block_size, so it can hold every token the target holds; its memory comes on top of
--kv-cache-memory-gb, in the ratio of per-token KV sizes (an EAGLE-3 head or one MTP layer: 1/L of
the target's; a 0.5B draft for a 7B target: ~10%). A request whose draft blocks cannot be reserved
(possible only when the target shares prefix blocks between requests) simply gets no drafts.

A sequence may start at a position > 0 (`DraftSeq.start`): its KV holds context positions
[start, end) in slots 0 .. end - start - 1. Attention metadata is built on these relative positions
(that is what the masks and slots need); RoPE needs the absolute ones, returned beside it.

Worked example (block_size 4): a head first sees a request at position 6 (6 cached prompt tokens);
start = 6; rows for positions 6..8 go to relative slots 0..2 of the first block; a later draft row at
position 9 is relative slot 3; `metadata([seq], [1], [10])` -> relative position 3, absolute 9.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specserve.server.kv.block_manager import BlockManager
from specserve.server.kv.kv_cache import cache_dtype
from specserve.server.models.attention import AttentionMetadata, build_attention_metadata

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]   # ([num_blocks, block_size, kv_heads, head_dim],) * 2


@dataclass
class DraftSeq:
    """One request's blocks in a drafter cache. Duck-types what BlockManager reads from a Request."""
    start: int = 0                                        # first context position this cache holds
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)   # always empty: no prefix caching here


@dataclass
class DraftKVCache:
    caches: list[KVCache]          # per drafter layer
    blocks: BlockManager
    block_size: int
    device: torch.device

    @classmethod
    def allocate(cls, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> DraftKVCache:
        # Zero-filled like the target cache: masked slots are still read by SDPA and NaN * 0 = NaN.
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                  for _ in range(num_layers)]
        return cls(caches, BlockManager(num_blocks, block_size, enable_prefix_caching=False), block_size,
                   torch.device(device))

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def reserve(self, seq: DraftSeq, end: int) -> bool:
        """Blocks for context positions [seq.start, end). All-or-nothing; False when the cache is full."""
        return self.blocks.ensure_slots(seq, end - seq.start)

    def free(self, seq: DraftSeq) -> None:
        self.blocks.free(seq)

    def metadata(self, seqs: list[DraftSeq], query_lens: list[int], ends: list[int]
                 ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Sequence i queries positions [ends[i] - query_lens[i], ends[i]) (attending to [start, ends[i])).

        Returns (metadata on relative positions, absolute positions [num_tokens] int64 for RoPE).
        """
        seq_lens = [end - s.start for s, end in zip(seqs, ends)]
        attn = build_attention_metadata(query_lens, seq_lens, [s.block_ids for s in seqs], self.block_size,
                                        self.device)
        starts = [s.start for s in seqs]
        if not any(starts):
            return attn, attn.positions
        offsets = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long),
                                          torch.tensor(query_lens, dtype=torch.long))   # [num_tokens]
        return attn, attn.positions + offsets.to(attn.positions.device)


def mirror_target_blocks(target_num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype, device: torch.device | str, name: str
                         ) -> DraftKVCache:
    """A drafter cache with the target's token capacity (see the module docstring), logged.
    dtype: the drafter's model dtype (its KV dtype is kv_cache.cache_dtype of it)."""
    kv_dtype = cache_dtype(dtype, device)
    cache = DraftKVCache.allocate(num_layers, num_kv_heads, head_dim, target_num_blocks, block_size, kv_dtype, device)
    size = DraftKVCache.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, kv_dtype) * target_num_blocks
    log.info("%s: own KV cache of %d blocks x %d tokens, %d layer(s), %.1f MiB", name, target_num_blocks,
             block_size, num_layers, size / 2**20)
    return cache
