"""Training-side Llama (GQA) with an optional DeepSeek-style MTP module, in plain PyTorch.

Module names equal Hugging Face `LlamaForCausalLM`'s (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`,
..., `model.norm`, `lm_head`), so exporting the main model is a dtype cast; the MTP module lives under `mtp.` and
is renamed to `model.layers.{L}.` on export (training/export.py). The maths follows HF's Llama exactly (RMSNorm in
fp32, rotate-half RoPE, repeat-kv GQA) and tests/test_training_target.py checks the logits against HF.

MTP (one module, DeepSeek-V3 layout):  row i of the MTP sequence sees
    x_i = eh_proj(cat([enorm(embed(tok[i+1])), hnorm(h_i)]))      embedding first, hidden second
    h_i = the main model's hidden state at position i AFTER the final norm (`model.norm`), as vLLM's DeepSeek MTP
          passes it; the embedding row at position 0 is zeroed, as vLLM does;
    out = block(x) (a Llama decoder layer, causal over rows, RoPE position i)
    logits_i = lm_head(shared_head.norm(out_i))   -> predicts tok[i+2]; embedding and head are shared.
Worked example: tokens [a, b, c, d] -> main predicts b,c,d from a,ab,abc; MTP row 0 (h_0, embed b) predicts c,
row 1 (h_1, embed c) predicts d; row 2 has no label.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaSpec:
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0   # 0 or 1 MTP module

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (int) -> cos, sin [T, head_dim] in fp32 (HF's default RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]          # [T, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)                            # [T, head_dim]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [T, hd]."""
    return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))


class Attention(nn.Module):
    def __init__(self, spec: LlamaSpec, in_features: int | None = None):
        super().__init__()
        d_in = in_features or spec.hidden_size
        hd = spec.head_dim
        self.n_heads, self.n_kv, self.hd = spec.num_attention_heads, spec.num_key_value_heads, hd
        self.q_proj = nn.Linear(d_in, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d_in, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d_in, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, spec.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, d_in] -> q [B, nh, T, hd], k/v [B, nkv, T, hd] with RoPE applied to q and k."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal (mask None) or masked (bool [Tq, Tk], True = may attend) GQA attention -> [B, T, d]."""
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=1)   # kv head j serves query heads j*rep .. j*rep+rep-1 (HF repeat_kv)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))

    def forward(self, x, cos, sin):
        return self.attend(*self.qkv(x, cos, sin))


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    """DeepSeek's `shared_head`: only its norm is owned; the head itself is the main `lm_head`."""

    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class MTPModule(Block):
    def __init__(self, spec: LlamaSpec):
        super().__init__(spec)
        self.enorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.hnorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=False)
        self.shared_head = SharedHead(spec)

    def forward(self, emb_next, hidden, cos, sin):
        """emb_next [B, T, d] = embed(tok[i+1]); hidden [B, T, d] = final-normed h_i -> pre-head state [B, T, d]."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin))


class Backbone(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaLM(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MTPModule(spec) if spec.num_nextn_predict_layers else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) init; output projections scaled by 1/sqrt(2*layers) (GPT-2 style); norms at 1."""
        n_blocks = self.spec.num_hidden_layers + (1 if self.mtp is not None else 0)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * n_blocks))
            else:
                nn.init.normal_(p, 0.0, std)

    def trunk(self, input_ids: torch.Tensor, capture: tuple[int, ...] = ()):
        """input_ids [B, T] -> (final-normed hidden [B, T, d], {idx: residual stream entering layer idx})."""
        T = input_ids.shape[1]
        cos, sin = rope_cos_sin(torch.arange(T, device=input_ids.device), self.spec.head_dim, self.spec.rope_theta)
        x = self.model.embed_tokens(input_ids)
        captured = {}
        for idx, layer in enumerate(self.model.layers):
            if idx in capture:
                captured[idx] = x
            x = layer(x, cos, sin)
        return self.model.norm(x), captured

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]."""
        return self.lm_head(self.trunk(input_ids)[0])

    def mtp_states(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """MTP over rows 0..T-2: input_ids [B, T], final-normed hidden [B, T, d] -> pre-head states [B, T-1, d]
        (row i predicts tok i+2)."""
        T = input_ids.shape[1]
        emb = self.model.embed_tokens(input_ids[:, 1:])                 # [B, T-1, d] = embed(tok[i+1])
        emb = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, 1:]], 1)  # zero position 0 (vLLM DeepSeek MTP)
        cos, sin = rope_cos_sin(torch.arange(T - 1, device=input_ids.device), self.spec.head_dim,
                                self.spec.rope_theta)
        return self.mtp(emb, hidden[:, :-1], cos, sin)

    def mtp_logits(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """-> [B, T-1, V]"""
        return self.lm_head(self.mtp_states(input_ids, hidden))

    def losses(self, input_ids: torch.Tensor, row_stride: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [B, T] -> (main next-token CE, MTP token-t+2 CE or None)."""
        hidden, _ = self.trunk(input_ids)
        logits = self.lm_head(hidden)
        V = logits.shape[-1]
        main = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), input_ids[:, 1:].reshape(-1))
        if self.mtp is None:
            return main, None
        mtp = self.mtp_loss(input_ids, hidden, row_stride)
        return main, mtp

    def mtp_loss(self, input_ids: torch.Tensor, hidden: torch.Tensor, row_stride: int = 1) -> torch.Tensor:
        """MTP CE on token t+2. row_stride > 1 runs the (costly) shared head on every row_stride-th row only:
        the MTP block still sees every row (causal attention needs them); the loss is a subsample of rows."""
        out = self.mtp_states(input_ids, hidden)[:, :-1:row_stride]   # rows 0..T-3 have labels
        labels = input_ids[:, 2::row_stride]
        logits = self.lm_head(out)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def flops_per_token(spec: LlamaSpec) -> int:
    """Forward FLOPs per token ~ 2 x (non-embedding params + lm_head); attention scores ignored."""
    d, hd = spec.hidden_size, spec.head_dim
    attn = d * spec.num_attention_heads * hd * 2 + d * spec.num_key_value_heads * hd * 2
    mlp = 3 * d * spec.intermediate_size
    return 2 * (spec.num_hidden_layers * (attn + mlp) + d * spec.vocab_size)
