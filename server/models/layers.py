"""Building blocks of the Llama family: RMSNorm, rotary embedding (default/linear/dynamic/llama3), gated MLP.

Numerics follow HF transformers so that fp32 logits match to ~1e-5: RMSNorm normalises in fp32 and
casts back before the weight multiply; RoPE angles are computed in fp32 and cast to the activation
dtype; RoPE uses the "rotate_half" (non-interleaved) layout, i.e. dimension i pairs with i + d/2.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specserve.server.models.config import ModelConfig, RopeScaling
from specserve.server.models.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))   # [dim]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim]; normalised over the last dimension."""
        if x.dtype == torch.float32:
            # HF's x * rsqrt(mean(x^2) + eps) * weight with no casts involved, in one call instead of four.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # HF: normalise in fp32, cast back, then multiply by the weight in the activation dtype.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul (rows [gate; up])."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                          # [num_tokens, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)                # [num_tokens, hidden]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] (fp32) for every position-independent RoPE type.

    llama3 example (Llama-3.1: factor 8, low 1, high 4, original context 8192): pairs whose
    wavelength exceeds 8192/1 tokens are slowed down 8x, pairs shorter than 8192/4 are kept, and
    the band in between is a linear blend in 1/wavelength.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)                        # [head_dim // 2]
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq
    if scaling.rope_type == "linear":
        # Scaling angles by 1/factor is the same as stretching positions by factor.
        return inv_freq / scaling.factor
    orig = scaling.original_max_position_embeddings
    low_wavelen = orig / scaling.low_freq_factor
    high_wavelen = orig / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * slowed / scaling.factor + smooth * slowed
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, slowed)


class RotaryEmbedding(nn.Module):
    """cos/sin table indexed by absolute position, built lazily on the device that asks for it.

    The table is a plain attribute, not a buffer: models are built on the meta device and
    materialised with to_empty(), which would leave a buffer uninitialised.

    "dynamic" (NTK) scaling: HF recomputes the base from the *current* sequence length, which
    cannot be reproduced with a KV cache (keys already cached keep their old rotation). We match HF
    exactly for every position < max_position_embeddings (unscaled) and, beyond it, rotate
    position p with the NTK base for a sequence of length p + 1, so each key's rotation is fixed.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.theta = cfg.rope_theta
        self.scaling = cfg.rope_scaling
        self.max_position_embeddings = cfg.max_position_embeddings
        self._cos_sin: torch.Tensor | None = None   # [2, table_len, head_dim // 2] fp32

    def _build(self, length: int, device: torch.device) -> torch.Tensor:
        positions = torch.arange(length, dtype=torch.float32)                   # [length]
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)       # [head_dim // 2]
        angles = positions[:, None] * inv_freq[None, :]                         # [length, head_dim // 2]
        if self.scaling is not None and self.scaling.rope_type == "dynamic":
            angles = self._dynamic_angles(angles, positions)
        return torch.stack([angles.cos(), angles.sin()]).to(device)

    def _dynamic_angles(self, angles: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        long = positions >= self.max_position_embeddings                        # [length]
        if not bool(long.any()):
            return angles
        dim, factor = self.head_dim, self.scaling.factor
        seq_len = positions[long] + 1                                           # [num_long]
        base = self.theta * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim     # [head_dim // 2]
        inv_freq = 1.0 / (base[:, None] ** exponent[None, :])                   # [num_long, head_dim // 2]
        angles[long] = positions[long, None] * inv_freq
        return angles

    def cos_sin(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] int64, all < max_position -> (cos, sin), each [num_tokens, 1, head_dim // 2].

        Called once per forward; every layer reuses the result.
        """
        table = self._cos_sin
        if table is None or table.shape[1] < max_position or table.device != positions.device:
            # Start small (a 128k-context table is ~64 MB) and double on demand; rows never change.
            length = max(max_position, 4096 if table is None else 2 * table.shape[1])
            table = self._cos_sin = self._build(length, positions.device)
        rows = table[:, positions].to(dtype).unsqueeze(2)                     # [2, num_tokens, 1, head_dim // 2]
        return rows[0], rows[1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim // 2] -> rotated copy of x.

    Pair (x1[i], x2[i]) = (x[i], x[i + d/2]) rotates to (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    x1, x2 = x.chunk(2, dim=-1)                                 # [num_tokens, heads, head_dim // 2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
