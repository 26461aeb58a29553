"""EAGLE-3 speculator: a one-layer head fed by three of the target's hidden states; and EAGLE-1 (method
`eagle`), the same wrapper around a head fed by the target's last normed state (eagle1_head.py).

No extra target pass: the engine's runner taps the residual streams entering the head's layers
(`aux_layer_ids`, default (2, L//2, L-3)) in every forward, prefill chunks included, and hands them to
observe() in a VerifiedStep. The head fuses them (fc), catches up its own KV on them, and drafts k
tokens by feeding its own pre-norm output back (speculators/hidden_drafter.py has the row
alignment and a worked example; eagle3_head.py the maths; eagle3_loader.py both public layouts).

Usage: `specserve serve --model <target> --eagle3 <head dir>`, then a request's
`"speculation": {"method": "eagle3", "num_speculative_tokens": 4}` (EAGLE-1: `--eagle <head dir>`,
method "eagle").
"""
from __future__ import annotations

import logging
from pathlib import Path

from specserve.speculators.base import BuildContext, TargetModel
from specserve.speculators.draft_kv import DraftKVCache, mirror_target_blocks
from specserve.speculators.eagle1_loader import load_eagle1_head
from specserve.speculators.eagle3_head import Eagle3Head
from specserve.speculators.eagle3_loader import load_eagle3_head
from specserve.speculators.head_speculator import HeadSpeculator

log = logging.getLogger(__name__)


class Eagle3Speculator(HeadSpeculator):
    name = "eagle3"
    label = "EAGLE-3"

    def __init__(self, head: Eagle3Head, cache: DraftKVCache, runner: TargetModel,
                 stash_states: bool = False) -> None:
        super().__init__(head, cache, stash_states)
        self.runner = runner           # its aux_layer_ids (the union of all taps) is set after we are built
        self.aux_layer_ids: tuple[int, ...] = tuple(sorted(set(head.spec.aux_layer_ids)))

    @classmethod
    def build(cls, ctx: BuildContext) -> Eagle3Speculator | None:
        if ctx.eagle3_dir is None or ctx.target is None:
            return None
        return cls.load(ctx.eagle3_dir, ctx.target, stash_states=ctx.stash_states)

    @classmethod
    def kv_bytes_per_block(cls, ctx: BuildContext) -> int:
        # an EAGLE-3 head's layer is as wide as the target here (its config may say otherwise: a few %)
        return 0 if ctx.eagle3_dir is None else cls.head_kv_bytes(ctx, 1)

    @classmethod
    def load(cls, head_dir: str | Path, runner: TargetModel, stash_states: bool = False) -> Eagle3Speculator:
        """runner: the target (model, cfg, dtype, device, num_blocks, block_size).
        stash_states: keep fc(taps) per target slot (the target caches prefixes: speculators/state_stash.py)."""
        head = cls.load_head(head_dir, runner)
        cfg = head.spec.layer_cfg
        cache = mirror_target_blocks(runner.num_blocks, runner.block_size, 1, cfg.num_key_value_heads,
                                     cfg.head_dim, runner.dtype, runner.device,
                                     f"{cls.label} head {Path(head_dir).name}")
        return cls(head, cache, runner, stash_states)

    @classmethod
    def load_head(cls, head_dir: str | Path, runner: TargetModel):
        head = load_eagle3_head(head_dir, runner.cfg, runner.model.embed_tokens, runner.dtype, runner.device)
        spec = head.spec
        log.info("EAGLE-3 head (%s layout): taps %s, draft vocab %d of %d, norm_before_residual %s, fc_norm %s, "
                 "norm_before_fc %s, norm_output %s", spec.layout, spec.aux_layer_ids, spec.draft_vocab_size,
                 spec.target_vocab_size, spec.norm_before_residual, spec.fc_norm, spec.norm_before_fc,
                 spec.norm_output)
        return head

    def bind(self) -> None:
        self.head.bind_taps(tuple(self.runner.aux_layer_ids))


class EagleSpeculator(Eagle3Speculator):
    """EAGLE-1 heads (SafeAILab layout): no taps; the head reads the target's final-normed state, which every
    VerifiedStep carries, and drafts through the target's lm_head."""
    name = "eagle"
    label = "EAGLE-1"

    @classmethod
    def build(cls, ctx: BuildContext) -> EagleSpeculator | None:
        if ctx.eagle_dir is None or ctx.target is None:
            return None
        return cls.load(ctx.eagle_dir, ctx.target, stash_states=ctx.stash_states)

    @classmethod
    def kv_bytes_per_block(cls, ctx: BuildContext) -> int:
        return 0 if ctx.eagle_dir is None else cls.head_kv_bytes(ctx, 1)

    @classmethod
    def load_head(cls, head_dir: str | Path, runner: TargetModel):
        head = load_eagle1_head(head_dir, runner.cfg, runner.model.embed_tokens, runner.model.lm_head,
                                runner.dtype, runner.device)
        log.info("EAGLE-1 head: fc bias %s, own embedding %s", head.spec.fc_bias,
                 head.embed_tokens is not runner.model.embed_tokens)
        return head
