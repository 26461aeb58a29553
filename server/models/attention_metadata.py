"""AttentionMetadata: everything the attention backends need about one step's varlen batch, built once.

The model runner calls specserve.server.models.attention.build_attention_metadata (which picks the backend);
this module holds the dataclasses and the per-backend precomputation, so no layer ever loops over
sequences to find slots, offsets or masks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

SHORT_QUERY_MAX = 16             # queries up to this length join the padded, batched SDPA call
FLASH_PAGED_BLOCK_MULTIPLE = 256  # upstream flash-attn 2 accepts paged KV only with such pages


@dataclass
class ShortGroup:
    """Sequences with query_len <= SHORT_QUERY_MAX, run as one padded batch of S sequences x Q queries.

    Padded query rows repeat the sequence's last real query (same position, same mask row), so no
    mask row is empty and no NaN can appear; their outputs are dropped.
    """
    num_seqs: int                       # S
    max_q: int                          # Q
    num_blocks: int                     # blocks gathered per sequence
    num_keys: int                       # L = num_blocks * block_size
    block_ids: torch.Tensor             # [S * num_blocks] int64 (padding block 0 is masked out)
    q_pos: torch.Tensor                 # [S, Q] int64 position of each padded query row
    token_index: torch.Tensor | None = None   # [S, Q] int64 token rows; None when tokens are already [S, Q]
    valid_src: torch.Tensor | None = None     # [num_valid] int64 rows of the flattened [S * Q] output to keep
    valid_dst: torch.Tensor | None = None     # [num_valid] int64 token rows they go to
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)  # see mask()
    seq_ids: tuple[int, ...] = ()             # the batch's sequence index of each of the S sequences
    # [S, Q, L] bool, keys each query row may see on top of causality (draft trees: its ancestors and the
    # context); None: plain causal. Set by server/models/tree_attention.restrict_rows.
    allowed: torch.Tensor | None = None

    def mask(self, group: int, rows: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (0 / -inf) [S, 1, rows * group, L] for queries padded to `rows` >= Q per
        sequence (extra rows repeat the last query) with query heads folded in as row i * group + g.

        Built by the first layer that asks and reused by the rest. Additive rather than boolean:
        SDPA would otherwise convert a boolean mask in every layer (slow for bf16 on CPU).
        """
        key = (group, rows, window, dtype)
        if key not in self.masks:
            q_pos = self.q_pos                                                    # [S, Q]
            if rows > self.max_q:
                q_pos = torch.cat([q_pos, q_pos[:, -1:].expand(-1, rows - self.max_q)], dim=1)
            key_pos = torch.arange(self.num_keys, device=q_pos.device)             # [L]
            allowed = _causal_mask(q_pos, key_pos, window)                        # [S, rows, L]
            if self.allowed is not None:
                extra = self.allowed                                              # [S, Q, L]
                if rows > self.max_q:
                    extra = torch.cat([extra, extra[:, -1:].expand(-1, rows - self.max_q, -1)], dim=1)
                allowed = allowed & extra
            if group > 1:
                allowed = allowed.repeat_interleave(group, dim=1)                 # [S, rows * group, L]
            self.masks[key] = _additive(allowed.unsqueeze(1), dtype)
        return self.masks[key]


