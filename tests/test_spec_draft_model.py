"""Draft-model speculator end to end on tiny random Llamas (checkpoints written by hand in HF layout).

Greedy output is unchanged by speculation (batch 1 and batched); a draft identical to the target is
accepted ~always (catch-up + rollback bookkeeping); the draft_probs it sends are exactly the draft's
distribution over context + drafts, recomputed from scratch by transformers; sampling at T = 1
through a draft model keeps the target's distribution (chi-square on the first two tokens);
preemption mid-speculation keeps greedy text; no KV block leaks; a foreign vocabulary is refused.

The checkpoint writers here are shared with tests/test_spec_eagle3.py and tests/test_spec_mtp.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specserve.sampling.outputs import SeqSamplingInput
from specserve.sampling.params import SamplingParams
from specserve.sampling.rejection import RejectionSampler
from specserve.server.config import EngineConfig
from specserve.server.engine.offline import OfflineEngine
from specserve.server.engine.request import Request
from specserve.server.models.attention import build_attention_metadata
from specserve.server.models.config import ModelConfig
from specserve.server.models.linear import pack_linears
from specserve.server.models.loader import build_random_model
from specserve.speculators.base import SpecParams
from specserve.speculators.draft_kv import DraftKVCache
from specserve.speculators.draft_model import DraftModelSpeculator

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "models" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
GREEDY = {"temperature": 0.0, "ignore_eos": True}
BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
TEXTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "The quick brown fox jumps over the lazy dog.",
         "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"]


# ------------------------------------------------------------------------- checkpoint writers (shared)
def vocab_size() -> int:
    data = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    return len(data["model"]["vocab"]) + len(data["added_tokens"])


class Rand:
    """Deterministic random tensors; norms 1 + noise so that a norm mix-up cannot hide."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def mat(self, *shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * scale

    def norm(self, dim: int) -> torch.Tensor:
        return 1.0 + self.mat(dim)


def block_tensors(prefix: str, cfg: dict, rand: Rand, in_mult: int = 1, qkv_bias: bool = False) -> dict:
    """HF names of one Llama/Qwen2 decoder layer (q/k/v read in_mult * H features)."""
    h, inter, heads, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    t = {prefix + "input_layernorm.weight": rand.norm(h), prefix + "post_attention_layernorm.weight": rand.norm(h),
         prefix + "self_attn.q_proj.weight": rand.mat(heads * d, in_mult * h),
         prefix + "self_attn.k_proj.weight": rand.mat(kv * d, in_mult * h),
         prefix + "self_attn.v_proj.weight": rand.mat(kv * d, in_mult * h),
         prefix + "self_attn.o_proj.weight": rand.mat(h, heads * d),
         prefix + "mlp.gate_proj.weight": rand.mat(inter, h), prefix + "mlp.up_proj.weight": rand.mat(inter, h),
         prefix + "mlp.down_proj.weight": rand.mat(h, inter)}
    if qkv_bias:
        for name, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            t[prefix + f"self_attn.{name}_proj.bias"] = rand.mat(rows)
    return t


def llama_tensors(cfg: dict, rand: Rand, qkv_bias: bool = False) -> dict:
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    t = {"model.embed_tokens.weight": rand.mat(vocab, h, scale=0.5), "model.norm.weight": rand.norm(h),
         "lm_head.weight": rand.mat(vocab, h, scale=0.5)}
    for i in range(cfg["num_hidden_layers"]):
        t.update(block_tensors(f"model.layers.{i}.", cfg, rand, qkv_bias=qkv_bias))
    return t


def write_checkpoint(out: Path, cfg: dict, tensors: dict, tokenizer: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    for name in TOKENIZER_FILES if tokenizer else ():
        if (TOKENIZER_DIR / name).is_file():
            shutil.copy(TOKENIZER_DIR / name, out / name)
    return out


def write_llama(out: Path, seed: int, **overrides) -> Path:
    cfg = {**BASE, "vocab_size": vocab_size(), **overrides}
    return write_checkpoint(out, cfg, llama_tensors(cfg, Rand(seed)))


def make_engine(model_dir, kv_gb: float = 0.004, **kw) -> OfflineEngine:
    """An engine drafting every k asked for (policy fixed unless kw says otherwise) and without the start-up
    probe (unless kw asks for it): these tests count drafts, catch-ups and what the histories saw."""
    kw.setdefault("speculation_policy", "fixed")
    kw.setdefault("speculation_probe_tokens", 0)
    cfg = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_threads=1,
                       kv_cache_memory_gb=kv_gb, **kw)
    return OfflineEngine.from_config(cfg)


