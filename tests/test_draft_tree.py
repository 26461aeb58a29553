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
from specserve.speculators.tree_calibration import ScoreCalibration

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
        parse_speculation({"method": "hybrid", "num_speculative_tokens": 4, "draft_tree": {"top_k": 2}})


# ------------------------------------------------------------------- the embedded family (a trained head)
@pytest.fixture(scope="module")
def embedded():
    from specserve.server.config import EngineConfig
    from specserve.server.engine.offline import OfflineEngine
    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, kv_cache_memory_gb=0.05,
                       speculation_policy="fixed", speculation_probe_tokens=0)
    eng = OfflineEngine.from_config(cfg)
    tok = eng.engine.tokenizer
    return eng, [tok.encode(t) for t in ("The history of the city began", "def fibonacci(n):")]


def moved_rows(monkeypatch) -> list[int]:
    """Counts the K/V rows the engine's compaction moves (branches accepted off the first child)."""
    from specserve.server.engine import engine as engine_module
    moved: list[int] = []
    original = engine_module.accepted_moves

    def counting(*args):
        src, dst = original(*args)
        moved.append(len(src))
        return src, dst
    monkeypatch.setattr(engine_module, "accepted_moves", counting)
    return moved


def frozen_tree_scores(eng, monkeypatch) -> None:
    """Greedy node scores stay log q (T = 1, speculators/tree_calibration.py) while a test compares them
    with a reference or across builds."""
    monkeypatch.setattr(ScoreCalibration, "set_target", lambda self, acceptance: None)
    for spec in eng.engine.spec.speculators.values():
        trees = getattr(getattr(spec, "drafter", spec), "trees", None)
        if trees is not None:
            monkeypatch.setattr(trees.calibration, "temperature", 1.0)


def fresh_build_mismatches(eng, monkeypatch, record_trees, spec: SpecParams, max_tokens: int) -> tuple[int, int]:
    """A tree run's builds after its first, each against the first build of a new request whose prompt is
    that context minus its last token (a drafter that never saw any tree) -> (mismatching builds, moved rows).
    record_trees(eng, monkeypatch) -> the list it fills with (context, candidates) per build."""
    frozen_tree_scores(eng, monkeypatch)
    moved = moved_rows(monkeypatch)
    log = record_trees(eng, monkeypatch)
    eng.generate(encode(eng)[:1], SamplingParams(**GREEDY, max_tokens=max_tokens), spec)
    runs = log[1:]
    bad = 0
    for context, cands in runs:
        del log[:]
        eng.generate([context[:-1]], SamplingParams(**GREEDY, max_tokens=10), spec)
        assert log[0][0] == context                  # the fresh request's first tree: the same context
        fresh = log[0][1]
        same = len(fresh) == len(cands) and all(
            (a.token, a.parent, a.depth) == (b.token, b.parent, b.depth) and abs(a.score - b.score) < 1e-4
            for a, b in zip(fresh, cands))
        bad += not same
    assert len(runs) >= 3
    return bad, sum(moved)


def test_after_a_tree_step_the_target_sees_only_the_accepted_path(embedded, monkeypatch):
    """Greedy with top-5 logprobs: every row the tree run samples from (the next step's logits included)
    equals the plain run's, which never saw the rejected branches. Without the compaction the K/V of a
    branch accepted off the first child sits in the wrong slots, and the text or the logprobs differ."""
    eng, prompts = embedded
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    refs = eng.generate(prompts, params)
    moved = moved_rows(monkeypatch)
    outs = eng.generate(prompts, params, tree(8, 4, 4))
    assert sum(moved) > 0                                   # some accepted paths left the first-child line
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        assert out.spec_stats.num_accepted_tokens > out.spec_stats.num_tree_steps   # > 1 accepted per step
        for got, want in zip(out.logprobs, ref.logprobs):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
    from specserve.server.engine import engine as engine_module
    monkeypatch.setattr(engine_module, "compact_tree_kv", lambda *args: None)
    broken = eng.generate(prompts, params, tree(8, 4, 4))
    assert any(b.token_ids != r.token_ids or any(abs(x.logprob - y.logprob) > 1e-3
                                                 for x, y in zip(b.logprobs, r.logprobs))
               for b, r in zip(broken, refs))


