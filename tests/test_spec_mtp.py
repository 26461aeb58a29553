"""MTP speculator on tiny random targets with next-n layers written by hand in both layouts, and every
method sharing one batch.

DeepSeek-V3 layout (`model.layers.{L+i}.*`, embedding-then-hidden, final-normed target state) with TWO
MTP layers, so k = 4 runs layer 0, layer 1, then chains the last layer twice; layer 0 ships an
`embed_tokens` equal to the target's (shared), layer 1 its own `shared_head.head` (used).
MiMo layout (`model.mtp_layers.{i}.*`, hidden-then-embedding, pre-norm target state, Qwen2 biases).
Checks: MTP appears automatically; greedy output equals plain; drafts' probabilities equal a slow
from-scratch reference of the layers; all six methods in one mixed batch (and under preemption)
reproduce plain greedy text and free every block of every cache.
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
    llama_tensors,
    make_engine,
    record_proposals,
    reference_probs,
    vocab_size,
    write_checkpoint,
    write_llama,
)
from test_spec_eagle3 import (
    eagle_weights,
    ref_attention,
    ref_mlp,
    ref_rms,
    target_states,
    write_eagle_original,
    write_target,
)

from specserve.sampling.params import SamplingParams
from specserve.speculators.base import SpecParams

NAMES = {  # layout -> (embedding norm, hidden norm, projection, final norm, embedding first?)
    "deepseek_v3": ("enorm", "hnorm", "eh_proj", "shared_head.norm", True),
    "mimo": ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", False),
}


def mtp_prefix(layout: str, num_layers: int, i: int) -> str:
    return f"model.layers.{num_layers + i}." if layout == "deepseek_v3" else f"model.mtp_layers.{i}."


def mtp_tensors(layout: str, cfg: dict, num_mtp: int, rand: Rand, target: dict) -> dict:
    h, bias = cfg["hidden_size"], layout == "mimo"
    enorm, hnorm, proj, fnorm, _ = NAMES[layout]
    t = {}
    for i in range(num_mtp):
        p = mtp_prefix(layout, cfg["num_hidden_layers"], i)
        t.update(block_tensors(p, cfg, rand, qkv_bias=bias))
        t.update({p + f"{enorm}.weight": rand.norm(h), p + f"{hnorm}.weight": rand.norm(h),
                  p + f"{proj}.weight": rand.mat(h, 2 * h), p + f"{fnorm}.weight": rand.norm(h)})
    if layout == "deepseek_v3":
        t[mtp_prefix(layout, cfg["num_hidden_layers"], 0) + "embed_tokens.weight"] = \
            target["model.embed_tokens.weight"].clone()                      # a copy: shared
        if num_mtp > 1:
            t[mtp_prefix(layout, cfg["num_hidden_layers"], 1) + "shared_head.head.weight"] = \
                rand.mat(cfg["vocab_size"], h, scale=0.5)                   # its own head: used
    return t


def write_mtp_target(out, layout: str, num_mtp: int, num_layers: int = 8, seed: int = 0):
    if layout == "mimo":
        cfg = {**BASE, "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "attention_bias": True}
    else:
        cfg = dict(BASE)
    cfg.update(vocab_size=vocab_size(), num_hidden_layers=num_layers, num_nextn_predict_layers=num_mtp)
    rand = Rand(seed)
    tensors = llama_tensors(cfg, rand, qkv_bias=layout == "mimo")
    return write_checkpoint(out, cfg, {**tensors, **mtp_tensors(layout, cfg, num_mtp, rand, tensors)})


# ------------------------------------------------------------------------- plain-tensor reference
def ref_mtp_probs(target_dir, layout: str, num_layers: int, num_mtp: int, context: list[int], drafts: list[int],
                  params: SamplingParams) -> torch.Tensor:
    """[k, V]: every layer recomputed over every base at every step (hidden_drafter.py's alignment)."""
    w = load_file(str(target_dir / "model.safetensors"))
    enorm, hnorm, proj, fnorm, embed_first = NAMES[layout]
    n = len(context)

    def tok(j: int) -> int:
        return context[j] if j < n else drafts[j - n]

    def run(m: int, xs: torch.Tensor, toks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        p = mtp_prefix(layout, num_layers, m)
        pos = torch.arange(len(toks))
        e = w.get(p + "embed_tokens.weight", w["model.embed_tokens.weight"])[torch.tensor(toks)]
        e[pos == 0] = 0.0
        parts = [ref_rms(e, w[p + f"{enorm}.weight"]), ref_rms(xs, w[p + f"{hnorm}.weight"])]
        x = torch.cat(parts if embed_first else parts[::-1], -1) @ w[p + f"{proj}.weight"].T
        y = x + ref_attention(ref_rms(x, w[p + "input_layernorm.weight"]), w, p + "self_attn.", pos)
        y = y + ref_mlp(ref_rms(y, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
        normed = ref_rms(y, w[p + f"{fnorm}.weight"])
        logits = normed[-1] @ w.get(p + "shared_head.head.weight", w["lm_head.weight"]).T
        return (normed if layout == "deepseek_v3" else y), logits

    hidden, prenorm, _ = target_states(target_dir, context[:n - 1])
    xs = prenorm if layout == "mimo" else hidden                                # bases 0..n-2
    rows = []
    for m in range(min(num_mtp, len(drafts))):     # depth m at every base, tokens t_{b+m+1}
        inputs, toks = xs, [tok(b + m + 1) for b in range(n - 1)]
        xs, logits = run(m, inputs, toks)
        rows.append(logits)
    extension: list[torch.Tensor] = []
    for _ in range(num_mtp, len(drafts)):          # chained: the last layer, one base further each step
        extension.append(xs[-1])
        base = n - 2 + len(extension)
        xs, logits = run(num_mtp - 1, torch.cat([inputs, torch.stack(extension)]),
                         toks + [tok(b + num_mtp) for b in range(n - 1, base + 1)])
        rows.append(logits)
    return reference_probs(torch.stack(rows), params)


# ------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"deepseek_v3": write_mtp_target(root / "deepseek", "deepseek_v3", num_mtp=2),
            "mimo": write_mtp_target(root / "mimo", "mimo", num_mtp=1, num_layers=3, seed=1),
            "eagle3": write_eagle_original(root / "eagle3", eagle_weights(seed=9)),
            "draft": write_llama(root / "draft", seed=4, num_hidden_layers=1),
            "plain": write_target(root / "plain")}


@pytest.fixture(scope="module")
def engine(dirs):
    """The DeepSeek-layout target with every speculator loaded."""
    return make_engine(dirs["deepseek_v3"], draft_model=str(dirs["draft"]), eagle3=str(dirs["eagle3"]))


# ------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", ["deepseek_v3", "mimo"])
def test_mtp_loads_automatically_and_greedy_equals_plain(dirs, engine, layout):
    eng = engine if layout == "deepseek_v3" else make_engine(dirs["mimo"])
    spec = eng.engine.spec.speculators["mtp"]
    assert spec.head.layout.name == layout
    prompts = encode(eng)
    params = SamplingParams(**GREEDY, max_tokens=20)
    refs = [o.token_ids for o in eng.generate(prompts, params)]
    assert eng.generate([prompts[0]], params, SpecParams("mtp", 3))[0].token_ids == refs[0]
    outs = eng.generate(prompts, params, [SpecParams("mtp", k) for k in (1, 2, 5)])
    assert [o.token_ids for o in outs] == refs
    assert_no_leaks(eng)
    assert "mtp" not in make_engine(dirs["plain"]).engine.spec.speculators


@pytest.mark.parametrize("layout,num_mtp,k", [("deepseek_v3", 2, 4), ("mimo", 1, 3)])
def test_mtp_drafts_follow_a_from_scratch_reference(dirs, layout, num_mtp, k):
    eng = make_engine(dirs[layout], enable_prefix_caching=False)
    log = record_proposals(eng, "mtp")
    eng.generate(encode(eng)[:2], SamplingParams(temperature=1.0, top_p=0.85, min_p=0.03, seed=8, max_tokens=12,
                                                 ignore_eos=True),
                 SpecParams("mtp", k))
    assert len(log) > 4
    num_layers = eng.engine.runner.cfg.num_hidden_layers
    for context, drafts, probs, sampling in log[::2]:
        ref = ref_mtp_probs(dirs[layout], layout, num_layers, num_mtp, context, drafts, sampling)
        torch.testing.assert_close(probs, ref, atol=2e-5, rtol=1e-3)


MIXED = [SpecParams("none", 0), SpecParams("ngram", 3), SpecParams("prediction", 4), SpecParams("draft", 2),
         SpecParams("draft", 5), SpecParams("eagle3", 3), SpecParams("mtp", 1), SpecParams("mtp", 4)]


def mixed_run(eng, prompts, params, refs):
    batch = [prompts[i % len(prompts)] for i in range(len(MIXED))]
    preds = [refs[i % len(prompts)] if s.method == "prediction" else None for i, s in enumerate(MIXED)]
    return eng.generate(batch, params, MIXED, preds)


def test_all_methods_in_one_mixed_batch_equal_plain(engine):
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=24)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    outs = mixed_run(engine, prompts, params, refs)
    for i, (out, spec) in enumerate(zip(outs, MIXED)):
        assert out.token_ids == refs[i % len(prompts)], f"request {i} ({spec})"
        assert spec.k == 0 or out.spec_stats.num_draft_tokens > 0, spec
    assert_no_leaks(engine)


def test_mixed_batch_under_preemption_keeps_greedy_text_and_frees_every_cache(dirs, engine):
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=32)
    refs = [o.token_ids for o in engine.generate(prompts, params)]
    # 8 layers x 16 tokens x 2 kv heads x 8 dims x K,V x fp32 = 16 KiB per block; 8 requests need ~24
    small = make_engine(dirs["deepseek_v3"], kv_gb=14 * 16384 / 2**30, draft_model=str(dirs["draft"]),
                        eagle3=str(dirs["eagle3"]))
    outs = mixed_run(small, prompts, params, refs)
    assert small.engine.scheduler.num_preemptions > 0
    for i, out in enumerate(outs):
        assert out.token_ids == refs[i % len(prompts)], f"request {i} ({MIXED[i]})"
    assert_no_leaks(small)


def test_declared_mtp_layers_without_tensors_are_an_error(dirs, tmp_path):
    import json
    import shutil
    broken = shutil.copytree(dirs["plain"], tmp_path / "broken")
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match="neither DeepSeek-V3 MTP tensors"):
        make_engine(broken)
