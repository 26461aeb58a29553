"""ModelRunner: turns a scheduled step into ONE varlen target forward and returns the logits rows.

For every scheduled request the query is all_token_ids[num_computed:num_computed+num_new] followed by
its drafts, i.e. a prefill chunk, [last_token] (plain decode), or [last_token, d_1..d_k] (verify).
Logits are computed only for rows that are sampled: the last 1 + k rows of a request that reaches the
end of its known tokens (all rows of the chunk when prompt logprobs were asked).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specserve.server.engine.scheduler import ScheduledSeq
from specserve.server.kv.kv_cache import allocate_kv_cache, cache_dtype
from specserve.server.models.attention import AttentionMetadata, build_attention_metadata


@dataclass
class StepBatch:
    input_ids: torch.Tensor          # [num_tokens] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor     # [num_rows] int64, indices into the token dimension
    row_starts: list[int]            # per seq: first logits row (or -1 when the seq does not sample)
    num_rows: list[int]              # per seq: logits rows (k_i + 1 sampled rows, + prompt rows)
    num_prompt_rows: list[int]       # per seq: leading rows used only for prompt logprobs
    token_offsets: list[int]         # per seq: first row of its query in the token dimension
    query_lens: list[int]            # per seq: known tokens + drafts


@dataclass
class StepResult:
    logits: torch.Tensor             # [num_rows, vocab] float32
    aux_hidden: list[torch.Tensor]   # per aux layer [num_tokens, hidden] (EAGLE-3), empty otherwise
    hidden: torch.Tensor             # [num_tokens, hidden] final-normed
    prenorm_hidden: torch.Tensor     # [num_tokens, hidden] before the final norm (MTP variants)
    batch: StepBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cfg, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.kv_caches = allocate_kv_cache(cfg, num_blocks, block_size, cache_dtype(dtype, device), device)
        self.aux_layer_ids: tuple[int, ...] = ()    # set by the EAGLE-3 speculator when loaded

    def prepare(self, seqs: list[ScheduledSeq], drafts: list[list[int]]) -> StepBatch:
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        row_starts: list[int] = []
        num_rows: list[int] = []
        num_prompt_rows: list[int] = []
        offsets: list[int] = []
        for seq, draft in zip(seqs, drafts):
            req = seq.request
            start = req.num_computed_tokens
            known = req.token_slice(start, start + seq.num_new_tokens)
            q = len(known) + len(draft)
            offset = len(input_ids)
            offsets.append(offset)
            input_ids.extend(known)
            input_ids.extend(draft)
            query_lens.append(q)
            seq_lens.append(start + q)
            n_prompt = 0
            if req.needs_prompt_logprobs and start < req.num_prompt_tokens:
                n_prompt = len(known) - (1 if seq.samples else 0)
            n_sample = 1 + len(draft) if seq.samples else 0
            if n_prompt + n_sample:
                row_starts.append(len(logits_idx))
                first = offset + q - n_sample - n_prompt
                logits_idx.extend(range(first, offset + q))
            else:
                row_starts.append(-1)
            num_rows.append(n_prompt + n_sample)
            num_prompt_rows.append(n_prompt)
        attn = build_attention_metadata(query_lens, seq_lens, [s.request.block_ids for s in seqs],
                                        self.block_size, self.device)
        return StepBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            attn=attn,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=self.device),
            row_starts=row_starts, num_rows=num_rows, num_prompt_rows=num_prompt_rows,
            token_offsets=offsets, query_lens=query_lens)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        out = self.model.forward_states(batch.input_ids, batch.attn, self.kv_caches, self.aux_layer_ids)
        logits = self.model.compute_logits(out.hidden[batch.logits_indices])   # [num_rows, vocab] fp32
        return StepResult(logits=logits, aux_hidden=out.aux_hidden, hidden=out.hidden,
                          prenorm_hidden=out.prenorm_hidden, batch=batch)

    def close(self) -> None:
        """Release what the runner started (tensor-parallel ranks: tp_runner.TPModelRunner); nothing here."""

    @torch.inference_mode()
    def time_verify_step(self, num_seqs: int, query_len: int, context_len: int, reps: int = 3) -> float:
        """Seconds of one forward (+ logits of every row) verifying `query_len` tokens for each of
        `num_seqs` sequences with `context_len` tokens before them.

        Start-up calibration only: it writes K/V into the first blocks of the cache, so it must run
        before any request owns a block (the values are never read by anyone afterwards: a block is
        always written by its owner before it is attended to, and no prefix hash points at these).
        """
        blocks_per_seq = -(-(context_len + query_len) // self.block_size)
        num_blocks = self.kv_caches[0][0].shape[0]
        if num_seqs * blocks_per_seq > num_blocks:
            raise ValueError(f"{num_seqs} x {context_len + query_len} tokens need {num_seqs * blocks_per_seq} "
                             f"KV blocks, the cache has {num_blocks}")
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
        attn = build_attention_metadata([query_len] * num_seqs, [context_len + query_len] * num_seqs,
                                        tables, self.block_size, self.device)
        input_ids = torch.zeros(num_seqs * query_len, dtype=torch.long, device=self.device)

        def once() -> None:
            out = self.model.forward_states(input_ids, attn, self.kv_caches, self.aux_layer_ids)
            self.model.compute_logits(out.hidden).argmax(dim=-1).tolist()   # the host copy syncs CUDA too

        once()
        start = time.perf_counter()
        for _ in range(reps):
            once()
        return (time.perf_counter() - start) / reps
