"""Load an EAGLE-3 head from a local directory in either public layout (docs/formats.md §1a, §1b).

  layout        detected by                       config                                  layer tensors
  eagle         no `speculators_model_type`       flat Llama-style dict; taps in           midlayer.*
                                                  eagle_config.eagle_aux_hidden_state_
                                                  layer_ids, else (2, L//2, L-3)
  speculators   `speculators_model_type: eagle3`  nested `transformer_layer_config`;       layers.0.*
                                                  top-level eagle_aux_hidden_state_layer_
                                                  ids (null = default), norm_before_residual
Both: fc.weight [H, 3*Ht], norm.weight, lm_head.weight [Vd, H], d2t int64 [Vd] (when Vd != V; an
offset table), t2d (training only, ignored), embed_tokens.weight only if the head ships one (else the
target's embedding is shared; it must then be H wide).

Defaults where the layouts are silent: `norm_before_residual` False (the speculators library's default;
vLLM's adapter assumes True when the key is missing, but the library always writes it); RoPE base
10000 when the head config has no rope_theta (what EAGLE's own code does). Taps are concatenated in
ascending layer order, as both EAGLE and vLLM collect them while iterating the target's layers.
EAGLE-3.1 and the speculators library's variants are driven by top-level config booleans in either
layout (docs/formats.md §1d): `fc_norm` (tensors fc_norm.{k}.weight [Ht], one per tap), `norm_before_fc`
(input_norm.weight [3 Ht], one norm over the concatenation; the two are exclusive) and `norm_output`
(no tensor). Features we do not implement (multi-layer heads, use_aux_hidden_state False) are refused with a
clear error rather than silently mis-drafted; EAGLE-1 heads load as method `eagle` (eagle1_loader.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specserve.server.models.config import ModelConfig
from specserve.server.models.linear import pack_linears
from specserve.server.models.loader import load_layer_weights, load_tensors
from specserve.speculators.eagle3_head import Eagle3Head, Eagle3Spec

_ARCH_BY_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}
_LAYER_PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}
_NORM_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")


def _top_tensors(spec: Eagle3Spec) -> list[str]:
    """The non-layer tensors a head of this spec must have (the norm variants add theirs)."""
    names = ["fc.weight", "norm.weight", "lm_head.weight"]
    if spec.norm_before_fc:
        names.append("input_norm.weight")
    if spec.fc_norm:
        names += [f"fc_norm.{k}.weight" for k in range(len(spec.aux_layer_ids))]
    return names


def default_taps(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's hard-coded taps. Example: 32 layers -> (2, 16, 29)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def parse_eagle3_config(raw: dict, target_cfg: ModelConfig) -> Eagle3Spec:
    if "speculators_model_type" in raw:
        return _parse_speculators(raw, target_cfg)
    return _parse_eagle(raw, target_cfg)


def layer_config(layer: dict, source: str, kind: str = "EAGLE-3") -> ModelConfig:
    """The head's one decoder layer as a ModelConfig (shared by the EAGLE-1 loader)."""
    layers = int(layer.get("num_hidden_layers", 1))
    if layers != 1:
        raise ValueError(f"{source}: {kind} heads with {layers} decoder layers are not supported (only 1)")
    model_type = layer.get("model_type", "llama")
    if model_type not in _ARCH_BY_TYPE:
        raise ValueError(f"{source}: {kind} head model_type {model_type!r} is not supported")
    # The head's own architecture name (e.g. LlamaForCausalLMEagle3) is not a target family: the layer is
    # built from the model_type's family flags.
    return ModelConfig.from_dict({**layer, "architectures": [_ARCH_BY_TYPE[model_type]]})


def _parse_eagle(raw: dict, target_cfg: ModelConfig) -> Eagle3Spec:
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError("EAGLE-3 head with use_aux_hidden_state=false is not supported; an EAGLE-1 head "
                         "(fc.weight [H, 2H], layers.0.*) loads with --eagle DIR as method 'eagle'")
    cfg = layer_config(raw, "EAGLE-3 config")
    taps = eagle.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
    return _spec(cfg, raw, target_cfg, taps, bool(raw.get("norm_before_residual", False)), "eagle")


def _parse_speculators(raw: dict, target_cfg: ModelConfig) -> Eagle3Spec:
    kind = raw["speculators_model_type"]
    if kind != "eagle3":
        raise ValueError(f"speculators_model_type {kind!r} is not supported here (expected 'eagle3')")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        # a malformed file, not a type error in our code: users get it as a startup ValueError
        raise ValueError("speculators EAGLE-3 config lacks a transformer_layer_config object")  # noqa: TRY004
    cfg = layer_config(layer, "speculators transformer_layer_config")
    return _spec(cfg, raw, target_cfg, raw.get("eagle_aux_hidden_state_layer_ids"),
                 bool(raw.get("norm_before_residual", False)), "speculators")


