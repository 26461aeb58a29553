"""MTP (multi-token prediction) layers as a DraftHead: a target checkpoint's own next-n layers.

One MTP layer, one row = (hidden x [H], token t, position p), docs/formats.md §2/§3:
    e   = embed(t), zeroed at position 0                        (vLLM's DeepSeek and MiMo MTP do this)
    DeepSeek-V3:  x' = eh_proj(cat(enorm(e), hnorm(x)))         embedding first, hidden second
    MiMo:         x' = input_proj(cat(hidden_layernorm(x), token_layernorm(e)))   hidden first
    out = decoder_block(x')                                     a standard Llama/Qwen2 layer, own KV
    logits = head(final_norm(out))                              final_norm: shared_head.norm | final_layernorm
Which target state is x: DeepSeek (in vLLM, and the embedded family's trainer) the FINAL-NORMED
hidden; MiMo the PRE-final-norm residual stream. The state chained to the next draft step follows the
same convention: DeepSeek passes final_norm(out) on, MiMo passes out.

Embedding and head: a layer's own copy if the checkpoint has one that differs from the target's
(DeepSeek files carry copies; MiMo and the embedded family share), else the target's modules.

Worked example (one layer): context [a, b, c], target states h_0, h_1 for a, b. Rows (h_0, b) at
position 0 (its embedding zeroed, so it sees h_0 alone) and (h_1, c) at position 1; the logits of the
second row are the first draft, the token after c.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.server.models.attention import AttentionMetadata
from specserve.server.models.config import ModelConfig
from specserve.server.models.layers import RMSNorm, RotaryEmbedding
from specserve.server.models.linear import Linear
from specserve.server.models.llama import LlamaDecoderLayer
from specserve.speculators.base import VerifiedStep
from specserve.speculators.draft_kv import KVCache


@dataclass(frozen=True)
class MtpLayout:
    name: str                  # "deepseek_v3" | "mimo"
    hidden_first: bool         # concatenation order into the projection
    prenorm_target: bool       # reads VerifiedStep.prenorm_hidden (MiMo) instead of .hidden (DeepSeek)

    @property
    def chain_normed(self) -> bool:
        """The state handed to the next step is normed like the target state this layout reads."""
        return not self.prenorm_target


DEEPSEEK_V3 = MtpLayout("deepseek_v3", hidden_first=False, prenorm_target=False)
MIMO = MtpLayout("mimo", hidden_first=True, prenorm_target=True)


class MtpLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, layout: MtpLayout) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.layout = layout
        self.embed_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.proj = Linear(2 * hidden, hidden, bias=False)
        self.block = LlamaDecoderLayer(cfg, layer_idx)     # layer_idx >= L: full attention, no window
        self.final_norm = RMSNorm(hidden, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """x [n, H] previous state, emb [n, H] -> the chained state [n, H] (see the module docstring)."""
        parts = [self.hidden_norm(x), self.embed_norm(emb)]
        if not self.layout.hidden_first:
            parts.reverse()
        out = self.block(self.proj(torch.cat(parts, dim=-1)), rope, attn, kv_cache)
        return self.final_norm(out) if self.layout.chain_normed else out


class MtpHead(nn.Module):
    """The DraftHead of speculators/hidden_drafter.py for n MTP layers."""

    def __init__(self, cfg: ModelConfig, num_layers: int, layout: MtpLayout) -> None:
        super().__init__()
        self.cfg = cfg
        self.layout = layout
        self.num_layers = num_layers
        self.hidden_size = cfg.hidden_size
        self.layers = nn.ModuleList(MtpLayer(cfg, cfg.num_hidden_layers + i, layout) for i in range(num_layers))
        self.rotary = RotaryEmbedding(cfg)
        # per layer: own copies or the target's modules (assigned by the loader)
        self.embeds: list[nn.Embedding] = []
        self.heads: list[nn.Linear] = []

    def target_states(self, step: VerifiedStep, rows: torch.Tensor) -> torch.Tensor:
        """rows [r] -> the target state the layout reads [r, H]."""
        states = step.prenorm_hidden if self.layout.prenorm_target else step.hidden
        return states.index_select(0, rows)

    stash_project = None        # the stash keeps the target state itself

    def stash_rows(self, step: VerifiedStep) -> torch.Tensor:
        """Every row's target state [num_tokens, H] (the stash copies it in at once: no projection)."""
        return step.prenorm_hidden if self.layout.prenorm_target else step.hidden

    def layer(self, m: int, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
              max_position: int, attn: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """hidden [r, H], token_ids [r], positions [r] absolute -> chained state [r, H]."""
        emb = self.embeds[m](token_ids)                                              # [r, H]
        emb = emb.masked_fill((positions == 0)[:, None], 0.0)
        rope = self.rotary.cos_sin(positions, max_position, hidden.dtype)
        return self.layers[m](hidden, emb, rope, attn, kv_cache)

    def logits(self, m: int, states: torch.Tensor) -> torch.Tensor:
        """states [r, H] (layer m's chained state) -> [r, V] float32."""
        if not self.layout.chain_normed:
            states = self.layers[m].final_norm(states)
        return self.heads[m](states).float()
