"""EAGLE-3 speculator on a tiny random 8-layer target (default taps 2, 4, 5) and random heads written by
hand in both public layouts (SafeAILab original: flat config + midlayer.*; vLLM speculators: nested
config + layers.0.*), with a reduced draft vocabulary mapped back through the d2t offset table.

Greedy output equals plain decoding; both layouts of the same weights give identical drafts; the
drafts' probabilities equal a slow from-scratch reference of the head (plain tensor maths, every
row recomputed at every step); preemption keeps greedy text and frees every block.
The plain-tensor reference layers here are shared with tests/test_spec_mtp.py.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_spec_draft_model import (
    BASE,
    GREEDY,
    Rand,
    assert_no_leaks,
    assert_same_proposals,
    block_tensors,
    encode,
    llama_tensors,
    make_engine,
    record_proposals,
    reference_probs,
    vocab_size,
    write_checkpoint,
)

from specserve.sampling.params import SamplingParams
from specserve.server.models.attention import build_attention_metadata
from specserve.server.models.config import ModelConfig
from specserve.server.models.loader import load_model
from specserve.speculators.base import SpecParams
from specserve.speculators.eagle3_loader import default_taps, parse_eagle3_config

TARGET_LAYERS = 8
DRAFT_VOCAB = 1500


# ------------------------------------------------------------------------- writers
def target_config(**overrides) -> dict:
    return {**BASE, "vocab_size": vocab_size(), "num_hidden_layers": TARGET_LAYERS, **overrides}


def write_target(out, seed: int = 0, extra: dict | None = None, **overrides):
    cfg = target_config(**overrides)
    tensors = llama_tensors(cfg, Rand(seed))
    return write_checkpoint(out, cfg, {**tensors, **(extra or {})})


def eagle_weights(seed: int, hidden: int = 32, draft_vocab: int = DRAFT_VOCAB) -> dict:
    """A random head's tensors in the ORIGINAL names (midlayer.*), d2t/t2d for a reduced vocabulary."""
    rand = Rand(seed)
    layer_cfg = {**BASE, "hidden_size": hidden}
    t = {"midlayer." + k: v for k, v in block_tensors("", layer_cfg, rand, in_mult=2).items()}
    t["midlayer.hidden_norm.weight"] = rand.norm(hidden)
    t["fc.weight"] = rand.mat(hidden, 3 * BASE["hidden_size"])
    t["norm.weight"] = rand.norm(hidden)
    t["lm_head.weight"] = rand.mat(draft_vocab, hidden, scale=0.5)
    used = torch.randperm(vocab_size(), generator=rand.gen)[:draft_vocab].sort().values
    t["d2t"] = used - torch.arange(draft_vocab)                       # an OFFSET table
    t["t2d"] = torch.zeros(vocab_size(), dtype=torch.bool).index_fill_(0, used, True)
    return t


def write_eagle_original(out, weights: dict, taps=None):
    cfg = {**BASE, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
           "vocab_size": vocab_size(), "draft_vocab_size": weights["lm_head.weight"].shape[0],
           "target_hidden_size": BASE["hidden_size"]}
    if taps is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(taps), "use_aux_hidden_state": True}
    return write_checkpoint(out, cfg, weights, tokenizer=False)


def write_eagle_speculators(out, weights: dict, taps, norm_before_residual: bool, embedding=None):
    layer = {**BASE, "num_hidden_layers": 1, "vocab_size": vocab_size(), "head_dim": 8}
    del layer["architectures"]
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
           "speculators_version": "0.1.0.dev14", "transformer_layer_config": layer,
           "draft_vocab_size": weights["lm_head.weight"].shape[0], "norm_before_residual": norm_before_residual,
           "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": None if taps is None else list(taps),
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                  "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
    renamed = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in weights.items()}
    if embedding is not None:
        renamed["embed_tokens.weight"] = embedding
    return write_checkpoint(out, cfg, renamed, tokenizer=False)