def _spec(cfg: ModelConfig, raw: dict, target_cfg: ModelConfig, taps, norm_before_residual: bool,
          layout: str) -> Eagle3Spec:
    num_layers = target_cfg.num_hidden_layers
    taps = tuple(sorted(int(i) for i in taps)) if taps else default_taps(num_layers)
    bad = [i for i in taps if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"EAGLE-3 head taps target layers {list(taps)}, but the target has {num_layers} layers")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"EAGLE-3 head was built for a vocabulary of {cfg.vocab_size} tokens, the target has "
                         f"{target_cfg.vocab_size}")
    target_hidden = int(raw.get("target_hidden_size") or cfg.hidden_size)
    if target_hidden != target_cfg.hidden_size:
        raise ValueError(f"EAGLE-3 head expects target hidden size {target_hidden}, the target has "
                         f"{target_cfg.hidden_size}")
    flags = {name: bool(raw.get(name, False)) for name in _NORM_FLAGS}
    if flags["fc_norm"] and flags["norm_before_fc"]:
        raise ValueError("EAGLE-3 config sets both fc_norm and norm_before_fc; they are exclusive (a norm per "
                         "tap, or one over the concatenation)")
    return Eagle3Spec(layer_cfg=cfg, target_hidden_size=target_hidden, target_vocab_size=target_cfg.vocab_size,
                      draft_vocab_size=int(raw.get("draft_vocab_size") or cfg.vocab_size), aux_layer_ids=taps,
                      norm_before_residual=norm_before_residual, layout=layout, **flags)


def load_eagle3_head(head_dir: str | Path, target_cfg: ModelConfig, target_embedding: nn.Embedding,
                     dtype: torch.dtype, device: torch.device | str) -> Eagle3Head:
    """Build and fill the head. `target_embedding` is shared when the head file has no embed_tokens."""
    with open(Path(head_dir) / "config.json", encoding="utf-8") as f:
        spec = parse_eagle3_config(json.load(f), target_cfg)
    tensors = load_tensors(head_dir, lambda name: True)
    with torch.device("meta"):
        head = Eagle3Head(spec)
    head = head.to_empty(device=device).to(dtype)
    prefix = _LAYER_PREFIX[spec.layout]
    layer_tensors = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
    if not layer_tensors:
        raise ValueError(f"{head_dir}: no {prefix}* tensors for a {spec.layout}-layout EAGLE-3 head")
    unused = load_layer_weights(head.midlayer, spec.layer_cfg, layer_tensors)
    if unused:
        raise ValueError(f"{head_dir}: unexpected EAGLE-3 layer tensors {unused[:5]}")
    top = _top_tensors(spec)
    with torch.no_grad():
        for name in top:
            if name not in tensors:
                raise ValueError(f"{head_dir}: EAGLE-3 head lacks {name}")
            copy_tensor(head.get_parameter(name), tensors[name], name)
    head.embed_tokens = shared_embedding(tensors, spec, target_embedding, head_dir, dtype, device)
    head.target_ids = _target_ids(tensors, spec, head_dir, device)
    extra = sorted(set(tensors) - {prefix + n for n in layer_tensors}
                   - {*top, "embed_tokens.weight", "d2t", "t2d"})
    if extra:
        raise ValueError(f"{head_dir}: unsupported EAGLE-3 tensors {extra[:5]} (e.g. a multi-layer head, or a "
                         "norm its config does not declare: fc_norm / norm_before_fc)")
    pack_linears(head)          # CPU fp32: weights final, pack them once (server/models/linear.py)
    return head.eval()


def copy_tensor(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"EAGLE-3 tensor {name}: shape {tuple(src.shape)} does not fit {tuple(dest.shape)}")
    dest.copy_(src)


def shared_embedding(tensors: dict, spec: Eagle3Spec, target_embedding: nn.Embedding, head_dir, dtype, device
               ) -> nn.Embedding:
    hidden = spec.layer_cfg.hidden_size
    own = tensors.get("embed_tokens.weight")
    if own is None:
        if target_embedding.weight.shape[1] != hidden:
            raise ValueError(f"{head_dir}: the head has no embed_tokens and its hidden size {hidden} differs "
                             f"from the target's embedding width {target_embedding.weight.shape[1]}")
        return target_embedding
    if tuple(own.shape) != (spec.target_vocab_size, hidden):
        raise ValueError(f"{head_dir}: embed_tokens shape {tuple(own.shape)}, expected "
                         f"{(spec.target_vocab_size, hidden)}")
    return nn.Embedding.from_pretrained(own.to(device=device, dtype=dtype), freeze=True)


def _target_ids(tensors: dict, spec: Eagle3Spec, head_dir, device) -> torch.Tensor | None:
    """[Vd] int64 target id of every draft id (d2t is an offset), None when the vocabularies coincide."""
    d2t = tensors.get("d2t")
    vd, v = spec.draft_vocab_size, spec.target_vocab_size
    if d2t is None:
        if vd != v:
            raise ValueError(f"{head_dir}: draft vocabulary {vd} != target {v} but no d2t table")
        return None
    if tuple(d2t.shape) != (vd,):
        raise ValueError(f"{head_dir}: d2t shape {tuple(d2t.shape)}, expected ({vd},)")
    ids = torch.arange(vd, dtype=torch.long) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= v or ids.unique().numel() != vd:
        raise ValueError(f"{head_dir}: d2t maps draft ids outside [0, {v}) or onto the same target id twice")
    return ids.to(device)
