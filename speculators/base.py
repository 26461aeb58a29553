"""The speculator interface and the per-request speculation choice."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DraftTree:
    """A request's draft tree shape (speculators/draft_tree.py): each of `depth` expansions keeps the
    `top_k` best nodes by cumulative draft log-probability; num_speculative_tokens of all candidates are
    verified. top_k == 1 is the chain (SpecParams.draft_tree is then None: the same code path)."""
    top_k: int
    depth: int


@dataclass(frozen=True)
class SpecParams:
    """One request's speculation choice. method 'none' or k == 0 is plain decoding (same code path)."""
    method: str = "none"
    num_speculative_tokens: int = 0
    options: dict[str, Any] = field(default_factory=dict)   # method options, e.g. prompt_lookup_min/max
    adaptive: bool = True      # False: always draft k (the server's goodput policy never cuts it)
    # who may share cross-request draft caches with this request (the suffix method): set at the HTTP edge
    # from the API key and the OpenAI `user` field; None: nobody (speculators/suffix.py, SECURITY.md)
    cache_scope: str | None = None
    draft_tree: DraftTree | None = None   # None: one chain of k drafts

    @property
    def k(self) -> int:
        return 0 if self.method == "none" else self.num_speculative_tokens


def count_accepted_positions(per_pos: list[int], num_draft: int, num_accepted: int) -> None:
    """Grow per_pos to num_draft entries and count one acceptance at positions 0..num_accepted-1."""
    if len(per_pos) < num_draft:
        per_pos.extend([0] * (num_draft - len(per_pos)))
    for i in range(num_accepted):
        per_pos[i] += 1


def count_depths(rows: list[list[float]], num_draft: int, num_accepted: int, decay: float = 1.0) -> None:
    """rows = [reached, accepted], per depth (index d - 1): count one draft of num_draft tokens of which the
    first num_accepted were accepted (it reached depths 1..attempted_positions), the earlier counts first
    scaled by `decay`. accepted[d] / reached[d] is the acceptance at depth d given the earlier ones were."""
    reached, accepted = rows
    if decay != 1.0:
        reached[:] = [x * decay for x in reached]
        accepted[:] = [x * decay for x in accepted]
    depth = attempted_positions(num_draft, num_accepted)
    if len(reached) < depth:
        reached.extend([0] * (depth - len(reached)))
        accepted.extend([0] * (depth - len(accepted)))
    for d in range(depth):
        reached[d] += 1
        accepted[d] += d < num_accepted


def attempted_positions(num_draft: int, num_accepted: int) -> int:
    """Draft positions a verification reached: the accepted ones plus the first rejected one, if any.
    accepted / attempted estimates the acceptance at a position given the earlier ones were accepted."""
    return min(num_accepted + 1, num_draft)


# Why a request's speculation was reduced or refused: the `reason` label of spec_decode_refused_total and
# the keys of a response's `speculation.cuts`, with the words its `notice` uses.
CUT_REASONS: dict[str, str] = {
    "token_budget": "k cut to fit the step's token budget (--max-num-batched-tokens)",
    "load": "k cut by the goodput policy where more drafts would lower the batch's tokens/s",
    "drafter_cache_full": "no drafts: the drafter's KV cache was full",
    "prefix_unseen": "the drafter had no KV room for the cached prompt prefix and drafted without it",
    "prediction_ignored": "the request's prediction was not used",
}


