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
from pathlib import Path

from specserve.speculators.base import BuildContext, TargetModel
from specserve.speculators.draft_kv import mirror_target_blocks
from specserve.speculators.head_speculator import HeadSpeculator
from specserve.speculators.mtp_loader import load_mtp_head

log = logging.getLogger(__name__)


class MtpSpeculator(HeadSpeculator):
    name = "mtp"

    @staticmethod
    def _available(ctx: BuildContext) -> bool:
        return ctx.model_dir is not None and ctx.target_cfg.num_nextn_predict_layers > 0

    @classmethod
    def build(cls, ctx: BuildContext) -> MtpSpeculator | None:
        if not cls._available(ctx) or ctx.target is None:
            return None
        return cls.load(ctx.model_dir, ctx.target, stash_states=ctx.stash_states)

    @classmethod
    def kv_bytes_per_block(cls, ctx: BuildContext) -> int:
        return cls.head_kv_bytes(ctx, ctx.target_cfg.num_nextn_predict_layers) if cls._available(ctx) else 0

    @classmethod
    def load(cls, model_dir: str | Path, runner: TargetModel, stash_states: bool = False) -> MtpSpeculator:
        """runner: the target; the MTP layers come from the same checkpoint directory.
        stash_states: keep the target state per target slot (the target caches prefixes: state_stash.py)."""
        cfg = runner.cfg
        head = load_mtp_head(model_dir, cfg, runner.model.embed_tokens, runner.model.lm_head,
                             runner.dtype, runner.device)
        cache = mirror_target_blocks(runner.num_blocks, runner.block_size, head.num_layers,
                                     cfg.num_key_value_heads, cfg.head_dim, runner.dtype, runner.device,
                                     f"MTP ({head.layout.name}, {head.num_layers} layer(s))")
        log.info("MTP speculator: %d %s layer(s) from %s", head.num_layers, head.layout.name, model_dir)
        return cls(head, cache, stash_states)
