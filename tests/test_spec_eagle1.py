"""EAGLE-1 heads (method `eagle`) on a tiny random target, written by hand in the public SafeAILab key names:
`fc.weight` [H, 2H] (+ `fc.bias` when config "bias" is true or missing), `layers.0.{self_attn,mlp,
post_attention_layernorm}.*`, no input_layernorm, no final norm, no lm_head, embed_tokens optional.

Greedy output equals plain decoding; the drafts' probabilities equal a from-scratch reference written here
in plain tensor maths (every row recomputed at every step); the same comparison against references with a
planted bug (fc.bias dropped, the concatenation order swapped, the target state taken before its final
norm) fails, so the check can tell them apart; malformed files are refused at start-up.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_spec_draft_model import (
    BASE,
    GREEDY,
    Rand,
    assert_no_leaks,
    block_tensors,
    encode,
    make_engine,
    record_proposals,
    reference_probs,
    vocab_size,
    write_checkpoint,
    write_llama,
)
from test_spec_eagle3 import ref_attention, ref_mlp, ref_rms, target_states

from specserve.sampling.params import SamplingParams
from specserve.server.models.config import ModelConfig
from specserve.speculators.base import SpecParams
from specserve.speculators.eagle1_loader import parse_eagle1_config


# ------------------------------------------------------------------------- writer
def eagle1_weights(seed: int, bias: bool, embedding: bool) -> dict:
    rand = Rand(seed)
    h = BASE["hidden_size"]
    t = {"layers.0." + k: v for k, v in block_tensors("", BASE, rand).items() if "input_layernorm" not in k}
    t["fc.weight"] = rand.mat(h, 2 * h)
    if bias:
        t["fc.bias"] = rand.mat(1, h)[0] * 10        # large enough that dropping it changes the drafts
    if embedding:
        t["embed_tokens.weight"] = rand.mat(vocab_size(), h, scale=0.5)
    return t


def write_eagle1(out, weights: dict, bias_key):
    """bias_key: True / False written as config "bias", None = the key absent (which means true)."""
    cfg = {**BASE, "num_hidden_layers": 1, "vocab_size": vocab_size()}
    if bias_key is not None:
        cfg["bias"] = bias_key
    return write_checkpoint(out, cfg, weights, tokenizer=False)


# ------------------------------------------------------------------------- plain-tensor reference
def ref_eagle1_probs(head_dir, target_dir, context: list[int], drafts: list[int], params: SamplingParams,
                     bug: str | None = None) -> torch.Tensor:
    """[k, V]: the head's distribution at every draft position. bug plants a known mistake."""
    w = load_file(str(head_dir / "model.safetensors"))
    target = load_file(str(target_dir / "model.safetensors"))
    embed = w.get("embed_tokens.weight", target["model.embed_tokens.weight"])
    normed, prenorm, _ = target_states(target_dir, context[:-1])                   # rows 0..n-2, [n-1, H]
    hidden = list(prenorm if bug == "prenorm" else normed)
    bias = w.get("fc.bias") if bug != "no_bias" else None
    tokens, positions, rows = list(context[1:]), list(range(len(context) - 1)), []
    for j in range(len(drafts)):
        x, emb = torch.stack(hidden), embed[torch.tensor(tokens)]
        a = torch.cat([x, emb] if bug == "swap" else [emb, x], -1) @ w["fc.weight"].T
        a = a + bias if bias is not None else a
        h = a + ref_attention(a, w, "layers.0.self_attn.", torch.tensor(positions))
        h = h + ref_mlp(ref_rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.mlp.")
        rows.append(h[-1] @ target["lm_head.weight"].T)                            # the target's head, no norm
        hidden.append(h[-1])
        tokens.append(drafts[j])
        positions.append(positions[-1] + 1)
    return reference_probs(torch.stack(rows), params)


# ------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle1")
    return {
        "target": write_llama(root / "target", seed=0),
        # the Vicuna/LLaMA2 layout: fc.bias, no "bias" key in the config, own embedding
        "vicuna": write_eagle1(root / "vicuna", eagle1_weights(3, bias=True, embedding=True), None),
        # the LLaMA3 layout: "bias": false, no fc.bias, the target's embedding
        "llama3": write_eagle1(root / "llama3", eagle1_weights(4, bias=False, embedding=False), False),
    }


@pytest.fixture(scope="module")
def engine(dirs):
    return make_engine(dirs["target"], eagle=str(dirs["vicuna"]), enable_prefix_caching=False)


# ------------------------------------------------------------------------- tests
def test_greedy_equals_plain_batch1_and_batched(dirs):
    for layout in ("vicuna", "llama3"):
        eng = make_engine(dirs["target"], eagle=str(dirs[layout]))
        assert "eagle" in eng.engine.spec.speculators
        prompts = encode(eng)
        params = SamplingParams(**GREEDY, max_tokens=24)
        refs = [o.token_ids for o in eng.generate(prompts, params)]
        assert eng.generate([prompts[1]], params, SpecParams("eagle", 1))[0].token_ids == refs[1]
        outs = eng.generate(prompts, params, [SpecParams("eagle", k) for k in (5, 2, 3)])
        assert [o.token_ids for o in outs] == refs
        assert all(o.spec_stats.num_draft_tokens > 0 for o in outs)
        assert_no_leaks(eng)


def test_embedding_and_head_are_shared_only_when_the_file_has_none(dirs, engine):
    own = engine.engine.spec.speculators["eagle"].head
    assert own.spec.fc_bias and own.fc.bias is not None
    assert own.embed_tokens is not engine.engine.runner.model.embed_tokens
    assert own.lm_head is engine.engine.runner.model.lm_head
    eng = make_engine(dirs["target"], eagle=str(dirs["llama3"]))
    shared = eng.engine.spec.speculators["eagle"].head
    assert not shared.spec.fc_bias and shared.fc.bias is None
    assert shared.embed_tokens is eng.engine.runner.model.embed_tokens


@pytest.mark.parametrize("layout", ["vicuna", "llama3"])
def test_drafts_follow_a_from_scratch_reference_and_planted_bugs_do_not(dirs, engine, layout):
    eng = engine if layout == "vicuna" else make_engine(dirs["target"], eagle=str(dirs[layout]),
                                                         enable_prefix_caching=False)
    log = record_proposals(eng, "eagle")
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=5, max_tokens=14, ignore_eos=True)
    eng.generate(encode(eng)[:2], params, SpecParams("eagle", 4))
    assert len(log) > 5
    bugs = ["swap", "prenorm"] + (["no_bias"] if layout == "vicuna" else [])
    for context, drafts, probs, sampling in log[::3]:
        ref = ref_eagle1_probs(dirs[layout], dirs["target"], context, drafts, sampling)
        torch.testing.assert_close(probs, ref, atol=2e-5, rtol=1e-3)
        for bug in bugs:     # the same comparison against a known-wrong head must fail
            wrong = ref_eagle1_probs(dirs[layout], dirs["target"], context, drafts, sampling, bug=bug)
            assert not torch.allclose(probs, wrong, atol=2e-5, rtol=1e-3), bug


