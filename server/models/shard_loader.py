"""One tensor-parallel rank's shard: its config, and its weights read slice by slice from the safetensors files.

Which part of each checkpoint tensor rank r of T holds (H heads, KV heads, d = head_dim, I, V):

    q_proj          rows of heads [r H/T, (r+1) H/T)                     (bias the same rows)
    k_proj, v_proj  rows of KV heads [r KV/T, ...), or, when KV < T, the one KV head r KV // T that this
                    rank's query heads read (KV heads are then replicated T / KV times)
    o_proj          columns of this rank's heads; bias on rank 0 only (zeros elsewhere)
    gate/up_proj    rows [r I/T, (r+1) I/T);  down_proj: those columns, bias on rank 0 only
    embed, lm_head  vocabulary rows [r ceil(V/T), ...), the last slice zero-padded
    norms           whole (replicated)

`safe_open(...).get_slice(name)[rows]` reads only those bytes, so no rank ever holds a full matrix.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specserve.server.models.config import ModelConfig
from specserve.server.models.linear import pack_linears
from specserve.server.models.llama import LlamaForCausalLM
from specserve.server.models.loader import (
    _fill,
    _part_rows,
    build_random_model,
    load_tensors,
    main_model_name,
    weight_files,
)
from specserve.server.models.parallel_layers import ShardedLlamaForCausalLM, TPGroup, shard_layers

_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def check_shardable(cfg: ModelConfig, world_size: int) -> None:
    """ValueError (a start-up error) when the model does not split over `world_size` ranks."""
    problems = []
    if cfg.num_attention_heads % world_size:
        problems.append(f"num_attention_heads {cfg.num_attention_heads}")
    kv = cfg.num_key_value_heads
    if kv % world_size and world_size % kv:
        problems.append(f"num_key_value_heads {kv} (neither a multiple nor a divisor of it)")
    if cfg.intermediate_size % world_size:
        problems.append(f"intermediate_size {cfg.intermediate_size}")
    if problems:
        raise ValueError(f"--tensor-parallel-size {world_size} does not divide the model's "
                         f"{', '.join(problems)}")


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The config one rank's modules are built from (the same on every rank)."""
    check_shardable(cfg, world_size)
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // world_size,
        num_key_value_heads=max(1, cfg.num_key_value_heads // world_size),
        intermediate_size=cfg.intermediate_size // world_size,
        vocab_size=-(-cfg.vocab_size // world_size))


def _rows(name: str, cfg: ModelConfig, local: ModelConfig, rank: int, world_size: int) -> tuple[int, int] | None:
    """(start, length) along the split dimension of a checkpoint tensor; None = replicated."""
    d = cfg.head_dim
    if ".q_proj." in name:
        return rank * local.num_attention_heads * d, local.num_attention_heads * d
    if ".k_proj." in name or ".v_proj." in name:
        first_kv = rank * cfg.num_key_value_heads // world_size
        return first_kv * d, local.num_key_value_heads * d
    if ".o_proj." in name:
        return rank * local.num_attention_heads * d, local.num_attention_heads * d
    if any(f".{p}." in name for p in ("gate_proj", "up_proj", "down_proj")):
        return rank * local.intermediate_size, local.intermediate_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return rank * local.vocab_size, local.vocab_size
    return None


def shard_tensor(name: str, view: Any, cfg: ModelConfig, local: ModelConfig, rank: int,
                 world_size: int) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`; `view` is a safetensors slice or a tensor (both index)."""
    rows = _rows(name, cfg, local, rank, world_size)
    row_parallel = any(f".{p}." in f".{name}" for p in _ROW_PARALLEL)
    if rows is None:
        return view[:]
    start, length = rows
    if row_parallel and name.endswith(".bias"):          # added once, after the all-reduce
        full = view[:]
        return full if rank == 0 else torch.zeros_like(full)
    if row_parallel:                                     # input columns
        return view[:, start:start + length]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        part = view[start:min(start + length, cfg.vocab_size)]
        pad = length - part.shape[0]
        return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part
    return view[start:start + length]


def _checkpoint_shards(model_dir: str | Path, cfg: ModelConfig, local: ModelConfig, rank: int,
                       world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if main_model_name(name, cfg) is not None:
                    yield name, shard_tensor(name, f.get_slice(name), cfg, local, rank, world_size)


def hf_tensors(model: LlamaForCausalLM, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A built model's parameters under the checkpoint's names (fused qkv / gate_up split back into parts)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        parent, _, own = module.rpartition(".")
        if own in fused:
            parts = param.detach().split(_part_rows(cfg, name))
            for part_name, part in zip(fused[own], parts):
                out[f"{parent}.{part_name}.{leaf}"] = part
        else:
            out[name] = param.detach()
    return out


def load_sharded_model(model_dir: str | Path | None, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                       device: torch.device | str, seed: int = 0) -> ShardedLlamaForCausalLM:
    """Rank tp.rank's shard, from the checkpoint (model_dir) or, with None, from the seeded random model that
    build_random_model(cfg, seed) makes (each rank rebuilds it and keeps its part: tests and the stand-in)."""
    local = shard_config(cfg, tp.world_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(local)
    model = model.to_empty(device=device).to(dtype)
    if local.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    sharded = shard_layers(model, cfg, tp)
    if model_dir is None:
        full = hf_tensors(build_random_model(cfg, seed=seed), cfg)
        tensors: Iterator[tuple[str, torch.Tensor]] = (
            (n, shard_tensor(n, t, cfg, local, tp.rank, tp.world_size)) for n, t in full.items())
        replicas = _memory_replicas(full, cfg) if tp.rank == 0 else None
    else:
        tensors = _checkpoint_shards(model_dir, cfg, local, tp.rank, tp.world_size)
        replicas = _checkpoint_replicas(model_dir, cfg) if tp.rank == 0 else None
    _fill(sharded, local, _renamed(tensors), f"rank {tp.rank}'s shard")
    pack_linears(sharded)
    sharded.replicas = replicas
    return sharded.eval()


def _renamed(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:        # the sharded head is registered as lm_head_shard
        yield ("lm_head_shard.weight" if name == "lm_head.weight" else name), tensor


def _replica_name(which: str, cfg: ModelConfig) -> str:
    return "lm_head.weight" if which == "lm_head" and not cfg.tie_word_embeddings else "model.embed_tokens.weight"


def _checkpoint_replicas(model_dir: str | Path, cfg: ModelConfig) -> Callable[[str], torch.Tensor]:
    def read(which: str) -> torch.Tensor:
        name = _replica_name(which, cfg)
        return load_tensors(model_dir, lambda n: n == name)[name]
    return read


def _memory_replicas(full: dict[str, torch.Tensor], cfg: ModelConfig) -> Callable[[str], torch.Tensor]:
    kept = {n: full[n] for n in {_replica_name("embed", cfg), _replica_name("lm_head", cfg)}}
    return lambda which: kept[_replica_name(which, cfg)]
