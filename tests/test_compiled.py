"""--compile: the torch.compile'd layer stack computes what the eager one does, compiles every graph at
start-up (no recompilation while serving), and keeps greedy speculation exact (speculative == plain)."""
from __future__ import annotations

import pytest
import torch

from sampling.params import SamplingParams
from server.config import EngineConfig
from server.engine.offline import OfflineEngine
from server.models.attention import build_attention_metadata
from server.models.loader import load_model
from speculators.base import SpecParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _mixed_forward(model, kv_caches, aux=()):
    """A prefill chunk (7 tokens), a decode (1) and a verify (4) in one varlen batch -> ModelOutput."""
    attn = build_attention_metadata([7, 1, 4], [7, 12, 9], [[0], [1], [2]], 16, torch.device("cpu"))
    ids = torch.arange(3, 15)
    with torch.inference_mode():
        return model.forward_states(ids, attn, kv_caches, aux)


def test_compiled_stack_matches_eager(tiny_model_dir):
    model, cfg = load_model(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu"))

    def fresh_caches():
        g = torch.Generator().manual_seed(0)   # the decode/verify rows attend to these "cached" keys too
        shape = (4, 16, cfg.num_key_value_heads, cfg.head_dim)
        return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
                for _ in range(cfg.num_hidden_layers)]

    aux = (0, cfg.num_hidden_layers - 1)
    eager_caches, compiled_caches = fresh_caches(), fresh_caches()
    eager = _mixed_forward(model, eager_caches, aux)
    model.enable_compile()
    calls = []
    stack = model.model.compiled_stack
    model.model.compiled_stack = lambda *a: calls.append(1) or stack(*a)
    got = _mixed_forward(model, compiled_caches, aux)
    assert calls, "the compiled stack was not used"
    torch.testing.assert_close(got.hidden, eager.hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.prenorm_hidden, eager.prenorm_hidden, rtol=1e-4, atol=1e-5)
    assert len(got.aux_hidden) == 2
    for a, b in zip(got.aux_hidden, eager.aux_hidden):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for (ke, ve), (kc, vc) in zip(eager_caches, compiled_caches):   # the op wrote this step's K/V
        torch.testing.assert_close(kc, ke, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(vc, ve, rtol=1e-4, atol=1e-5)
    with torch.no_grad():      # outside inference mode (grad-free eval): the eager stack, same numbers
        plain = model.forward_states(torch.arange(3, 15), build_attention_metadata(
            [7, 1, 4], [7, 12, 9], [[0], [1], [2]], 16, torch.device("cpu")), fresh_caches(), aux)
    torch.testing.assert_close(plain.hidden, eager.hidden, rtol=0, atol=0)


@pytest.fixture(scope="module")
def compiled_engine(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir), draft_model=str(tiny_model_dir), dtype="float32",
                       device="cpu", num_threads=1, kv_cache_memory_gb=0.02, compile=True)
    return OfflineEngine.from_config(cfg)


def test_compiled_engine_keeps_greedy_speculation_exact_without_recompiling(compiled_engine):
    eng = compiled_engine
    assert eng.engine.runner.model.model.compiled_stack is not None
    assert eng.engine.spec.speculators["draft"].model.model.compiled_stack is not None
    tok = eng.engine.tokenizer
    prompts = [tok.encode(t) for t in ("def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
                                       "for i in range(10):\n    print(i)\nfor i in range(10):\n",
                                       "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,")]
    params = SamplingParams(**GREEDY, max_tokens=24)
    # Start-up compiled every graph (1-token and multi-token steps, target and draft): serving must
    # never stop to compile again, whatever the batch looks like.
    with torch._dynamo.config.patch(error_on_recompile=True):
        refs = [eng.generate([p], params)[0].token_ids for p in prompts]
        for method, k in (("ngram", 3), ("draft", 4)):
            for p, ref in zip(prompts, refs):
                got = eng.generate([p], params, SpecParams(method, k))[0]
                assert got.token_ids == ref, (method, k)
        specs = [SpecParams("draft", 2), SpecParams("ngram", 5), SpecParams("none", 0)]
        mixed = eng.generate(prompts, params, specs)
    assert [m.token_ids for m in mixed] == refs
    assert mixed[0].spec_stats.num_draft_tokens > 0
    assert eng.engine.scheduler.bm.num_free_blocks == eng.engine.scheduler.bm.num_blocks
