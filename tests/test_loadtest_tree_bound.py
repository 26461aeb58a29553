"""loadtest/tree_bound.py: the best N-node tree of first and second choices, and the per-depth rates it is fed."""
from __future__ import annotations

import itertools
import random

import pytest
from test_spec_draft_model import TEXTS, write_llama

from loadtest.tree_bound import best_tree, measure
from specserve import LLM
from specserve.server.config import EngineConfig

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def brute_force(first, second, n):
    """Every node up to the rates' depth as a path of choices (0: first, 1: second), its product, the n best."""
    products = []
    for depth in range(1, len(first) + 1):
        for path in itertools.product((0, 1), repeat=depth):
            p = 1.0
            for d, c in enumerate(path):
                p *= first[d] if c == 0 else (1.0 - first[d]) * second[d]
            products.append(p)
    return 1.0 + sum(sorted(products, reverse=True)[:n])


def test_the_best_tree_is_the_n_most_likely_nodes_and_never_below_the_chain():
    assert best_tree([0.5, 0.5], [1.0, 1.0], 2) == (1.75, 2.0)
    chain, tree = best_tree([0.8, 0.7, 0.6], [0.0, 0.0, 0.0], 3)
    assert chain == tree == pytest.approx(1 + 0.8 + 0.56 + 0.336)       # no second choice is ever right
    rng = random.Random(0)
    for _ in range(50):
        depth, n = rng.randint(1, 6), rng.randint(1, 10)
        first = [rng.random() for _ in range(depth)]
        second = [rng.random() for _ in range(depth)]
        chain, tree = best_tree(first, second, n)
        assert tree == pytest.approx(brute_force(first, second, n))
        assert tree >= chain - 1e-12


def test_a_drafter_equal_to_the_target_is_always_right_first(tmp_path):
    target = write_llama(tmp_path / "target", seed=0)
    same = write_llama(tmp_path / "draft", seed=0)                      # the target's own weights
    eng = LLM(config=EngineConfig(model=str(target), draft_model=str(same), dtype="float32", device="cpu",
                                  num_threads=1, kv_cache_memory_gb=0.01, speculation_probe_tokens=0,
                                  speculation_policy="fixed"))
    prompts = [eng.engine.tokenizer.encode(t) for t in TEXTS]
    got = measure(eng, "draft", prompts, 4, 17)
    assert got["steps"][0] >= 3 * len(prompts)
    assert got["reach"] == [1.0] * 4 and got["first"] == [1.0] * 4
    other = write_llama(tmp_path / "other", seed=3)                     # a drafter that is not the target
    eng = LLM(config=EngineConfig(model=str(target), draft_model=str(other), dtype="float32", device="cpu",
                                  num_threads=1, kv_cache_memory_gb=0.01, speculation_probe_tokens=0,
                                  speculation_policy="fixed"))
    got = measure(eng, "draft", prompts, 4, 17)
    assert got["reach"][0] == 1.0 and got["first"][0] < 1.0 and 0.0 <= got["second"][0] <= 1.0
    assert not eng.engine.has_work
