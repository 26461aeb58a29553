"""Load a target checkpoint's MTP layers (docs/formats.md §2 DeepSeek-V3, §3 MiMo).

Available when config.json has `num_nextn_predict_layers` > 0 (DeepSeek-V3 and MiMo both use that key).
The layout is detected from the tensor names:

  DeepSeek-V3  model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head.norm, [shared_head.head],
               [embed_tokens], input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}
  MiMo         model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm,
               input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}

The decoder block must be of the target's family (Llama/Qwen2 attention + gated MLP); DeepSeek-V3's
real MLA/MoE blocks fail here with the list of tensors we could not place.
Example: the embedded target (L = 4, one MTP layer) stores `model.layers.4.eh_proj.weight` [H, 2H].
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from specserve.server.models.config import ModelConfig
from specserve.server.models.linear import Linear, pack_linears
from specserve.server.models.loader import load_layer_weights, load_tensors
from specserve.speculators.mtp_head import DEEPSEEK_V3, MIMO, MtpHead, MtpLayout

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# per layout: checkpoint suffix -> MtpLayer parameter (everything else belongs to the decoder block)
_OWN = {
    "deepseek_v3": {"enorm.weight": "embed_norm.weight", "hnorm.weight": "hidden_norm.weight",
                    "eh_proj.weight": "proj.weight", "shared_head.norm.weight": "final_norm.weight"},
    "mimo": {"token_layernorm.weight": "embed_norm.weight", "hidden_layernorm.weight": "hidden_norm.weight",
             "input_proj.weight": "proj.weight", "final_layernorm.weight": "final_norm.weight"},
}
_OPTIONAL = {"embed_tokens.weight": "embed", "shared_head.head.weight": "head"}


def mtp_tensors(model_dir: str | Path, cfg: ModelConfig) -> tuple[MtpLayout, list[dict[str, torch.Tensor]]]:
    """(layout, per MTP layer its tensors by name relative to the layer prefix). Reads only MTP tensors."""
    L, n = cfg.num_hidden_layers, cfg.num_nextn_predict_layers

    def is_mtp(name: str) -> bool:
        match = _LAYER.match(name)
        return name.startswith("model.mtp_layers.") or (match is not None and int(match.group(1)) >= L)

    tensors = load_tensors(model_dir, is_mtp)
    if f"model.layers.{L}.eh_proj.weight" in tensors:
        layout, prefixes = DEEPSEEK_V3, [f"model.layers.{L + i}." for i in range(n)]
    elif "model.mtp_layers.0.input_proj.weight" in tensors:
        layout, prefixes = MIMO, [f"model.mtp_layers.{i}." for i in range(n)]
    else:
        raise ValueError(f"{model_dir}: num_nextn_predict_layers={n} but neither DeepSeek-V3 MTP tensors "
                         f"(model.layers.{L}.eh_proj.weight) nor MiMo ones (model.mtp_layers.0.input_proj.weight)")
    layers = [{k[len(p):]: t for k, t in tensors.items() if k.startswith(p)} for p in prefixes]
    empty = [p for p, d in zip(prefixes, layers) if not d]
    if empty:
        raise ValueError(f"{model_dir}: config declares {n} MTP layers but {empty} hold no tensors")
    return layout, layers


def load_mtp_head(model_dir: str | Path, cfg: ModelConfig, target_embedding: nn.Embedding, target_head: nn.Linear,
                  dtype: torch.dtype, device: torch.device | str) -> MtpHead:
    layout, layers = mtp_tensors(model_dir, cfg)
    with torch.device("meta"):
        head = MtpHead(cfg, len(layers), layout)
    head = head.to_empty(device=device).to(dtype)
    for i, (layer, tensors) in enumerate(zip(head.layers, layers)):
        own, block, optional = {}, {}, {}
        for name, t in tensors.items():
            if name in _OWN[layout.name]:
                own[_OWN[layout.name][name]] = t
            elif name in _OPTIONAL:
                optional[_OPTIONAL[name]] = t
            else:
                block[name] = t
        missing = sorted(set(_OWN[layout.name].values()) - set(own))
        if missing:
            raise ValueError(f"{model_dir}: MTP layer {i} ({layout.name}) lacks {missing}")
        with torch.no_grad():
            for name, t in own.items():
                dest = layer.get_parameter(name)
                if tuple(dest.shape) != tuple(t.shape):
                    raise ValueError(f"{model_dir}: MTP layer {i} {name} shape {tuple(t.shape)}, "
                                     f"expected {tuple(dest.shape)}")
                dest.copy_(t)
        unused = load_layer_weights(layer.block, cfg, block)
        if unused:
            raise ValueError(f"{model_dir}: MTP layer {i} has tensors we cannot place (not a {cfg.family} "
                             f"decoder block?): {unused[:5]}")
        head.embeds.append(_shared_or_own(optional.get("embed"), target_embedding, nn.Embedding, dtype, device))
        head.heads.append(_shared_or_own(optional.get("head"), target_head, Linear, dtype, device))
    pack_linears(head)          # CPU fp32: weights final, pack them once (server/models/linear.py)
    for module in head.heads:   # own heads are not submodules (plain list): pack them too
        if module is not target_head:
            pack_linears(module)
    return head.eval()


def _shared_or_own(tensor: torch.Tensor | None, target: nn.Module, kind: type, dtype, device) -> nn.Module:
    """The target's module unless the checkpoint's copy differs from it (then an own, frozen copy)."""
    if tensor is None:
        return target
    weight = tensor.to(device=device, dtype=dtype)
    if tuple(weight.shape) != tuple(target.weight.shape):
        raise ValueError(f"MTP {kind.__name__} shape {tuple(weight.shape)} does not match the target's "
                         f"{tuple(target.weight.shape)}")
    if torch.equal(weight, target.weight):
        return target                     # DeepSeek's "shares parameters": keep one copy in memory
    if kind is nn.Embedding:
        return nn.Embedding.from_pretrained(weight, freeze=True)
    module = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    module.weight = nn.Parameter(weight, requires_grad=False)
    return module
