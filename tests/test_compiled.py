"""--compile: the torch.compile'd layer stack computes what the eager one does, compiles every graph at
start-up (no recompilation while serving), and keeps greedy speculation exact (speculative == plain)."""
from __future__ import annotations

import pytest
import torch

from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.engine.offline import OfflineEngine
from specserve.server.models.attention import build_attention_metadata
from specserve.server.models.latency_tuning import is_latency_tuned
from specserve.server.models.loader import load_model
from specserve.speculators.base import SpecParams

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
                       device="cpu", num_threads=1, kv_cache_memory_gb=0.02, compile=True,
                       speculation_policy="fixed")
    return OfflineEngine.from_config(cfg)


def test_compiled_engine_keeps_greedy_speculation_exact_without_recompiling(compiled_engine):
    eng = compiled_engine
    assert eng.engine.runner.model.model.compiled_stack is not None
    draft = eng.engine.spec.speculators["draft"].model
    tuned = is_latency_tuned(draft)
    # compiled, unless its linears were latency-tuned onto the fp32 route (then eager: builder.compile_models)
    assert (draft.model.compiled_stack is None) == tuned
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rows_do_not_depend_on_batch(dtype):
    """A token's hidden state has the same bits whether it is decoded alone (1 row), verified first among
    drafts (5 rows) or in a batch of 8 such verifications (40 rows): what makes greedy speculation exact.
    Inductor specialises 1-row inputs into a second graph by default; with the embedded target's layer
    shapes that graph rounded differently in bf16 (0.03 on a hidden value; greedy n-gram output changed),
    so the stack is traced with an unbacked token count: one graph for every size."""
    from specserve.server.kv.kv_cache import cache_dtype
    from specserve.server.models.config import ModelConfig
    from specserve.server.models.linear import Linear, pack_linears
    from specserve.server.models.loader import build_random_model
    if dtype == torch.bfloat16 and pack_linears(Linear(64, 64).to(torch.bfloat16)) == 0:
        pytest.skip("this CPU's oneDNN has no packed bf16 kernel: bf16 rows may depend on the batch here")
    cfg = ModelConfig.from_dict(dict(   # the embedded target's layer shapes, 2 layers, small vocabulary
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=512,
        intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0))
    model = build_random_model(cfg, seed=0, dtype=dtype)
    model.enable_compile()
    kv_dtype = cache_dtype(dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    shape = (32, 16, cfg.num_key_value_heads, cfg.head_dim)
    base = [(torch.randn(shape, generator=g).to(kv_dtype), torch.randn(shape, generator=g).to(kv_dtype))
            for _ in range(cfg.num_hidden_layers)]

    def first_row(num_seqs: int, tokens: list[int]) -> torch.Tensor:
        q = len(tokens)
        attn = build_attention_metadata([q] * num_seqs, [36 + q] * num_seqs,
                                        [[4 * i + j for j in range(3)] for i in range(num_seqs)], 16,
                                        torch.device("cpu"))
        with torch.inference_mode():
            return model.forward_states(torch.tensor(tokens * num_seqs), attn,
                                        [(k.clone(), v.clone()) for k, v in base]).hidden[0]

    alone = first_row(1, [9])
    assert torch.equal(first_row(1, [9, 1, 2, 3, 7]), alone)
    assert torch.equal(first_row(8, [9, 1, 2, 3, 7]), alone)
