"""Engine end to end on a tiny random Llama: speculation never changes greedy output, exact truncation,
preemption + re-admission, no leaked KV blocks. Offline (no HTTP): the same Engine the server runs."""
from __future__ import annotations

import pytest

from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.engine.offline import OfflineEngine
from specserve.speculators.base import SpecParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(model_dir, **kw) -> OfflineEngine:
    cfg = EngineConfig(model=str(model_dir), dtype=kw.pop("dtype", "float32"), device="cpu", num_threads=1,
                       kv_cache_memory_gb=kw.pop("kv_gb", 0.02), **kw)
    return OfflineEngine.from_config(cfg)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.engine.tokenizer
    texts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
             "for i in range(10):\n    print(i)\nfor i in range(10):\n",
             "The quick brown fox jumps over the lazy dog. The quick brown",
             "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"]
    return [tok.encode(t) for t in texts]


def plain(engine, prompts, **params):
    return engine.generate(prompts, SamplingParams(**{**GREEDY, **params}))


@pytest.mark.parametrize("k", [1, 3, 6])
def test_ngram_greedy_equals_plain_batch1(engine, prompts, k):
    for p in prompts:
        ref = plain(engine, [p], max_tokens=40)[0]
        got = engine.generate([p], SamplingParams(**GREEDY, max_tokens=40), SpecParams("ngram", k))[0]
        assert got.token_ids == ref.token_ids
        assert got.text == ref.text
    # the random tiny model repeats itself, so the n-gram drafts are mostly right
    assert got.spec_stats.num_drafts > 0 and got.spec_stats.num_accepted_tokens > 0
    assert got.num_steps < len(got.token_ids)


def test_prediction_greedy_equals_plain_exact_and_wrong_prediction(engine, prompts):
    p = prompts[0]
    ref = plain(engine, [p], max_tokens=40)[0]
    exact = engine.generate([p], SamplingParams(**GREEDY, max_tokens=40), SpecParams("prediction", 5),
                            predictions=[ref.token_ids])[0]
    assert exact.token_ids == ref.token_ids
    st = exact.spec_stats
    assert st.num_accepted_tokens == st.num_draft_tokens > 0     # an exact prediction is always accepted
    corrupted = list(ref.token_ids)
    corrupted[3] = (corrupted[3] + 1) % 100        # inside the first draft window: a rejection
    corrupted[20:23] = [11, 12, 13]                # later: the pointer must re-align after it
    wrong = engine.generate([p], SamplingParams(**GREEDY, max_tokens=40), SpecParams("prediction", 4),
                            predictions=[corrupted])[0]
    assert wrong.token_ids == ref.token_ids
    assert wrong.spec_stats.num_accepted_tokens < wrong.spec_stats.num_draft_tokens
    assert exact.num_steps < wrong.num_steps < len(ref.token_ids)


def test_mixed_batch_methods_and_k_share_steps(engine, prompts):
    refs = [plain(engine, [p], max_tokens=30)[0] for p in prompts]
    specs = [SpecParams("none", 0), SpecParams("ngram", 1), SpecParams("ngram", 4), SpecParams("ngram", 6),
             SpecParams("prediction", 3), SpecParams("prediction", 7), SpecParams("ngram", 2),
             SpecParams("none", 0)]
    batch_prompts = [prompts[i % len(prompts)] for i in range(8)]
    preds = [refs[i % len(prompts)].token_ids if s.method == "prediction" else None
             for i, s in enumerate(specs)]
    outs = engine.generate(batch_prompts, SamplingParams(**GREEDY, max_tokens=30), specs, preds)
    for i, out in enumerate(outs):
        assert out.token_ids == refs[i % len(prompts)].token_ids, f"request {i} ({specs[i]})"


