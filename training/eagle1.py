"""EAGLE-1 head (fc over [embedding; target hidden], one decoder layer, the target's lm_head) with training-time
test, trained by the same loop as the EAGLE-3 head (training/train_eagle3.py --head eagle1).

Layout and maths follow the public SafeAILab EAGLE-1 heads (docs/formats.md §1c):
  step 0, row i:  x = h_i, the target's last hidden state at position i AFTER its final norm
  every step:     a = fc(cat(embed(tok), x))              [2H] -> [H], embedding first, hidden second (fc may
                                                          carry a bias)
                  h = a + o_proj(attn(q, k, v from a))    layer 0 has NO input_layernorm
                  h = h + mlp(post_attention_layernorm(h))
                  logits = target.lm_head(h)              no final norm, no lm_head of its own
  h is also the hidden fed to the next step (it stands in for the target's normed hidden state).
Row i pairs the target's state at position i with the embedding of token i+1 and predicts token i+2; the
training-time-test steps and the loss are those of training/eagle3.py (ttt_loss works on either head).
"""
from __future__ import annotations

import torch
from torch import nn

from training.eagle3 import ttt_mask
from training.model import MLP, Attention, LlamaLM, LlamaSpec, RMSNorm, rope_cos_sin


class Eagle1Layer(nn.Module):
    """A Llama decoder layer without input_layernorm (EAGLE-1's layer 0)."""

    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)


class Eagle1Head(nn.Module):
    draft_ids = None            # full vocabulary: the target's own lm_head scores every id

    def __init__(self, spec: LlamaSpec, target: LlamaLM, fc_bias: bool = True):
        super().__init__()
        self.spec = spec
        self.fc_bias = fc_bias
        self.embed_tokens = nn.Embedding.from_pretrained(target.model.embed_tokens.weight.detach().clone(),
                                                         freeze=True)
        self.fc = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([Eagle1Layer(spec)])
        for p in self.parameters():
            if p.requires_grad:
                nn.init.ones_(p) if p.dim() == 1 else nn.init.normal_(p, 0.0, 0.02)
        if fc_bias:
            nn.init.zeros_(self.fc.bias)
        # the target's head, frozen; not part of the export (loaders use the target's)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(target.lm_head.weight.detach().clone(), requires_grad=False)

    @property
    def draft_vocab_size(self) -> int:
        return self.spec.vocab_size

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def restrict(self, target_logits: torch.Tensor) -> torch.Tensor:
        return target_logits

    def init_from_target(self, target: LlamaLM) -> None:
        """No warm start: the head owns no norm or lm_head to copy (the recipe trains fc and the layer)."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def ttt_logits(self, feat: torch.Tensor, next_tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """feat [B, T, H]; next_tokens [B, T + steps - 1] -> logits per step, each [B, T, V]."""
        return [self.logits(h) for h in self.ttt_states(feat, next_tokens, steps)]

    def ttt_states(self, feat: torch.Tensor, next_tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """feat [B, T, H] normed target states; next_tokens [B, T + steps - 1] -> per step [B, T, H]."""
        T = feat.shape[1]
        layer = self.layers[0]
        attn: Attention = layer.self_attn
        x = feat
        keys, values, outs = [], [], []
        dev = feat.device
        rows = torch.arange(T, device=dev)
        for j in range(steps):
            emb = self.embed_tokens(next_tokens[:, j:j + T])               # [B, T, H]
            a = self.fc(torch.cat([emb, x], dim=-1))                       # [B, T, H]
            cos, sin = rope_cos_sin(rows + j, self.spec.head_dim, self.spec.rope_theta)
            q, k, v = attn.qkv(a, cos, sin)
            keys.append(k)
            values.append(v)
            mask = ttt_mask(T, j, dev)
            h = a + attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            outs.append(h)
            x = h
        return outs


@torch.no_grad()
def target_features(target: LlamaLM, window: torch.Tensor, layers=()):
    """window [B, T+1] -> (final-normed hidden [B, T, H] for rows 0..T-1, target logits [B, T+1, V])."""
    hidden, _ = target.trunk(window)
    return hidden[:, :-1], target.lm_head(hidden)
