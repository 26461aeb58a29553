"""HiddenStateDrafter: the shared machinery of heads fed by the target's hidden states (EAGLE-3, MTP).

A head has n >= 1 layers (EAGLE-3: 1; MTP: the checkpoint's next-n layers). Each layer m keeps its own
KV in a drafter cache (speculators/draft_kv.py). Notation: t_j is the request's token at position j,
h_b the target's state at position b ("base" b), g^m_b layer m's output for base b.

  layer 0, base b:  input (h_b, t_{b+1}), RoPE position b            -> g^0_b predicts t_{b+2}
  layer m, base b:  input (g^{m-1}_b, t_{b+m+1}), RoPE position b    -> g^m_b predicts t_{b+m+2}

(DeepSeek-V3's depth-m module at position b; for m = 0 this is the docs/formats.md alignment "row i pairs
the hidden at position i with token i+1, positions not shifted".)

observe() (after every target forward, prefill chunks included) catches every layer up on the rows
whose inputs are real: layer 0 on the target rows that stay in the context, layer m on bases whose
token t_{b+m+1} is known. Layer m therefore lags layer 0 by m bases; the outputs of layer m-1 that
layer m has not consumed yet wait in carry[m-1]. Rows the target rejected are never observed, so
the head's rollback is its `ends` counters alone. When the target served the first P positions of a
request from its prefix cache, the head's first observe reads their layer-0 inputs from the state stash
(record() writes every forward's rows there; speculators/state_stash.py) and runs layer 0 over bases
[0, P + valid) at once, so it never drafts blind to a cached prompt. The same read lets a head with a
stash rest: observe() passes over a request the head has not drafted for since its last observe (its
prompt's prefill, the goodput policy cut its drafts, the hybrid's or `auto`'s choice went elsewhere), and
propose runs the layers over every base it skipped, in one forward (catch_up), before it drafts again. A
head that is never chosen for a request (auto, hybrid) thus never runs over its rows.

propose(), with N = num_tokens (the last token t_{N-1} has no target state yet):
  step 0:        d_1 from g^0_{N-2} (already computed by observe: no forward)
  step s < n:    layer s on bases [ends[s], N-1) (s rows in steady state), the tokens t_{b+s+1} being
                 known tokens or drafts d_1..d_s; the last row gives d_{s+1}
  step s >= n:   chained beyond the depth, reusing the LAST layer: one row at base N-1+s-n with
                 input (its previous output, d_s), as EAGLE-3 and vLLM chain a single head
KV written by draft rows is speculative: the next observe overwrites it. A request with a draft tree
(top_k > 1) grows it instead: speculators/draft_tree.py for one layer, speculators/mtp_tree.py for n > 1
(layer m's rows keyed by tree node, the same bases and inputs as the chain along each path).

Worked example, EAGLE-3 (n = 1), k = 3, context t_0..t_4 (N = 5), target states h_0..h_3:
  observe computed g_0..g_3 (rows (h_b, t_{b+1}) at positions 0..3); d_1 = argmax logits(g_3);
  step 1: row (g_3, d_1) at position 4 -> g'; d_2 = argmax logits(g');
  step 2: row (g', d_2) at position 5 -> d_3.
  The target accepts d_1 and emits r: next observe runs rows (h_4, d_1), (h_5, r) at positions 4, 5.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specserve.server.models.attention import AttentionMetadata
from specserve.speculators.base import DraftProposal, VerifiedStep
from specserve.speculators.draft_kv import DraftKVCache, DraftSeq, KVCache
from specserve.speculators.draft_sampling import append_drafts
from specserve.speculators.draft_tree import HeadTreeBuilder, as_tree
from specserve.speculators.mtp_tree import LayeredTreeBuilder
from specserve.speculators.state_stash import TargetStateStash


class DraftHead(Protocol):
    """An nn.Module (its parameters' dtype is the activation dtype)."""
    num_layers: int
    hidden_size: int

    def target_states(self, step: VerifiedStep, rows: torch.Tensor) -> torch.Tensor:
        """rows [r] int64 token rows of the step -> layer-0 hidden inputs [r, H] (EAGLE-3: fc of the taps)."""
        ...

    def stash_rows(self, step: VerifiedStep) -> torch.Tensor:
        """Every row of the step as the state stash takes it: [num_tokens, R], whose `stash_project` is
        target_states (EAGLE-3: the concatenated taps, a new tensor, projected by fc)."""
        ...

    # stash_project: Callable [n, R] -> [n, H], or None when stash_rows are the states themselves (MTP)

    def layer(self, m: int, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
              max_position: int, attn: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """hidden [r, H], token_ids [r], positions [r] absolute (all < max_position: sizes the RoPE table
        without a device sync) -> [r, H] the state fed to the next step."""
        ...

    def logits(self, m: int, states: torch.Tensor) -> torch.Tensor:
        """states [r, H] from layer m -> [r, target vocab] float32 (-inf outside a reduced draft vocab)."""
        ...


@dataclass
class _HeadSeq:
    kv: DraftSeq
    ends: list[int]                  # [n] layer m holds valid KV for bases [kv.start, ends[m])
    carry: list[torch.Tensor]        # [n] layer m outputs for bases [ends[m+1], ends[m]); last layer: last row


@dataclass
class _Rows:
    """One request's rows in a layer forward: bases [lo, hi), their hidden inputs and tokens."""
    seq: _HeadSeq
    lo: int
    hi: int
    hidden: torch.Tensor             # [hi - lo, H]
    tokens: list[int]                # [hi - lo]


@dataclass
class _Live:
    index: int
    request: object
    seq: _HeadSeq
    k: int
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    outputs: torch.Tensor | None = None   # [rows, H] the last step's layer outputs (bases ending at the last row)


class HiddenStateDrafter:
    def __init__(self, head: DraftHead, cache: DraftKVCache, stash_states: bool = False) -> None:
        """stash_states: the target caches prefixes, so keep the head's inputs per target slot (the cache
        mirrors the target's blocks; speculators/state_stash.py)."""
        self.head = head
        self.cache = cache
        self.n = head.num_layers
        self.device = cache.device
        self.dtype = next(head.parameters()).dtype   # activations; the KV cache may be wider (cache_dtype)
        self.stash = None if not stash_states else TargetStateStash(
            cache.num_blocks * cache.block_size, head.hidden_size, cache.block_size, self.dtype, self.device,
            project=head.stash_project)
        self._seqs: dict[str, _HeadSeq] = {}
        self.num_prefix_catch_ups = 0     # requests whose prompt (cached or unobserved) it read from the stash
        self.num_rested = 0               # request-steps observe() passed over (the stash fills them in)
        self.last_catch_up_s = 0.0        # seconds the last propose spent in catch_up
        self.last_catch_up_rows = 0       # and the rows it read
        self._drafted: set[str] = set()   # requests proposed for since their last observe
        # reason -> count since the engine last drained it (spec_decode_refused_total):
        # "drafter_cache_full": a step drafted nothing for want of KV room; "prefix_unseen": the head had
        # no room for a cached prompt prefix and drafts from the positions after it
        self.refusals: collections.Counter[str] = collections.Counter()
        # draft trees (EAGLE-2): one layer in draft_tree.py, several (MTP next-n layers) in mtp_tree.py
        self.trees = HeadTreeBuilder(self) if self.n == 1 else LayeredTreeBuilder(self)

    # -- record: every forward's rows into the stash ---------------------------------------------------
    @torch.inference_mode()
    def record(self, step: VerifiedStep, slot_mapping: torch.Tensor) -> None:
        """Called after EVERY target forward (all rows, whatever their method) when a stash exists."""
        self.stash.add(slot_mapping, self.head.stash_rows(step))

    # -- observe: catch up on the target's states ---------------------------------------------------
    @torch.inference_mode()
    def observe(self, step: VerifiedStep) -> None:
        items, rows, firsts = [], [], []
        for i, req in enumerate(step.requests):
            if self.stash is not None and req.request_id not in self._drafted:
                self.num_rested += 1
                continue                # resting (a new request too): catch_up reads the gap from the stash
            self._drafted.discard(req.request_id)
            start, valid = step.num_computed_before[i], step.valid_lens[i]
            seq = self._sync(req, start, start + valid)
            if seq is None:
                continue                # cache full: restart from a later position next time
            items.append((req, seq, start + valid))
            firsts.append((seq.ends[0], start))
            rows.append(torch.arange(step.token_offsets[i], step.token_offsets[i] + valid))
        if not items:
            return
        inputs = self.head.target_states(step, torch.cat(rows).to(self.device))     # [sum(valid), H]
        outputs = list(inputs.split([len(r) for r in rows]))
        for j, ((req, _, _), (first, start)) in enumerate(zip(items, firsts)):
            if first < start:           # bases [first, start): served from the prefix cache, or skipped
                outputs[j] = torch.cat([self.stash.read(req.block_ids, first, start), outputs[j]])
        self._advance(items, outputs)

    def catch_up(self, requests: Sequence) -> int:
        """Bring heads that skipped observing up to the request's last computed position, from the stash.
        Returns the rows read."""
        items, outputs = [], []
        for req in requests:
            seq = self._seqs.get(req.request_id)
            end0 = req.num_tokens - 1           # positions with a target state
            if seq is None and self.stash is not None and end0 > 0:
                # never observed: read the prompt from the stash, from position 0 where the cache has room,
                # else from its last state only (counted as prefix_unseen)
                seq = self._sync(req, end0 - 1, end0)
            if self.stash is None or seq is None or seq.ends[0] >= end0:
                continue
            if not self.cache.reserve(seq.kv, end0):
                self.release(req)
                continue
            items.append((req, seq, end0))
            outputs.append(self.stash.read(req.block_ids, seq.ends[0], end0))       # [end0 - ends[0], H]
        if items:
            self._advance(items, outputs)
        return sum(out.shape[0] for out in outputs)

    def _advance(self, items: list[tuple], outputs: list[torch.Tensor]) -> None:
        """Run every layer over the bases each request's layer lacks. items: (request, seq, end0), the
        layer-0 inputs of bases [seq.ends[0], end0) in outputs."""
        for m in range(self.n):
            batch: list[_Rows] = []
            for j, (req, seq, end0) in enumerate(items):
                # bases whose inputs exist: layer 0 up to end0; layer m up to what layer m-1 computed,
                # and only where the token t_{b+m+1} is known
                lo = seq.ends[m]
                hi = min(end0 if m == 0 else seq.ends[m - 1], req.num_tokens - m - 1)
                hidden = outputs[j] if m == 0 else torch.cat([seq.carry[m - 1], outputs[j]])
                count = max(0, hi - lo)
                if m > 0:
                    seq.carry[m - 1] = hidden[count:]
                tokens = req.token_slice(lo + m + 1, lo + count + m + 1)            # t_{b+m+1}
                batch.append(_Rows(seq, lo, lo + count, hidden[:count], tokens))
            outputs = self._run_layer(m, batch)
            for rows_m, out in zip(batch, outputs):
                rows_m.seq.ends[m] = rows_m.hi
                if m == self.n - 1 and out.shape[0]:
                    rows_m.seq.carry[m] = out[-1:]

    def _sync(self, req, start: int, end: int) -> _HeadSeq | None:
        """The request's state, with KV reserved up to `end`, if it continues at `start` (or before it, the
        gap in the stash: skipped observes); otherwise
        a fresh one: from position 0 when the stash holds the states of [0, start) (a cached target
        prefix), else starting at `start` (no stash, or no room for the prefix). None: the cache is full."""
        seq = self._seqs.get(req.request_id)
        if seq is not None and (seq.ends[0] == start or (self.stash is not None and seq.ends[0] < start)):
            if self.cache.reserve(seq.kv, end):
                return seq
            self.release(req)
            return None
        if seq is not None:
            self.cache.free(seq.kv)
        for first in ((0, start) if self.stash is not None and start > 0 else (start,)):
            empty = torch.empty(0, self.head.hidden_size, dtype=self.dtype, device=self.device)   # [0, H]
            seq = self._seqs[req.request_id] = _HeadSeq(
                kv=DraftSeq(start=first), ends=[first] * self.n, carry=[empty] * self.n)
            if self.cache.reserve(seq.kv, end):
                self.num_prefix_catch_ups += first < start
                if first == start > 0 and self.stash is not None:
                    self.refusals["prefix_unseen"] += 1
                    req.spec_stats.cut("prefix_unseen")
                return seq
            self.release(req)
        return None

    # -- propose: k draft steps, batched -------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence, ks: Sequence[int]) -> DraftProposal:
        asked = [req for req, k in zip(requests, ks) if k > 0]
        self._drafted.update(req.request_id for req in asked)
        start = time.perf_counter()
        self.last_catch_up_rows = self.catch_up(asked)
        self.last_catch_up_s = time.perf_counter() - start
        live: list[_Live] = []
        grown: list[_Live] = []          # draft-tree requests (speculators/draft_tree.py)
        for i, (req, k) in enumerate(zip(requests, ks)):
            seq = self._seqs.get(req.request_id)
            n_tok = req.num_tokens
            if k <= 0:
                continue
            tree = as_tree(req.spec_params.draft_tree)
            end = self.trees.kv_end(n_tok, tree) if tree is not None else n_tok - 1 + max(0, k - self.n)
            if (seq is None or seq.ends[0] != n_tok - 1 or seq.carry[0].shape[0] == 0
                    or not self.cache.reserve(seq.kv, end)):
                self.refusals["drafter_cache_full"] += 1   # out of sync only after a cache-full release
                req.spec_stats.cut("drafter_cache_full")
                continue
            (grown if tree is not None else live).append(_Live(i, req, seq, k))
        parents: list[list[int] | None] = [None for _ in requests]
        probs: list[torch.Tensor | None] = [None for _ in requests]
        if grown:
            t0 = time.perf_counter()
            for item, (tokens, tree_parents, tree_probs) in zip(grown, self.trees.build(grown)):
                # tree_probs [nodes, vocab]: per node the q it was drawn from (None: top-K children)
                item.tokens, parents[item.index], probs[item.index] = tokens, tree_parents, tree_probs
            self.trees.build_seconds += time.perf_counter() - t0
            self.trees.num_built += len(grown)
            self.trees.num_calls += 1
        if live:
            first = torch.cat([item.seq.carry[0][-1:] for item in live])             # [a, H] = g^0_{N-2}
            self._sample(live, self.head.logits(0, first))
            for item, row in zip(live, first):
                # step 0 ran no layer: with n > 1, layer 1 reads g^0_{N-2} from carry[0] (outputs empty);
                # with n = 1 the chained step reads it from here
                item.outputs = row[None][:0] if self.n > 1 else row[None]                # [0 | 1, H]
            for s in range(1, max(item.k for item in live)):
                self._step(s, [item for item in live if item.k > s])
        token_ids: list[list[int]] = [[] for _ in requests]
        for item in live:
            token_ids[item.index] = item.tokens
            probs[item.index] = torch.stack(item.probs) if item.probs else None      # [k_i, vocab]
        for item in grown:
            token_ids[item.index] = item.tokens
        return DraftProposal(token_ids, probs, parents)

    def _step(self, s: int, items: list[_Live]) -> None:
        m = min(s, self.n - 1)
        batch: list[_Rows] = []
        for item in items:
            n_tok, seq = item.request.num_tokens, item.seq
            if s < self.n:     # layer s on every base it lacks up to N-2, fed by layer s-1
                lo, hi = seq.ends[s], n_tok - 1
                hidden = torch.cat([seq.carry[s - 1], item.outputs])
            else:              # chained beyond the depth: the last layer again, one base further
                lo = n_tok - 1 + s - self.n
                hi = lo + 1
                hidden = item.outputs[-1:]
            tokens = [self._token(item, j) for j in range(lo + m + 1, hi + m + 1)]
            batch.append(_Rows(seq, lo, hi, hidden, tokens))
        outputs = self._run_layer(m, batch)
        for item, out in zip(items, outputs):
            item.outputs = out
        last = torch.cat([out[-1:] for out in outputs])                               # [a, H]
        self._sample(items, self.head.logits(m, last))

    @staticmethod
    def _token(item: _Live, j: int) -> int:
        """t_j of the request, or the draft standing at position j."""
        n_tok = item.request.num_tokens
        return item.request.token_slice(j, j + 1)[0] if j < n_tok else item.tokens[j - n_tok]

    # -- shared ---------------------------------------------------------------------------------------
    def _run_layer(self, m: int, batch: list[_Rows]) -> list[torch.Tensor]:
        """One varlen forward of layer m over every request's rows -> per request [rows, H]."""
        work = [r for r in batch if r.hi > r.lo]
        if not work:
            return [r.hidden[:0] for r in batch]
        attn, positions = self.cache.metadata([r.seq.kv for r in work], [r.hi - r.lo for r in work],
                                              [r.hi for r in work])
        hidden = torch.cat([r.hidden for r in work])                                 # [rows, H]
        tokens = torch.tensor([t for r in work for t in r.tokens], dtype=torch.long, device=self.device)
        out = self.head.layer(m, hidden, tokens, positions, max(r.hi for r in work), attn,
                              self.cache.caches[m])                                  # [rows, H]
        pieces = iter(out.split([r.hi - r.lo for r in work]))
        return [next(pieces) if r.hi > r.lo else r.hidden[:0] for r in batch]

    @staticmethod
    def _sample(items: list[_Live], logits: torch.Tensor) -> None:
        append_drafts(items, logits)

    def release(self, request) -> None:
        self._drafted.discard(request.request_id)
        seq = self._seqs.pop(request.request_id, None)
        if seq is not None:
            self.cache.free(seq.kv)
