"""Draft trees (speculators/draft_tree.py) with a random EAGLE-3 head on a tiny random target: greedy tree
output equals plain greedy, alone and in batches mixing trees, chains and plain decoding; top_k 1 is the
chain; the accepted path's K/V are compacted so later steps see only it; the request field is checked."""
from __future__ import annotations

import pytest
from test_spec_draft_model import GREEDY, assert_no_leaks, encode, make_engine
from test_spec_eagle3 import eagle_weights, write_eagle_original, write_target

from specserve.sampling.params import SamplingParams
from specserve.server.config import parse_speculation
from specserve.speculators.base import DraftTree, SpecParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    target = write_target(root / "target")
    head = write_eagle_original(root / "head", eagle_weights(seed=7))
    return make_engine(target, eagle3=str(head))


def tree(k: int, top_k: int, depth: int) -> SpecParams:
    return SpecParams("eagle3", k, draft_tree=DraftTree(top_k, depth))


def test_greedy_tree_equals_plain_alone_and_mixed(engine):
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=24)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    for spec in (tree(8, 2, 4), tree(6, 3, 2), tree(8, 4, 5)):
        out = engine.generate([prompts[0]], params, spec)[0]
        assert out.token_ids == refs[0], spec
        assert out.spec_stats.num_tree_steps > 0
    mixed = [tree(8, 3, 3), SpecParams("eagle3", 4), SpecParams("none", 0)]
    outs = engine.generate(prompts, params, mixed)
    assert [o.token_ids for o in outs] == refs
    assert outs[0].spec_stats.num_tree_steps > 0 and outs[1].spec_stats.num_tree_steps == 0
    assert_no_leaks(engine)


def test_parse_draft_tree_field():
    assert parse_speculation({"method": "eagle3", "num_speculative_tokens": 8,
                              "draft_tree": {"top_k": 4, "depth": 3}}).draft_tree == DraftTree(4, 3)
    for bad in ({"top_k": 0}, {"top_k": 2, "depth": 9}, {"top_k": "2"}, {"depth": 2}, [2],
                {"top_k": 2, "depth": 2, "x": 1}, {"top_k": 99}):
        with pytest.raises(ValueError):
            parse_speculation({"method": "eagle3", "num_speculative_tokens": 8, "draft_tree": bad})
    with pytest.raises(ValueError, match="drafts chains only"):
        parse_speculation({"method": "ngram", "num_speculative_tokens": 4, "draft_tree": {"top_k": 2}})
