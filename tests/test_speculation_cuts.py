"""Every cut of a request's speculation shows in its response (`speculation.cuts` + `notice`) with the same
reasons and counts as `spec_decode_refused_total`: over HTTP where a real server can be made to cut
(token budget, an unusable prediction), on the engine where a cut needs a drafter or a cost model forced
into it (drafter cache full, prefix unseen, goodput policy)."""
from __future__ import annotations

import asyncio

import pytest
from conftest import SERVED_NAME, ServerProcess

from specserve.sampling.params import SamplingParams
from specserve.server.api.responses import SpeculationInfo
from specserve.server.config import EngineConfig
from specserve.server.engine.offline import OfflineEngine
from specserve.speculators.base import CUT_REASONS, SpecParams, SpecStats

REPEATING = ["a b c a b c a b c a b", "x = 1\nx = 1\nx = 1\nx =", "[0, 0, 0, 0, 0,", "1 2 3 1 2 3 1 2"]


def refused(url: str, reason: str) -> float:
    import httpx
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("specserve:spec_decode_refused_total{") and f'reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def budget_url(tiny_model_dir, tmp_path_factory):
    """A step holds 6 tokens: two decoding requests at k = 4 cannot both draft all of k."""
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("budget") / "server.log",
                         "--max-num-batched-tokens", "6", "--max-speculative-tokens", "4",
                         "--speculation-policy", "fixed")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_a_token_budget_cut_is_in_the_response_and_the_counter(budget_url):
    import openai
    body = {"speculation": {"method": "ngram", "num_speculative_tokens": 4}, "ignore_eos": True}
    before = refused(budget_url, "token_budget")

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{budget_url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(c.completions.create(model=SERVED_NAME, prompt=p, max_tokens=24,
                                                                temperature=0, extra_body=body)
                                          for p in REPEATING))
    results = asyncio.run(all_at_once())
    stats = [r.model_extra["speculation"] for r in results]
    cut = [s["cuts"]["token_budget"] for s in stats if s.get("cuts")]
    assert sum(cut) > 0
    assert sum(cut) == refused(budget_url, "token_budget") - before        # the same count, per step
    for s in stats:
        if s.get("cuts"):
            assert set(s["cuts"]) == {"token_budget"} and "token budget" in s["notice"]
        else:
            assert s["notice"] is None
    with openai.OpenAI(base_url=f"{budget_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        plain = [c.completions.create(model=SERVED_NAME, prompt=p, max_tokens=24, temperature=0,
                                      extra_body={"speculation": {"method": "none"}, "ignore_eos": True})
                 for p in REPEATING]
    assert [r.choices[0].text for r in results] == [r.choices[0].text for r in plain]   # cuts change no text
    assert all(r.model_extra["speculation"].get("cuts") is None for r in plain)


def test_a_request_nothing_cut_has_no_cuts_and_no_notice(client):
    r = client.completions.create(model=SERVED_NAME, prompt=REPEATING[0], max_tokens=32, temperature=0,
                                  extra_body={"speculation": {"method": "ngram", "num_speculative_tokens": 2,
                                                              "adaptive": False}, "ignore_eos": True})
    spec = r.model_extra["speculation"]
    assert spec["num_drafts"] > 0 and spec["cuts"] is None and spec["notice"] is None


def test_the_notice_names_every_reason_with_its_step_count():
    a, b = SpecStats(method="eagle3", k=4), SpecStats(method="eagle3", k=4)
    for reason in ("load", "load", "drafter_cache_full"):
        a.cut(reason)
    b.cut("prefix_unseen")
    info = SpeculationInfo.from_stats([a, b], SpecParams("eagle3", 4))
    assert info.cuts == {"load": 2, "drafter_cache_full": 1, "prefix_unseen": 1}
    assert info.num_steps_k_reduced == 2
    for reason, words in CUT_REASONS.items():
        if reason in info.cuts:
            assert words in info.notice
    assert "(2 steps)" in info.notice and "(1 step)" in info.notice
    assert info.requested is None                        # the method and k ran as asked


def tiny_engine(tiny_model_dir, **extra) -> OfflineEngine:
    return OfflineEngine.from_config(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu",
                                                  num_threads=1, kv_cache_memory_gb=0.02, **extra))


def run_counting(eng: OfflineEngine, prompts, params, spec) -> tuple[list, dict[str, int]]:
    """Generate while summing the step stats' refusals (what spec_decode_refused_total receives)."""
    counted: dict[str, int] = {}
    step = eng.engine.step

    def counting_step():
        outputs, stats = step()
        for reason, count in stats.spec_refused.items():
            counted[reason] = counted.get(reason, 0) + count
        return outputs, stats
    eng.engine.step = counting_step
    try:
        return eng.generate(prompts, params, spec), counted
    finally:
        del eng.engine.step


def test_a_full_draft_model_cache_is_in_each_requests_stats(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir, draft_model=str(tiny_model_dir), speculation_policy="fixed")
    cache = eng.engine.spec.speculators["draft"].cache
    cache.reserve = lambda seq, end: False                     # as if every drafter block were taken
    prompts = [eng.engine.tokenizer.encode(p) for p in REPEATING[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs, counted = run_counting(eng, prompts, params, SpecParams("draft", 3))
    per_request = [o.spec_stats.cuts.get("drafter_cache_full", 0) for o in outs]
    assert all(n > 0 for n in per_request) and sum(per_request) == counted["drafter_cache_full"]
    assert all(o.spec_stats.num_drafts == 0 for o in outs)
    info = SpeculationInfo.from_stats([outs[0].spec_stats], SpecParams("draft", 3))
    assert info.cuts == {"drafter_cache_full": per_request[0]} and "KV cache was full" in info.notice


def test_goodput_cuts_are_in_the_requests_stats(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir, speculation_policy="goodput")
    policy = eng.engine.spec.policy
    policy.calibrate([(n, 1e-4 + 1.0 * n) for n in range(1, 41)])
    for i in range(64):                        # a machine where every verified token costs a second
        n = 1 + i % 40
        policy.observe_step(n, 1e-4 + 1.0 * n)
    prompt = eng.engine.tokenizer.encode("x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,")
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    (out,), counted = run_counting(eng, [prompt], params, SpecParams("ngram", 4))
    assert out.spec_stats.cuts == {"load": counted["load"]} and counted["load"] > 0
    info = SpeculationInfo.from_stats([out.spec_stats], SpecParams("ngram", 4))
    assert info.num_steps_k_reduced == counted["load"] and "goodput policy" in info.notice
