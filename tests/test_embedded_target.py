"""The shipped embedded target (models/target): what `make serve` serves when no --model is given.

Checks the real weights, not a random stand-in: plain transformers loads the checkpoint (dropping the MTP
layer), the server's greedy tokens are HF's argmax at every position, the model is trained (held-out loss far
below a uniform guess), and its MTP layer is picked up automatically and drafts tokens the target accepts.
"""
import json
import math

import pytest
import torch

from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.engine.offline import OfflineEngine
from specserve.server.models.embedded import require as embedded_family
from specserve.speculators.base import SpecParams
from training import common
from training.evaluate import function_prompts

NEW = 32


@pytest.fixture(scope="module")
def offline():
    cfg = EngineConfig(dtype="float32", device="cpu", num_threads=1, kv_cache_memory_gb=0.05, seed=0,
                       speculation_probe_tokens=0)
    return OfflineEngine.from_config(cfg)


@pytest.fixture(scope="module")
def prompts(offline):
    return [offline.engine.tokenizer.encode(p) for p in function_prompts(2)]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(str(embedded_family().target), torch_dtype=torch.float32).eval()


def _greedy(offline, prompts, spec):
    return offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), spec)


def test_checkpoint_declares_mtp_and_default_engine_offers_it(offline):
    cfg = json.loads((embedded_family().target / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]          # GQA
    assert "mtp" in offline.engine.spec.speculators
    assert (embedded_family().target / "model.safetensors").stat().st_size < 150e6


def test_hf_loads_the_main_model_and_agrees_with_the_server(offline, prompts, hf_model):
    outs = _greedy(offline, prompts, SpecParams())
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == NEW
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = hf_model(ids).logits[0, len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        # every server token is HF's argmax (up to fp32 rounding: ties within 1e-3 may go either way)
        assert torch.all(chosen >= logits.max(-1).values - 1e-3), (chosen, logits.max(-1).values)


def test_target_is_trained(hf_model):
    _, held = common.token_streams()
    window = torch.from_numpy(held[:513].astype("int64"))[None]
    with torch.no_grad():
        loss = float(hf_model(window[:, :-1], labels=window[:, :-1]).loss)
    assert loss < 0.5 * math.log(hf_model.config.vocab_size), loss


def test_mtp_drafts_are_accepted_and_lossless(offline, prompts):
    plain = _greedy(offline, prompts, SpecParams())
    mtp = _greedy(offline, prompts, SpecParams(method="mtp", num_speculative_tokens=1))
    assert [o.token_ids for o in mtp] == [o.token_ids for o in plain]
    drafts = sum(o.spec_stats.num_draft_tokens for o in mtp)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in mtp)
    assert drafts > 0 and accepted / drafts > 0.3, (accepted, drafts)
    assert sum(o.num_steps for o in mtp) < sum(o.num_steps for o in plain)


def test_the_embedded_eagle1_head_is_offered_small_and_lossless(offline, prompts):
    """`make serve` (no flags) offers method `eagle` from models/eagle: a few-MB SafeAILab-layout EAGLE-1
    head whose greedy drafts are accepted and keep the plain text."""
    head_dir = embedded_family().eagle
    assert (head_dir / "model.safetensors").stat().st_size < 10e6
    assert "eagle" in offline.engine.spec.speculators
    head = offline.engine.spec.speculators["eagle"].head
    assert head.spec.fc_bias == json.loads((head_dir / "config.json").read_text())["bias"]
    assert head.lm_head is offline.engine.runner.model.lm_head
    plain = _greedy(offline, prompts, SpecParams())
    outs = _greedy(offline, prompts, SpecParams(method="eagle", num_speculative_tokens=4))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    drafts = sum(o.spec_stats.num_draft_tokens for o in outs)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
    assert drafts > 0 and accepted / drafts > 0.1, (accepted, drafts)


def test_plain_copy_for_other_servers_drops_only_the_mtp_layer(tmp_path):
    """loadtest.bench_vllm hands vLLM this copy: the main model's tensors bit for bit, no MTP weights or
    config keys, tokenizer alongside; plain transformers loads it with no missing or unexpected keys."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from loadtest.bench_vllm import plain_copy
    out = plain_copy(embedded_family().target, tmp_path / "plain")
    src, dst = load_file(embedded_family().target / "model.safetensors"), load_file(out / "model.safetensors")
    n = json.loads((embedded_family().target / "config.json").read_text())["num_hidden_layers"]
    mtp = {k for k in src if k.startswith(f"model.layers.{n}.")}
    assert mtp and set(dst) == set(src) - mtp
    assert all(torch.equal(dst[k], src[k]) for k in dst)
    cfg = json.loads((out / "config.json").read_text())
    assert "num_nextn_predict_layers" not in cfg and "mtp" not in cfg
    assert (out / "tokenizer.json").exists()
    _, info = LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_bf16_family_every_method_keeps_greedy_text_in_one_batch(prompts):
    """`--dtype bfloat16` on a CPU with bf16 units: bf16 weights (packed, row-stable) and bf16 K/V read in
    place by the paged kernel, whose fp32 reduction order per row does not depend on the batch, the
    number of queries or keys. Every speculator, mixed in one batch and never cut by the load (adaptive
    off), emits what plain bf16 decoding emits."""
    from specserve.server.models.linear import Linear, pack_linears
    if pack_linears(Linear(64, 64).to(torch.bfloat16)) == 0:
        pytest.skip("this CPU's oneDNN has no packed bf16 kernel: bf16 rows may depend on the batch here")
    eng = OfflineEngine.from_config(EngineConfig(dtype="bfloat16", device="cpu", num_threads=1,
                                                 kv_cache_memory_gb=0.05, seed=0, speculation_probe_tokens=0))
    from specserve.server.models.attention import cpu_backend
    paged = cpu_backend() == "paged"                    # else the SDPA fallback attends over fp32 K/V
    assert eng.engine.runner.kv_caches[0][0].dtype == (torch.bfloat16 if paged else torch.float32)
    methods = ["none", "ngram", "suffix", "draft", "eagle3", "eagle", "mtp", "hybrid"]
    assert set(methods[1:]) <= set(eng.engine.spec.speculators)
    plain = _greedy(eng, prompts, SpecParams())
    batch = [p for p in prompts for _ in methods]
    specs = [SpecParams() if m == "none" else SpecParams(method=m, num_speculative_tokens=3, adaptive=False)
             for _ in prompts for m in methods]
    outs = _greedy(eng, batch, specs)
    for i, out in enumerate(outs):
        assert out.token_ids == plain[i // len(methods)].token_ids, specs[i]
    assert all(
        o.spec_stats.num_accepted_tokens > 0
        for o, s in zip(outs, specs) if s.method in ("draft", "eagle3", "eagle", "mtp")
    )
