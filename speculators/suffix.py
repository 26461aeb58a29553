"""Suffix decoding: drafts from the request's own context and from earlier requests' texts.

Two indexes (speculators/suffix_index.py) answer "where did the end of this context occur before?":
the request's own prompt + output, updated with each step's new tokens, and a cross-request cache that
receives each finished request's prompt tail and output. Each step, each source proposes the most
frequent continuation of its longest match, as SuffixDecoding (arXiv 2411.04975) does: the draft grows
with the match, up to min(k, spec_factor x match length), and stops where the continuation's frequency
among the matching occurrences (multiplied along the path) falls below min_token_prob. The source whose
draft has the larger expected length wins. Drafts are deterministic (draft_probs None): exact.

Worked example, k = 8: an agent loop sends the same prompt again. Its context ends with the prompt's
last 32 tokens, which the cache holds followed by the earlier answer -> match length 32, the earlier
answer's next 8 tokens are the draft, each with frequency 1.0.

Who shares the cache is a security decision (SECURITY.md): drafts never change the output, but their
speed shows whether similar text was generated before. `--suffix-scope user` (the default) shares it
only among requests with the same cache scope (the API key and the OpenAI `user` field: SpecParams
.cache_scope, set at the HTTP edge); a request without one uses only its own context. `request` never
shares; `global` shares among all requests. `--suffix-cache-tokens` bounds the cache; the oldest tokens
go first.

Options (request `speculation` object): min_token_prob (default 0.1), spec_factor (default 1.0).
"""
from __future__ import annotations

from collections.abc import Sequence

from specserve.speculators.base import BuildContext, DraftProposal, SpecRequest, Speculator
from specserve.speculators.suffix_index import MAX_MATCH, SEPARATOR, SuffixIndex, warm
from specserve.speculators.tree_shape import as_tree, merge_paths

SCOPES = ("request", "user", "global")
MIN_TOKEN_PROB = 0.1
SPEC_FACTOR = 1.0
PROMPT_TAIL = 256        # prompt tokens kept with a finished output: what a repeated request will match
_OPTIONS = {"min_token_prob": (MIN_TOKEN_PROB, 1e-6, 1.0), "spec_factor": (SPEC_FACTOR, 0.01, 64.0)}


def suffix_options(options: dict) -> tuple[float, float]:
    if not options:                                    # the common case, once per request and step
        return MIN_TOKEN_PROB, SPEC_FACTOR
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"unknown suffix speculation options {sorted(unknown)}; expected {sorted(_OPTIONS)}")
    out = []
    for name, (default, lo, hi) in _OPTIONS.items():
        v = options.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")
        out.append(float(v))
    return out[0], out[1]


class SuffixSpeculator(Speculator):
    drafts_trees = True      # the request's own and the shared cache's continuations become siblings
    name = "suffix"

    def __init__(self, cache_tokens: int = 1_000_000, scope: str = "user") -> None:
        if scope not in SCOPES:
            raise ValueError(f"suffix scope must be one of {SCOPES}, got {scope!r}")
        self.scope_mode = scope
        self.shared = SuffixIndex(cache_tokens) if scope != "request" and cache_tokens > 0 else None
        self._scope_ids: dict[str, int] = {}
        self._scope_written: set[int] = set()      # scopes that added to the cache (others skip its lookup)
        self._local: dict[str, SuffixIndex] = {}

    @classmethod
    def build(cls, ctx: BuildContext) -> SuffixSpeculator:
        warm()                                  # compiled (or loaded from numba's cache) at start-up
        return cls(ctx.suffix_cache_tokens, ctx.suffix_scope)

    @staticmethod
    def validate(options: dict) -> None:
        suffix_options(options)

    def scope_id(self, req: SpecRequest) -> int | None:
        """The cross-request cache partition of a request, or None: it neither reads nor writes the cache."""
        if self.shared is None:
            return None
        if self.scope_mode == "global":
            return 0
        key = req.spec_params.cache_scope
        if key is None:
            return None
        return self._scope_ids.setdefault(key, len(self._scope_ids) + 1)

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        drafts: list[list[int]] = []
        parents: list[list[int] | None] = []
        for req, k in zip(requests, ks):
            tree = as_tree(req.spec_params.draft_tree)
            if tree is None:
                drafts.append(self.draft(req, k)[0])
                parents.append(None)
                continue
            # a tree: the request's own and the shared cache's continuations become siblings (best first)
            found = sorted((c for c in self.candidates(req, tree.depth) if c[1] > 0), key=lambda c: -c[1])[:tree.top_k]
            tokens, tree_parents = merge_paths([c[0] for c in found if c[0]], k)
            drafts.append(tokens)
            parents.append(tree_parents if tokens else None)
        return DraftProposal(drafts, [None] * len(drafts), parents)

    def draft(self, req: SpecRequest, k: int) -> tuple[list[int], float]:
        """Up to k ids and their expected accepted length under the matched frequencies."""
        return max((c for c in self.candidates(req, k) if c[1] > 0), key=lambda c: c[1], default=([], 0.0))

    def candidates(self, req: SpecRequest, k: int) -> list[tuple[list[int], float]]:
        """Per index that matches (the request's own, then the shared cache): up to k ids and their expected
        accepted length."""
        if k <= 0:
            return []
        local = self._context(req)
        tail = local.tail(MAX_MATCH)                                      # [<= MAX_MATCH] int32
        min_prob, factor = suffix_options(req.spec_params.options)
        out: list[tuple[list[int], float]] = []
        sid = self.scope_id(req)
        for index, scope in ((local, 0), (self.shared, sid)):
            if index is None or scope is None or (index is self.shared and scope not in self._scope_written):
                continue
            draft = index.draft(tail, scope, k, factor, min_prob)
            if draft[0]:
                out.append(draft)
        return out

    def _context(self, req: SpecRequest) -> SuffixIndex:
        index = self._local.get(req.request_id)
        if index is None or index.end > req.num_tokens:
            index = self._local[req.request_id] = SuffixIndex(2 * req.num_tokens + 64, growable=True)
            index.extend(req.all_token_ids)
        elif index.end < req.num_tokens:
            index.extend(req.token_slice(index.end, req.num_tokens))
        return index

    def release(self, request: SpecRequest) -> None:
        """A finished request's prompt tail and output join its scope's cache (a preempted one comes back)."""
        self._local.pop(request.request_id, None)
        sid = self.scope_id(request)
        if sid is None or not request.is_finished or not request.output_token_ids:
            return
        n = request.num_tokens
        start = max(0, n - len(request.output_token_ids) - PROMPT_TAIL)
        self.shared.extend([*request.token_slice(start, n), SEPARATOR], sid)
        self._scope_written.add(sid)
