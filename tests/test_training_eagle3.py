"""EAGLE-3 head: TTT loss trains, export has the public EAGLE-3 tensor names and shapes."""
import json

import torch
from safetensors.torch import load_file

from training.eagle3 import (
    Eagle3Head,
    aux_layer_ids,
    select_draft_vocab,
    target_features,
    ttt_loss,
)
from training.export import export_eagle3
from training.model import LlamaLM, LlamaSpec
from training.train_eagle3 import head_spec

TARGET = LlamaSpec(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2)


def _setup():
    torch.manual_seed(0)
    target = LlamaLM(TARGET).eval()
    head = Eagle3Head(head_spec(TARGET), TARGET.hidden_size, target.model.embed_tokens.weight)
    head.init_from_target(target)
    return target, head


def test_ttt_mask_matches_inference_chain():
    """Step-1 logits of row i equal a fresh two-row computation with only the keys inference would have."""
    target, head = _setup()
    layers = aux_layer_ids(8)
    assert layers == (2, 4, 5)
    w = torch.randint(0, 512, (1, 9))
    aux, _ = target_features(target, w, layers)
    nxt = torch.cat([w[:, 1:], torch.zeros(1, 1, dtype=w.dtype)], 1)
    with torch.no_grad():
        full = head.ttt_logits(aux, nxt, steps=2)
        i = 4   # truncate to rows 0..i: row i's outputs must not depend on later rows
        part = head.ttt_logits(aux[:, :i + 1], nxt[:, :i + 2], steps=2)
    assert torch.allclose(full[0][:, :i + 1], part[0], atol=1e-5)
    assert torch.allclose(full[1][:, i], part[1][:, i], atol=1e-5)


def test_head_trains_and_exports(tmp_path):
    target, head = _setup()
    layers = aux_layer_ids(8)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    w = torch.randint(0, 512, (4, 33))
    aux, tl = target_features(target, w, layers)
    first = None
    for _ in range(15):
        loss, _, _ = ttt_loss(head, aux, w, tl, steps=3)
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < first
    out = export_eagle3(head, TARGET, tmp_path / "eagle3", layers)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == 512 and cfg["target_hidden_size"] == 32
    H, Ht, Im, hd = 32, 32, 64, 8
    expected = {
        "fc.weight": (H, 3 * Ht),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (4 * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (2 * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (2 * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, 4 * hd),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (Im, H),
        "midlayer.mlp.up_proj.weight": (Im, H),
        "midlayer.mlp.down_proj.weight": (H, Im),
        "norm.weight": (H,),
        "lm_head.weight": (512, H),
    }
    sd = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert all(v.dtype == torch.bfloat16 for v in sd.values())


def test_acceptance_walk():
    from training.evaluate import chain_matches, walk
    corr = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert chain_matches(corr).tolist() == [2, 0, 4]
    # always 4 of k=4 accepted: 5 tokens per step; never: 1 token per step
    assert walk(lambda p: 4, 0, 20, 4) == 5.0
    assert walk(lambda p: 0, 0, 20, 4) == 1.0
    # the cap at the end of the sequence: 7 tokens, full acceptance -> steps of 5 and 2
    assert walk(lambda p: 4, 0, 7, 4) == 3.5


def test_select_draft_vocab_takes_the_most_frequent_ids_sorted():
    stream = [5, 5, 5, 2, 2, 9, 9, 7, 1]                # counts: 5:3, 2:2, 9:2, 7:1, 1:1
    assert select_draft_vocab(stream, 12, 3).tolist() == [2, 5, 9]
    assert select_draft_vocab(stream, 12, 4).tolist() == [1, 2, 5, 9]   # a tie (1 vs 7) goes to the lower id
    for bad in (0, 13):
        try:
            select_draft_vocab(stream, 12, bad)
        except ValueError:
            continue
        raise AssertionError(f"size {bad} accepted")


def test_reduced_draft_vocab_trains_exports_public_tables_and_round_trips(tmp_path):
    from training.evaluate import load_head
    torch.manual_seed(0)
    target = LlamaLM(TARGET).eval()
    draft_ids = torch.tensor(sorted(torch.randperm(512)[:96].tolist()))
    head = Eagle3Head(head_spec(TARGET), TARGET.hidden_size, target.model.embed_tokens.weight, draft_ids)
    head.init_from_target(target)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[draft_ids])   # warm start: the draft rows
    layers = aux_layer_ids(8)
    w = torch.randint(0, 512, (4, 33))
    aux, tl = target_features(target, w, layers)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(15):
        loss, _, accs = ttt_loss(head, aux, w, tl, steps=3)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] and all(0.0 <= a <= 1.0 for a in accs)
    out = export_eagle3(head, TARGET, tmp_path / "eagle3", layers, dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 512 and cfg["draft_vocab_size"] == 96
    sd = load_file(str(out / "model.safetensors"))
    assert sd["lm_head.weight"].shape == (96, 32) and "draft_ids" not in sd
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (512,)
    assert torch.equal(torch.arange(96) + sd["d2t"], draft_ids)                 # an OFFSET table
    assert torch.equal(torch.nonzero(sd["t2d"]).flatten(), draft_ids)
    back = load_head(out, target)                                                # what training.evaluate scores
    assert torch.equal(back.draft_ids, draft_ids)
    with torch.no_grad():
        nxt = torch.cat([w[:, 1:], torch.zeros(4, 2, dtype=w.dtype)], 1)
        for a, b in zip(head.ttt_logits(aux, nxt, 3), back.ttt_logits(aux, nxt, 3)):
            torch.testing.assert_close(a, b)


def test_restrict_head_refuses_reduced_heads_and_bad_ids(tmp_path):
    import pytest

    from training.restrict_eagle3 import restrict_head
    _, head = _setup()
    full = export_eagle3(head, TARGET, tmp_path / "full", aux_layer_ids(8))
    for bad in (torch.tensor([3, 1]), torch.tensor([1, 1]), torch.tensor([0, 512]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match="distinct ascending"):
            restrict_head(full, tmp_path / "cut", bad)
    cut = restrict_head(full, tmp_path / "cut", torch.tensor([0, 7, 300]))
    assert load_file(str(cut / "model.safetensors"))["d2t"].tolist() == [0, 6, 298]
    with pytest.raises(ValueError, match="already"):
        restrict_head(cut, tmp_path / "again", torch.tensor([0, 7]))
