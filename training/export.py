"""Write trained modules as Hugging Face checkpoints (config.json + model.safetensors + tokenizer files).

Target: a plain `LlamaForCausalLM` checkpoint plus one DeepSeek-V3-style MTP layer stored as
`model.layers.{L}.*` (L = num_hidden_layers), declared by `num_nextn_predict_layers: 1`. Plain transformers
loads the main model and drops the MTP tensors as unexpected keys. The MTP layer owns no embedding and no
head: it shares `model.embed_tokens.weight` and `lm_head.weight` (stated in config.json under `mtp`).

EAGLE-3 head: the original SafeAILab layout (`fc`, `midlayer.*`, `norm`, `lm_head`), architecture
`LlamaForCausalLMEagle3`, full draft vocabulary (so no d2t/t2d), no `embed_tokens` (taken from the target).

EAGLE-1 head: the SafeAILab layout (`fc.weight` [H, 2H], `fc.bias` when config `"bias"` is true,
`layers.0.{self_attn,mlp,post_attention_layernorm}.*`), a Llama config with `num_hidden_layers: 1`; no
`embed_tokens`, no final norm, no `lm_head` (the target's are used).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from training.common import TOKENIZER_DIR
from training.model import LlamaLM, LlamaSpec

MTP_CONVENTION = {
    "layout": "deepseek_v3",                   # model.layers.{num_hidden_layers}.{enorm,hnorm,eh_proj,...}
    "concat_order": "embedding_then_hidden",   # eh_proj(cat([enorm(embed(tok[i+1])), hnorm(h_i)]))
    "hidden_state": "post_final_norm",         # h_i = model.norm(last layer output), as vLLM's DeepSeek MTP
    "zero_embedding_at_position_0": True,      # embed row at position 0 is zeroed, as vLLM's DeepSeek MTP
    "shares_embedding": "model.embed_tokens.weight",
    "shares_head": "lm_head.weight",           # logits = lm_head(shared_head.norm(block(x)))
    "loss_weight": None,                       # filled in by the trainer
}


def hf_llama_config(spec: LlamaSpec, eos_token_id: int = 0) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,          # 4.x layout
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},   # 5.x layout
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "num_nextn_predict_layers": spec.num_nextn_predict_layers,
    }


def target_state_dict(model: LlamaLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Training names -> checkpoint names: main model as is, `mtp.X` -> `model.layers.{L}.X`."""
    L = model.spec.num_hidden_layers
    out = {}
    for name, t in model.state_dict().items():
        if model.spec.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.startswith("mtp."):
            name = f"model.layers.{L}." + name[len("mtp."):]
        out[name] = t.detach().to(dtype).contiguous()
    return out


def copy_tokenizer(out_dir: Path, tokenizer_dir: Path = TOKENIZER_DIR) -> None:
    for fn in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = Path(tokenizer_dir) / fn
        if src.exists():
            shutil.copyfile(src, Path(out_dir) / fn)


def write_json(path: Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def export_llama(
    model: LlamaLM,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    mtp_loss_weight: float | None = None,
    training_info: dict | None = None,
    tokenizer_dir: Path = TOKENIZER_DIR,
) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = hf_llama_config(model.spec)
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    if model.spec.num_nextn_predict_layers:
        cfg["mtp"] = dict(MTP_CONVENTION, loss_weight=mtp_loss_weight)
    if training_info:
        cfg["specserve_training"] = training_info
    write_json(out_dir / "config.json", cfg)
    write_json(out_dir / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0})
    save_file(target_state_dict(model, dtype), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(out_dir, tokenizer_dir)
    return out_dir


def draft_vocab_tables(draft_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """The public EAGLE-3 reduced-vocabulary tensors for ascending target ids `draft_ids` [Vd]:
    d2t [Vd] int64 OFFSETS (target id = draft id + d2t[draft id]) and t2d [V] bool (kept ids)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return {"d2t": (draft_ids - torch.arange(draft_ids.numel())).to(torch.int64), "t2d": t2d}


def draft_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] target id of every draft id: the inverse of draft_vocab_tables' offsets."""
    return torch.arange(d2t.numel()) + d2t.long()


def export_eagle3(
    head,
    target_spec: LlamaSpec,
    out_dir: Path,
    aux_layers: tuple[int, ...],
    dtype: torch.dtype = torch.bfloat16,
    training_info: dict | None = None,
    tokenizer_dir: Path = TOKENIZER_DIR,
) -> Path:
    """head: training.eagle3.Eagle3Head. Its frozen target embedding is not saved (loaders take the target's)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    s = head.spec
    cfg = hf_llama_config(s)
    cfg.update(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "num_hidden_layers": 1,
            "num_nextn_predict_layers": 0,
            "draft_vocab_size": head.draft_vocab_size,
            "target_hidden_size": target_spec.hidden_size,
            "torch_dtype": str(dtype).replace("torch.", ""),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True},
        }
    )
    del cfg["num_nextn_predict_layers"]
    if training_info:
        cfg["specserve_training"] = training_info
    write_json(out_dir / "config.json", cfg)
    sd = {
        k: v.detach().to(dtype).contiguous()
        for k, v in head.state_dict().items()
        if not k.startswith("embed_tokens") and k != "draft_ids"
    }
    if head.draft_ids is not None:
        sd.update(draft_vocab_tables(head.draft_ids.cpu(), s.vocab_size))
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(out_dir, tokenizer_dir)
    return out_dir


def export_eagle1(
    head,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    training_info: dict | None = None,
    tokenizer_dir: Path = TOKENIZER_DIR,
) -> Path:
    """head: training.eagle1.Eagle1Head. Its frozen embedding and the target's lm_head are not saved."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = hf_llama_config(head.spec)
    del cfg["num_nextn_predict_layers"]
    cfg.update({"num_hidden_layers": 1, "bias": bool(head.fc_bias), "torch_dtype": str(dtype).replace("torch.", "")})
    if training_info:
        cfg["specserve_training"] = training_info
    write_json(out_dir / "config.json", cfg)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()
          if not k.startswith(("embed_tokens", "lm_head"))}
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(out_dir, tokenizer_dir)
    return out_dir


def load_llama(ckpt_dir: Path, dtype: torch.dtype = torch.float32) -> LlamaLM:
    """Read a checkpoint written by export_llama back into the training module (MTP included if present)."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
    spec = LlamaSpec(**{k: cfg[k] for k in LlamaSpec.__dataclass_fields__ if k in cfg})
    model = LlamaLM(spec)
    L = spec.num_hidden_layers
    sd = {}
    for name, t in load_file(str(Path(ckpt_dir) / "model.safetensors")).items():
        if name.startswith(f"model.layers.{L}."):
            name = "mtp." + name[len(f"model.layers.{L}.") :]
        sd[name] = t.to(dtype)
    if spec.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd)
    return model.to(dtype)