def _files(tmp_path, name, weights, bias_key):
    return write_eagle1(tmp_path / name, weights, bias_key)


def test_malformed_heads_are_refused_at_start_up(dirs, tmp_path):
    good = eagle1_weights(5, bias=True, embedding=False)
    cases = {
        "missing bias": ({k: v for k, v in good.items() if k != "fc.bias"}, None, "lacks fc.bias"),
        "stray bias": (good, False, "has fc.bias"),
        "input norm": ({**good, "layers.0.input_layernorm.weight": torch.ones(BASE["hidden_size"])}, True,
                       "input_layernorm"),
        "own head": ({**good, "lm_head.weight": torch.zeros(vocab_size(), BASE["hidden_size"])}, True,
                     "unsupported EAGLE-1 tensors"),
    }
    for name, (weights, bias_key, match) in cases.items():
        head = _files(tmp_path, name.replace(" ", "_"), weights, bias_key)
        with pytest.raises(ValueError, match=match):
            make_engine(dirs["target"], eagle=str(head))


def test_config_refusals():
    target = ModelConfig.from_dict({**BASE, "vocab_size": vocab_size()})
    flat = {**BASE, "num_hidden_layers": 1, "vocab_size": vocab_size()}
    assert parse_eagle1_config(flat, target).fc_bias is True              # "bias" missing means true
    assert parse_eagle1_config({**flat, "bias": False}, target).fc_bias is False
    for bad, match in (
        ({**flat, "hidden_size": 64}, "hidden size"),
        ({**flat, "vocab_size": 100}, "vocabulary"),
        ({**flat, "num_hidden_layers": 2}, "decoder layers"),
        ({**flat, "bias": "yes"}, "bias"),
        ({**flat, "draft_vocab_size": 100}, "eagle3"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_eagle1_config(bad, target)


@pytest.mark.parametrize("fc_bias", [True, False], ids=["bias", "no-bias"])
def test_the_embedded_familys_eagle1_export_drafts_what_the_trainer_predicts(tmp_path, fc_bias):
    """Contract with training/: an EAGLE-1 head written by training.export.export_eagle1 loads as method
    `eagle`, and its drafts' probabilities equal the trainer's own module (training-time-test steps 0..k-1
    of row N-2, whose attention pattern is exactly inference's), the bias and the shared head included."""
    from test_spec_eagle3 import perturb

    from training.eagle1 import Eagle1Head as TrainedHead
    from training.eagle1 import target_features
    from training.export import export_eagle1, export_llama
    from training.model import LlamaLM, LlamaSpec

    torch.manual_seed(0)
    spec = LlamaSpec(vocab_size=vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    target = LlamaLM(spec)
    perturb(target)
    head = TrainedHead(LlamaSpec(**{**spec.to_dict(), "num_hidden_layers": 1}), target, fc_bias)
    perturb(head)
    export_llama(target, tmp_path / "target", dtype=torch.float32)
    export_eagle1(head, tmp_path / "eagle", dtype=torch.float32)
    eng = make_engine(tmp_path / "target", eagle=str(tmp_path / "eagle"), enable_prefix_caching=False)
    assert eng.engine.spec.speculators["eagle"].head.spec.fc_bias is fc_bias
    log = record_proposals(eng, "eagle")
    eng.generate(encode(eng)[:2], SamplingParams(temperature=1.0, seed=4, max_tokens=10, ignore_eos=True),
                 SpecParams("eagle", 3))
    with torch.no_grad():
        for context, drafts, probs, _ in log[::3]:
            feats, _ = target_features(target, torch.tensor([context]))              # rows 0..N-2
            steps = head.ttt_logits(feats, torch.tensor([context[1:] + drafts[:-1]]), len(drafts))
            trained = torch.stack([s[0, len(context) - 2] for s in steps]).softmax(-1)  # [k, V]
            torch.testing.assert_close(probs, trained, atol=2e-5, rtol=1e-3)
    assert len(log) > 3
