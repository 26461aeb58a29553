"""N-gram / prompt-lookup speculator: propose what followed the longest earlier match of the context's
suffix (prompt + output). Deterministic drafts (draft_probs None), exact under rejection sampling.

Options (request `speculation` object): prompt_lookup_min (default 1), prompt_lookup_max (default 4).
"""
from __future__ import annotations

from collections.abc import Sequence

from specserve.speculators.base import DraftProposal, DraftTree, SpecRequest, Speculator
from specserve.speculators.ngram_match import TokenBuffer, longest_match, match_starts
from specserve.speculators.tree_shape import as_tree, merge_paths

DEFAULT_MIN = 1
DEFAULT_MAX = 4
MAX_LOOKUP = 16


def lookup_bounds(options: dict, default_min: int = DEFAULT_MIN) -> tuple[int, int]:
    lo = options.get("prompt_lookup_min", default_min)
    hi = options.get("prompt_lookup_max", max(DEFAULT_MAX, lo) if isinstance(lo, int) else DEFAULT_MAX)
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_LOOKUP:
            raise ValueError(f"{name} must be an integer in [1, {MAX_LOOKUP}], got {v!r}")
    if lo > hi:
        raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    return lo, hi


def match_tree(ctx, lo: int, hi: int, k: int, tree: DraftTree) -> tuple[list[int], list[int]]:
    """A draft tree of up to k nodes from the continuations of the latest `tree.top_k` occurrences of the
    longest match with distinct continuations (latest first), each up to `tree.depth` tokens, merged where
    they share a prefix (tree_shape.merge_paths)."""
    paths: list[list[int]] = []
    for start in match_starts(ctx[:-1], ctx, lo, hi)[::-1]:      # latest first (the chain's preference)
        path = ctx[start:start + tree.depth].tolist()
        if path and path not in paths:
            paths.append(path)
            if len(paths) == tree.top_k:
                break
    return merge_paths(paths, k)


class NgramSpeculator(Speculator):
    name = "ngram"
    drafts_trees = True                                  # several earlier matches become siblings

    def __init__(self, default_min: int = DEFAULT_MIN) -> None:
        self.default_min = default_min           # shortest match that counts when a request does not say
        self._buffers: dict[str, TokenBuffer] = {}

    @staticmethod
    def validate(options: dict) -> None:
        unknown = set(options) - {"prompt_lookup_min", "prompt_lookup_max"}
        if unknown:
            raise ValueError(f"unknown ngram speculation options {sorted(unknown)}; "
                             "expected prompt_lookup_min, prompt_lookup_max")
        lookup_bounds(options)

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        drafts: list[list[int]] = []
        parents: list[list[int] | None] = []
        for req, k in zip(requests, ks):
            ctx = self._context(req)                         # [L]
            lo, hi = lookup_bounds(req.spec_params.options, self.default_min)
            tree = as_tree(req.spec_params.draft_tree)
            if tree is not None:
                tokens, tree_parents = match_tree(ctx, lo, hi, k, tree)
                drafts.append(tokens)
                parents.append(tree_parents if tokens else None)
                continue
            # search everything but the last token, so the suffix cannot match itself
            start = longest_match(ctx[:-1], ctx, lo, hi, want=k)
            drafts.append(ctx[start:start + k].tolist() if start >= 0 else [])
            parents.append(None)
        return DraftProposal(drafts, [None] * len(drafts), parents)

    def _context(self, req):
        buf = self._buffers.get(req.request_id)
        if buf is None or buf.size > req.num_tokens:
            buf = self._buffers[req.request_id] = TokenBuffer(req.all_token_ids)
        elif buf.size < req.num_tokens:
            buf.extend(req.token_slice(buf.size, req.num_tokens))
        return buf.view()

    def release(self, request: SpecRequest) -> None:
        self._buffers.pop(request.request_id, None)
