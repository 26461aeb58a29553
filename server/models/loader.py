"""Checkpoint loading: HF directory (config.json + *.safetensors, sharded or not) -> LlamaForCausalLM.

Safetensors only: pickle-based weights (*.bin, *.pt) can run code on load, so they are refused
with a message saying how to convert. Tensors the main model does not own (MTP layers stored as
`model.layers.{L}.*` for L >= num_hidden_layers, `model.mtp_layers.*`, rotary inv_freq buffers,
anything unknown) are skipped here; speculators read them later with load_tensors(). A missing
required tensor is an error, never a silently random weight.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from specserve.server.models.config import ModelConfig, load_config
from specserve.server.models.linear import pack_linears
from specserve.server.models.llama import LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# checkpoint suffix -> (our fused parameter suffix, index of the part inside it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order. Raises for pickle-only checkpoints."""
    root = Path(model_dir)
    index = root / _INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
        return [root / n for n in names]
    if (root / "model.safetensors").is_file():
        # Mistral repos also ship consolidated.safetensors (native names): never read both.
        return [root / "model.safetensors"]
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for pattern in _PICKLE_PATTERNS for p in root.glob(pattern))
    if pickled:
        raise ValueError(f"{root} holds only pickle-based weights ({', '.join(pickled)}); these are refused "
                         "because loading them can execute code. Convert them to safetensors, e.g. "
                         "model.save_pretrained(dir, safe_serialization=True) in a trusted environment.")
    raise FileNotFoundError(f"no *.safetensors weights found in {root}")


def iter_tensors(model_dir: str | Path, predicate: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for checkpoint tensors whose name passes `predicate`, one at a time."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if predicate is None or predicate(name):
                    yield name, f.get_tensor(name)


def load_tensors(model_dir: str | Path, predicate: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Raw tensors by checkpoint name, e.g. the MTP layer of a DeepSeek-style checkpoint:
    load_tensors(d, lambda n: n.startswith(f"model.layers.{cfg.num_hidden_layers}."))."""
    return dict(iter_tensors(model_dir, predicate))


def main_model_name(name: str, cfg: ModelConfig) -> str | None:
    """The checkpoint name if the main model owns that tensor, else None (MTP layers, inv_freq, a tied
    lm_head, anything unknown). Example: "model.layers.{L}.eh_proj.weight" -> None for L layers."""
    match = _LAYER_KEY.match(name)
    if match is None:
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            return name
        return name if name == "lm_head.weight" and not cfg.tie_word_embeddings else None
    if int(match.group(1)) >= cfg.num_hidden_layers or "rotary_emb" in match.group(2):
        return None
    return name


def fused_name(name: str) -> tuple[str, int | None]:
    """HF parameter name -> (our parameter name, part index inside the fused tensor | None).

    Example: "model.layers.3.self_attn.k_proj.bias" -> ("model.layers.3.self_attn.qkv_proj.bias", 1);
    works relative to any module ("mlp.up_proj.weight" -> ("mlp.gate_up_proj.weight", 1)).
    """
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    key = ".".join(parts[-2:])
    if key not in _FUSED:
        return name, None
    fused, part = _FUSED[key]
    return ".".join(parts[:-2] + [fused, leaf]), part


def _part_rows(cfg: ModelConfig, fused_param: str) -> list[int]:
    """Row counts of the parts stacked in a fused parameter, in part order."""
    if "qkv_proj" in fused_param:
        d = cfg.head_dim
        return [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d]
    return [cfg.intermediate_size, cfg.intermediate_size]


@torch.no_grad()
def _fill(module: nn.Module, cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> list[str]:
    """Copy HF-named tensors (names relative to `module`) into it, casting dtype and fusing parts.

    Raises on a shape mismatch or when any parameter (or fused part) was not provided; returns the
    names that match no parameter.
    """
    params = dict(module.named_parameters())
    expected = {(name, part) for name in params
                for part in (range(len(_part_rows(cfg, name))) if name.rpartition(".")[0].endswith(
                    ("qkv_proj", "gate_up_proj")) else [None])}
    loaded: set[tuple[str, int | None]] = set()
    unused: list[str] = []
    for hf_name, tensor in tensors:
        name, part = fused_name(hf_name)
        if name not in params:
            unused.append(hf_name)
            continue
        dest = params[name]
        if part is not None:
            rows = _part_rows(cfg, name)
            dest = dest.narrow(0, sum(rows[:part]), rows[part])
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} does not fit "
                             f"{name} slice {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add((name, part))
    missing = sorted(f"{n}[part {p}]" if p is not None else n for n, p in expected - loaded)
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} required tensors, e.g. {missing[:5]}")
    return unused


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Fill the model from a checkpoint; tensors it does not own are skipped (and logged)."""
    skipped: list[str] = []

    def owned() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_tensors(model_dir):
            if main_model_name(name, model.config) is None:
                skipped.append(name)
            else:
                yield name, tensor

    skipped += _fill(model, model.config, owned(), f"checkpoint {model_dir}")
    if skipped:
        logger.info("ignored %d checkpoint tensors not used by the main model (e.g. %s)", len(skipped), skipped[:3])


def load_layer_weights(layer: LlamaDecoderLayer, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Fill one decoder layer (e.g. an MTP block) from HF-named tensors relative to it
    ("self_attn.q_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight", ...).
    Returns the names the layer does not own (e.g. MiMo's token_layernorm) for the caller to use."""
    unused = _fill(layer, cfg, tensors.items(), "layer tensors")
    pack_linears(layer)
    return unused


def load_model(model_dir: str | Path, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from config.json and fill it from the safetensors files.

    dtype None keeps the checkpoint's declared torch_dtype (float32 when it declares none).
    """
    weight_files(model_dir)  # refuse pickle-only checkpoints before anything else
    cfg = load_config(model_dir)
    dtype = dtype or cfg.torch_dtype or torch.float32
    model = _empty_model(cfg, dtype, device)
    load_weights(model, model_dir)
    pack_linears(model)
    return model.eval(), cfg


def build_random_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Deterministic random weights (same values on every device): N(0, 0.02) matrices and biases,
    norms 1 + N(0, 0.02) so that a norm-weight mix-up cannot hide. For tests and a default model."""
    model = _empty_model(cfg, dtype, device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = torch.randn(param.shape, generator=gen) * 0.02
            if name.endswith("norm.weight"):
                values += 1.0
            param.copy_(values)
    pack_linears(model)
    return model.eval()


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    # Built on the meta device: no time is spent on random init that the checkpoint overwrites.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty() re-creates parameters, which unties them
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