def test_seeded_tree_text_equals_plain_seeded(embedded):
    eng, prompts = embedded
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=32, ignore_eos=True, top_p=0.95,
                            presence_penalty=0.3)
    refs = [o.token_ids for o in eng.generate(prompts, params)]
    outs = eng.generate(prompts, params, tree(8, 3, 4))
    assert [o.token_ids for o in outs] == refs
    assert all(o.spec_stats.num_accepted_tokens > 0 for o in outs)


def test_top_k_1_is_the_chain_bit_for_bit(embedded):
    eng, prompts = embedded
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    chain = eng.generate(prompts, params, SpecParams("eagle3", 6))
    one = eng.generate(prompts, params, tree(6, 1, 6))
    for a, b in zip(chain, one):
        assert a.token_ids == b.token_ids
        assert a.spec_stats.accepted_per_pos == b.spec_stats.accepted_per_pos
        assert b.spec_stats.num_tree_steps == 0 and b.spec_stats.draft_tree is None


def test_tree_shape_and_accepted_depth_reach_the_response_and_metrics(embedded):
    from prometheus_client import CollectorRegistry

    from specserve.server.api.responses import SpeculationInfo
    from specserve.server.metrics import Metrics
    eng, prompts = embedded
    engine = eng.engine
    metrics = Metrics("m", registry=CollectorRegistry())
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = tree(8, 4, 4)
    engine.add_request("t", prompts[0], params, spec)
    engine.add_request("c", prompts[1], params, SpecParams("eagle3", 4))
    done = {}
    while engine.has_work:
        outs, stats = engine.step()
        metrics.on_step(stats)
        done.update({o.request_id: o for o in outs if o.finished})
    st = done["t"].spec_stats
    info = SpeculationInfo.from_stats([st], spec).model_dump()["draft_tree"]
    assert (info["top_k"], info["depth"]) == (4, 4)
    assert info["num_tree_steps"] == st.num_drafts and info["num_tree_nodes"] == st.num_draft_tokens
    assert sum(d * n for d, n in enumerate(info["accepted_depth"])) == st.num_accepted_tokens
    assert info["mean_accepted_depth"] == pytest.approx(st.num_accepted_tokens / st.num_drafts)
    assert SpeculationInfo.from_stats([done["c"].spec_stats], SpecParams("eagle3", 4)).draft_tree is None
    text = metrics.render().decode()
    for shape, s in (("tree", st), ("chain", done["c"].spec_stats)):
        assert _sample(text, "spec_decode_accepted_depth_count", shape) == s.num_drafts
        assert _sample(text, "spec_decode_accepted_depth_sum", shape) == s.num_accepted_tokens
    assert _sample(text, "spec_decode_num_tree_nodes_total") == st.num_draft_tokens


