"""Draft trees for MTP heads of 1, 2 and 3 next-n layers (speculators/draft_tree.py for one layer,
speculators/mtp_tree.py for more) on tiny random targets whose MTP layers are written by hand.

The layers here read mostly their input token (the projection is the identity on the embedding half plus
noise) and share the target's final norm and lm_head; the random target is close to a bigram model, so
such a layer nearly predicts the target's next token and drafts get accepted, including paths off a
node's first child; their random blocks (attention over the head's own KV) still shape every score.
Checks: greedy tree output equals plain greedy, alone and mixed with chains and plain requests; every
node's score equals the sum along its path of a from-scratch reference of the layers (test_spec_mtp's),
and a tree without the per-layer ancestor mask or fed the wrong parent's state (planted bugs) does not;
after a tree step the drafts equal those of a fresh request's head, which never saw the rejected branches
(and do not when the head observes the tree's rows unordered, a planted bug); the server default tree.
"""
from __future__ import annotations

import math

import pytest
import torch
from test_draft_tree import fresh_build_mismatches, frozen_tree_scores
from test_spec_draft_model import (
    BASE,
    GREEDY,
    Rand,
    assert_no_leaks,
    block_tensors,
    encode,
    llama_tensors,
    make_engine,
    vocab_size,
    write_checkpoint,
)
from test_spec_mtp import NAMES, mtp_prefix, ref_mtp_probs

from specserve.sampling.params import SamplingParams
from specserve.speculators import draft_tree, mtp_tree
from specserve.speculators.base import DraftTree, SpecParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")
NUM_LAYERS = 2                                   # target layers
HEADS = {"one": ("mimo", 1), "two": ("deepseek_v3", 2), "three": ("mimo", 3)}


def write_predictable_mtp(out, layout: str, num_mtp: int, seed: int):
    """A target with num_mtp MTP layers that each pass their token's embedding on (see the docstring)."""
    cfg = dict(BASE) if layout == "deepseek_v3" else {**BASE, "architectures": ["MiMoForCausalLM"],
                                                      "model_type": "mimo", "attention_bias": True}
    cfg.update(vocab_size=vocab_size(), num_hidden_layers=NUM_LAYERS, num_nextn_predict_layers=num_mtp)
    rand = Rand(seed)
    t = llama_tensors(cfg, rand, qkv_bias=layout == "mimo")
    h = cfg["hidden_size"]
    enorm, hnorm, proj, fnorm, embed_first = NAMES[layout]
    eye, zero = torch.eye(h), torch.zeros(h, h)
    for i in range(num_mtp):
        p = mtp_prefix(layout, NUM_LAYERS, i)
        t.update(block_tensors(p, cfg, rand, qkv_bias=layout == "mimo"))
        pick = torch.cat([eye, zero] if embed_first else [zero, eye], dim=1)       # [H, 2H] the embedding half
        t.update({p + f"{enorm}.weight": torch.ones(h), p + f"{hnorm}.weight": rand.norm(h),
                  p + f"{proj}.weight": pick + rand.mat(h, 2 * h),
                  p + f"{fnorm}.weight": t["model.norm.weight"].clone()})
    return write_checkpoint(out, cfg, t)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_tree")
    return {name: write_predictable_mtp(root / name, layout, n, seed=n) for name, (layout, n) in HEADS.items()}


@pytest.fixture(scope="module")
def engines(dirs):
    return {name: make_engine(d, enable_prefix_caching=False) for name, d in dirs.items()}


def tree(k: int, top_k: int, depth: int) -> SpecParams:
    return SpecParams("mtp", k, draft_tree=DraftTree(top_k, depth))


# ------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("name", list(HEADS))
def test_greedy_tree_equals_plain_alone_and_mixed(engines, name):
    eng = engines[name]
    assert eng.engine.spec.speculators["mtp"].head.num_layers == HEADS[name][1]
    prompts = encode(eng)
    params = SamplingParams(**GREEDY, max_tokens=20)
    refs = [o.token_ids for o in eng.generate(prompts, params)]
    for spec in (tree(8, 2, 4), tree(6, 3, 2), tree(12, 8, 3), tree(8, 4, 6)):
        outs = eng.generate(prompts, params, spec)
        assert [o.token_ids for o in outs] == refs, spec
        assert all(o.spec_stats.num_tree_steps > 0 and not o.spec_stats.cuts for o in outs), spec
        assert sum(o.spec_stats.num_accepted_tokens for o in outs) > 0, spec
    mixed = [tree(8, 3, 3), SpecParams("mtp", 4), SpecParams("none", 0), tree(5, 2, 5)]
    outs = eng.generate([prompts[i % 3] for i in range(4)], params, mixed)
    assert [o.token_ids for o in outs] == [refs[i % 3] for i in range(4)]
    assert outs[0].spec_stats.num_tree_steps > 0 and outs[1].spec_stats.num_tree_steps == 0
    assert outs[1].spec_stats.num_drafts > 0 and outs[3].spec_stats.num_tree_steps > 0
    assert_no_leaks(eng)


