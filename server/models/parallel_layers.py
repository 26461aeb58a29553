"""Megatron-style tensor-parallel layers for the Llama family, and the sharded causal LM built from them.

Each rank builds an ordinary LlamaForCausalLM from its *shard config* (shard_config: a rank's heads, KV heads,
intermediate rows and vocabulary rows), so every Linear already has the shape of its shard; four modules
then change class (same parameters, a collective added to forward):

    qkv_proj, gate_up_proj   column-parallel: plain Linear on this rank's output rows, no communication
    o_proj, down_proj        RowParallelLinear: partial sums over this rank's input columns, one all-reduce
    embed_tokens             VocabParallelEmbedding: rows of this rank's vocabulary slice, one all-reduce
    lm_head                  ParallelLMHead: logits of this rank's vocabulary slice, one all-gather

So a layer costs two all-reduces and a forward two more collectives; the residual stream, the norms and
RoPE stay replicated (every rank holds the full [num_tokens, hidden] stream, so the hidden states a
speculator reads on rank 0 are the unsharded ones). A row-parallel bias is held by rank 0 only (zeros
elsewhere), so the all-reduce adds it once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specserve.server.models.config import ModelConfig
from specserve.server.models.linear import Linear
from specserve.server.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group; `group` is the process group of the collectives
    (NCCL on CUDA, gloo on CPU; None = the default group)."""
    rank: int
    world_size: int
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[n, m] on every rank -> [n, world_size * m], rank order along the last dimension."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class RowParallelLinear(Linear):
    """y = all_reduce(x_shard @ W[:, shard].T) (+ bias, held by rank 0 only)."""
    tp: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the table; other ids give 0 here and their
    row on the rank that holds it, so one all-reduce completes every lookup."""
    tp: TPGroup
    vocab_start: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start                            # [num_tokens]
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, 0), self.weight)   # [num_tokens, hidden]
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(Linear):
    """Logits of this rank's vocabulary rows, gathered: [n, hidden] -> [n, vocab_size]. The last rank's slice
    is padded with zero rows when the vocabulary does not divide; the padding is cut after the gather."""
    tp: TPGroup
    vocab_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(super().forward(x))[:, :self.vocab_size]


def _become(module: nn.Module, cls: type, **attrs: object) -> None:
    """Give an already-built module the parallel class of the same shape (parameters stay as they are)."""
    module.__class__ = cls
    for name, value in attrs.items():
        setattr(module, name, value)


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    """One rank's shard of a Llama-family model. forward/compute_logits are collective: every rank of the
    group must run them with the same inputs (server/engine/tp_runner.py arranges it).

    Speculators on rank 0 that share the target's embedding or lm_head (EAGLE-3, MTP) call them alone, so
    they get full, unsharded copies instead (`embed_tokens`, `lm_head`), built on first use from the
    checkpoint by `replicas` ("embed" | "lm_head" -> full weight); the sharded ones stay in `model` and
    `lm_head_shard`.
    """

    full_config: ModelConfig
    tp: TPGroup
    replicas: Callable[[str], torch.Tensor] | None = None

    @property
    def embed_tokens(self) -> nn.Embedding:
        full = self.__dict__.get("_full_embed")
        if full is None:
            weight = self._replica("embed")
            full = self.__dict__["_full_embed"] = nn.Embedding.from_pretrained(weight, freeze=True)
        return full

    @property
    def lm_head(self) -> Linear:
        full = self.__dict__.get("_full_lm_head")
        if full is None:
            weight = self._replica("lm_head")
            full = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            full.weight = nn.Parameter(weight, requires_grad=False)
            full.pack()
            self.__dict__["_full_lm_head"] = full
        return full

    def _replica(self, which: str) -> torch.Tensor:
        if self.replicas is None:
            raise RuntimeError(f"no unsharded {which} on tensor-parallel rank {self.tp.rank}")
        weight = self.model.embed_tokens.weight
        return self.replicas(which).to(dtype=weight.dtype, device=weight.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> [n, vocab] float32, gathered from every rank's vocabulary slice."""
        return self._modules["lm_head_shard"](hidden).float()


def shard_layers(model: LlamaForCausalLM, full: ModelConfig, tp: TPGroup) -> ShardedLlamaForCausalLM:
    """Turn a model built from shard_config(full, ...) into the rank's ShardedLlamaForCausalLM (in place)."""
    vocab_rows = model.model.embed_tokens.num_embeddings
    for layer in model.model.layers:
        _become(layer.self_attn.o_proj, RowParallelLinear, tp=tp)
        _become(layer.mlp.down_proj, RowParallelLinear, tp=tp)
    _become(model.model.embed_tokens, VocabParallelEmbedding, tp=tp, vocab_start=tp.rank * vocab_rows)
    head = model._modules.pop("lm_head")
    _become(head, ParallelLMHead, tp=tp, vocab_size=full.vocab_size)
    model.__class__ = ShardedLlamaForCausalLM
    model.add_module("lm_head_shard", head)
    model.full_config, model.tp = full, tp
    return model
