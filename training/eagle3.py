"""EAGLE-3 head (one decoder "midlayer" fed by fused low/mid/high target states) with training-time test.

Layout and maths follow the public EAGLE-3 heads (docs/formats.md §1a):
  step 0, row i:  x = fc(cat(h_2, h_mid, h_high))   residual stream ENTERING target layers (2, L//2, L-3), row i
  every step:     a = cat(input_layernorm(embed(tok)), hidden_norm(x))       embedding first, hidden second
                  h = x + o_proj(attn(q, k, v from a));  h = h + mlp(post_attention_layernorm(h))
                  logits = lm_head(norm(h));  h (pre-norm) is the hidden fed to the next step
Row i pairs the target's state at position i with the embedding of token i+1 and predicts token i+2.

Training-time test (TTT): step j > 0 feeds the head's own output h back as x, with the corpus token i+1+j and
position i+j. Its query at row i attends to the step-0 keys of rows <= i (causal) and to its own keys of
steps 1..j at row i only; this is exactly what a query sees at inference after j chained drafts.
Loss of step j: soft cross-entropy to the target's distribution at position i+1+j (what the target predicts
for token i+2+j), weighted 0.8^j, over rows with i+1+j < window length.
Worked example: window [t0..t4] (T=4 rows), j=1, row 0: hidden = step-0 output of row 0, token t2, position 1,
target = softmax(target_logits[2]) (the target's prediction of t3).

Reduced draft vocabulary (optional, as the public heads do): lm_head scores only Vd target ids, the Vd most
frequent in the training corpus (`select_draft_vocab`, sorted ascending). The loss then matches the target's
distribution renormalised over those ids, and a draft id maps back to target id draft_ids[d]; the export
writes this as the public d2t offset table (target = d + d2t[d]) and the t2d mask. A smaller lm_head is
the point: it is most of the head's per-step cost.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.model import (
    MLP,
    Attention,
    LlamaLM,
    LlamaSpec,
    RMSNorm,
    rope_cos_sin,
)


def aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


class Midlayer(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, in_features=2 * spec.hidden_size)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)


def ttt_mask(T: int, j: int, device) -> torch.Tensor:
    """[T, (j+1)*T] attention mask of unrolled draft step j: causal over the step-0 keys, diagonal over the keys
    of steps 1..j (each position sees only its own earlier draft states)."""
    return torch.cat([torch.ones(T, T, dtype=torch.bool, device=device).tril()]
                     + [torch.eye(T, dtype=torch.bool, device=device)] * j, dim=1)


def select_draft_vocab(tokens, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent ids of a token stream, sorted ascending -> [size] int64 (ties: lower id)."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = torch.bincount(torch.as_tensor(tokens).long().reshape(-1), minlength=vocab_size)[:vocab_size]
    return torch.argsort(-counts, stable=True)[:size].sort().values      # stable: a tie keeps the lower id


class Eagle3Head(nn.Module):
    def __init__(self, spec: LlamaSpec, target_hidden_size: int, target_embedding: torch.Tensor,
                 draft_ids: torch.Tensor | None = None):
        """draft_ids: [Vd] ascending target ids the lm_head scores (None: the whole vocabulary)."""
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding.from_pretrained(target_embedding.detach().clone(), freeze=True)
        self.fc = nn.Linear(3 * target_hidden_size, spec.hidden_size, bias=False)
        self.midlayer = Midlayer(spec)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.register_buffer("draft_ids", None if draft_ids is None else draft_ids.long().clone())
        self.lm_head = nn.Linear(spec.hidden_size, self.draft_vocab_size, bias=False)
        for p in self.parameters():
            if p.requires_grad:
                nn.init.ones_(p) if p.dim() == 1 else nn.init.normal_(p, 0.0, 0.02)

    @property
    def draft_vocab_size(self) -> int:
        return self.spec.vocab_size if self.draft_ids is None else self.draft_ids.numel()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Argmaxes of the head's logits -> target token ids."""
        return draft_ids if self.draft_ids is None else self.draft_ids[draft_ids]

    def restrict(self, target_logits: torch.Tensor) -> torch.Tensor:
        """[..., V] target scores -> [..., Vd], the columns the head predicts (softmax renormalises them)."""
        return target_logits if self.draft_ids is None else target_logits.index_select(-1, self.draft_ids)

    def init_from_target(self, target: LlamaLM) -> None:
        """Warm start: lm_head (its draft rows) and final norm from the target (same hidden size required)."""
        if target.spec.hidden_size == self.spec.hidden_size:
            with torch.no_grad():
                self.lm_head.weight.copy_(self.restrict(target.lm_head.weight.t()).t())
                self.norm.weight.copy_(target.model.norm.weight)

    def ttt_logits(self, aux: torch.Tensor, next_tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """aux [B, T, 3*Ht]; next_tokens [B, T + steps - 1] (row i of step j uses next_tokens[:, i + j])
        -> logits per step, each [B, T, V]."""
        return [self.logits(h) for h in self.ttt_states(aux, next_tokens, steps)]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def ttt_states(self, aux: torch.Tensor, next_tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Like ttt_logits but returns the pre-norm states per step, each [B, T, H]."""
        T = aux.shape[1]
        ml = self.midlayer
        attn: Attention = ml.self_attn
        x = self.fc(aux)                                                   # [B, T, H]
        keys, values, outs = [], [], []
        dev = aux.device
        rows = torch.arange(T, device=dev)
        for j in range(steps):
            emb = self.embed_tokens(next_tokens[:, j:j + T])               # [B, T, H]
            a = torch.cat([ml.input_layernorm(emb), ml.hidden_norm(x)], dim=-1)
            cos, sin = rope_cos_sin(rows + j, self.spec.head_dim, self.spec.rope_theta)
            q, k, v = attn.qkv(a, cos, sin)
            keys.append(k)
            values.append(v)
            mask = ttt_mask(T, j, dev)
            h = x + attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask)
            h = h + ml.mlp(ml.post_attention_layernorm(h))
            outs.append(h)
            x = h
        return outs


@torch.no_grad()
def target_features(target: LlamaLM, window: torch.Tensor, layers: tuple[int, ...]):
    """window [B, T+1] -> (aux [B, T, 3*Ht] for rows 0..T-1, target logits [B, T+1, V])."""
    hidden, captured = target.trunk(window, capture=layers)
    aux = torch.cat([captured[i] for i in layers], dim=-1)[:, :-1]
    return aux, target.lm_head(hidden)


def ttt_loss(head: Eagle3Head, aux: torch.Tensor, window: torch.Tensor, target_logits: torch.Tensor, steps: int,
             decay: float = 0.8, row_stride: int = 1) -> tuple[torch.Tensor, list[float], list[float]]:
    """window [B, T+1]; returns (weighted loss, per-step soft-CE, per-step top-1 agreement with the target).
    row_stride > 1 scores every row_stride-th row only (the lm_head is the costly part; every row still runs
    through the layer, since later rows attend to earlier ones)."""
    B, T1 = window.shape
    T = T1 - 1
    pad = torch.zeros(B, steps - 1, dtype=window.dtype, device=window.device)
    next_tokens = torch.cat([window[:, 1:], pad], dim=1)                   # [B, T + steps - 1]
    states = head.ttt_states(aux, next_tokens, steps)
    total, ces, accs = 0.0, [], []
    for j, h in enumerate(states):
        n = T - j                                                          # rows with a target position i+1+j <= T
        tgt = target_logits[:, 1 + j:1 + j + n:row_stride].float()                  # [B, n', V]
        lp = F.log_softmax(head.logits(h[:, :n:row_stride]).float(), dim=-1)       # [B, n', Vd]
        ce = -(F.softmax(head.restrict(tgt), dim=-1) * lp).sum(-1).mean()
        total = total + (decay ** j) * ce
        ces.append(ce.item())
        # agreement with the target's own top-1 over the FULL vocabulary (a top-1 outside the draft vocab is a miss)
        accs.append((head.to_target_ids(lp.argmax(-1)) == tgt.argmax(-1)).float().mean().item())
    return total, ces, accs
