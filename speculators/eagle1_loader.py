"""Load an EAGLE-1 head (SafeAILab layout, docs/formats.md §1c) from a local directory.

  config   a Llama config with num_hidden_layers 1 and an optional "bias" for fc (missing means true:
           the Vicuna/LLaMA2 heads carry fc.bias, the LLaMA3 heads say "bias": false)
  tensors  fc.weight [H, 2H], fc.bias [H] (exactly when bias is true), layers.0.{self_attn,mlp,
           post_attention_layernorm}.* (no input_layernorm), embed_tokens.weight [V, H] optional (else the
           target's is shared); no final norm and no lm_head (the target's is used)
The head's H must be the target's hidden size: fc reads the target's state next to an H-wide embedding.
Anything else in the file is refused rather than ignored (a dropped fc.bias would mis-draft silently).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specserve.server.models.config import ModelConfig
from specserve.server.models.linear import pack_linears
from specserve.server.models.loader import load_layer_weights, load_tensors
from specserve.speculators.eagle1_head import Eagle1Head, Eagle1Spec
from specserve.speculators.eagle3_loader import copy_tensor, layer_config, shared_embedding

_LAYER_PREFIX = "layers.0."


def parse_eagle1_config(raw: dict, target_cfg: ModelConfig) -> Eagle1Spec:
    if "speculators_model_type" in raw or raw.get("eagle_config") or "draft_vocab_size" in raw:
        raise ValueError("this is an EAGLE-3 head config (speculators_model_type / eagle_config / "
                         "draft_vocab_size); serve it with --eagle3 DIR as method 'eagle3'")
    cfg = layer_config(raw, "EAGLE-1 config", kind="EAGLE-1")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"EAGLE-1 head was built for a vocabulary of {cfg.vocab_size} tokens, the target has "
                         f"{target_cfg.vocab_size}")
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"EAGLE-1 head hidden size {cfg.hidden_size} differs from the target's "
                         f"{target_cfg.hidden_size} (fc reads the target's state as is)")
    bias = raw.get("bias", True)
    if not isinstance(bias, bool):
        raise ValueError(f"EAGLE-1 config \"bias\" must be true or false, got {bias!r}")
    return Eagle1Spec(layer_cfg=cfg, target_vocab_size=target_cfg.vocab_size, fc_bias=bias)


def load_eagle1_head(head_dir: str | Path, target_cfg: ModelConfig, target_embedding: nn.Embedding,
                     target_lm_head: nn.Module, dtype: torch.dtype, device: torch.device | str) -> Eagle1Head:
    """Build and fill the head; the target's lm_head (and embedding, when the file has none) are shared."""
    with open(Path(head_dir) / "config.json", encoding="utf-8") as f:
        spec = parse_eagle1_config(json.load(f), target_cfg)
    tensors = load_tensors(head_dir, lambda name: True)
    with torch.device("meta"):
        head = Eagle1Head(spec)
    head = head.to_empty(device=device).to(dtype)
    layer_tensors = {n[len(_LAYER_PREFIX):]: t for n, t in tensors.items() if n.startswith(_LAYER_PREFIX)}
    if not layer_tensors:
        raise ValueError(f"{head_dir}: no {_LAYER_PREFIX}* tensors for an EAGLE-1 head")
    unused = load_layer_weights(head.layers[0], spec.layer_cfg, layer_tensors)
    if unused:
        raise ValueError(f"{head_dir}: unexpected EAGLE-1 layer tensors {unused[:5]} (layer 0 of an EAGLE-1 "
                         "head has no input_layernorm)")
    top = ["fc.weight"] + (["fc.bias"] if spec.fc_bias else [])
    with torch.no_grad():
        for name in top:
            if name not in tensors:
                why = " (config \"bias\" is true or missing, which means true)" if name == "fc.bias" else ""
                raise ValueError(f"{head_dir}: EAGLE-1 head lacks {name}{why}")
            copy_tensor(head.get_parameter(name), tensors[name], name)
    if not spec.fc_bias and "fc.bias" in tensors:
        raise ValueError(f"{head_dir}: the file has fc.bias but its config says \"bias\": false")
    extra = sorted(set(tensors) - {_LAYER_PREFIX + n for n in layer_tensors} - {*top, "embed_tokens.weight"})
    if extra:
        raise ValueError(f"{head_dir}: unsupported EAGLE-1 tensors {extra[:5]} (an EAGLE-1 head has no final "
                         "norm, no lm_head and one layer)")
    head.embed_tokens = shared_embedding(tensors, spec, target_embedding, head_dir, dtype, device)
    pack_linears(head)          # before the target's lm_head joins: that one is packed already
    head.lm_head = target_lm_head
    return head.eval()