@dataclass
class LongSeq:
    """One long query chunk (prefill), attended with its own SDPA call."""
    token_start: int
    token_end: int
    prefix_len: int                     # context tokens cached before this chunk
    kv_slots: torch.Tensor | None       # [seq_len] int64 slots of the whole context; None if prefix_len == 0
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)  # (window, dtype) -> [q, seq_len] additive

    def mask(self, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """None means plain causal over fresh K/V (no prefix, no window): SDPA's is_causal."""
        if self.prefix_len == 0 and window is None:
            return None
        if (window, dtype) not in self.masks:
            seq_len = self.prefix_len + self.token_end - self.token_start
            q_pos = torch.arange(self.prefix_len, seq_len, device=device)         # [q]
            allowed = _causal_mask(q_pos, torch.arange(seq_len, device=device), window)
            self.masks[(window, dtype)] = _additive(allowed, dtype)
        return self.masks[(window, dtype)]


@dataclass
class AttentionMetadata:
    """Built ONCE per forward by the model runner, shared (read-only apart from memoised masks) by all layers."""
    positions: torch.Tensor             # [num_tokens] int64
    slot_mapping: torch.Tensor          # [num_tokens] int64 flat slot block_id * block_size + offset
    query_start_loc: torch.Tensor       # [num_seqs + 1] int32 cumulative query lengths
    seq_lens: torch.Tensor              # [num_seqs] int32 context length including this step's tokens
    block_tables: torch.Tensor          # [num_seqs, max_blocks] int32 (rows padded with block 0)
    max_query_len: int
    max_seq_len: int
    block_size: int
    backend: str = "sdpa"               # "sdpa" | "paged" | "triton" | "flash"
    query_lens_cpu: tuple[int, ...] = ()
    seq_lens_cpu: tuple[int, ...] = ()
    # SDPA backend plan
    short_groups: list[ShortGroup] = field(default_factory=list)   # usually one; see _bucket_short
    long: list[LongSeq] = field(default_factory=list)
    # flash backend plan
    cu_seqlens_k: torch.Tensor | None = None    # [num_seqs + 1] int32
    flash_kv_slots: torch.Tensor | None = None  # [sum(seq_lens)] int64 when the cache is not FA-pageable

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def _causal_mask(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """q_pos: [..., q], key_pos: [L] -> [..., q, L] bool, True where key <= query (and inside the window).

    Example: q_pos [2, 3], window None, L = 4 -> [[T T T F], [T T T T]].
    Keys beyond seq_len never pass because every query position is < seq_len.
    """
    allowed = key_pos <= q_pos.unsqueeze(-1)
    if window is not None:
        allowed &= key_pos > q_pos.unsqueeze(-1) - window
    return allowed


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask -> 0 where allowed, -inf elsewhere. Every row keeps >= 1 allowed key, so no NaN."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _validate(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int) -> None:
    if not query_lens:
        raise ValueError("a step needs at least one sequence")
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    for i, (q, s, blocks) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if not 1 <= q <= s:
            raise ValueError(f"sequence {i}: need 1 <= query_len ({q}) <= seq_len ({s})")
        if len(blocks) * block_size < s:
            raise ValueError(f"sequence {i}: {len(blocks)} blocks of {block_size} cannot hold {s} tokens")


def build_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device, backend: str) -> AttentionMetadata:
    """Example: query_lens [3, 1], seq_lens [3, 6], block_size 4, block_tables [[7], [2, 5]] ->
    positions [0 1 2 5], slot_mapping [28 29 30 21], query_start_loc [0 3 4].

    Index arithmetic runs in numpy: dozens of tiny torch ops would cost more than the decode step's
    attention itself on CPU.
    """
    _validate(query_lens, seq_lens, block_tables, block_size)
    n = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)                              # [n]
    s_lens = np.asarray(seq_lens, dtype=np.int64)                                # [n]
    table = np.zeros((n, max(len(b) for b in block_tables)), dtype=np.int64)    # [n, max_blocks]
    for i, blocks in enumerate(block_tables):
        table[i, :len(blocks)] = blocks
    qsl = np.zeros(n + 1, dtype=np.int64)                                        # [n + 1]
    np.cumsum(q_lens, out=qsl[1:])
    seq_of_token = np.repeat(np.arange(n), q_lens)                               # [num_tokens]
    positions = np.arange(qsl[-1]) - qsl[seq_of_token] + (s_lens - q_lens)[seq_of_token]
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        positions=torch.from_numpy(positions), slot_mapping=torch.from_numpy(slots),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)), seq_lens=torch.from_numpy(s_lens.astype(np.int32)),
        block_tables=torch.from_numpy(table.astype(np.int32)),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size, backend=backend,
        query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens))
    if backend == "flash":
        _plan_flash(meta, table, s_lens)
    elif backend == "sdpa":
        _plan_sdpa(meta, table, q_lens, s_lens, qsl)
    elif backend not in ("paged", "triton"):   # the kernels read block_tables / seq_lens / query_start_loc as is
        raise ValueError(f"unknown attention backend {backend!r}")
    return _to_device(meta, torch.device(device))