@dataclass
class SpecStats:
    """Per-request speculation counters, reported in the response's `speculation` field."""
    method: str = "none"
    k: int = 0
    num_drafts: int = 0            # verification steps that carried >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [k]
    num_attempted_positions: int = 0   # positions reached: accepted + the first rejected one (acceptance estimate)
    # reason (CUT_REASONS) -> steps whose drafts were reduced or refused for it; the same reasons and
    # counts go to spec_decode_refused_total
    cuts: dict[str, int] = field(default_factory=dict)
    grammar_rejected: int = 0      # steps where the request's grammar forbade one of its drafts (rejected there)
    # draft trees: {"top_k", "depth"} of the request's tree (None: chains); accepted_depth_steps[d] counts
    # the tree steps whose accepted path was d nodes deep
    draft_tree: dict[str, int] | None = None
    num_tree_steps: int = 0
    num_tree_nodes: int = 0        # tree nodes verified, over all tree steps
    accepted_depth_steps: list[int] = field(default_factory=list)

    # auto: method -> [steps chosen, draft tokens, accepted tokens, attempted positions]
    # ("none": the steps it chose plain decoding)
    by_method: dict[str, list[int]] = field(default_factory=dict)
    # auto: lookup -> [reached, accepted] per depth (count_depths) of every draft it offered, chosen or not,
    # scored against the tokens the request went on to emit (AutoSpeculator.score_offers); internal, not
    # reported. A lookup draft that matched its first tokens is copying text, and is accepted further on
    # more often than at its start
    lookup_depths: dict[str, list[list[int]]] = field(default_factory=dict)

    def lookup_score(self, method: str) -> list[int] | None:
        """auto: [accepted, attempted positions] over all depths of `method`'s scored offers (None: no offer
        scored); asked for each candidate of each step, so only the one method is summed."""
        rows = self.lookup_depths.get(method)
        return None if rows is None else [sum(rows[1]), sum(rows[0])]

    @property
    def lookup_scores(self) -> dict[str, list[int]]:
        """auto: lookup -> lookup_score for every lookup with a scored offer."""
        return {m: self.lookup_score(m) for m in self.lookup_depths}

    def record_method(self, method: str, num_draft: int, num_accepted: int) -> None:
        row = self.by_method.setdefault(method, [0, 0, 0, 0])
        row[0] += 1
        row[1] += num_draft
        row[2] += num_accepted
        row[3] += attempted_positions(num_draft, num_accepted) if num_draft else 0

    def cut(self, reason: str) -> None:
        self.cuts[reason] = self.cuts.get(reason, 0) + 1

    @property
    def num_steps_k_reduced(self) -> int:
        """Steps where the goodput policy drafted fewer than k."""
        return self.cuts.get("load", 0)

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_attempted_positions += attempted_positions(num_draft, num_accepted)
        count_accepted_positions(self.accepted_per_pos, num_draft, num_accepted)

    def record_tree(self, num_nodes: int, depth: int) -> None:
        self.num_tree_steps += 1
        self.num_tree_nodes += num_nodes
        if len(self.accepted_depth_steps) <= depth:
            self.accepted_depth_steps.extend([0] * (depth + 1 - len(self.accepted_depth_steps)))
        self.accepted_depth_steps[depth] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class DraftProposal:
    token_ids: list[list[int]]                   # per request, k_i draft ids (k_i may be < asked, even 0)
    # per request, [k_i, vocab] or None (deterministic drafts): row j is the distribution draft j was drawn
    # from; for a tree, node j's (its parent's draft distribution, shared by its siblings)
    draft_probs: list[torch.Tensor | None]
    # per request, None (a chain) or a draft tree: parents[j] is node j's parent node (-1: the last known
    # token), parents[j] < j; token_ids[i][j] is node j's token; siblings in the order they were drawn
    # (speculators/draft_tree.py)
    parents: list[list[int] | None] | None = None


@dataclass
class VerifiedStep:
    """What one target forward computed for the requests of one method (prefill chunks included).

    Model-based speculators read the target's hidden states here (EAGLE-3 taps, MTP inputs) instead of
    running the target again. Row r of `hidden` belongs to requests[i] when
    token_offsets[i] <= r < token_offsets[i] + query_lens[i]; those rows are the positions
    num_computed_before[i] .. num_computed_before[i] + query_lens[i] - 1 of that request, i.e. its known
    tokens followed by the drafts it verified. Only the first `valid_lens[i]` rows hold states of tokens
    that stay in the context (the known tokens + accepted drafts); the rest were rejected.
    """
    requests: list[SpecRequest]
    num_computed_before: list[int]     # the request's num_computed_tokens when the step began
    token_offsets: list[int]
    query_lens: list[int]
    valid_lens: list[int]
    num_accepted: list[int]            # accepted drafts (0 for prefill chunks)
    sampled: list[bool]                # whether the step emitted tokens for the request
    hidden: torch.Tensor             # [num_tokens, hidden] final-normed target states
    prenorm_hidden: torch.Tensor     # [num_tokens, hidden] before the final norm
    aux_hidden: list[torch.Tensor]   # per tapped layer [num_tokens, hidden] (empty unless requested)


class SpecRequest(Protocol):
    """What a speculator may read of an engine request (read-only; server/engine/request.py owns it)."""
    request_id: str
    sampling_params: Any                    # specserve.sampling.params.SamplingParams (seed, temperature: draft RNG)
    spec_params: SpecParams
    prediction_token_ids: list[int] | None  # the request's Predicted Output, if any
    output_token_ids: list[int]
    block_ids: list[int]                    # the target's KV blocks (a state stash is keyed by their slots)
    spec_stats: SpecStats                   # where a drafter notes a cut (spec_stats.cut(reason)); else read-only
    grammar: Any                            # structured output's GrammarState (None: free text); drafters mask
                                            # their logits with it (specserve/grammar/draft_mask.py)

    @property
    def num_tokens(self) -> int: ...        # prompt + output tokens known so far

    @property
    def all_token_ids(self) -> list[int]: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...

    @property
    def is_finished(self) -> bool: ...      # released because it ended (not preempted)


