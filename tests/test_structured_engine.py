"""Structured outputs in the engine, exact under every speculator (tiny random target + drafters).

Greedy output under a JSON schema and under a regex is the same with every method as without
speculation; grammar-forbidden drafts are rejected at their position and counted; the masks of a
step are computed with the draft prefix; drafters propose under the mask. The sampling test
(chi-square on the first two tokens under a grammar, speculative vs the exact masked target) lives
in tests/test_structured_sampling.py, the randomized validation run in tests/test_structured_fuzz.py.
"""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
from test_spec_draft_model import make_engine, write_llama
from test_spec_eagle3 import eagle_weights, write_eagle_original
from test_spec_mtp import write_mtp_target

from specserve.grammar.backend import GrammarError
from specserve.grammar.compiler import GrammarCompiler, GrammarLimits
from specserve.grammar.llguidance_backend import LLGuidanceBackend
from specserve.sampling.params import SamplingParams, StructuredSpec
from specserve.speculators.base import SpecParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3}},
    "required": ["name", "count", "ok", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}(\.[a-z]{1,4})?"
METHODS = [("ngram", 4), ("prediction", 4), ("draft", 3), ("eagle3", 4), ("mtp", 2), ("hybrid", 4), ("auto", 4)]
PROMPTS = ['{"name": "ab", "count": 1, "ok": true, "tags": []}\n{"name": "ab", "count": 1, ',
           "Answer as JSON: ", "abc-12.de abc-12.de abc-"]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    target = write_mtp_target(root / "target", "deepseek_v3", num_mtp=2)
    return make_engine(target, kv_gb=0.01, draft_model=str(write_llama(root / "draft", seed=4, num_hidden_layers=1)),
                       eagle3=str(write_eagle_original(root / "eagle3", eagle_weights(seed=9))))


def encode(engine, texts=PROMPTS):
    return [engine.engine.tokenizer.encode(t) for t in texts]


def constrained(spec: StructuredSpec, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=kw.pop("max_tokens", 64),
                          structured=spec, **kw)


@pytest.mark.parametrize("spec", [StructuredSpec("json", json.dumps(SCHEMA)), StructuredSpec("regex", REGEX)],
                         ids=["json_schema", "regex"])
def test_greedy_with_every_method_equals_plain_greedy(engine, spec):
    prompts = encode(engine)
    params = constrained(spec)
    refs = engine.generate(prompts, params)
    assert all(r.finish_reason == "stop" for r in refs)
    for ref in refs:                               # the constraint holds on the reference itself
        if spec.kind == "json":
            jsonschema.validate(json.loads(ref.text), SCHEMA)
    drafted = 0
    for method, k in METHODS:
        preds = [r.token_ids[:3] + [5, 6, 7] + r.token_ids[3:] for r in refs] if method == "prediction" else None
        outs = engine.generate(prompts, params, SpecParams(method, k), predictions=preds)
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs], method
        drafted += sum(o.spec_stats.num_draft_tokens for o in outs)
        # batch 1 too (a batch of one constrained request takes other code paths in the sampler)
        one = engine.generate([prompts[1]], params, SpecParams(method, k),
                              predictions=preds[1:2] if preds else None)[0]
        assert one.token_ids == refs[1].token_ids, method
    assert drafted > 50


@pytest.mark.parametrize("spec", [StructuredSpec("json", json.dumps(SCHEMA)), StructuredSpec("regex", REGEX)],
                         ids=["json_schema", "regex"])
def test_seeded_sampling_under_a_grammar_equals_plain_seeded_with_every_method(engine, spec):
    """Coupled sampling reads the grammar-masked distribution: a seeded T = 0.8 request under a schema
    emits plain seeded decoding's tokens with every method, batched and alone."""
    prompts = encode(engine)
    params = [constrained(spec, temperature=0.8, top_p=0.95, seed=77 + i) for i in range(len(prompts))]
    refs = engine.generate(prompts, params)
    assert len({tuple(r.token_ids) for r in refs}) == len(refs)
    for ref in refs:
        if spec.kind == "json":
            jsonschema.validate(json.loads(ref.text), SCHEMA)
    drafted = 0
    for method, k in METHODS:
        preds = [r.token_ids[:2] + [5, 6] + r.token_ids[2:] for r in refs] if method == "prediction" else None
        outs = engine.generate(prompts, params, SpecParams(method, k), predictions=preds)
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs], method
        drafted += sum(o.spec_stats.num_draft_tokens for o in outs)
        one = engine.generate([prompts[0]], params[0], SpecParams(method, k),
                              predictions=preds[:1] if preds else None)[0]
        assert one.token_ids == refs[0].token_ids, method
    assert drafted > 50


