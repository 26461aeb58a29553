"""The EAGLE-1 head as a module: fc over [embedding; target hidden] (2H -> H, optional bias), one Llama
decoder layer without input_layernorm, no final norm, and the target's own lm_head.

Maths (docs/formats.md §1c), one row = (hidden x [H], token t, position p):
    a      = fc(cat(embed(t), x))                 [2H] -> [H]  embedding first, hidden second
    h      = a + o_proj(attn(q, k, v from a))     RoPE at p, causal over the head's own KV; no input norm
    h      = h + mlp(post_attention_layernorm(h)) -> h, the state fed to the next draft step
    logits = target.lm_head(h)                    no norm: h stands in for the target's normed state
At the first step x is the target's last hidden state AFTER its final norm (VerifiedStep.hidden).
The row alignment, KV bookkeeping and chaining are HiddenStateDrafter's, shared with EAGLE-3 and MTP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.server.models.attention import AttentionMetadata
from specserve.server.models.config import ModelConfig
from specserve.server.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from specserve.server.models.linear import Linear
from specserve.server.models.llama import LlamaAttention
from specserve.speculators.base import VerifiedStep
from specserve.speculators.draft_kv import KVCache


@dataclass(frozen=True)
class Eagle1Spec:
    """What an EAGLE-1 head's config says (see eagle1_loader.py)."""
    layer_cfg: ModelConfig                 # the decoder layer: hidden H (= the target's), heads, RoPE, eps
    target_vocab_size: int                 # V: the target's lm_head scores the whole vocabulary
    fc_bias: bool                          # config "bias" (missing means true)
    aux_layer_ids: tuple[int, ...] = ()    # no taps: the head reads the target's last (normed) state


class Eagle1Layer(nn.Module):
    """A Llama decoder layer whose attention reads its input un-normed (EAGLE-1's layer 0)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, 0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """x [n, H] fc output -> [n, H]."""
        h = x + self.self_attn(x, rope, attn, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1Head(nn.Module):
    """The DraftHead of speculators/hidden_drafter.py for EAGLE-1 (one layer)."""
    num_layers = 1

    def __init__(self, spec: Eagle1Spec) -> None:
        super().__init__()
        cfg = spec.layer_cfg
        self.spec = spec
        self.hidden_size = cfg.hidden_size
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=spec.fc_bias)
        self.layers = nn.ModuleList([Eagle1Layer(cfg)])
        self.rotary = RotaryEmbedding(cfg)
        self.embed_tokens: nn.Embedding | None = None       # own (from the head file) or the target's
        self.lm_head: nn.Module | None = None               # the target's

    def bind_taps(self, tapped: tuple[int, ...]) -> None:
        """No taps to bind (the speculator wrapper is EAGLE-3's)."""

    # -- DraftHead ------------------------------------------------------------------------------------
    def target_states(self, step: VerifiedStep, rows: torch.Tensor) -> torch.Tensor:
        """rows [r] -> the target's final-normed states [r, H]."""
        return step.hidden.index_select(0, rows)

    stash_project = None        # the stash keeps the target state itself

    def stash_rows(self, step: VerifiedStep) -> torch.Tensor:
        return step.hidden

    def layer(self, m: int, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
              max_position: int, attn: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """hidden [r, H], token_ids [r], positions [r] absolute (< max_position) -> h [r, H]."""
        rope = self.rotary.cos_sin(positions, max_position, hidden.dtype)
        x = self.fc(torch.cat([self.embed_tokens(token_ids), hidden], dim=-1))          # [r, H]
        return self.layers[0](x, rope, attn, kv_cache)

    def logits(self, m: int, states: torch.Tensor) -> torch.Tensor:
        """states [r, H] -> [r, V] float32 through the target's lm_head."""
        return self.lm_head(states).float()
