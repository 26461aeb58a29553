"""The two forwards a draft tree adds, each against one plain forward per root-to-leaf path: the target's
tree-masked verification (server/models/tree_attention.py, per-depth positions) and the EAGLE-3 head's
tree building (speculators/draft_tree.py: each node's cumulative score is the sum of the head's
log-probabilities along its path, recomputed from scratch by the reference head of test_spec_eagle3)."""
from __future__ import annotations

import math

import pytest
import torch
from test_spec_draft_model import encode, make_engine
from test_spec_eagle3 import eagle_weights, ref_eagle_probs, write_eagle_original, write_target

from specserve.sampling.params import SamplingParams
from specserve.server.models.attention import build_attention_metadata
from specserve.server.models.attention_metadata import SHORT_QUERY_MAX
from specserve.server.models.loader import load_model
from specserve.server.models.tree_attention import ancestor_rows, node_depths, restrict_rows
from specserve.speculators import draft_tree
from specserve.speculators.base import DraftTree, SpecParams
from specserve.speculators.tree_shape import TREE_MAX_NODES

pytestmark = pytest.mark.usefixtures("single_torch_thread")
BS = 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_attention")
    return {"target": write_target(root / "target"), "head": write_eagle_original(root / "head", eagle_weights(7))}


def kv_for(cfg, blocks: int):
    return [(torch.zeros(blocks, BS, cfg.num_key_value_heads, cfg.head_dim),
             torch.zeros(blocks, BS, cfg.num_key_value_heads, cfg.head_dim)) for _ in range(cfg.num_hidden_layers)]


@torch.inference_mode()
def plain_last_logits(model, cfg, tokens: list[int]) -> torch.Tensor:
    blocks = -(-len(tokens) // BS)
    attn = build_attention_metadata([len(tokens)], [len(tokens)], [list(range(blocks))], BS, torch.device("cpu"))
    out = model.forward_states(torch.tensor(tokens), attn, kv_for(cfg, blocks))
    return model.compute_logits(out.hidden[-1:])[0]                                  # [vocab]


def test_tree_limits_fit_one_padded_attention_call():
    assert TREE_MAX_NODES == SHORT_QUERY_MAX - 1


@torch.inference_mode()
def test_tree_masked_verification_equals_a_plain_forward_per_path(dirs):
    model, cfg = load_model(dirs["target"], dtype=torch.float32)
    context = [5, 91, 300, 7, 12, 44, 873, 2, 19]                  # the last one is the root row's token
    tokens = [40, 41, 42, 43, 44, 45, 46, 47]
    parents = [-1, -1, 0, 0, 1, 2, 5, -1]                            # depths 1 1 2 2 2 3 4 1
    n, base = len(tokens), len(context) - 1
    blocks = -(-(len(context) + n) // BS)
    kv = kv_for(cfg, blocks)
    table = [list(range(blocks))]
    pre = build_attention_metadata([base], [base], table, BS, torch.device("cpu"), backend="sdpa")
    model.forward_states(torch.tensor(context[:-1]), pre, kv)    # the context's K/V
    attn = build_attention_metadata([n + 1], [base + n + 1], table, BS, torch.device("cpu"), backend="sdpa")
    allowed = torch.zeros(n + 1, base + n + 1, dtype=torch.bool)
    allowed[:, :base] = True
    allowed[:, base:] = ancestor_rows(parents)
    restrict_rows(attn, 0, allowed)
    attn.positions = torch.tensor([base] + [base + d for d in node_depths(parents)])
    out = model.forward_states(torch.tensor([context[-1], *tokens]), attn, kv)
    logits = model.compute_logits(out.hidden)                                        # [n + 1, vocab]
    paths = [[]]
    for tok, parent in zip(tokens, parents):
        paths.append([*paths[parent + 1], tok])
    for r, path in enumerate(paths):
        torch.testing.assert_close(logits[r], plain_last_logits(model, cfg, context + path), atol=2e-5, rtol=1e-4)
    # the chain's mask is the causal one: a tree whose nodes each hang off the previous one
    chain = ancestor_rows([-1, 0, 1])
    assert torch.equal(chain, torch.ones(4, 4, dtype=torch.bool).tril())


def test_head_tree_scores_follow_a_from_scratch_reference(dirs, monkeypatch):
    eng = make_engine(dirs["target"], eagle3=str(dirs["head"]), enable_prefix_caching=False)
    seen: list[tuple[list[int], list]] = []
    builder = eng.engine.spec.speculators["eagle3"].drafter.trees
    build = builder.build

    def record(cands, n):
        seen.append((list(current[0]), list(cands)))
        return original(cands, n)

    def wrapped(items):
        current[0] = items[0].request.all_token_ids
        return build(items)
    current: list = [None]
    original = draft_tree.best_nodes
    monkeypatch.setattr(draft_tree, "best_nodes", record)
    monkeypatch.setattr(builder, "build", wrapped)
    eng.generate(encode(eng)[:1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                 SpecParams("eagle3", 8, draft_tree=DraftTree(3, 3)))
    assert seen
    params = SamplingParams(temperature=1.0)
    for context, cands in seen[:2]:
        assert len(cands) == 3 + 2 * 9                              # K first tokens, K * K per later depth
        for c in cands[::4]:
            path, node = [], c
            while True:
                path.insert(0, node.token)
                if node.parent < 0:
                    break
                node = cands[node.parent]
            ref = ref_eagle_probs(dirs["head"] / "model.safetensors", dirs["target"], context, path, params,
                                  norm_before_residual=False)           # [len(path), V]
            expected = sum(math.log(float(ref[j, t])) for j, t in enumerate(path))
            assert c.score == pytest.approx(expected, abs=2e-4), (path, c)