def _sample(text: str, name: str, shape: str | None = None) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"specserve:{name}{{") and (shape is None or f'draft="{shape}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return None



def test_lookup_trees_siblings_are_earlier_matches_and_greedy_equals_plain(tiny_model_dir):
    import numpy as np

    from specserve.speculators.ngram import match_tree
    ctx = np.array([1, 2, 7, 8, 5, 1, 2, 7, 9, 6, 1, 2], dtype=np.int64)
    assert match_tree(ctx, 1, 4, 8, DraftTree(2, 2)) == ([7, 9, 8], [-1, 0, 0])   # latest continuation first
    assert match_tree(ctx, 1, 4, 2, DraftTree(2, 3)) == ([7, 9], [-1, 0])         # k nodes, depth order
    engine = make_engine(tiny_model_dir, kv_gb=0.02)      # a random model that repeats itself
    tok = engine.engine.tokenizer
    texts = ("def add(a, b):\n    return a + b\n\ndef add(a, c):\n    return a - c\n\ndef add(a,",
             "x = [1, 2, 3]\ny = [1, 2, 4]\nz = [1, 2,", "The quick brown fox. The quick red fox. The quick")
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(**GREEDY, max_tokens=40)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    specs = [SpecParams("ngram", 8, draft_tree=DraftTree(3, 4)), SpecParams("ngram", 4),
             SpecParams("ngram", 6, draft_tree=DraftTree(2, 6)), SpecParams("suffix", 6, draft_tree=DraftTree(2, 4))]
    outs = engine.generate([prompts[i % 3] for i in range(4)], params, specs)
    assert [o.token_ids for o in outs] == [refs[i % 3] for i in range(4)]
    for out in (outs[0], outs[2], outs[3]):
        assert out.spec_stats.num_tree_steps > 0 and out.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(engine)


def test_a_tree_request_over_http_reports_its_tree(http):
    from conftest import SERVED_NAME
    body = {"model": SERVED_NAME, "prompt": "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,", "max_tokens": 12,
            "temperature": 0, "speculation": {"method": "ngram", "num_speculative_tokens": 6,
                                              "draft_tree": {"top_k": 2, "depth": 3}}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    spec = r.json()["speculation"]
    assert spec["draft_tree"]["top_k"] == 2 and spec["draft_tree"]["depth"] == 3
    assert spec["draft_tree"]["num_tree_steps"] == spec["num_drafts"]


def test_grammar_masks_each_tree_row_after_its_own_path(embedded):
    """A JSON-schema constraint: each tree row is masked after that node's path, so greedy and seeded tree
    output equal plain constrained decoding, and the text is valid (masking every row with the root's mask,
    a planted bug, breaks the equality)."""
    import json

    from specserve.sampling.params import StructuredSpec
    eng, prompts = embedded
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}
    spec_json = StructuredSpec("json", json.dumps(schema))
    for params in (SamplingParams(temperature=0.0, max_tokens=48, structured=spec_json),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=48, structured=spec_json)):
        refs = eng.generate(prompts, params)
        outs = eng.generate(prompts, params, tree(8, 3, 4))
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
        assert all(o.spec_stats.num_tree_steps > 0 for o in outs)
        for o in outs:
            if o.finish_reason == "stop":
                assert set(json.loads(o.text)) == {"name", "age"}


def test_server_default_tree_flags():
    from specserve.server.cli import build_parser, configs_from_args
    from specserve.server.config import EngineConfig
    cfg = EngineConfig(draft_tree_top_k=3, draft_tree_depth=4)
    cfg.validate()
    assert cfg.with_default_tree(SpecParams("eagle3", 8)).draft_tree == DraftTree(3, 4)
    assert cfg.with_default_tree(SpecParams("eagle3", 2)).draft_tree == DraftTree(3, 2)   # depth <= k
    assert cfg.with_default_tree(SpecParams("mtp", 8)).draft_tree == DraftTree(3, 4)     # MTP of any depth
    assert cfg.with_default_tree(SpecParams("draft", 8)).draft_tree == DraftTree(3, 4)   # the draft model
    assert cfg.with_default_tree(SpecParams("hybrid", 8)).draft_tree is None             # chains only
    explicit = SpecParams("eagle3", 8, draft_tree=DraftTree(1, 8))                          # asked for the chain
    assert cfg.with_default_tree(explicit) is explicit
    assert EngineConfig().with_default_tree(SpecParams("eagle3", 8)).draft_tree is None    # default: chains
    for argv in (["--draft-tree-top-k", "99"], ["--draft-tree-top-k", "2", "--draft-tree-depth", "0"],
                 ["--draft-tree-top-k", "2", "--max-speculative-tokens", "32", "--draft-tree-depth", "20"]):
        with pytest.raises(ValueError, match="draft_tree"):
            configs_from_args(build_parser().parse_args(["serve", *argv]))
    wide = EngineConfig(draft_tree_top_k=2, draft_tree_depth=4, max_speculative_tokens=32)
    wide.validate()
    assert wide.with_default_tree(SpecParams("eagle3", 20)).draft_tree is None            # k > 15: the chain


def test_sharded_targets_refuse_trees():
    from specserve.server.config import EngineConfig
    from specserve.server.engine.spec_dispatch import SpecDispatcher
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(draft_tree_top_k=2, tensor_parallel_size=2).validate()
    spec = SpecDispatcher({})
    spec.trees_allowed = False
    with pytest.raises(ValueError, match="tensor-parallel"):
        spec.validate(SpecParams("none", 0, draft_tree=DraftTree(2, 2)))
    spec.validate(SpecParams("none", 0, draft_tree=DraftTree(1, 2)))      # the chain is fine
