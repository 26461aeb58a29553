"""The Llama family (Llama, Qwen2, Qwen3, Mistral) as one paged, varlen causal LM.

All tokens of a step, from every sequence, travel as one flat [num_tokens, hidden] batch; the
per-sequence structure lives only in AttentionMetadata. Architecture differences are flags on
ModelConfig (see config.py): qkv/o/mlp biases, Qwen3's per-head q/k RMSNorm, head_dim, windows.

Parameter names follow HF's except for two fusions (the loader splits checkpoint tensors into them):
    self_attn.qkv_proj   = rows [q_proj; k_proj; v_proj]
    mlp.gate_up_proj     = rows [gate_proj; up_proj]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.server.models.attention import AttentionMetadata
from specserve.server.models.compiled import COMPILE_OPTIONS, attend, forward_context, register
from specserve.server.models.config import ModelConfig
from specserve.server.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope
from specserve.server.models.linear import Linear

KVCache = tuple[torch.Tensor, torch.Tensor]   # ([num_blocks, block_size, kv_heads, head_dim],) * 2


@dataclass
class ModelOutput:
    hidden: torch.Tensor              # [num_tokens, hidden] after the final RMSNorm (what lm_head sees)
    prenorm_hidden: torch.Tensor      # [num_tokens, hidden] residual stream before the final norm (MiMo MTP)
    aux_hidden: list[torch.Tensor]    # per requested layer id: [num_tokens, hidden] stream entering it


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.layer_window(layer_idx)
        self.layer_idx = layer_idx
        self.attention_handle = register(self)
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_rows, bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """x: [num_tokens, hidden]; rope: (cos, sin) each [num_tokens, 1, head_dim // 2] -> [num_tokens, hidden]."""
        n, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)                                          # [n, (heads + 2 kv_heads) * d]
        qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head's vector, before RoPE
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = apply_rope(qk, *rope)          # q and k rotated together: half the small ops of two calls
        q, k = qk[:, :heads], qk[:, heads:]                             # [n, heads, d], [n, kv_heads, d]
        out = attend(self, q, k, v, kv_cache, attn)                     # [n, heads, d]
        return self.o_proj(out.reshape(n, heads * d))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Reusable by MTP heads."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """x: [num_tokens, hidden] residual stream -> [num_tokens, hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), rope, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.compiled_stack = None      # torch.compile'd _stack (enable_compile); None = eager

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata, kv_caches: list[KVCache],
                aux_layer_ids: tuple[int, ...] = ()) -> ModelOutput:
        dtype = self.embed_tokens.weight.dtype
        cos, sin = self.rotary_emb.cos_sin(attn.positions, attn.max_seq_len, dtype)   # once for all layers
        if self.compiled_stack is None or not torch.is_inference_mode_enabled():
            hidden, x, aux = self._stack(input_ids, cos, sin, aux_layer_ids, attn, kv_caches)
        else:
            if not input_ids.is_inference():   # made outside inference mode (the runner's): one guard set for all
                input_ids = input_ids.clone()
            for t in (input_ids, cos, sin):    # one graph for every token count, 1 included (compiled.py)
                torch._dynamo.decorators.mark_unbacked(t, 0)
            with forward_context(attn, kv_caches):
                hidden, x, aux = self.compiled_stack(input_ids, cos, sin, aux_layer_ids)
        return ModelOutput(hidden=hidden, prenorm_hidden=x, aux_hidden=list(aux))

    def _stack(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               aux_layer_ids: tuple[int, ...], attn: AttentionMetadata | None = None,
               kv_caches: list[KVCache] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Embedding -> layers -> final norm. Compiled, it runs without attn/kv_caches (server/models/compiled.py)."""
        x = self.embed_tokens(input_ids)                                # [num_tokens, hidden]
        aux: list[torch.Tensor | None] = [None] * len(aux_layer_ids)
        for i, layer in enumerate(self.layers):
            for j, tap in enumerate(aux_layer_ids):
                if tap == i:        # EAGLE-3 convention: un-normed stream entering layer i (= HF hidden_states[i])
                    aux[j] = x
            x = layer(x, (cos, sin), attn, None if kv_caches is None else kv_caches[i])
        return self.norm(x), x, tuple(aux)

    def enable_compile(self) -> None:
        """Run the layer stack through torch.compile from now on (see server/models/compiled.py)."""
        self.compiled_stack = torch.compile(self._stack, dynamic=True, options=COMPILE_OPTIONS)


class LlamaForCausalLM(nn.Module):
    """One class serves Llama, Qwen2, Qwen3 and Mistral; flags come from ModelConfig.

    forward() is the engine's hot path; forward_states() also returns the pre-final-norm hidden
    state (for MTP heads that consume it, e.g. MiMo) in a ModelOutput.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def norm(self) -> RMSNorm:
        return self.model.norm

    def forward_states(self, input_ids: torch.Tensor, attn: AttentionMetadata, kv_caches: list[KVCache],
                       aux_layer_ids: tuple[int, ...] = ()) -> ModelOutput:
        """input_ids: [num_tokens] int64. aux ids must lie in [0, num_hidden_layers)."""
        num_layers = self.config.num_hidden_layers
        if any(not 0 <= i < num_layers for i in aux_layer_ids):
            raise ValueError(f"aux_layer_ids {aux_layer_ids} must lie in [0, {num_layers})")
        if len(kv_caches) != num_layers:
            raise ValueError(f"expected {num_layers} KV caches, got {len(kv_caches)}")
        return self.model(input_ids, attn, kv_caches, aux_layer_ids)

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata, kv_caches: list[KVCache],
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> (final-normed hidden [num_tokens, hidden], aux hidden states, each [num_tokens, hidden])."""
        out = self.forward_states(input_ids, attn, kv_caches, aux_layer_ids)
        return out.hidden, out.aux_hidden

    def enable_compile(self) -> None:
        self.model.enable_compile()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> [n, vocab] float32 (samplers work in fp32)."""
        return self.lm_head(hidden).float()
