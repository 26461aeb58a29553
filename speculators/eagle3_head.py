"""The EAGLE-3 head as a module: fc fusion of three target taps, one decoder layer whose attention reads
[embedding; hidden] (2H wide), a final norm and a (possibly reduced-vocabulary) lm_head.

Maths (docs/formats.md §1a/§1b), one row = (hidden x [H], token t, position p):
    normed   = hidden_norm(x)
    residual = normed if norm_before_residual else x          (original EAGLE: the un-normed x)
    a        = cat(input_layernorm(embed(t)), normed)          [2H]  embedding first, hidden second
    h        = residual + o_proj(attn(q, k, v from a))         RoPE at p, causal over the head's own KV
    h        = h + mlp(post_attention_layernorm(h))            -> h, the pre-norm state fed to the next step
    logits   = lm_head(norm(h))                                [Vd], mapped to target ids by d2t
At the first step x = fc(cat(aux_a, aux_b, aux_c)) of the target's taps (ascending layer order).

Config-driven variants (docs/formats.md §1d), all off in a plain EAGLE-3 head:
    fc_norm         x = fc(cat(fc_norm.0(aux_a), fc_norm.1(aux_b), fc_norm.2(aux_c)))   EAGLE-3.1: one RMSNorm
                    per tap [Ht]
    norm_before_fc  x = fc(input_norm(cat(aux_a, aux_b, aux_c)))   ONE RMSNorm over the concatenation [3 Ht]
    norm_output     the next step's hidden is norm(h), not h (EAGLE-3.1); logits = lm_head(norm(h)) either way

d2t is an OFFSET table: target_id = draft_id + d2t[draft_id]. Example: used target ids [0, 5, 9]
-> d2t [0, 4, 7]; draft id 2 is target id 9. Draft logits are scattered into a full-vocabulary row
filled with -inf, so drafts and draft_probs are in target ids.
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
class Eagle3Spec:
    """What a head's config says, whichever layout it came in (see eagle3_loader.py)."""
    layer_cfg: ModelConfig                 # the decoder layer: hidden H, heads, head_dim, RoPE, eps
    target_hidden_size: int                # Ht: fc input is num_taps * Ht
    target_vocab_size: int                 # V
    draft_vocab_size: int                  # Vd: rows of lm_head
    aux_layer_ids: tuple[int, ...]         # target layers tapped, in concatenation (ascending) order
    norm_before_residual: bool
    layout: str                            # "eagle" (SafeAILab original) | "speculators" (vLLM library)
    fc_norm: bool = False                  # an RMSNorm per tap before fc (`fc_norm.{k}.weight` [Ht])
    norm_before_fc: bool = False           # one RMSNorm over the concatenated taps (`input_norm.weight` [3 Ht])
    norm_output: bool = False              # the normed output is fed to the next draft step


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, 0)
        # the one difference from a Llama layer: q/k/v read [embedding; hidden], 2H wide
        qkv = self.self_attn.qkv_proj
        self.self_attn.qkv_proj = Linear(2 * hidden, qkv.out_features, bias=qkv.bias is not None)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """x [n, H] hidden, emb [n, H] token embeddings -> [n, H] pre-norm output."""
        normed = self.hidden_norm(x)
        residual = normed if self.norm_before_residual else x
        a = torch.cat([self.input_layernorm(emb), normed], dim=-1)                 # [n, 2H]
        h = residual + self.self_attn(a, rope, attn, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The DraftHead of speculators/hidden_drafter.py for EAGLE-3 (one layer)."""
    num_layers = 1

    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__()
        cfg = spec.layer_cfg
        self.spec = spec
        self.hidden_size = cfg.hidden_size
        taps, width, eps = len(spec.aux_layer_ids), spec.target_hidden_size, cfg.rms_norm_eps
        self.input_norm = RMSNorm(taps * width, eps) if spec.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(width, eps) for _ in range(taps)) if spec.fc_norm else None
        self.fc = Linear(taps * width, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg, spec.norm_before_residual)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, spec.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        self.embed_tokens: nn.Embedding | None = None       # own (from the head file) or the target's
        self.register_buffer("target_ids", None)             # [Vd] int64 draft id -> target id, None = identity
        self.aux_index: tuple[int, ...] = ()                 # positions of our taps in the step's aux list

    def bind_taps(self, tapped: tuple[int, ...]) -> None:
        """Map our tap layers to their index in VerifiedStep.aux_hidden (the runner taps the union, sorted)."""
        missing = [i for i in self.spec.aux_layer_ids if i not in tapped]
        if missing:
            raise RuntimeError(f"the target runner does not tap layers {missing} needed by the EAGLE-3 head")
        self.aux_index = tuple(tapped.index(i) for i in self.spec.aux_layer_ids)

    # -- DraftHead ------------------------------------------------------------------------------------
    def target_states(self, step: VerifiedStep, rows: torch.Tensor) -> torch.Tensor:
        """rows [r] -> fc(cat(taps)) [r, H]."""
        taps = [step.aux_hidden[j].index_select(0, rows) for j in self.aux_index]   # each [r, Ht]
        return self.stash_project(torch.cat(taps, dim=-1))

    def stash_rows(self, step: VerifiedStep) -> torch.Tensor:
        """Every row's concatenated taps [num_tokens, 3 Ht] (a new tensor); the stash projects them in bulk."""
        return torch.cat([step.aux_hidden[j] for j in self.aux_index], dim=-1)

    def stash_project(self, raw: torch.Tensor) -> torch.Tensor:
        """stash_rows -> target_states: [n, 3 Ht] -> (the config's norms, then) fc [n, H]."""
        if self.input_norm is not None:
            raw = self.input_norm(raw)
        if self.fc_norm is not None:
            parts = raw.chunk(len(self.fc_norm), dim=-1)                           # each [n, Ht]
            raw = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(raw)

    def layer(self, m: int, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
              max_position: int, attn: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """hidden [r, H], token_ids [r], positions [r] absolute (< max_position) -> h [r, H] (norm(h) with
        norm_output)."""
        rope = self.rotary.cos_sin(positions, max_position, hidden.dtype)
        h = self.midlayer(hidden, self.embed_tokens(token_ids), rope, attn, kv_cache)
        return self.norm(h) if self.spec.norm_output else h

    def logits(self, m: int, states: torch.Tensor) -> torch.Tensor:
        """states [r, H] -> [r, V] float32, -inf outside the draft vocabulary."""
        normed = states if self.spec.norm_output else self.norm(states)           # norm_output: normed already
        draft = self.lm_head(normed).float()                                      # [r, Vd]
        if self.target_ids is None:
            return draft
        full = draft.new_full((draft.shape[0], self.spec.target_vocab_size), float("-inf"))
        return full.index_copy_(1, self.target_ids, draft)
