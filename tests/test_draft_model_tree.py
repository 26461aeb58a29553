"""Draft trees for the draft model (speculators/draft_model_tree.py) on a tiny random target whose draft is
its own first two layers (with its embedding, final norm and lm_head: a layer-skip draft). The random target
is close to a bigram model, so the draft predicts it well and accepts paths off a node's first child too.

Checks: greedy tree output equals plain greedy, alone and in a batch mixing trees, chains and plain requests,
and seeded tree text equals plain seeded, alone and in a batch with chains, plain decoding, unseeded and greedy
trees; every node's score equals the sum along its path of the log-probabilities of a from-scratch
transformers forward of the draft over context + path (the first build and the builds after tree steps);
after a tree step the drafts equal those of a fresh request's draft, which never saw the tree's rows (and do
not when the draft trusts the tree's first-child line as a chain's KV, a planted bug); the server default
tree applies to draft.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_draft_tree import fresh_build_mismatches, frozen_tree_scores
from test_spec_draft_model import (
    BASE,
    GREEDY,
    Rand,
    assert_no_leaks,
    encode,
    llama_tensors,
    make_engine,
    vocab_size,
    write_checkpoint,
)

from specserve.sampling.params import SamplingParams
from specserve.speculators import draft_model_tree
from specserve.speculators.base import DraftTree, SpecParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")
DRAFT_LAYERS = 2                      # of the target's BASE["num_hidden_layers"] = 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-model-tree")
    cfg = {**BASE, "vocab_size": vocab_size()}
    tensors = llama_tensors(cfg, Rand(0))
    first = {k: v for k, v in tensors.items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < DRAFT_LAYERS}
    return {"target": write_checkpoint(root / "target", cfg, tensors),
            "draft": write_checkpoint(root / "draft", {**cfg, "num_hidden_layers": DRAFT_LAYERS}, first)}


@pytest.fixture(scope="module")
def engine(dirs):
    return make_engine(dirs["target"], draft_model=str(dirs["draft"]))


def tree(k: int, top_k: int, depth: int) -> SpecParams:
    return SpecParams("draft", k, draft_tree=DraftTree(top_k, depth))


# ------------------------------------------------------------------------- greedy equality
def test_greedy_tree_equals_plain_alone_and_mixed(engine):
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=20)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    for spec in (tree(8, 2, 4), tree(6, 3, 2), tree(15, 8, 3), tree(12, 4, 6)):
        out = engine.generate([prompts[0]], params, spec)[0]
        assert out.token_ids == refs[0], spec
        assert out.spec_stats.num_tree_steps > 0 and not out.spec_stats.cuts, spec
        assert out.spec_stats.num_accepted_tokens > 0, spec
    mixed = [tree(8, 3, 3), SpecParams("draft", 4), SpecParams("none", 0), tree(5, 2, 5)]
    outs = engine.generate([prompts[i % 3] for i in range(4)], params, mixed)
    assert [o.token_ids for o in outs] == [refs[i % 3] for i in range(4)]
    assert outs[0].spec_stats.num_tree_steps > 0 and outs[1].spec_stats.num_tree_steps == 0
    assert outs[1].spec_stats.num_drafts > 0 and outs[3].spec_stats.num_tree_steps > 0
    assert_no_leaks(engine)


def test_seeded_tree_text_equals_plain_seeded_alone_and_mixed(engine):
    """A seeded tree's children are the best of the draft's coupled scores (the first: the chain's coupled
    draft); the verifier follows the target's coupled choice, so the text is plain seeded text, alone and in a
    batch with chains, plain decoding, an unseeded tree and a greedy tree."""
    prompts = encode(engine)
    params = SamplingParams(temperature=0.8, seed=5, top_p=0.95, max_tokens=20, ignore_eos=True)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    outs = engine.generate(prompts, params, tree(8, 3, 4))
    assert [o.token_ids for o in outs] == refs
    assert all(o.spec_stats.num_tree_steps > 0 for o in outs)
    assert sum(o.spec_stats.num_accepted_tokens for o in outs) > 0
    other = SamplingParams(temperature=0.8, seed=9, max_tokens=20, ignore_eos=True)
    other_ref = engine.generate(prompts[:1], other)[0].token_ids
    unseeded = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    mixed_params = [params, params, params, other, unseeded, SamplingParams(**GREEDY, max_tokens=20)]
    mixed_spec = [tree(8, 3, 4), SpecParams("draft", 4), SpecParams("none", 0), tree(6, 2, 3), tree(8, 2, 4),
                  tree(8, 3, 3)]
    mixed = engine.generate([prompts[i % 3] for i in range(3)] + [prompts[0]] * 3, mixed_params, mixed_spec)
    assert [o.token_ids for o in mixed[:3]] == refs and mixed[3].token_ids == other_ref
    assert len(mixed[4].token_ids) == 20
    assert mixed[5].token_ids == engine.generate(prompts[:1], mixed_params[5])[0].token_ids
    assert all(mixed[i].spec_stats.num_tree_steps > 0 for i in (0, 3, 4, 5))


# ------------------------------------------------------------------------- scores against a reference
def record_trees(engine, monkeypatch) -> list[tuple[list[int], list]]:
    """Log (context, candidates) of every tree the draft model builds (one request at a time)."""
    builder = engine.engine.spec.speculators["draft"].trees
    log: list = []
    original, build = draft_model_tree.best_nodes, builder.build

    def record(cands, n):
        log[-1][1].extend(cands)
        return original(cands, n)

    def wrapped(items, logits):
        log.append((list(items[0].request.all_token_ids), []))
        return build(items, logits)
    monkeypatch.setattr(draft_model_tree, "best_nodes", record)
    monkeypatch.setattr(builder, "build", wrapped)
    return log


def score_errors(hf, context: list[int], cands: list) -> list[float]:
    """|score - reference| of every candidate: per leaf, one transformers forward of the draft over context +
    the leaf's path, each node's reference the sum of its path's log-probabilities."""
    parents = {c.parent for c in cands}
    errors: list[float] = []
    for leaf in (i for i in range(len(cands)) if i not in parents):
        path = [leaf]
        while cands[path[0]].parent >= 0:
            path.insert(0, cands[path[0]].parent)
        tokens = [cands[j].token for j in path]
        with torch.no_grad():
            logits = hf(torch.tensor([context + tokens[:-1]])).logits[0, len(context) - 1:]   # [len(path), V]
        logprobs = logits.double().log_softmax(dim=-1)
        total = 0.0
        for depth, j in enumerate(path):
            total += float(logprobs[depth, cands[j].token])
            errors.append(abs(cands[j].score - total))
    return errors


