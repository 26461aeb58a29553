"""TargetStateStash: a hidden-state head's layer-0 inputs, kept per target KV slot, so that the head can see
the context the target served from its prefix cache.

The problem it solves: an EAGLE-3 head or an MTP layer is fed the target's hidden state of every position
(EAGLE-3: fc of three tapped layers; MTP: the final hidden state). On a prefix-cache hit of P prompt tokens
the target computes nothing for positions < P, so a head that reads only the current forward's states
starts at P and drafts blind to the cached prompt. That is the common case in serving (a shared system
prompt, a benchmark sending the same prompts to several methods): measured on the embedded family, a warm
cache cost EAGLE-3 0.08 of mean acceptance length.

The fix: every target forward writes the head's layer-0 input of EVERY row (all requests, any method) into
one tensor indexed like the target's KV slots (block_id * block_size + offset). A slot holds the state of
the token whose K/V it holds, so whatever block the prefix cache shares, its states come with it; a row
of a rejected draft is overwritten when its slot is reused, exactly like its K/V. A head meeting a request
whose first P positions are cached reads their states here and runs its layer over them once (a one-layer
"prefill", ~1/L of the target's), then continues as if it had seen the prompt itself.

Cost: hidden_size values per target slot in the head's dtype (the embedded family: 1 KiB per token per
head against the target's 8 KiB of K/V; an 8B Llama with a 4096-wide head: 8 KiB against 128 KiB), counted
in --kv-cache-memory-gb; per forward one copy of its rows into a queue, and the head's input projection
(EAGLE-3's fc) over the queued rows in bulk, when a head reads the stash or the queue is full.

Worked example (block_size 4): a request's block table [7, 2], 6 cached prompt tokens -> positions 0..5
live in slots 28, 29, 30, 31, 8, 9; `read([7, 2], 0, 6)` returns those six rows in position order.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


class TargetStateStash:
    """project: raw row -> state (EAGLE-3: the head's fc over the concatenated taps; None: rows are states).

    Recording must be nearly free for the requests that never use a head (the common case), so with a
    projection a forward's rows are only queued (no matmul); they are projected and written in bulk, in the order they
    were recorded (a slot reused by a later forward ends up with the later row), when a head reads the
    stash or `max_pending_rows` have queued up. Recording the fc per forward instead cost ~0.1 ms per
    step at batch 1 here (one small matmul call) for every request.
    """

    def __init__(self, num_slots: int, hidden_size: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, project: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 max_pending_rows: int = 512) -> None:
        self.states = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)   # [num_slots, H]
        self.block_size = block_size
        self.project = project
        self.max_pending_rows = max_pending_rows
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []     # (slot_mapping [n], raw rows [n, R])
        self._pending_rows = 0

    @staticmethod
    def bytes_per_block(hidden_size: int, block_size: int, dtype: torch.dtype) -> int:
        return hidden_size * block_size * torch.empty((), dtype=dtype).element_size()

    def add(self, slot_mapping: torch.Tensor, raw: torch.Tensor) -> None:
        """slot_mapping [n] int64, raw [n, R]: the rows of one forward (kept, not copied, while queued)."""
        if self.project is None:        # nothing to amortize: straight in (one copy)
            self.states.index_copy_(0, slot_mapping.to(self.states.device), raw.to(self.states.dtype))
            return
        self._pending.append((slot_mapping, raw))
        self._pending_rows += raw.shape[0]
        if self._pending_rows >= self.max_pending_rows:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        raw = torch.cat([r for _, r in self._pending])                                 # [rows, R]
        states = self.project(raw).to(self.states.dtype)                 # only queued with a projection
        offset = 0
        for slots, rows in self._pending:                                           # oldest first
            n = rows.shape[0]
            self.states.index_copy_(0, slots.to(self.states.device), states[offset:offset + n])
            offset += n
        self._pending.clear()
        self._pending_rows = 0

    def read(self, block_ids: list[int], lo: int, hi: int) -> torch.Tensor:
        """-> [hi - lo, H]: the states of context positions [lo, hi) of a sequence with this block table."""
        self.flush()
        positions = torch.arange(lo, hi)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size]
        slots = blocks * self.block_size + positions % self.block_size
        return self.states.index_select(0, slots.to(self.states.device))
