"""Draft-model speculator: a small Llama-family model proposes k tokens autoregressively.

The draft model has its own paged KV cache (speculators/draft_kv.py) and its own per-request counter.
Each engine step, for all requests that chose `draft`, batched:

  forward 1 (varlen): the tokens the draft has not seen yet -> first draft d_1 from the last row.
                      First time: the whole context (prompt + output). Afterwards: the accepted
                      drafts it did not write itself + the bonus/recovered token (usually 1-2 tokens).
  forward j = 2..k:   one row per request still drafting: d_{j-1} -> d_j.

A request with a draft tree (top_k > 1) grows it from forward 1's last row instead of forwards 2..k: one
forward per depth over every tree request's frontier (speculators/draft_model_tree.py); its rows are never
read as a chain's (num_confirmed = N, nothing speculative).

Rollback is a counter: KV of d_1..d_{k-1} is written during drafting; next step the draft compares
them with the tokens the target actually kept, and the matching prefix stays valid. The rest is
forgotten (overwritten later), nothing is copied.

Worked example, k = 3, context [a b c] (N = 3): forward 1 runs [a b c] at positions 0..2 -> d1;
forward 2 runs d1 at 3 -> d2; forward 3 runs d2 at 4 -> d3 (d3's KV is never written). The target
accepts d1 only and emits r: context [a b c d1 r]. Next step: KV at position 3 (d1) matches, position
4 (d2) does not -> valid = 4, forward 1 runs [r] at position 4.

Sampling: greedy requests get argmax drafts (draft_probs None); unseeded sampled ones get drafts drawn
from the draft model's own distribution at the request's temperature/top-k/top-p with those probs
returned, which keeps rejection sampling exact; seeded ones get coupled drafts (position-keyed Gumbel
noise), which keeps the seed's text (speculators/draft_sampling.py). A tree's children are drawn the same
ways (speculators/tree_children.py), each node with the probs it was drawn from.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.server.kv.kv_cache import kv_cache_bytes_per_block
from specserve.server.models.attention import AttentionMetadata
from specserve.server.models.config import ModelConfig, load_config
from specserve.server.models.latency_tuning import tune_for_latency
from specserve.server.models.llama import LlamaForCausalLM
from specserve.speculators.base import BuildContext, DraftProposal, DraftTree, SpecRequest, Speculator
from specserve.speculators.draft_kv import DraftKVCache, DraftSeq, mirror_target_blocks
from specserve.speculators.draft_model_tree import DraftModelTreeBuilder
from specserve.speculators.draft_sampling import append_drafts
from specserve.speculators.tree_shape import as_tree
from specserve.speculators.vocab import check_same_vocabulary


@dataclass
class _DraftState:
    kv: DraftSeq = field(default_factory=DraftSeq)
    num_confirmed: int = 0        # positions [0, num_confirmed) hold KV of the request's real tokens
    speculative: list[int] = field(default_factory=list)   # drafts with KV at num_confirmed.. (may be rejected)


@dataclass
class _Live:
    """A request drafting this step."""
    index: int                    # position in the propose() batch
    state: _DraftState
    request: object
    k: int
    tree: DraftTree | None = None                            # None: a chain
    tokens: list[int] = field(default_factory=list)          # drafts so far (a tree: its nodes)
    probs: list[torch.Tensor] = field(default_factory=list)  # [vocab] per random draft (a tree: per node)
    parents: list[int] | None = None                         # a tree's parents (draft_tree.best_nodes)


class DraftModelSpeculator(Speculator):
    name = "draft"
    drafts_trees = True                # speculators/draft_model_tree.py

    def __init__(self, model: LlamaForCausalLM, cache: DraftKVCache, target_vocab_size: int) -> None:
        self.model = model
        self.cache = cache
        self.target_vocab_size = target_vocab_size
        self.device = cache.device
        self._states: dict[str, _DraftState] = {}
        self.refusals: collections.Counter[str] = collections.Counter()   # reason -> count, drained per step
        self.trees = DraftModelTreeBuilder(self)

    @classmethod
    def build(cls, ctx: BuildContext) -> DraftModelSpeculator | None:
        if ctx.draft_dir is None or ctx.target is None:
            return None
        t = ctx.target
        return cls.load(ctx.draft_dir, t.cfg, ctx.tokenizer_dir, t.num_blocks, t.block_size, t.dtype, t.device)

    @classmethod
    def kv_bytes_per_block(cls, ctx: BuildContext) -> int:
        if ctx.draft_dir is None:
            return 0
        return kv_cache_bytes_per_block(load_config(ctx.draft_dir), ctx.block_size, ctx.kv_dtype)

    @classmethod
    def load(cls, draft_dir: str | Path, target_cfg: ModelConfig, target_tokenizer_dir: str | Path | None,
             target_num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
             ) -> DraftModelSpeculator:
        """Refuses (ValueError) a draft whose vocabulary differs from the target's, before loading weights."""
        from specserve.server.models.loader import load_model
        draft_cfg = load_config(draft_dir)
        check_same_vocabulary(target_tokenizer_dir, target_cfg.vocab_size, draft_dir, draft_cfg.vocab_size)
        model, cfg = load_model(draft_dir, dtype=dtype, device=device)
        tune_for_latency(model, "draft model")     # drafts need speed, not batch-invariant rows
        cache = mirror_target_blocks(target_num_blocks, block_size, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                     cfg.head_dim, dtype, device, f"draft model {Path(draft_dir).name}")
        return cls(model, cache, target_cfg.vocab_size)

    # -- Speculator interface -----------------------------------------------------------------------
    @staticmethod
    def validate(options: dict) -> None:
        if options:
            raise ValueError(f"draft speculation takes no options, got {sorted(options)}")

    @torch.inference_mode()
    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        live: list[_Live] = []
        first_tokens: list[list[int]] = []
        for i, (req, k) in enumerate(zip(requests, ks)):
            if k <= 0:
                continue
            state = self._state(req)
            valid = self._rollback(state, req)
            n = req.num_tokens
            tree = as_tree(req.spec_params.draft_tree)
            # KV for the unseen tokens and for d_1..d_{k-1} (positions [0, n + k - 1)), or for a tree's rows
            end = self.trees.kv_end(n, tree) if tree is not None else n + k - 1
            if not self.cache.reserve(state.kv, end):
                self.refusals["drafter_cache_full"] += 1   # (shared target prefixes): no drafts this step
                req.spec_stats.cut("drafter_cache_full")
                continue
            first_tokens.append(req.token_slice(valid, n))
            live.append(_Live(i, state, req, k, tree))
        if live:
            self._draft(live, first_tokens)
        token_ids: list[list[int]] = [[] for _ in requests]
        probs: list[torch.Tensor | None] = [None for _ in requests]
        parents: list[list[int] | None] = [None for _ in requests]
        for item in live:
            token_ids[item.index] = item.tokens
            parents[item.index] = item.parents
            if item.probs:
                probs[item.index] = torch.stack(item.probs)            # [k_i, vocab]
        return DraftProposal(token_ids, probs, parents)

    # observe: the default no-op; the draft model reads tokens, not target states (catch-up is in propose)

    def calibrate_trees(self, acceptance: float) -> None:
        self.trees.calibration.set_target(acceptance)

    def release(self, request: SpecRequest) -> None:
        state = self._states.pop(request.request_id, None)
        if state is not None:
            self.cache.free(state.kv)

    def drain_refusals(self) -> dict[str, int]:
        out = dict(self.refusals)
        self.refusals.clear()
        return out

    # -- internals ----------------------------------------------------------------------------------
    def _state(self, req) -> _DraftState:
        state = self._states.get(req.request_id)
        if state is None or state.num_confirmed > req.num_tokens:   # unseen, or recomputed from scratch
            if state is not None:
                self.cache.free(state.kv)
            state = self._states[req.request_id] = _DraftState()
        return state

    @staticmethod
    def _rollback(state: _DraftState, req) -> int:
        """Positions whose KV is still valid: the confirmed tokens plus the drafts the target kept.
        At least the last token is recomputed: its logits give d_1."""
        n = req.num_tokens
        written = state.speculative
        actual = req.token_slice(state.num_confirmed, min(state.num_confirmed + len(written), n))
        matched = 0
        while matched < len(actual) and actual[matched] == written[matched]:
            matched += 1
        return min(state.num_confirmed + matched, n - 1)

    def _draft(self, live: list[_Live], first_tokens: list[list[int]]) -> None:
        ends = [item.request.num_tokens for item in live]
        start = time.perf_counter()
        logits = self._forward([item.state for item in live], first_tokens, ends)   # [a, vocab]
        # a first forward over more than the usual 1-2 unseen tokens per request is mostly catch-up
        unseen = sum(len(t) for t in first_tokens)
        self.last_catch_up_rows = max(unseen - 2 * len(live), 0)
        self.last_catch_up_s = (time.perf_counter() - start) * self.last_catch_up_rows / max(unseen, 1)
        for item, end in zip(live, ends):
            item.state.num_confirmed = end
            item.state.speculative = []
        chains = [j for j, item in enumerate(live) if item.tree is None]
        trees = [j for j, item in enumerate(live) if item.tree is not None]
        if trees:
            self._grow([live[j] for j in trees], logits[trees])
        if chains:
            self._chain([live[j] for j in chains], logits[chains])

    def _grow(self, items: list[_Live], logits: torch.Tensor) -> None:
        """The tree requests' trees from forward 1's last rows (logits [a, vocab])."""
        start = time.perf_counter()
        for item, (tokens, parents, probs) in zip(items, self.trees.build(items, logits)):
            # probs [nodes, vocab]: per node the q it was drawn from (None: top-K children, greedy)
            item.tokens, item.parents, item.probs = tokens, parents, [] if probs is None else list(probs)
        self.trees.build_seconds += time.perf_counter() - start
        self.trees.num_built += len(items)
        self.trees.num_calls += 1

    def _chain(self, live: list[_Live], logits: torch.Tensor) -> None:
        """d_1 from forward 1's last rows (logits [a, vocab]), then forwards 2..k."""
        self._sample(live, logits)
        for j in range(1, max(item.k for item in live)):
            active = [item for item in live if item.k > j]
            # d_j goes in at position end + j - 1; its KV is speculative until the target keeps d_j
            for item in active:
                item.state.speculative.append(item.tokens[-1])
            logits = self._forward([item.state for item in active], [[item.tokens[-1]] for item in active],
                                   [item.request.num_tokens + j for item in active])
            self._sample(active, logits)

    def _forward(self, states: list[_DraftState], tokens: list[list[int]], ends: list[int]) -> torch.Tensor:
        """Sequence i computes `tokens[i]` ending at position ends[i] - 1 -> last-row logits [n, target vocab]."""
        query_lens = [len(t) for t in tokens]
        attn, _ = self.cache.metadata([s.kv for s in states], query_lens, ends)
        last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1                  # [n]
        return self.logits_of_rows([t for seq in tokens for t in seq], attn, last)

    def logits_of_rows(self, tokens: list[int], attn: AttentionMetadata,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """One draft forward of `tokens` ([num_tokens] ids laid out as `attn` says) -> logits [r, target vocab]
        of the token rows `rows` ([r] int64; None: every row)."""
        # Ids beyond the draft's embedding (a smaller padded vocab, same tokenizer) never come from a
        # trained target; clamp rather than crash if one does.
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).clamp_(max=self.model.config.vocab_size - 1)
        hidden = self.model.forward_states(ids, attn, self.cache.caches).hidden         # [num_tokens, H]
        logits = self.model.compute_logits(hidden if rows is None else hidden.index_select(0, rows))
        return _to_target_vocab(logits, self.target_vocab_size)                         # [r, target vocab]

    @staticmethod
    def _sample(items: list[_Live], logits: torch.Tensor) -> None:
        append_drafts(items, logits)


def _to_target_vocab(logits: torch.Tensor,  # [n, draft vocab] float32
                     vocab: int) -> torch.Tensor:
    """[n, vocab]: padding rows of a larger draft embedding dropped, missing ids at -inf (never drafted)."""
    if logits.shape[1] >= vocab:
        return logits[:, :vocab]
    pad = logits.new_full((logits.shape[0], vocab - logits.shape[1]), float("-inf"))
    return torch.cat([logits, pad], dim=1)