# ------------------------------------------------------------------------- scores against a reference
def record_trees(eng, monkeypatch) -> list[tuple[list[int], list]]:
    """Log (context, candidates) of every tree the MTP drafter builds (one request at a time)."""
    builder = eng.engine.spec.speculators["mtp"].drafter.trees
    module = draft_tree if type(builder) is draft_tree.HeadTreeBuilder else mtp_tree
    log: list = []
    original, build = module.best_nodes, builder.build

    def record(cands, n):
        log[-1][1].extend(cands)
        return original(cands, n)

    def wrapped(items):
        log.append((list(items[0].request.all_token_ids), []))
        return build(items)
    monkeypatch.setattr(module, "best_nodes", record)
    monkeypatch.setattr(builder, "build", wrapped)
    return log


def score_errors(target_dir, name: str, context: list[int], cands: list) -> list[float]:
    """|score - reference| of every candidate: the reference recomputes every layer over every base for the
    node's path as the drafts (tests/test_spec_mtp.py ref_mtp_probs), one call per leaf."""
    layout, n = HEADS[name]
    parents = {c.parent for c in cands}
    errors: list[float] = []
    for leaf in (i for i in range(len(cands)) if i not in parents):
        path = [leaf]
        while cands[path[0]].parent >= 0:
            path.insert(0, cands[path[0]].parent)
        ref = ref_mtp_probs(target_dir, layout, NUM_LAYERS, n, context, [cands[j].token for j in path],
                            SamplingParams(temperature=1.0))                        # [len(path), V]
        total = 0.0
        for depth, j in enumerate(path):
            total += math.log(float(ref[depth, cands[j].token]))
            errors.append(abs(cands[j].score - total))
    return errors


def tree_score_errors(dirs, engines, name: str, monkeypatch, spec: SpecParams, builds: int = 3) -> list[float]:
    eng = engines[name]
    frozen_tree_scores(eng, monkeypatch)
    log = record_trees(eng, monkeypatch)
    eng.generate(encode(eng)[1:2], SamplingParams(**GREEDY, max_tokens=4 * builds), spec)
    assert len(log) >= builds
    errors: list[float] = []
    for context, cands in log[:builds]:        # the first, and the builds after a tree step
        assert len(cands) > spec.draft_tree.top_k
        errors += score_errors(dirs[name], name, context, cands)
    return errors


@pytest.mark.parametrize("name,spec,rows", [("one", tree(8, 3, 4), None), ("two", tree(8, 3, 4), None),
                                            ("three", tree(8, 3, 5), None), ("three", tree(10, 4, 4), 3)])
def test_every_node_scores_its_paths_reference_log_probs(dirs, engines, name, spec, rows, monkeypatch):
    """rows: at most this many rows per request per forward (more rounds than the default limit gives)."""
    if rows is not None:
        monkeypatch.setattr(mtp_tree, "SHORT_QUERY_MAX", rows)
    errors = tree_score_errors(dirs, engines, name, monkeypatch, spec)
    assert max(errors) < 2e-4, max(errors)


def test_without_the_layer_mask_or_with_the_wrong_parent_scores_differ(dirs, engines, monkeypatch):
    monkeypatch.setattr(mtp_tree, "restrict_rows", lambda attn, seq, allowed: None)    # siblings visible
    assert max(tree_score_errors(dirs, engines, "three", monkeypatch, tree(8, 3, 4), builds=1)) > 1e-2
    monkeypatch.undo()
    hidden = mtp_tree.LayeredTreeBuilder._hidden

    def sibling_state(g, m, node):        # a node at depth >= 2 gets a sibling of its parent's state
        parent = g.cands[node].parent
        if parent >= 0 and g.cands[node].depth <= m:
            sibling = next(c for c in g.out[m - 1] if g.cands[c].depth == g.cands[parent].depth and c != parent)
            return g.out[m - 1][sibling]
        return hidden(g, m, node)
    monkeypatch.setattr(mtp_tree.LayeredTreeBuilder, "_hidden", staticmethod(sibling_state))
    assert max(tree_score_errors(dirs, engines, "three", monkeypatch, tree(8, 3, 4), builds=1)) > 1e-2


# ------------------------------------------------------------------------- after a tree step
def fresh_head_mismatches(eng, monkeypatch) -> tuple[int, int]:
    return fresh_build_mismatches(eng, monkeypatch, record_trees, tree(8, 3, 4), 16)


@pytest.mark.parametrize("name", ["two", "three"])
def test_after_a_tree_step_drafts_equal_a_fresh_heads(engines, name, monkeypatch):
    bad, moved = fresh_head_mismatches(engines[name], monkeypatch)
    assert moved > 0                   # some accepted paths left the first-child line
    assert bad == 0


def test_a_head_that_observes_the_trees_rows_unordered_differs(engines, monkeypatch):
    from specserve.server.engine import engine as engine_module
    monkeypatch.setattr(engine_module, "chain_rows", lambda result, src, dst: result)
    bad, moved = fresh_head_mismatches(engines["two"], monkeypatch)
    assert moved > 0 and bad > 0


# ------------------------------------------------------------------------- the server default
def test_the_server_default_tree_applies_to_mtp():
    from specserve.server.config import EngineConfig, parse_speculation
    cfg = EngineConfig(draft_tree_top_k=3, draft_tree_depth=4)
    cfg.validate()
    assert cfg.with_default_tree(SpecParams("mtp", 8)).draft_tree == DraftTree(3, 4)
    assert cfg.with_default_tree(SpecParams("hybrid", 8)).draft_tree is None        # chains only
    assert parse_speculation({"method": "mtp", "num_speculative_tokens": 8,
                              "draft_tree": {"top_k": 4, "depth": 3}}).draft_tree == DraftTree(4, 3)