class TargetModel(Protocol):
    """What a model-based drafter may read of the target at load time (the engine's ModelRunner)."""
    model: Any                              # the target LlamaForCausalLM (embed_tokens, lm_head)
    cfg: Any                                # specserve.server.models.config.ModelConfig
    dtype: torch.dtype
    device: torch.device
    block_size: int
    num_blocks: int                         # target KV blocks; a drafter's cache mirrors the count
    aux_layer_ids: tuple[int, ...]          # every tap the target records (the union over speculators)


@dataclass
class BuildContext:
    """Everything a method needs to decide whether it is available and to load itself.

    Built once by the engine builder; `target` is None while only sizing KV memory (before the target's
    KV cache exists). `loaded` holds the speculators built so far, in registry order (the hybrid reads it).
    """
    target_cfg: Any                         # ModelConfig of the target
    model_dir: Path | None                  # the target checkpoint (MTP layers live there); None: random
    tokenizer_dir: Path
    draft_dir: str | None                   # --draft-model, or the embedded family's draft
    eagle3_dir: str | None                  # --eagle3, or the embedded family's head
    block_size: int
    kv_dtype: torch.dtype
    model_dtype: torch.dtype
    stash_states: bool                      # prefix caching on: heads keep a per-slot state stash
    suffix_cache_tokens: int = 1_000_000    # the suffix method's cross-request cache budget (tokens)
    suffix_scope: str = "user"              # request | user | global: who shares that cache
    eagle_dir: str | None = None            # --eagle (an EAGLE-1 head), or the embedded family's
    target: TargetModel | None = None
    loaded: dict[str, Speculator] = field(default_factory=dict)


class Speculator:
    """The interface every method implements; the defaults are the explicit no-op hooks.

    A new method subclasses this, sets `name`, implements `propose` (and `build` unless it needs nothing
    loaded), and gets one entry in speculators/registry.py. docs/architecture.md walks through it.
    """
    name: str = ""
    # target layers whose entering residual streams the speculator needs from every forward (EAGLE-3)
    aux_layer_ids: tuple[int, ...] = ()
    # True: record(step, slot_mapping) sees every target forward's rows (prefix-cache state stash)
    records_states: bool = False
    # seconds of the last propose spent reading what the drafter had not seen yet (a draft model's first
    # look at a prompt, a resting head's catch-up): not the price of a draft step (server/engine/spec_policy.py)
    last_catch_up_s: float = 0.0
    # ... and the rows it read then (0: none, or a drafter that does not count them)
    last_catch_up_rows: int = 0
    # True: propose() builds draft trees for requests whose SpecParams.draft_tree is set
    drafts_trees: bool = False

    @classmethod
    def build(cls, ctx: BuildContext) -> Speculator | None:
        """The loaded speculator, or None when what it needs is not there (the method is then not offered)."""
        return cls()

    @classmethod
    def kv_bytes_per_block(cls, ctx: BuildContext) -> int:
        """Bytes of drafter memory (KV, state stash) per target KV block, if `build` would load it."""
        return 0

    @staticmethod
    def validate(options: dict) -> None:
        """Raise ValueError for method options it does not understand (HTTP 400)."""
        if options:
            raise ValueError(f"this speculation method takes no options, got {sorted(options)}")

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        """Up to ks[i] draft tokens for requests[i] (read-only)."""
        raise NotImplementedError

    def observe(self, step: VerifiedStep) -> None:
        """Called after every forward that included requests of this method (after update of the
        requests' counters and outputs), for methods that keep state (draft KV, hidden states)."""

    def record(self, step: VerifiedStep, slot_mapping: torch.Tensor) -> None:
        """Only when `records_states`: every row of every target forward, keyed by KV slot."""

    def release(self, request: SpecRequest) -> None:
        """Forget per-request state (request finished, aborted or preempted)."""

    def drain_refusals(self) -> dict[str, int]:
        """reason -> count of what it could not do since the last call (spec_decode_refused_total)."""
        return {}

    def drafter_of(self, request: SpecRequest) -> str | None:
        """The loaded method whose drafter drafted `request`'s drafts this step, when this speculator drafts
        through another's (the hybrid's model drafter), else None. The engine books the step's acceptance
        under that method too: the default method's traffic is most of what a server learns about its
        drafter, and `auto` and the collapse signal read it there."""
        return None

    def calibrate_trees(self, acceptance: float) -> None:
        """The server's greedy acceptance per position for this method: a tree-drafting model drafter fits
        its greedy nodes' score to it (speculators/tree_calibration.py); others ignore it."""