def _plan_flash(meta: AttentionMetadata, table: np.ndarray, s_lens: np.ndarray) -> None:
    cu_k = np.zeros(len(s_lens) + 1, dtype=np.int64)                            # [n + 1]
    np.cumsum(s_lens, out=cu_k[1:])
    meta.cu_seqlens_k = torch.from_numpy(cu_k.astype(np.int32))
    if meta.block_size % FLASH_PAGED_BLOCK_MULTIPLE:
        seq_of_key = np.repeat(np.arange(len(s_lens)), s_lens)                   # [sum(seq_lens)]
        key_pos = np.arange(cu_k[-1]) - cu_k[seq_of_key]
        bs = meta.block_size
        meta.flash_kv_slots = torch.from_numpy(table[seq_of_key, key_pos // bs] * bs + key_pos % bs)


def _plan_sdpa(meta: AttentionMetadata, table: np.ndarray, q_lens: np.ndarray, s_lens: np.ndarray,
               qsl: np.ndarray) -> None:
    bs = meta.block_size
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q > SHORT_QUERY_MAX:
            pos = np.arange(s)
            slots = torch.from_numpy(table[i, pos // bs] * bs + pos % bs) if s > q else None
            meta.long.append(LongSeq(int(qsl[i]), int(qsl[i]) + q, s - q, slots))
    short_ids = [i for i, q in enumerate(meta.query_lens_cpu) if q <= SHORT_QUERY_MAX]
    blocks_needed = {i: -(-meta.seq_lens_cpu[i] // bs) for i in short_ids}
    groups = _bucket_short(short_ids, blocks_needed)
    for ids in groups:
        meta.short_groups.append(_short_group(ids, table, q_lens, s_lens, qsl, bs,
                                              covers_all=len(ids) == len(q_lens)))


def _bucket_short(short_ids: list[int], blocks_needed: dict[int, int]) -> list[list[int]]:
    """Split the short sequences so that padding every one to its group's longest context at most
    doubles the K/V gathered. Example (blocks): [7, 250, 7, 7] -> [[1, 0], [2, 3]]; equal lengths stay one group.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in sorted(short_ids, key=lambda j: -blocks_needed[j]):
        if current and blocks_needed[current[0]] * (len(current) + 1) > 2 * (real + blocks_needed[i]):
            groups.append(sorted(current))
            current, real = [], 0
        current.append(i)
        real += blocks_needed[i]
    if current:
        groups.append(sorted(current))
    return groups


def _short_group(ids: list[int], table: np.ndarray, q_lens: np.ndarray, s_lens: np.ndarray, qsl: np.ndarray,
                 bs: int, covers_all: bool) -> ShortGroup:
    idx = np.asarray(ids)
    ql, sl = q_lens[idx], s_lens[idx]                                            # [S]
    max_q = int(ql.max())
    num_blocks = -(-int(sl.max()) // bs)
    rows = np.minimum(np.arange(max_q)[None, :], (ql - 1)[:, None])            # [S, Q] padded rows repeat the last
    group = ShortGroup(num_seqs=len(ids), max_q=max_q, num_blocks=num_blocks, num_keys=num_blocks * bs,
                       block_ids=torch.from_numpy(table[idx, :num_blocks].reshape(-1)),
                       q_pos=torch.from_numpy((sl - ql)[:, None] + rows), seq_ids=tuple(ids))
    if not covers_all or int(ql.min()) != max_q:   # tokens are not already laid out as [S, Q]
        token_index = qsl[idx][:, None] + rows                                   # [S, Q]
        valid_src = np.flatnonzero(np.arange(max_q)[None, :] < ql[:, None])      # [num_valid] into [S * Q]
        group.token_index = torch.from_numpy(token_index)
        group.valid_src = torch.from_numpy(valid_src)
        group.valid_dst = torch.from_numpy(token_index.reshape(-1)[valid_src])
    return group


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if device.type == "cpu":
        return meta
    move = lambda t: None if t is None else t.to(device, non_blocking=True)
    for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "cu_seqlens_k", "flash_kv_slots"):
        setattr(meta, name, move(getattr(meta, name)))
    for group in meta.short_groups:
        for name in ("block_ids", "q_pos", "token_index", "valid_src", "valid_dst"):
            setattr(group, name, move(getattr(group, name)))
    for seq in meta.long:
        seq.kv_slots = move(seq.kv_slots)
    return meta
