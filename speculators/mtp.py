"""MTP speculator: the target checkpoint's own next-n prediction layers draft k tokens.

Loaded automatically when the target's config.json declares `num_nextn_predict_layers` > 0
(DeepSeek-V3 layout `model.layers.{L+i}.*`, MiMo layout `model.mtp_layers.{i}.*`; mtp_loader.py).
Like EAGLE-3 it needs no extra target pass: observe() reads the target's final (DeepSeek) or pre-norm
(MiMo) hidden states from every forward. Step s of drafting uses MTP layer s while s < n and then
keeps reusing the LAST layer (chaining k beyond the depth); each layer has its own KV cache
(speculators/hidden_drafter.py has the row alignment and a worked example).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from speculators.base import DraftProposal, VerifiedStep
from speculators.draft_kv import DraftKVCache, mirror_target_blocks
from speculators.hidden_drafter import HiddenStateDrafter
from speculators.mtp_head import MtpHead
from speculators.mtp_loader import load_mtp_head

log = logging.getLogger(__name__)


class MtpSpeculator:
    name = "mtp"
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, head: MtpHead, cache: DraftKVCache, stash_states: bool = False) -> None:
        self.head = head
        self.drafter = HiddenStateDrafter(head, cache, stash_states)
        self.refusals = self.drafter.refusals               # spec_decode_refused_total, drained per step
        self.records_states = stash_states                  # record() must see every target forward

    @classmethod
    def load(cls, model_dir: str | Path, runner, stash_states: bool = False) -> MtpSpeculator:
        """runner: the target ModelRunner; the MTP layers come from the same checkpoint directory.
        stash_states: keep the target state per target slot (the target caches prefixes: state_stash.py)."""
        cfg = runner.cfg
        head = load_mtp_head(model_dir, cfg, runner.model.embed_tokens, runner.model.lm_head,
                             runner.dtype, runner.device)
        cache = mirror_target_blocks(runner.kv_caches[0][0].shape[0], runner.block_size, head.num_layers,
                                     cfg.num_key_value_heads, cfg.head_dim, runner.dtype, runner.device,
                                     f"MTP ({head.layout.name}, {head.num_layers} layer(s))")
        log.info("MTP speculator: %d %s layer(s) from %s", head.num_layers, head.layout.name, model_dir)
        return cls(head, cache, stash_states)

    @property
    def cache(self) -> DraftKVCache:
        return self.drafter.cache

    @staticmethod
    def validate(options: dict) -> None:
        if options:
            raise ValueError(f"mtp speculation takes no options, got {sorted(options)}")

    def propose(self, requests: Sequence, ks: Sequence[int]) -> DraftProposal:
        return self.drafter.propose(requests, ks)

    def record(self, step: VerifiedStep, slot_mapping) -> None:
        self.drafter.record(step, slot_mapping)

    def observe(self, step: VerifiedStep) -> None:
        self.drafter.observe(step)

    def release(self, request) -> None:
        self.drafter.release(request)
