"""EAGLE-3 speculator: a one-layer head fed by three of the target's hidden states.

No extra target pass: the engine's runner taps the residual streams entering the head's layers
(`aux_layer_ids`, default (2, L//2, L-3)) in every forward, prefill chunks included, and hands them to
observe() in a VerifiedStep. The head fuses them (fc), catches up its own KV on them, and drafts k
tokens by feeding its own pre-norm output back (speculators/hidden_drafter.py has the row
alignment and a worked example; eagle3_head.py the maths; eagle3_loader.py both public layouts).

Usage: `specserve serve --model <target> --eagle3 <head dir>`, then a request's
`"speculation": {"method": "eagle3", "num_speculative_tokens": 4}`.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from speculators.base import DraftProposal, VerifiedStep
from speculators.draft_kv import DraftKVCache, mirror_target_blocks
from speculators.eagle3_head import Eagle3Head
from speculators.eagle3_loader import load_eagle3_head
from speculators.hidden_drafter import HiddenStateDrafter

log = logging.getLogger(__name__)


class Eagle3Speculator:
    name = "eagle3"

    def __init__(self, head: Eagle3Head, cache: DraftKVCache, runner, stash_states: bool = False) -> None:
        self.head = head
        self.runner = runner           # its aux_layer_ids (the union of all taps) is set after we are built
        self.aux_layer_ids: tuple[int, ...] = tuple(sorted(set(head.spec.aux_layer_ids)))
        self.drafter = HiddenStateDrafter(head, cache, stash_states)
        self.refusals = self.drafter.refusals               # spec_decode_refused_total, drained per step
        self.records_states = stash_states                  # record() must see every target forward

    @classmethod
    def load(cls, head_dir: str | Path, runner, stash_states: bool = False) -> Eagle3Speculator:
        """runner: the target ModelRunner (model, cfg, dtype, device, kv_caches, block_size).
        stash_states: keep fc(taps) per target slot (the target caches prefixes: speculators/state_stash.py)."""
        head = load_eagle3_head(head_dir, runner.cfg, runner.model.embed_tokens, runner.dtype, runner.device)
        spec = head.spec
        cfg = spec.layer_cfg
        num_blocks = runner.kv_caches[0][0].shape[0]
        cache = mirror_target_blocks(num_blocks, runner.block_size, 1, cfg.num_key_value_heads, cfg.head_dim,
                                     runner.dtype, runner.device, f"EAGLE-3 head {Path(head_dir).name}")
        log.info("EAGLE-3 head (%s layout): taps %s, draft vocab %d of %d, norm_before_residual %s",
                 spec.layout, spec.aux_layer_ids, spec.draft_vocab_size, spec.target_vocab_size,
                 spec.norm_before_residual)
        return cls(head, cache, runner, stash_states)

    @property
    def cache(self) -> DraftKVCache:
        return self.drafter.cache

    @staticmethod
    def validate(options: dict) -> None:
        if options:
            raise ValueError(f"eagle3 speculation takes no options, got {sorted(options)}")

    def propose(self, requests: Sequence, ks: Sequence[int]) -> DraftProposal:
        return self.drafter.propose(requests, ks)

    def record(self, step: VerifiedStep, slot_mapping) -> None:
        self.head.bind_taps(tuple(self.runner.aux_layer_ids))
        self.drafter.record(step, slot_mapping)

    def observe(self, step: VerifiedStep) -> None:
        self.head.bind_taps(tuple(self.runner.aux_layer_ids))
        self.drafter.observe(step)

    def release(self, request) -> None:
        self.drafter.release(request)
