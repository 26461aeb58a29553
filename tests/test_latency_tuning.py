"""Drafter linears on the fastest kernel (server/models/latency_tuning.py): the choice follows the
measured times, the fp32 route computes the same product, the target is never tuned, and a draft model
whose every linear runs on the fp32 route still keeps greedy speculation exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.engine.offline import OfflineEngine
from specserve.server.models import latency_tuning
from specserve.server.models.linear import Linear, pack_linears
from specserve.speculators.base import SpecParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def fresh_decisions(monkeypatch):
    monkeypatch.setattr(latency_tuning, "_decided", {})


def _packed_mlp(dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    module = torch.nn.Sequential(Linear(48, 96, bias=True), Linear(96, 40, bias=False)).to(dtype)
    if pack_linears(module) == 0:
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype} weights: nothing to tune")
    return module


@pytest.mark.parametrize("faster", ["fp32", "packed"])
def test_the_measured_faster_route_is_kept(monkeypatch, fresh_decisions, faster):
    module = _packed_mlp(torch.float32)
    times = (1.0, 0.5) if faster == "fp32" else (0.5, 1.0)        # (packed, fp32) seconds
    monkeypatch.setattr(latency_tuning, "route_times", lambda linear: times)
    chosen = latency_tuning.tune_for_latency(module)
    assert chosen == {"0": faster, "1": faster}
    assert all((m.fp32_weight is not None) == (faster == "fp32") for m in module)


def test_a_marginal_gain_keeps_the_packed_kernel(monkeypatch, fresh_decisions):
    module = _packed_mlp(torch.float32)
    monkeypatch.setattr(latency_tuning, "route_times", lambda linear: (1.0, 0.95))   # < 10 % faster
    assert set(latency_tuning.tune_for_latency(module).values()) == {"packed"}


def test_each_shape_is_timed_once_per_process(monkeypatch, fresh_decisions):
    timed = []
    monkeypatch.setattr(latency_tuning, "route_times", lambda linear: timed.append(linear) or (1.0, 0.5))
    latency_tuning.tune_for_latency(_packed_mlp(torch.float32))
    latency_tuning.tune_for_latency(_packed_mlp(torch.float32))      # same shapes: the first answer holds
    assert len(timed) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp32_route_computes_the_same_product(fresh_decisions, dtype):
    module = _packed_mlp(dtype)
    x = torch.randn(5, 48).to(dtype)
    with torch.inference_mode():
        packed = module(x)
        for m in module:
            m.use_fp32_route()
        fast = module(x)
    assert fast.dtype == dtype and fast.shape == packed.shape
    reference = F.linear(F.linear(x.double(), module[0].weight.double(), module[0].bias.double()),
                         module[1].weight.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fast.double(), reference, rtol=tol, atol=tol)
    torch.testing.assert_close(packed.double(), reference, rtol=tol, atol=tol)
    for m in module:        # re-packing (weights edited) drops the stale fp32 snapshot
        m.pack()
        assert m.fp32_weight is None


def test_all_fp32_draft_keeps_greedy_speculation_exact_and_target_untouched(monkeypatch, fresh_decisions,
                                                                          tiny_model_dir):
    monkeypatch.setattr(latency_tuning, "route_times", lambda linear: (1.0, 0.1))    # every drafter linear
    eng = OfflineEngine.from_config(EngineConfig(model=str(tiny_model_dir), draft_model=str(tiny_model_dir),
                                                 dtype="float32", device="cpu", num_threads=1,
                                                 kv_cache_memory_gb=0.02, speculation_policy="fixed"))
    draft = eng.engine.spec.speculators["draft"].model
    target = eng.engine.runner.model
    draft_linears = [m for m in draft.modules() if isinstance(m, Linear)]
    assert draft_linears and all(m.fp32_weight is not None for m in draft_linears)
    assert all(m.fp32_weight is None for m in target.modules() if isinstance(m, Linear))
    tok = eng.engine.tokenizer
    prompts = [tok.encode(t) for t in ("def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
                                       "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,")]
    params = SamplingParams(**GREEDY, max_tokens=24)
    refs = [eng.generate([p], params)[0].token_ids for p in prompts]
    for k in (1, 4):
        got = eng.generate(prompts, params, SpecParams("draft", k))
        assert [g.token_ids for g in got] == refs
        assert got[0].spec_stats.num_accepted_tokens > 0     # the draft is the target: it is accepted
    assert eng.engine.scheduler.bm.num_free_blocks == eng.engine.scheduler.bm.num_blocks
