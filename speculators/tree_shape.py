"""What a draft tree may look like (speculators/draft_tree.py builds them): checked at the HTTP edge and
at start-up, without torch (the CLI imports this before any model loads)."""
from __future__ import annotations

from specserve.speculators.base import DraftTree

# drafters that build trees: hidden-state heads (EAGLE-2 trees; MTP of any depth), the draft model (the same,
# a forward per depth), the lookups (earlier matches)
TREE_METHODS = ("eagle3", "eagle", "mtp", "draft", "ngram", "suffix")
TREE_MAX_NODES = 15   # root + nodes fit one padded tree-masked attention call (attention_metadata.SHORT_QUERY_MAX)
TREE_MAX_TOP_K = 8
TREE_MAX_DEPTH = 16


def check_tree(tree: DraftTree, k: int, method: str | None = None) -> None:
    """ValueError naming what is wrong with a draft tree of k verified nodes (method None: any)."""
    if not 1 <= tree.top_k <= TREE_MAX_TOP_K:
        raise ValueError(f"draft_tree.top_k must be in [1, {TREE_MAX_TOP_K}], got {tree.top_k}")
    if not 1 <= tree.depth <= TREE_MAX_DEPTH:
        raise ValueError(f"draft_tree.depth must be in [1, {TREE_MAX_DEPTH}], got {tree.depth}")
    if tree.top_k == 1:
        return
    if method is not None and method not in TREE_METHODS:
        raise ValueError(f"speculation method {method!r} drafts chains only; draft trees (top_k > 1) "
                         f"are drafted by {list(TREE_METHODS)}")
    if not 1 <= k <= TREE_MAX_NODES:
        raise ValueError(f"a draft tree verifies num_speculative_tokens nodes, which must be in "
                         f"[1, {TREE_MAX_NODES}], got {k}")
    if tree.depth > k:
        raise ValueError(f"draft_tree.depth ({tree.depth}) cannot exceed num_speculative_tokens ({k})")


def as_tree(tree: DraftTree | None) -> DraftTree | None:
    """The tree to draft, or None for a chain (no tree, or top_k 1)."""
    return tree if tree is not None and tree.top_k > 1 else None


def merge_paths(paths: list[list[int]], k: int) -> tuple[list[int], list[int]]:
    """Candidate continuations (best first) merged into one tree where they share a prefix; the first k nodes
    in depth order (parents first) -> (tokens, parents, -1: the root). Example: [[7, 8], [7, 9]], k 8 ->
    ([7, 8, 9], [-1, 0, 0])."""
    children: dict[tuple[int, int], int] = {}              # (parent node, token) -> node
    depth_of: list[int] = []
    tokens: list[int] = []
    parents: list[int] = []
    for path in paths:
        node = -1
        for tok in path:
            if (node, tok) not in children:
                children[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                depth_of.append(0 if node < 0 else depth_of[node] + 1)
            node = children[(node, tok)]
    order = sorted(range(len(tokens)), key=lambda j: (depth_of[j], j))[:k]
    where = {j: i for i, j in enumerate(order)}
    return [tokens[j] for j in order], [-1 if parents[j] < 0 else where[parents[j]] for j in order]
