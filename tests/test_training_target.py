"""Target + MTP: trains (loss falls), resumes exactly, exports a checkpoint plain HF loads with equal logits."""
import json

import pytest
import torch
from safetensors.torch import load_file

from training import common
from training.export import export_llama, load_llama
from training.lm_loop import LMTrainConfig, train_lm
from training.model import LlamaLM, LlamaSpec, flops_per_token
from training.train_draft import DRAFT
from training.train_target import PRESETS

TINY = LlamaSpec(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def streams():
    tok = common.load_tokenizer()
    text = (common.REPO / "training" / "common.py").read_text()
    s = common.encode_documents(tok, [text] * 4)
    return s, s[: len(s) // 4]


def _cfg(tmp_path, **kw):
    base = dict(name="t", spec=TINY, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1, tokens=4 * 32 * 6,
                eval_windows=4, eval_seq_len=32, final_eval_windows=4, eval_every_s=1e9, log_every=1000,
                threads=1, seed=0)
    base.update(kw)
    return LMTrainConfig(**base)


@pytest.fixture(params=["fp32", "bf16"])
def precision(request, monkeypatch):
    """Both training precisions run on every CPU (bf16 is only slow where the CPU lacks bf16 units)."""
    monkeypatch.setenv("SPECSERVE_TRAIN_PRECISION", request.param)
    common.cpu_bf16_fast.cache_clear()
    yield request.param
    common.cpu_bf16_fast.cache_clear()


def test_precision_override_picks_the_autocast(precision):
    assert common.precision("cpu") == ("bf16-autocast" if precision == "bf16" else "fp32")
    with common.autocast("cpu"):
        y = torch.randn(4, 8) @ torch.randn(8, 4)
    assert y.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)


def test_tiny_target_trains_and_resumes(tmp_path, monkeypatch, streams, precision):
    monkeypatch.setattr(common, "RUNS_DIR", tmp_path)
    torch.manual_seed(0)
    before = LlamaLM(TINY)
    w = torch.from_numpy(streams[0][:4 * 33].astype("int64")).view(4, 33)
    with torch.no_grad():
        m0, t0 = before.losses(w)
    model, summary = train_lm(_cfg(tmp_path, name="full"), *streams)
    with torch.no_grad():
        m1, t1 = model.losses(w)
    assert m1 < m0 - 0.5 and t1 < t0 - 0.5, (m0, m1, t0, t1)
    assert summary["finished"] and summary["steps"] == 6
    assert summary["precision"] == ("bf16-autocast" if precision == "bf16" else "fp32")
    # cut the run into three invocations (a run being stopped) and resume: identical weights
    for _ in range(3):
        resumed, s = train_lm(_cfg(tmp_path, name="cut", stop_after_steps=2), *streams)
        if s["finished"]:
            break
    for (k, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_second_stage_starts_from_the_first_and_reports_cumulative_tokens(tmp_path, monkeypatch, streams):
    """--init-from: a new stage (own run dir, fresh optimizer and schedule) starts from stage 1's weights,
    either its run checkpoint or its export, and the export's training info adds the stages up."""
    monkeypatch.setattr(common, "RUNS_DIR", tmp_path)
    stage1, s1 = train_lm(_cfg(tmp_path, name="s1", out_dir=tmp_path / "export1"), *streams)
    w = torch.from_numpy(streams[0][:4 * 33].astype("int64")).view(4, 33)
    for source in (tmp_path / "s1" / "ckpt.pt", tmp_path / "export1"):
        name = "s2-" + source.name
        probe = _cfg(tmp_path, name=name, init_from=source, tokens=4 * 32, lr=1e-9, warmup_steps=1)
        stage2, _ = train_lm(probe, *streams)       # one step at lr ~0: the weights are stage 1's
        with torch.no_grad():
            a, b = stage1.losses(w)[0], stage2.losses(w)[0]
        assert float(b) == pytest.approx(float(a), abs=0.05 if source.is_dir() else 1e-4)   # export is bf16
    final, s2 = train_lm(_cfg(tmp_path, name="s2", init_from=tmp_path / "export1", out_dir=tmp_path / "export2"),
                         *streams)
    info = json.loads((tmp_path / "export2" / "config.json").read_text())["specserve_training"]
    assert info["tokens"] == s1["tokens"] + s2["tokens"]
    assert [st["tokens"] for st in info["stages"]] == [s1["tokens"], s2["tokens"]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_loads_in_hf_and_ignores_mtp(tmp_path, dtype):
    from transformers import LlamaForCausalLM
    torch.manual_seed(1)
    model = LlamaLM(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    out = export_llama(model, tmp_path / "ckpt", dtype=dtype, mtp_loss_weight=0.3)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["mtp"]["concat_order"] == "embedding_then_hidden" and cfg["mtp"]["hidden_state"] == "post_final_norm"
    sd = load_file(str(out / "model.safetensors"))
    L = TINY.num_hidden_layers
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"):
        assert f"model.layers.{L}.{name}" in sd
    assert sd[f"model.layers.{L}.eh_proj.weight"].shape == (TINY.hidden_size, 2 * TINY.hidden_size)
    assert all(t.dtype == dtype for t in sd.values())
    hf = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert len(hf.model.layers) == L
    # compare against the training model holding the same (possibly bf16-rounded) weights, in fp32
    ref = load_llama(out).eval()
    x = torch.randint(0, TINY.vocab_size, (2, 40))
    with torch.no_grad():
        a, b = ref(x), hf(x).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    if dtype == torch.float32:
        with torch.no_grad():
            assert torch.allclose(model(x), b, atol=1e-4, rtol=1e-4)
    # the MTP weights round-trip through the checkpoint
    with torch.no_grad():
        h, _ = model.trunk(x)
        h2, _ = ref.trunk(x)
        tol = 1e-4 if dtype == torch.float32 else 1e9
        assert (model.mtp_logits(x, h) - ref.mtp_logits(x, h2)).abs().max() < tol


def test_preset_sizes():
    target = PRESETS["target"]
    with torch.device("meta"):
        m = LlamaLM(target)
    main_params = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("mtp."))
    assert 25e6 <= main_params <= 40e6
    assert target.num_key_value_heads < target.num_attention_heads
    assert flops_per_token(DRAFT) <= flops_per_token(target) / 8


def test_the_evaluations_sampler_keeps_the_nucleus_and_the_card_reports_both_loop_measures():
    from training.evaluate import greedy, sample
    from training.model_card import status_lines
    torch.manual_seed(0)
    model = LlamaLM(TINY).eval()
    prompt = [5, 6, 7]
    # a nucleus smaller than any single token keeps only the most likely one: greedy
    assert sample(model, prompt, 6, temperature=1.0, top_p=1e-9, seed=1) == greedy(model, prompt, 6)
    draws = {tuple(sample(model, prompt, 6, temperature=1.0, top_p=1.0, seed=s)) for s in range(4)}
    assert len(draws) > 1 and sample(model, prompt, 6, 1.0, 1.0, seed=2) == sample(model, prompt, 6, 1.0, 1.0, seed=2)

    class Corpus:
        @staticmethod
        def heldout_texts():
            return ["def f(x):\n    return x + 1\n" * 3]
    loop, fresh = "a b c " * 10, "def g(y): return y * 2 if y else None"
    rows = status_lines({"samples": [{"completion": loop, "sampled": [fresh, fresh]}]}, Corpus())
    greedy_row = next(r for r in rows if "greedy samples do not loop" in r)
    sampled_row = next(r for r in rows if "sampled completions" in r)
    assert greedy_row.endswith("| **no** |") and sampled_row.endswith("| yes |")