def test_a_mixed_batch_of_free_and_constrained_requests_keeps_both_exact(engine):
    prompts = encode(engine)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    json_params = constrained(StructuredSpec("json", json.dumps(SCHEMA)))
    params = [free, json_params, constrained(StructuredSpec("regex", REGEX))]
    refs = [engine.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    outs = engine.generate(prompts, params, [SpecParams("ngram", 3), SpecParams("draft", 4), SpecParams("eagle3", 2)])
    assert [o.token_ids for o in outs] == refs


def test_grammar_forbidden_drafts_are_rejected_there_and_counted(engine):
    """A prediction that breaks the schema: its drafts are verified under the mask, the forbidden one is
    rejected at its position, the output is the plain constrained output, and the step is counted."""
    prompt = encode(engine)[1]
    params = constrained(StructuredSpec("json", json.dumps(SCHEMA)))
    ref = engine.generate([prompt], params)[0]
    bad = engine.engine.tokenizer.encode('{"name": "ab", "count": "not a number"}')
    out = engine.generate([prompt], params, SpecParams("prediction", 6), predictions=[bad])[0]
    assert out.token_ids == ref.token_ids
    assert out.spec_stats.grammar_rejected >= 1
    assert out.spec_stats.num_accepted_tokens >= 1        # the valid start of the prediction was accepted


def test_row_masks_follow_the_draft_prefix_and_roll_back(engine):
    compiler = engine.engine.grammars
    tok = engine.engine.tokenizer
    state = compiler.start(StructuredSpec("regex", "ab(c|d)"))
    a, b, c, d, x = (tok.encode(ch)[0] for ch in "abcdx")
    mask, n_valid = state.row_masks([a, b, x, c])
    assert n_valid == 2 and mask.shape == (5, engine.engine.runner.cfg.vocab_size)
    assert mask[0, a] and not mask[0, b]
    assert mask[1, b] and not mask[1, a]
    assert mask[2, c] and mask[2, d] and not mask[2, x]          # after a, b: only c or d
    mask2, n2 = state.row_masks([a])                             # the walk was rolled back
    assert n2 == 1 and mask2[0, a] and mask2[1, b]
    state.commit([a])
    assert state.draft_mask([])[b] and not state.draft_mask([])[a]
    assert state.draft_mask([x]) is None                         # a forbidden prefix has no next mask
    state.commit([b, d])
    assert state.is_finished


def test_model_drafters_propose_only_grammar_valid_tokens(engine):
    prompt = encode(engine)[1]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=48, structured=StructuredSpec("regex", REGEX))
    for method in ("draft", "eagle3", "mtp"):
        spec = engine.engine.spec.speculators[method]
        log = []
        original = spec.propose

        def propose(requests, ks, original=original, log=log):
            proposal = original(requests, ks)
            for req, toks, probs in zip(requests, proposal.token_ids, proposal.draft_probs):
                if toks:
                    mask, n_valid = req.grammar.row_masks(list(toks))
                    # (drafts after one that completes the output are never used: they count as valid)
                    log.append((n_valid == len(toks), probs, mask[:len(toks)]))
            return proposal
        spec.propose = propose
        try:
            engine.generate([prompt] * 3, [dataclasses.replace(params, seed=s) for s in range(3)],
                            SpecParams(method, 4 if method != "mtp" else 2))
        finally:
            del spec.propose
        assert log, method
        assert all(valid for valid, _, _ in log), method
        for _, probs, mask in log:                 # the draft_probs are the masked distribution
            assert probs is not None and float(probs[~mask].sum()) == 0.0


def test_compiler_limits_and_errors(engine):
    backend = engine.engine.grammars.backend
    compiler = GrammarCompiler(backend, GrammarLimits(max_bytes=100, timeout_s=5.0, cache_size=2))
    with pytest.raises(GrammarError, match="at most 100"):
        compiler.compile(StructuredSpec("regex", "a" * 101))
    with pytest.raises(GrammarError, match="regex"):
        compiler.compile(StructuredSpec("regex", "(a"))
    with pytest.raises(GrammarError, match="json"):
        compiler.compile(StructuredSpec("json", "{not json"))
    with pytest.raises(GrammarError, match="choice"):
        compiler.compile(StructuredSpec("choice", "[]"))
    for text in ("a", "b", "c"):
        compiler.compile(StructuredSpec("regex", text))
    assert compiler.cache_len == 2                        # bounded LRU
    first = compiler.compile(StructuredSpec("regex", "c"))
    assert compiler.compile(StructuredSpec("regex", "c")) is first     # a hit returns the compiled grammar


def test_compile_time_is_bounded(engine):
    class Slow:
        vocab_size = 8

        def compile(self, kind, value):
            import time
            time.sleep(1.0)
    compiler = GrammarCompiler(Slow(), GrammarLimits(timeout_s=0.05))
    with pytest.raises(GrammarError, match="longer than 0.05 s"):
        compiler.compile(StructuredSpec("regex", "a"))
    with pytest.raises(GrammarError, match="longer than"):     # cached failure: no second compile
        compiler.compile(StructuredSpec("regex", "a"))


def test_padded_model_vocabulary_never_allows_padding_ids(engine, tmp_path):
    tok_dir = engine.engine.grammars.backend.tokenizer   # noqa: F841 - the engine's own backend works
    vocab = engine.engine.tokenizer.vocab_size
    from test_spec_draft_model import TOKENIZER_DIR
    backend = LLGuidanceBackend(TOKENIZER_DIR, vocab + 40, engine.engine.tokenizer.eos_token_ids)
    state = GrammarCompiler(backend).start(StructuredSpec("json_object"))
    mask, _ = state.row_masks([])
    assert mask.shape[1] == vocab + 40 and not bool(mask[0, vocab:].any()) and bool(mask[0, :vocab].any())
