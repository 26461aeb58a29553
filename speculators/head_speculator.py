"""One wrapper for the hidden-state heads (EAGLE-3, MTP): a head model plus its own KV cache, driven by
HiddenStateDrafter (speculators/hidden_drafter.py has the row alignment and a worked example).

Subclasses say how to load the head (`build`), how much memory it holds per target block
(`kv_bytes_per_block`) and, for EAGLE-3, which target layers to tap (`aux_layer_ids`, `bind`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.server.kv.kv_cache import kv_cache_bytes_per_block
from specserve.speculators.base import BuildContext, DraftProposal, SpecRequest, Speculator, VerifiedStep
from specserve.speculators.draft_kv import DraftKVCache
from specserve.speculators.hidden_drafter import HiddenStateDrafter
from specserve.speculators.state_stash import TargetStateStash


class HeadSpeculator(Speculator):
    def __init__(self, head, cache: DraftKVCache, stash_states: bool = False) -> None:
        self.head = head
        self.drafter = HiddenStateDrafter(head, cache, stash_states)
        self.records_states = stash_states                  # record() must see every target forward
        self.drafts_trees = True                            # draft_tree.py (one layer), mtp_tree.py (n > 1)

    @staticmethod
    def head_kv_bytes(ctx: BuildContext, num_layers: int) -> int:
        """num_layers target-wide KV layers per block, plus the state stash when prefixes are cached."""
        cfg = ctx.target_cfg
        per_layer = kv_cache_bytes_per_block(cfg, ctx.block_size, ctx.kv_dtype) // cfg.num_hidden_layers
        stash = TargetStateStash.bytes_per_block(cfg.hidden_size, ctx.block_size, ctx.model_dtype)
        return per_layer * num_layers + (stash if ctx.stash_states else 0)

    @property
    def cache(self) -> DraftKVCache:
        return self.drafter.cache

    @property
    def last_catch_up_s(self) -> float:                       # the drafter times its catch-up
        return self.drafter.last_catch_up_s

    @last_catch_up_s.setter
    def last_catch_up_s(self, seconds: float) -> None:
        self.drafter.last_catch_up_s = seconds

    @property
    def last_catch_up_rows(self) -> int:
        return self.drafter.last_catch_up_rows

    @last_catch_up_rows.setter
    def last_catch_up_rows(self, rows: int) -> None:
        self.drafter.last_catch_up_rows = rows

    def bind(self) -> None:
        """Hook before the head reads a forward's states (EAGLE-3 re-reads the runner's tap order)."""

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        return self.drafter.propose(requests, ks)

    def record(self, step: VerifiedStep, slot_mapping: torch.Tensor) -> None:
        self.bind()
        self.drafter.record(step, slot_mapping)

    def observe(self, step: VerifiedStep) -> None:
        self.bind()
        self.drafter.observe(step)

    def release(self, request: SpecRequest) -> None:
        self.drafter.release(request)

    def calibrate_trees(self, acceptance: float) -> None:
        self.drafter.trees.calibration.set_target(acceptance)

    def drain_refusals(self) -> dict[str, int]:
        out = dict(self.drafter.refusals)
        self.drafter.refusals.clear()
        return out