def encode(engine: OfflineEngine, texts=TEXTS) -> list[list[int]]:
    return [engine.engine.tokenizer.encode(t) for t in texts]


def record_proposals(engine: OfflineEngine, method: str) -> list[tuple]:
    """Wrap a speculator's propose: log (context at propose time, drafts, draft_probs, sampling params)."""
    spec = engine.engine.spec.speculators[method]
    log: list = []
    original = spec.propose

    def propose(requests, ks):
        proposal = original(requests, ks)
        for req, toks, probs in zip(requests, proposal.token_ids, proposal.draft_probs):
            if toks:
                log.append((list(req.all_token_ids), list(toks), None if probs is None else probs.clone(),
                            req.sampling_params))
        return proposal
    spec.propose = propose        # an instance attribute: `del spec.propose` restores the method
    return log


def assert_same_proposals(engines, method: str, prompts, params, spec, atol: float = 1e-6, rtol: float = 0.0):
    """Two engines generate the same requests with `method`: same contexts and drafts at every propose
    (more than 10 of them), draft probabilities within atol/rtol."""
    logs = []
    for eng in engines:
        logs.append(record_proposals(eng, method))
        eng.generate(prompts, params, spec)
        del eng.engine.spec.speculators[method].propose
    assert len(logs[0]) == len(logs[1]) > 10
    for (ctx_a, drafts_a, probs_a, _), (ctx_b, drafts_b, probs_b, _) in zip(*logs):
        assert ctx_a == ctx_b and drafts_a == drafts_b
        if probs_a is not None:
            torch.testing.assert_close(probs_a, probs_b, atol=atol, rtol=rtol)


def reference_probs(logits: torch.Tensor,  # [k, vocab] float32 from a from-scratch forward
                    params: SamplingParams) -> torch.Tensor:
    """[k, vocab]: softmax(logits / T) after min-p (relative to the most likely token), top-k, then
    top-p over what top-k kept (what the drafter must sample from), in float64."""
    scaled = logits.double() / params.temperature
    if params.min_p > 0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if 0 < params.top_k < logits.shape[1]:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        values, order = scaled.softmax(-1).sort(-1, descending=True)
        drop = (values.cumsum(-1) - values) >= params.top_p         # the tokens above already reach top_p
        scaled = scaled.scatter(1, order, values.log().masked_fill(drop, float("-inf")))
    return scaled.softmax(dim=-1).float()


def assert_no_leaks(engine: OfflineEngine) -> None:
    bm = engine.engine.scheduler.bm
    assert bm.num_free_blocks == bm.num_blocks
    for method, spec in engine.engine.spec.speculators.items():
        cache = getattr(spec, "cache", None)
        if cache is not None:
            assert cache.num_free_blocks == cache.num_blocks, method


pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ------------------------------------------------------------------------- fixtures
def write_target_and_draft(root: Path) -> dict[str, Path]:
    """A small random target and a smaller draft model of its vocabulary, under root."""
    return {"target": write_llama(root / "target", seed=0),
            "draft": write_llama(root / "draft", seed=1, num_hidden_layers=2, hidden_size=16,
                                 intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return write_target_and_draft(tmp_path_factory.mktemp("draft-model"))


@pytest.fixture(scope="module")
def engine(dirs) -> OfflineEngine:
    return make_engine(dirs["target"], draft_model=str(dirs["draft"]))


# ------------------------------------------------------------------------- tests
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_batch1_and_batched(engine, k):
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=24)
    refs = [engine.generate([p], params)[0].token_ids for p in prompts]
    single = engine.generate([prompts[0]], params, SpecParams("draft", k))[0]
    assert single.token_ids == refs[0]
    assert single.spec_stats.num_draft_tokens > 0
    batched = engine.generate(prompts, params, SpecParams("draft", k))
    assert [o.token_ids for o in batched] == refs
    assert_no_leaks(engine)


def test_identical_draft_is_accepted_almost_always(dirs):
    eng = make_engine(dirs["target"], draft_model=str(dirs["target"]))
    prompts = encode(eng)
    params = SamplingParams(**GREEDY, max_tokens=30)
    refs = [o.token_ids for o in eng.generate(prompts, params)]
    for k in (1, 3, 6):
        outs = eng.generate(prompts, params, SpecParams("draft", k))
        assert [o.token_ids for o in outs] == refs
        drafted = sum(o.spec_stats.num_draft_tokens for o in outs)
        accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
        assert accepted >= 0.95 * drafted > 0, (k, accepted, drafted)
        assert max(o.num_steps for o in outs) <= -(-30 // (k + 1)) + 2
    assert_no_leaks(eng)


def test_draft_probs_are_the_drafts_distribution_recomputed_from_scratch(dirs, engine):
    transformers = pytest.importorskip("transformers")
    log = record_proposals(engine, "draft")
    params = [SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, max_tokens=20,
                             ignore_eos=True)
              for t, top_k, top_p, min_p, seed in ((1.0, 0, 1.0, 0.0, 1), (0.7, 50, 1.0, 0.0, 2),
                                                   (1.3, 0, 1.0, 0.0, None), (0.9, 0, 0.8, 0.0, 3),
                                                   (1.0, 0, 1.0, 0.05, None), (0.8, 40, 0.9, 0.02, 4))]
    try:
        engine.generate(encode(engine), params, SpecParams("draft", 3))
    finally:
        del engine.engine.spec.speculators["draft"].propose
    hf = transformers.AutoModelForCausalLM.from_pretrained(dirs["draft"]).float().eval()
    assert len(log) > 10
    for context, drafts, probs, sampling in log:
        with torch.no_grad():   # the draft's view of context + d_1..d_{k-1}, from scratch
            logits = hf(torch.tensor([context + drafts[:-1]])).logits[0, len(context) - 1:]   # [k, vocab]
        assert probs.shape == logits.shape
        torch.testing.assert_close(probs, reference_probs(logits, sampling), atol=2e-5, rtol=1e-3)
        assert all(probs[j, d] > 0 for j, d in enumerate(drafts))


def test_seeded_sampling_with_draft_is_reproducible(engine):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    prompt = encode(engine)[1]
    a = engine.generate([prompt], params, SpecParams("draft", 4))[0]
    b = engine.generate([prompt], params, SpecParams("draft", 4))[0]
    assert a.token_ids == b.token_ids


def test_preemption_mid_speculation_keeps_greedy_text_and_frees_every_block(dirs, engine):
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=48)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    # 4 layers x 16 tokens x 2 kv heads x 8 dims x K,V x fp32 = 8 KiB per block: 9 blocks < what 3 requests need
    small = make_engine(dirs["target"], kv_gb=9 * 8192 / 2**30, draft_model=str(dirs["draft"]))
    specs = [SpecParams("draft", 4), SpecParams("draft", 2), SpecParams("none", 0)]
    outs = small.generate(prompts, params, specs)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == refs
    assert_no_leaks(small)
    assert not small.engine.spec.speculators["draft"]._states


def test_a_draft_with_another_vocabulary_is_refused(dirs, tmp_path):
    swapped = Path(shutil.copytree(dirs["draft"], tmp_path / "swapped"))
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="different vocabulary"):
        make_engine(dirs["target"], draft_model=str(swapped))
    bare = write_llama(tmp_path / "bare", seed=5, num_hidden_layers=1, vocab_size=vocab_size() + 64)
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="vocab_size"):
        make_engine(dirs["target"], draft_model=str(bare))


# ------------------------------------------------------------------------- T = 1 is lossless through a draft
STAT_VOCAB = 8
STAT_PROMPT = [1, 2, 3]
STAT_KS = (1, 2, 3)


