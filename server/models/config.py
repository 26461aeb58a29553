"""ModelConfig: the one typed view of a Llama-family checkpoint's config.json.

Four HF architectures share one implementation (server/models/llama.py); they differ only in flags
that are resolved here, once, so that no model code ever looks at `architecture` again:

    family   qkv bias            o_proj bias      q/k RMSNorm   head_dim default        sliding window
    llama    attention_bias      attention_bias   no            hidden / heads          none
    qwen2    always              never            no            hidden / heads          use_sliding_window
    qwen3    attention_bias      attention_bias   yes           128 (class default!)    use_sliding_window
    mistral  never               never            no            hidden / heads          sliding_window

RoPE parameters are read from either spelling: transformers 4.x writes top-level `rope_theta` plus
`rope_scaling` ({"type": ...} or {"rope_type": ...}); 5.x writes a `rope_parameters` dict that
also holds `rope_theta`. Unknown HF keys are ignored (they describe training, not inference), but
anything that would change the forward pass and that we do not implement raises ValueError.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

# architecture name in config.json -> family flag set above. MiMo is Qwen2 plus MTP layers that the
# main-model loader skips (the MTP speculator loads them by prefix).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "MiMoForCausalLM": "qwen2",
}
# configs saved without "architectures" (e.g. a bare PretrainedConfig.save_pretrained) still name a model_type
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM", "mimo": "MiMoForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RopeScaling:
    """Context-extension parameters for RoPE (see layers.RotaryEmbedding for the formulas)."""
    rope_type: str                                   # one of SUPPORTED_ROPE_TYPES except "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0                     # llama3 only
    high_freq_factor: float = 4.0                    # llama3 only
    original_max_position_embeddings: int | None = None   # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                 # e.g. "Qwen3ForCausalLM"
    family: str                       # "llama" | "qwen2" | "qwen3" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool              # bias on q/k/v projections
    o_proj_bias: bool                 # bias on o_proj (Llama/Qwen3 attention_bias; never for Qwen2)
    mlp_bias: bool
    qk_norm: bool                     # Qwen3: per-head RMSNorm on q and k before RoPE
    sliding_window: int | None        # keys visible to a query: positions (p - window, p]
    sliding_layers: tuple[bool, ...]  # [num_hidden_layers] True where the window applies
    num_nextn_predict_layers: int = 0  # MTP layers stored beside the main model (DeepSeek/MiMo)
    torch_dtype: torch.dtype | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.sliding_layers) != self.num_hidden_layers:
            raise ValueError("sliding_layers must have one entry per hidden layer")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def layer_window(self, layer_idx: int) -> int | None:
        """Sliding window of one decoder layer, None for full attention (also for extra layers
        beyond num_hidden_layers, such as MTP blocks built from this config)."""
        if layer_idx >= self.num_hidden_layers:
            return None
        return self.sliding_window if self.sliding_layers[layer_idx] else None

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Parse a config.json dict. Example: {"architectures": ["Qwen2ForCausalLM"], ...}."""
        arch = _architecture(raw)
        family = SUPPORTED_ARCHITECTURES[arch]
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or (128 if family == "qwen3" else None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
            head_dim = hidden // heads
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        num_layers = int(raw["num_hidden_layers"])
        window, sliding = _sliding(raw, family, num_layers)
        bias = bool(raw.get("attention_bias", False))
        theta, scaling = _rope(raw)
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias={"qwen2": True, "mistral": False}.get(family, bias),
            o_proj_bias=bias if family in ("llama", "qwen3") else False,
            mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family == "qwen3",
            sliding_window=window,
            sliding_layers=sliding,
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            torch_dtype=_DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "")),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
        )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs an HF config.json")
    with open(path, encoding="utf-8") as f:
        return ModelConfig.from_dict(json.load(f))


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs and raw.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[raw["model_type"]]
    shown = archs or [f"model_type={raw.get('model_type')!r}"]
    raise ValueError(f"unsupported architecture {shown}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")


def _sliding(raw: dict, family: str, num_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """Which layers use a sliding window, following each HF config class's own rule."""
    window = raw.get("sliding_window")
    if family == "llama" or window is None:
        return None, (False,) * num_layers
    if family == "mistral":
        if raw.get("layer_types"):
            raise ValueError("Mistral configs with per-layer layer_types (Ministral) are not supported")
        return int(window), (True,) * num_layers
    # Qwen2/Qwen3: the window is forced off unless use_sliding_window; then layer_types decides,
    # defaulting to "layers from max_window_layers on slide".
    if not raw.get("use_sliding_window", False):
        return None, (False,) * num_layers
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", num_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return int(window), tuple(t == "sliding_attention" for t in types)


def _rope(raw: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either the 4.x or the 5.x spelling."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    factor = float(params.get("factor", 1.0))
    if not math.isfinite(factor) or factor < 1.0:
        raise ValueError(f"rope scaling factor must be >= 1, got {factor}")
    if rope_type == "llama3":
        missing = {"low_freq_factor", "high_freq_factor"} - params.keys()
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {sorted(missing)}")
        orig = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 8192)
        return theta, RopeScaling("llama3", factor, float(params["low_freq_factor"]),
                                  float(params["high_freq_factor"]), int(orig))
    return theta, RopeScaling(rope_type, factor)
