"""make bench-tree's script on the smallest grid, for the EAGLE-3 head and the draft model: one chain row and
one tree row, the tree's build time reported beside the step time (the real run is docs/benchmarks.md's)."""
from __future__ import annotations

import pytest

from loadtest import bench_tree

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("method", ["eagle3", "draft"])
def test_bench_tree_smoke(method):
    rows = bench_tree.main(["--method", method, "--n", "3", "--trees", "2x2", "--concurrency", "1",
                            "--temperatures", "0", "--prompt-sets", "prose", "--prompts", "1", "--prompts-batch1", "1",
                            "--max-tokens", "6"])
    assert [r["config"] for r in rows] == ["chain k=3", "tree 2x2"]
    chain, tree = rows
    assert chain["build_us"] == 0 < tree["build_us"] < tree["step_us"]
    assert all(r["tokens_per_step"] >= 1 and r["tok_s"] > 0 and r["draft_us"] > 0 for r in rows)