def test_penalties_and_logprobs_unchanged_by_speculation(engine, prompts):
    params = dict(max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3,
                  logprobs=3)
    for p in prompts[:2]:
        ref = plain(engine, [p], **params)[0]
        got = engine.generate([p], SamplingParams(**GREEDY, **params), SpecParams("ngram", 4))[0]
        assert got.token_ids == ref.token_ids
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        for a, b in zip(got.logprobs, ref.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_stop_string_and_max_tokens_truncate_inside_an_accepted_run(engine, prompts):
    p = prompts[1]
    ref = plain(engine, [p], max_tokens=40)[0]
    stop = ref.text[12:15]
    assert stop and stop in ref.text
    ref_stop = plain(engine, [p], max_tokens=40, stop=[stop])[0]
    got = engine.generate([p], SamplingParams(**GREEDY, max_tokens=40, stop=[stop]), SpecParams("ngram", 6))[0]
    assert got.text == ref_stop.text == ref.text[:ref.text.index(stop)]
    assert got.token_ids == ref_stop.token_ids and got.finish_reason == "stop"
    for n in (1, 2, 7, 13):
        got = engine.generate([p], SamplingParams(**GREEDY, max_tokens=n), SpecParams("ngram", 6))[0]
        assert got.token_ids == ref.token_ids[:n] and got.finish_reason == "length"


def test_stop_token_id_inside_accepted_run(engine, prompts):
    p = prompts[0]
    ref = plain(engine, [p], max_tokens=30)[0]
    stop_id = ref.token_ids[9]
    first = ref.token_ids.index(stop_id)
    got = engine.generate([p], SamplingParams(**GREEDY, max_tokens=30, stop_token_ids=[stop_id]),
                          SpecParams("ngram", 5))[0]
    assert got.token_ids == ref.token_ids[:first + 1] and got.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_with_speculation(engine, prompts):
    params = SamplingParams(temperature=0.8, max_tokens=25, seed=1234, ignore_eos=True)
    a = engine.generate([prompts[2]], params, SpecParams("ngram", 4))[0]
    b = engine.generate([prompts[2]], params, SpecParams("ngram", 4))[0]
    assert a.token_ids == b.token_ids


def test_preemption_and_readmission_keep_greedy_text_and_free_all_blocks(tiny_model_dir, prompts):
    big = make_engine(tiny_model_dir)
    refs = [plain(big, [p], max_tokens=60)[0].token_ids for p in prompts]
    # 64-wide, 2-layer fp32 model: 2*2*16*2*16*4 B = 8 KiB per 16-token block -> ~14 blocks
    small = make_engine(tiny_model_dir, kv_gb=14 * 8192 / 2**30)
    bm = small.engine.scheduler.bm
    specs = [SpecParams("ngram", 4), SpecParams("none", 0), SpecParams("ngram", 2), SpecParams("none", 0)]
    outs = small.generate(prompts, SamplingParams(**GREEDY, max_tokens=60), specs)
    assert small.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref
    assert bm.num_free_blocks == bm.num_blocks
    assert not small.engine.live and not small.engine.scheduler.running


def test_prompt_longer_than_budget_is_chunked_with_same_output(tiny_model_dir, prompts):
    chunked = make_engine(tiny_model_dir, max_num_batched_tokens=9)
    whole = make_engine(tiny_model_dir)
    p = prompts[0] * 3
    a = plain(chunked, [p], max_tokens=20)[0]
    b = plain(whole, [p], max_tokens=20)[0]
    assert a.token_ids == b.token_ids


def test_bf16_speculation_keeps_greedy_text(tiny_model_dir, prompts):
    """bf16 on CPU: the packed bf16 Linear gives each row the same bits whatever the batch (blocks of 32
    rows) and attention runs in fp32, so verifying 8 requests x up to 8 tokens (64 rows) emits what plain
    decoding emits here (with bf16 attention it does not; near-ties can still flip, builder.pick_dtype)."""
    import torch

    from specserve.server.models.linear import Linear, pack_linears
    if pack_linears(Linear(64, 64).to(torch.bfloat16)) == 0:
        pytest.skip("this CPU's oneDNN has no packed bf16 kernel: bf16 rows may depend on the batch here")
    eng = make_engine(tiny_model_dir, dtype="bfloat16")
    refs = [plain(eng, [p], max_tokens=30)[0] for p in prompts]
    specs = [SpecParams("ngram", 7), SpecParams("prediction", 7), SpecParams("ngram", 3), SpecParams("none", 0)] * 2
    batch_prompts = [prompts[i % len(prompts)] for i in range(8)]
    preds = [refs[i % len(prompts)].token_ids if s.method == "prediction" else None for i, s in enumerate(specs)]
    outs = eng.generate(batch_prompts, SamplingParams(**GREEDY, max_tokens=30), specs, preds)
    for i, out in enumerate(outs):
        assert out.token_ids == refs[i % len(prompts)].token_ids, f"request {i} ({specs[i]})"
    assert sum(o.spec_stats.num_accepted_tokens for o in outs) > 0