def tiny_lm(seed: int, sharpness: float):
    """A 2-layer, 8-token Llama whose next-token distributions are far from uniform."""
    cfg = ModelConfig.from_dict({**BASE, "vocab_size": STAT_VOCAB, "hidden_size": 16, "intermediate_size": 32,
                                 "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1})
    model = build_random_model(cfg, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
        model.model.embed_tokens.weight.mul_(50.0)
    pack_linears(model)          # the packed CPU weights are a snapshot: refresh after editing
    return model, cfg


@torch.inference_mode()
def full_logits(model, cfg, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence [len, vocab]: every position from scratch (a fresh cache, one block per sequence)."""
    kv = [(torch.zeros(len(seqs), 16, 1, 8), torch.zeros(len(seqs), 16, 1, 8)) for _ in range(2)]
    lens = [len(s) for s in seqs]
    attn = build_attention_metadata(lens, lens, [[i] for i in range(len(seqs))], 16, torch.device("cpu"))
    out = model.forward_states(torch.tensor([t for s in seqs for t in s]), attn, kv)
    return list(model.compute_logits(out.hidden).split(lens))


def sample_pairs(num: int, misreport: bool = False) -> torch.Tensor:
    """[num] t1 * V + t2: the first two tokens emitted through DraftModelSpeculator + RejectionSampler."""
    torch.manual_seed(11)
    target, cfg = tiny_lm(3, sharpness=12.0)
    draft, _ = tiny_lm(4, sharpness=8.0)
    cache = DraftKVCache.allocate(2, 1, 8, num, 16, torch.float32, "cpu")
    spec = DraftModelSpeculator(draft, cache, STAT_VOCAB)
    sampler = RejectionSampler()
    params = SamplingParams(temperature=1.0, max_tokens=8)
    reqs = [Request(f"r{i}", list(STAT_PROMPT), params, SpecParams("draft", 3)) for i in range(num)]
    pending = reqs
    while pending:   # step 1 for all; step 2 (catch-up after a rejection) for those with one token
        ks = [STAT_KS[int(r.request_id[1:]) % 3] for r in pending]
        proposal = spec.propose(pending, ks)
        drafts = proposal.token_ids
        logits = full_logits(target, cfg, [r.all_token_ids + d for r, d in zip(pending, drafts)])
        rows = torch.cat([lg[r.num_tokens - 1:] for r, lg in zip(pending, logits)])      # [sum(k + 1), V]
        # misreport: claim a distribution other than the one drafted from (each row rolled by one id)
        probs = [p.roll(1, dims=-1) if misreport else p for p in proposal.draft_probs]
        outs = sampler(rows, [SeqSamplingInput(params, r.prompt_token_ids, list(r.output_token_ids), d, p)
                              for r, d, p in zip(pending, drafts, probs)])
        for r, out in zip(pending, outs):
            r.output_token_ids.extend(out.token_ids)
        pending = [r for r in pending if r.num_output_tokens < 2]
    assert cache.num_free_blocks < cache.num_blocks
    for r in reqs:
        spec.release(r)
    assert cache.num_free_blocks == cache.num_blocks
    return torch.tensor([r.output_token_ids[0] * STAT_VOCAB + r.output_token_ids[1] for r in reqs])


def exact_joint() -> torch.Tensor:
    target, cfg = tiny_lm(3, sharpness=12.0)
    first = full_logits(target, cfg, [STAT_PROMPT])[0][-1].double().softmax(-1)                    # [V]
    second = torch.stack([lg[-1] for lg in full_logits(target, cfg, [STAT_PROMPT + [t] for t in range(STAT_VOCAB)])])
    return (first[:, None] * second.double().softmax(-1)).reshape(-1)


def test_sampling_through_the_draft_model_keeps_the_target_distribution():
    from test_rejection_stats import chi_square_p_value
    joint = exact_joint()
    assert joint.max() > 0.05 and (joint > 1e-3).sum() > 10      # a distribution worth testing
    assert chi_square_p_value(sample_pairs(6000), joint) > 1e-3


def test_the_statistic_catches_draft_probs_that_are_not_the_sampling_distribution():
    # (Sending None instead would still be exact: one-hot verification is lossless for any draft.)
    from test_rejection_stats import chi_square_p_value
    assert chi_square_p_value(sample_pairs(3000, misreport=True), exact_joint()) < 1e-6