# ------------------------------------------------------------------------- plain-tensor reference (shared)
def ref_rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ref_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, d] rotated by absolute positions [T] (rotate-half layout)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv[None, :]
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ref_attention(a: torch.Tensor, w: dict, p: str, positions: torch.Tensor, heads: int = 4, kv_heads: int = 2,
                  theta: float = 10000.0) -> torch.Tensor:
    """Causal self-attention of rows a [T, D] (rows in position order), weights w[p + 'q_proj.weight'] ..."""
    def proj(name):
        out = a @ w[p + f"{name}.weight"].T
        return out + w[p + f"{name}.bias"] if p + f"{name}.bias" in w else out
    n = a.shape[0]
    d = w[p + "q_proj.weight"].shape[0] // heads
    q = ref_rope(proj("q_proj").view(n, heads, d), positions, theta)
    k = ref_rope(proj("k_proj").view(n, kv_heads, d), positions, theta).repeat_interleave(heads // kv_heads, 1)
    v = proj("v_proj").view(n, kv_heads, d).repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    return out @ w[p + "o_proj.weight"].T


def ref_mlp(x: torch.Tensor, w: dict, p: str) -> torch.Tensor:
    return (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


@torch.inference_mode()
def target_states(model_dir, tokens: list[int], taps=()) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Full from-scratch target forward: (final-normed [T, H], pre-norm [T, H], taps each [T, H])."""
    model, cfg = load_model(model_dir, dtype=torch.float32)
    blocks = -(-len(tokens) // 16)
    kv = [(torch.zeros(blocks, 16, cfg.num_key_value_heads, cfg.head_dim),
           torch.zeros(blocks, 16, cfg.num_key_value_heads, cfg.head_dim)) for _ in range(cfg.num_hidden_layers)]
    attn = build_attention_metadata([len(tokens)], [len(tokens)], [list(range(blocks))], 16, torch.device("cpu"))
    out = model.forward_states(torch.tensor(tokens), attn, kv, tuple(taps))
    return out.hidden, out.prenorm_hidden, out.aux_hidden


def ref_eagle_probs(head_file, target_dir, context: list[int], drafts: list[int], params: SamplingParams,
                    norm_before_residual: bool, taps=(2, 4, 5)) -> torch.Tensor:
    """[k, V]: the head's distribution for every draft position, every row recomputed at every step."""
    w = load_file(str(head_file))
    w = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in w.items()}
    embed = w.get("embed_tokens.weight", load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"])
    n = len(context)
    _, _, aux = target_states(target_dir, context[:n - 1], sorted(set(taps)))
    by_layer = dict(zip(sorted(set(taps)), aux))
    hidden = [row for row in torch.cat([by_layer[i] for i in taps], -1) @ w["fc.weight"].T]   # rows 0..n-2
    tokens, positions, rows = list(context[1:]), list(range(n - 1)), []
    for j in range(len(drafts)):
        x, emb = torch.stack(hidden), embed[torch.tensor(tokens)]
        normed = ref_rms(x, w["midlayer.hidden_norm.weight"])
        a = torch.cat([ref_rms(emb, w["midlayer.input_layernorm.weight"]), normed], -1)
        attn = ref_attention(a, w, "midlayer.self_attn.", torch.tensor(positions))
        h = (normed if norm_before_residual else x) + attn
        h = h + ref_mlp(ref_rms(h, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer.mlp.")
        draft_logits = ref_rms(h[-1], w["norm.weight"]) @ w["lm_head.weight"].T  # [Vd]
        full = torch.full((embed.shape[0],), float("-inf"))
        full[torch.arange(len(draft_logits)) + w.get("d2t", 0)] = draft_logits  # d2t: offsets
        rows.append(full)
        hidden.append(h[-1])  # the next row: own pre-norm output, the draft just made
        tokens.append(drafts[j])
        positions.append(positions[-1] + 1)
    return reference_probs(torch.stack(rows), params)


# ------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = write_target(root / "target")
    weights = eagle_weights(seed=7)
    embedding = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    return {
        "target": target,
        "original": write_eagle_original(root / "original", weights),  # default taps, target's embedding
        "speculators": write_eagle_speculators(root / "speculators", weights, (5, 2, 4), False, embedding),
        "nbr": write_eagle_speculators(root / "nbr", eagle_weights(seed=8), None, True),
    }


@pytest.fixture(scope="module")
def engine(dirs):
    return make_engine(dirs["target"], eagle3=str(dirs["original"]))


# ------------------------------------------------------------------------- tests
def test_greedy_equals_plain_batch1_and_batched(engine):
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=24)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.generate([prompts[1]], params, SpecParams("eagle3", 1))[0].token_ids == refs[1]
    outs = engine.generate(prompts, params, [SpecParams("eagle3", k) for k in (5, 2, 3)])
    assert [o.token_ids for o in outs] == refs
    assert all(o.spec_stats.num_draft_tokens > 0 for o in outs)
    assert_no_leaks(engine)


def test_both_layouts_of_the_same_weights_draft_identically(dirs):
    # prefix caching off: a cache hit would (legitimately) shorten one head's context and not the other's
    engine = make_engine(dirs["target"], eagle3=str(dirs["original"]), enable_prefix_caching=False)
    other = make_engine(dirs["target"], eagle3=str(dirs["speculators"]), enable_prefix_caching=False)
    spec = other.engine.spec.speculators["eagle3"]
    assert spec.head.spec.layout == "speculators" and spec.aux_layer_ids == (2, 4, 5)
    assert spec.head.embed_tokens is not other.engine.runner.model.embed_tokens  # its own copy
    prompts = encode(engine)
    for params in (SamplingParams(**GREEDY, max_tokens=16), SamplingParams(temperature=1.0, seed=3, max_tokens=16)):
        assert_same_proposals((engine, other), "eagle3", prompts, params, SpecParams("eagle3", 3))


@pytest.mark.parametrize("variant", ["original", "nbr"])
def test_drafts_follow_a_from_scratch_reference_of_the_head(dirs, variant):
    eng = make_engine(dirs["target"], eagle3=str(dirs[variant]), enable_prefix_caching=False)
    log = record_proposals(eng, "eagle3")
    params = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, seed=5, max_tokens=14, ignore_eos=True)
    eng.generate(encode(eng)[:2], params, SpecParams("eagle3", 4))
    assert len(log) > 5
    for context, drafts, probs, sampling in log[::2]:
        ref = ref_eagle_probs(
            dirs[variant] / "model.safetensors",
            dirs["target"],
            context,
            drafts,
            sampling,
            norm_before_residual=variant == "nbr",
        )
        torch.testing.assert_close(probs, ref, atol=2e-5, rtol=1e-3)
        assert all(ref[j, d] > 0 for j, d in enumerate(drafts))  # drafts are target ids via d2t


def test_preemption_mid_speculation_keeps_greedy_text(dirs, engine):
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=40)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    # 8 layers x 16 tokens x 2 kv heads x 8 dims x K,V x fp32 = 16 KiB per block
    small = make_engine(dirs["target"], kv_gb=8 * 16384 / 2**30, eagle3=str(dirs["original"]))
    outs = small.generate(prompts, params, [SpecParams("eagle3", 4), SpecParams("eagle3", 2), SpecParams("none")])
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == refs
    assert_no_leaks(small)


def test_config_layouts_defaults_and_refusals():
    target = ModelConfig.from_dict(target_config(num_hidden_layers=32))
    assert default_taps(32) == (2, 16, 29)
    flat = {
        **BASE,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "vocab_size": vocab_size(),
        "draft_vocab_size": 100,
    }
    spec = parse_eagle3_config(flat, target)
    assert (spec.layout, spec.aux_layer_ids, spec.norm_before_residual, spec.draft_vocab_size) == (
        "eagle",
        (2, 16, 29),
        False,
        100,
    )
    assert spec.layer_cfg.rope_theta == 10000.0
    nested = {
        "speculators_model_type": "eagle3",
        "draft_vocab_size": 100,
        "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": [30, 1, 15],
        "transformer_layer_config": {k: v for k, v in flat.items() if k != "architectures"},
    }
    spec = parse_eagle3_config(nested, target)
    assert (spec.layout, spec.aux_layer_ids, spec.norm_before_residual) == ("speculators", (1, 15, 30), True)
    for bad, match in (
        ({**nested, "norm_before_fc": True, "fc_norm": True}, "exclusive"),
        ({**nested, "eagle_aux_hidden_state_layer_ids": [1, 2, 40]}, "taps"),
        ({**flat, "num_hidden_layers": 2}, "decoder layers"),
        ({**flat, "eagle_config": {"use_aux_hidden_state": False}}, "EAGLE-1"),
        ({**flat, "target_hidden_size": 64}, "target hidden size"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_eagle3_config(bad, target)
    assert json.dumps(nested)  # the dicts above are plain JSON, like the files on the hub


@torch.no_grad()
def perturb(module: torch.nn.Module) -> None:
    """Trainer init puts every norm at 1: perturb the trainable weights so that a norm mix-up shows."""
    for p in module.parameters():
        if p.requires_grad:
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02))


@pytest.mark.parametrize("reduced_vocab", [False, True], ids=["full-vocab", "draft-vocab"])
def test_the_embedded_familys_exports_draft_what_the_trainer_predicts(tmp_path, reduced_vocab):
    """Contract with training/: a target + MTP layer and an EAGLE-3 head written by training.export load
    here, and our drafts' probabilities equal the trainer's own modules (MTP row N-2; EAGLE-3 training-
    time-test steps 0..k-1 of row N-2, whose attention pattern is exactly inference's). With a reduced
    draft vocabulary (training's --draft-vocab), the exported d2t maps the trainer's ids to the same
    target ids and every id outside it gets probability 0."""
    from training.eagle3 import Eagle3Head as TrainedHead
    from training.eagle3 import aux_layer_ids, target_features
    from training.export import export_eagle3, export_llama
    from training.model import LlamaLM, LlamaSpec

    torch.manual_seed(0)
    spec = LlamaSpec(
        vocab_size=vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_nextn_predict_layers=1,
    )
    target = LlamaLM(spec)
    perturb(target)
    # the head keeps a frozen copy of the (final) target embedding, as in training; it is never exported
    draft_ids = torch.randperm(spec.vocab_size)[: spec.vocab_size // 3].sort().values if reduced_vocab else None
    head = TrainedHead(
        LlamaSpec(**{**spec.to_dict(), "num_hidden_layers": 1, "num_nextn_predict_layers": 0}),
        spec.hidden_size,
        target.model.embed_tokens.weight,
        draft_ids,
    )
    perturb(head)
    export_llama(target, tmp_path / "target", dtype=torch.float32)
    export_eagle3(head, spec, tmp_path / "eagle3", aux_layer_ids(TARGET_LAYERS), dtype=torch.float32)
    eng = make_engine(tmp_path / "target", eagle3=str(tmp_path / "eagle3"), enable_prefix_caching=False)
    assert {"mtp", "eagle3"} <= set(eng.engine.spec.speculators)
    logs = {m: record_proposals(eng, m) for m in ("mtp", "eagle3")}
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=10, ignore_eos=True)
    prompts = encode(eng)[:2]
    eng.generate(prompts + prompts, params, [SpecParams("mtp", 1)] * 2 + [SpecParams("eagle3", 3)] * 2)
    layers = aux_layer_ids(TARGET_LAYERS)
    with torch.no_grad():
        for context, _drafts, probs, _ in logs["mtp"][::3]:
            ids = torch.tensor([context])
            mtp_logits = target.mtp_logits(ids, target.trunk(ids)[0])[0, len(context) - 2]  # predicts t_N
            torch.testing.assert_close(probs[0], mtp_logits.softmax(-1), atol=2e-5, rtol=1e-3)
        for context, drafts, probs, _ in logs["eagle3"][::3]:
            aux, _ = target_features(target, torch.tensor([context]), layers)  # rows 0..N-2
            next_tokens = torch.tensor([context[1:] + drafts[:-1]])
            steps = head.ttt_logits(aux, next_tokens, len(drafts))
            trained = torch.stack([s[0, len(context) - 2] for s in steps]).softmax(-1)  # [k, Vd]
            if reduced_vocab:
                full = torch.zeros(len(drafts), spec.vocab_size)
                full[:, draft_ids] = trained
                trained = full
                assert all(d in set(draft_ids.tolist()) for d in drafts)
            torch.testing.assert_close(probs, trained, atol=2e-5, rtol=1e-3)
    assert len(logs["mtp"]) > 3 and len(logs["eagle3"]) > 3
    if reduced_vocab:
        return
    # training.restrict_eagle3 cuts the same full-vocabulary export down to some rows: the server's drafts
    # are then the trainer's distribution over those rows only, renormalised.
    from training.restrict_eagle3 import restrict_head

    rows = torch.randperm(spec.vocab_size)[: spec.vocab_size // 4].sort().values
    restrict_head(tmp_path / "eagle3", tmp_path / "eagle3-cut", rows)
    eng = make_engine(tmp_path / "target", eagle3=str(tmp_path / "eagle3-cut"), enable_prefix_caching=False)
    log = record_proposals(eng, "eagle3")
    eng.generate(prompts, params, [SpecParams("eagle3", 3)] * 2)
    with torch.no_grad():
        for context, drafts, probs, _ in log[::3]:
            aux, _ = target_features(target, torch.tensor([context]), layers)
            steps = head.ttt_logits(aux, torch.tensor([context[1:] + drafts[:-1]]), len(drafts))
            want = torch.zeros(len(drafts), spec.vocab_size)
            want[:, rows] = torch.stack([s[0, len(context) - 2, rows] for s in steps]).softmax(-1)
            torch.testing.assert_close(probs, want, atol=2e-5, rtol=1e-3)
    assert len(log) > 3