@pytest.mark.parametrize("spec", [tree(8, 3, 4), tree(10, 4, 5)])
def test_every_node_scores_its_paths_reference_log_probs(dirs, engine, spec, monkeypatch):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(dirs["draft"]).float().eval()
    frozen_tree_scores(engine, monkeypatch)
    log = record_trees(engine, monkeypatch)
    engine.generate(encode(engine)[1:2], SamplingParams(**GREEDY, max_tokens=12), spec)
    assert len(log) >= 3
    errors: list[float] = []
    for context, cands in log[:3]:             # the first build, and builds after tree steps
        assert len(cands) > spec.draft_tree.top_k
        errors += score_errors(hf, context, cands)
    assert max(errors) < 1e-4, max(errors)        # ~5e-6 measured; without the ancestor mask > 0.1


# ------------------------------------------------------------------------- after a tree step
def fresh_draft_mismatches(engine, monkeypatch) -> tuple[int, int]:
    return fresh_build_mismatches(engine, monkeypatch, record_trees, tree(8, 3, 4), 24)


def test_after_a_tree_step_drafts_equal_a_fresh_drafts(engine, monkeypatch):
    bad, moved = fresh_draft_mismatches(engine, monkeypatch)
    assert moved > 0                   # some accepted paths left the first-child line
    assert bad == 0


def test_a_draft_that_reads_the_tree_rows_as_a_chain_differs(engine, monkeypatch):
    """Planted bug: after building, the draft claims the tree's first-child line as a chain's speculative
    drafts (KV at keys N, N + 1, ...), so when the target accepts that line the next propose trusts key N + 1,
    which holds the first node's sibling."""
    builder = engine.engine.spec.speculators["draft"].trees
    build = builder.build

    def chain_claim(items, logits):
        out = build(items, logits)
        for item, (tokens, parents, _) in zip(items, out):
            line, node = [], 0
            while node is not None:
                line.append(tokens[node])
                node = next((j for j, p in enumerate(parents) if p == node), None)
            item.state.speculative = line
        return out
    monkeypatch.setattr(builder, "build", chain_claim)
    bad, _ = fresh_draft_mismatches(engine, monkeypatch)
    assert bad > 0


# ------------------------------------------------------------------------- the server default
def test_the_server_default_tree_applies_to_draft(engine):
    from specserve.server.cli import build_parser, configs_from_args
    from specserve.server.config import parse_speculation
    argv = ["serve", "--speculation", '{"method": "draft", "num_speculative_tokens": 8}',
            "--draft-tree-top-k", "3", "--draft-tree-depth", "4"]
    cfg = configs_from_args(build_parser().parse_args(argv))[0]
    assert cfg.default_speculation(["draft"]).draft_tree == DraftTree(3, 4)
    assert cfg.with_default_tree(SpecParams("draft", 2)).draft_tree == DraftTree(3, 2)      # depth <= k
    assert parse_speculation({"method": "draft", "num_speculative_tokens": 8,
                              "draft_tree": {"top_k": 4, "depth": 3}}).draft_tree == DraftTree(4, 3)
    spec = cfg.with_default_tree(SpecParams("draft", 6))
    prompts = encode(engine)[2:]
    params = SamplingParams(**GREEDY, max_tokens=12)
    out = engine.generate(prompts, params, spec)[0]
    assert out.token_ids == engine.generate(prompts, params)[0].token_ids
    assert out.spec_stats.num_tree_steps > 0
