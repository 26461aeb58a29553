"""Paged KV-cache bookkeeping: which blocks each request owns, plus a prefix cache of full blocks.

No torch here. A block is `block_size` consecutive token slots; slot = block_id * block_size + offset.

Prefix caching: a full block whose tokens are all computed gets a chained hash
h_i = hash((h_{i-1}, tokens of block i)). A new request whose leading full blocks hash the same shares
them (ref counts). Freed blocks keep their hash and sit in an LRU free list until reused, so a repeated
prompt hits even after the first request finished.

Worked example (block_size 4): prompt [1..10] -> blocks A=[1,2,3,4], B=[5,6,7,8], C=[9,10,_,_].
After prefill, A and B are hashed. A second prompt [1..8, 42] reuses A and B (8 cached tokens) and
allocates one fresh block for [42].
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Protocol


class BlockOwner(Protocol):
    """What the block manager reads and writes of a sequence: the engine's Request, a drafter's DraftSeq."""
    block_ids: list[int]
    block_hashes: list[bytes]          # chained hashes of full, computed blocks (prefix caching)
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block; raise --kv-cache-memory-gb")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # free blocks in LRU order (oldest first); values unused. Cached-but-free blocks live here too.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_hash: dict[int, bytes] = {}     # block id -> hash (only full computed blocks)
        self._hash_to_block: dict[bytes, int] = {}
        self.num_cache_queries = 0                # tokens looked up
        self.num_cache_hits = 0                   # tokens found

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, request: BlockOwner, num_slots: int) -> int:
        have = len(request.block_ids)
        return max(0, -(-num_slots // self.block_size) - have)

    # -- allocation ------------------------------------------------------------------------------
    def allocate_cached_prefix(self, request: BlockOwner) -> int:
        """Attach cached leading blocks to a request with no blocks; returns tokens now computed.

        At least one token is left to compute so the step produces logits for the last position.
        """
        assert not request.block_ids
        if not self.enable_prefix_caching:
            return 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        self.num_cache_queries += len(tokens)
        parent = None
        for i in range(max_blocks):
            h = self._hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = self._hash_to_block.get(h)
            if block is None:
                break
            self._take(block)
            request.block_ids.append(block)
            request.block_hashes.append(h)
            parent = h
        cached = len(request.block_ids) * self.block_size
        self.num_cache_hits += cached
        return cached

    def ensure_slots(self, request: BlockOwner, num_slots: int) -> bool:
        """Grow the request's block list to hold `num_slots` tokens. All-or-nothing."""
        need = self.blocks_needed(request, num_slots)
        if need > len(self._free):
            return False
        for _ in range(need):
            block, _ = self._free.popitem(last=False)      # least recently freed
            self._evict_hash(block)
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def free(self, request: BlockOwner) -> None:
        # Reverse order: a request's tail blocks are the least likely to be shared, so reuse them first.
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
        request.block_ids = []
        request.block_hashes = []

    def cache_computed_blocks(self, request: BlockOwner) -> None:
        """Hash the request's full blocks whose tokens are all computed (call after each step)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= len(request.block_hashes):
            return
        tokens = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        for i in range(len(request.block_hashes), num_full):
            h = self._hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = request.block_ids[i]
            request.block_hashes.append(h)
            if h not in self._hash_to_block and block not in self._block_hash:
                self._hash_to_block[h] = block
                self._block_hash[block] = h
            parent = h

    # -- internals -------------------------------------------------------------------------------
    @staticmethod
    def _hash(parent: bytes | None, tokens: list[int]) -> bytes:
        # A cryptographic digest, not hash(): crafted prompts must not collide with another user's blocks.
        h = hashlib.blake2b(parent or b"", digest_size=16)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def _evict_hash(self, block: int) -> None:
        h = self._block_hash.pop(block, None)
        if h is not None and self._hash_to_block.get(h) == block:
            del self._hash_to_block[h]
