"""EAGLE-1 head in training/: the shared TTT loss trains it, and the export has the public SafeAILab EAGLE-1
tensor names and shapes (no input_layernorm, no final norm, no lm_head, no embedding) and its "bias"."""
import json

import pytest
import torch
from safetensors.torch import load_file

from training.eagle1 import Eagle1Head, target_features
from training.eagle3 import ttt_loss
from training.evaluate import load_eagle1
from training.export import export_eagle1
from training.model import LlamaLM, LlamaSpec
from training.train_eagle3 import head_spec

TARGET = LlamaSpec(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("fc_bias", [True, False])
def test_head_trains_exports_and_round_trips(tmp_path, fc_bias):
    torch.manual_seed(0)
    target = LlamaLM(TARGET).eval()
    head = Eagle1Head(head_spec(TARGET), target, fc_bias)
    trainable = [p for p in head.parameters() if p.requires_grad]
    assert all(p is not head.lm_head.weight and p is not head.embed_tokens.weight for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=3e-3)
    w = torch.randint(0, 512, (4, 33))
    feats, tl = target_features(target, w)
    assert torch.equal(feats, target.trunk(w)[0][:, :-1])       # the target's state AFTER its final norm
    first = None
    for _ in range(15):
        loss, _, _ = ttt_loss(head, feats, w, tl, steps=3)
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < first
    out = export_eagle1(head, tmp_path / "eagle")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is fc_bias and cfg["hidden_size"] == 32
    H, Im, hd = 32, 64, 8
    expected = {
        "fc.weight": (H, 2 * H),
        "layers.0.self_attn.q_proj.weight": (4 * hd, H),
        "layers.0.self_attn.k_proj.weight": (2 * hd, H),
        "layers.0.self_attn.v_proj.weight": (2 * hd, H),
        "layers.0.self_attn.o_proj.weight": (H, 4 * hd),
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.mlp.gate_proj.weight": (Im, H),
        "layers.0.mlp.up_proj.weight": (Im, H),
        "layers.0.mlp.down_proj.weight": (H, Im),
        **({"fc.bias": (H,)} if fc_bias else {}),
    }
    sd = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    # the evaluator reads it back into the same function (bf16 rounding aside)
    back = load_eagle1(out, target)
    nxt = torch.cat([w[:, 1:], torch.zeros(4, 1, dtype=w.dtype)], 1)
    with torch.no_grad():
        torch.testing.assert_close(back.ttt_logits(feats, nxt, 2)[1], head.ttt_logits(feats, nxt, 2)[1],
                                   atol=0.05, rtol=0.05)
