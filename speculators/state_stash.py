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
in --kv-cache-memory-gb; and the head's input projection on every row of every forward (EAGLE-3's fc),
which the head reuses for its own requests' rows instead of computing it again.

Worked example (block_size 4): a request's block table [7, 2], 6 cached prompt tokens -> positions 0..5
live in slots 28, 29, 30, 31, 8, 9; `read([7, 2], 0, 6)` returns those six rows in position order.
"""
from __future__ import annotations

import torch


class TargetStateStash:
    def __init__(self, num_slots: int, hidden_size: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.states = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)   # [num_slots, H]
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(hidden_size: int, block_size: int, dtype: torch.dtype) -> int:
        return hidden_size * block_size * torch.empty((), dtype=dtype).element_size()

    def write(self, slot_mapping: torch.Tensor, states: torch.Tensor) -> None:
        """slot_mapping [n] int64, states [n, H]: the rows of one target forward."""
        self.states.index_copy_(0, slot_mapping.to(self.states.device), states.to(self.states.dtype))

    def read(self, block_ids: list[int], lo: int, hi: int) -> torch.Tensor:
        """-> [hi - lo, H]: the states of context positions [lo, hi) of a sequence with this block table."""
        positions = torch.arange(lo, hi)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size]
        slots = blocks * self.block_size + positions % self.block_size
        return self.states.index_select(0, slots.to(self.states.device))
