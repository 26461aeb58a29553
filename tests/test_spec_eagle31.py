"""EAGLE-3.1 and the speculators library's norm variants load under `eagle3`, driven by their config:
`fc_norm` (an RMSNorm per tap before fc: `fc_norm.{k}.weight` [Ht]), `norm_before_fc` (ONE RMSNorm over the
concatenated taps: `input_norm.weight` [3 Ht]) and `norm_output` (the normed output is the next step's
hidden). Random heads in both layouts with those public names; drafts' probabilities equal a from-scratch
reference written here, and references with a planted bug (a norm skipped, the wrong norm, the un-normed
output fed back) do not. Plain EAGLE-3 heads are tests/test_spec_eagle3.py's.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_spec_draft_model import BASE, GREEDY, Rand, encode, make_engine, record_proposals, reference_probs
from test_spec_eagle3 import (
    eagle_weights,
    ref_attention,
    ref_mlp,
    ref_rms,
    target_states,
    write_eagle_original,
    write_eagle_speculators,
    write_target,
)

from specserve.sampling.params import SamplingParams
from specserve.speculators.base import SpecParams

TAPS = (2, 4, 5)       # the default taps of the 8-layer target


def variant_weights(seed: int, fc_norm: bool, norm_before_fc: bool) -> dict:
    w = eagle_weights(seed)
    rand, ht = Rand(seed + 100), BASE["hidden_size"]
    if fc_norm:
        w.update({f"fc_norm.{k}.weight": rand.norm(ht) * (1 + k) for k in range(len(TAPS))})
    if norm_before_fc:
        w["input_norm.weight"] = rand.norm(len(TAPS) * ht)
    return w


def write_variant(out, layout: str, weights: dict, flags: dict):
    """flags: the top-level config booleans, in either layout (the speculators converter reads the original
    layout's flags at the top level too)."""
    if layout == "original":
        write_eagle_original(out, weights)
    else:
        write_eagle_speculators(out, weights, None, False)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **flags}))
    return out


def ref_probs(head_dir, target_dir, context, drafts, params, flags: dict, bug: str | None = None) -> torch.Tensor:
    """[k, V] from plain tensor maths; flags as in the config, bug plants a known mistake."""
    w = load_file(str(head_dir / "model.safetensors"))
    w = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in w.items()}
    embed = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    _, _, aux = target_states(target_dir, context[:-1], TAPS)
    if flags.get("fc_norm") and bug != "skip_fc_norm":
        aux = [ref_rms(a, w[f"fc_norm.{k}.weight"]) for k, a in enumerate(aux)]
    raw = torch.cat(aux, -1)                                                       # [n-1, 3 Ht]
    if flags.get("norm_before_fc"):
        if bug == "per_tap":      # the other norm: normalise each tap on its own, same weights
            raw = torch.cat([ref_rms(c, g) for c, g in zip(raw.chunk(3, -1), w["input_norm.weight"].chunk(3))], -1)
        elif bug != "skip_input_norm":
            raw = ref_rms(raw, w["input_norm.weight"])
    hidden = list(raw @ w["fc.weight"].T)
    tokens, positions, rows = list(context[1:]), list(range(len(context) - 1)), []
    for j in range(len(drafts)):
        x, emb = torch.stack(hidden), embed[torch.tensor(tokens)]
        normed = ref_rms(x, w["midlayer.hidden_norm.weight"])
        a = torch.cat([ref_rms(emb, w["midlayer.input_layernorm.weight"]), normed], -1)
        h = x + ref_attention(a, w, "midlayer.self_attn.", torch.tensor(positions))
        h = h + ref_mlp(ref_rms(h, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer.mlp.")
        out = ref_rms(h, w["norm.weight"])
        full = torch.full((embed.shape[0],), float("-inf"))
        full[torch.arange(w["lm_head.weight"].shape[0]) + w["d2t"]] = out[-1] @ w["lm_head.weight"].T
        rows.append(full)
        hidden.append(out[-1] if flags.get("norm_output") and bug != "prenorm_output" else h[-1])
        tokens.append(drafts[j])
        positions.append(positions[-1] + 1)
    return reference_probs(torch.stack(rows), params)


VARIANTS = {   # name: (layout, flags, planted bugs the comparison must catch)
    "eagle31-speculators": ("speculators", {"fc_norm": True, "norm_output": True},
                            ["skip_fc_norm", "prenorm_output"]),
    "eagle31-original": ("original", {"fc_norm": True, "norm_output": True}, ["skip_fc_norm"]),
    "norm_before_fc": ("speculators", {"norm_before_fc": True, "norm_output": False},
                       ["skip_input_norm", "per_tap"]),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle31")
    out = {"target": write_target(root / "target")}
    for i, (name, (layout, flags, _)) in enumerate(VARIANTS.items()):
        w = variant_weights(20 + i, flags.get("fc_norm", False), flags.get("norm_before_fc", False))
        out[name] = write_variant(root / name, layout, w, flags)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_drafts_follow_the_reference_and_planted_bugs_do_not(dirs, name):
    layout, flags, bugs = VARIANTS[name]
    eng = make_engine(dirs["target"], eagle3=str(dirs[name]), enable_prefix_caching=False)
    head = eng.engine.spec.speculators["eagle3"].head
    expected = ({"original": "eagle"}.get(layout, layout), flags.get("fc_norm", False),
                flags.get("norm_before_fc", False), flags["norm_output"])
    assert (head.spec.layout, head.spec.fc_norm, head.spec.norm_before_fc, head.spec.norm_output) == expected
    log = record_proposals(eng, "eagle3")
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=5, max_tokens=14, ignore_eos=True)
    eng.generate(encode(eng)[:2], params, SpecParams("eagle3", 4))
    assert len(log) > 5
    for context, drafts, probs, sampling in log[::3]:
        ref = ref_probs(dirs[name], dirs["target"], context, drafts, sampling, flags)
        torch.testing.assert_close(probs, ref, atol=2e-5, rtol=1e-3)
        for bug in bugs:
            wrong = ref_probs(dirs[name], dirs["target"], context, drafts, sampling, flags, bug=bug)
            assert not torch.allclose(probs, wrong, atol=2e-5, rtol=1e-3), bug


def test_greedy_equals_plain_with_an_eagle31_head(dirs):
    eng = make_engine(dirs["target"], eagle3=str(dirs["eagle31-speculators"]))
    prompts = encode(eng)
    params = SamplingParams(**GREEDY, max_tokens=20)
    refs = [o.token_ids for o in eng.generate(prompts, params)]
    outs = eng.generate(prompts, params, [SpecParams("eagle3", k) for k in (4, 2, 3)])
    assert [o.token_ids for o in outs] == refs and all(o.spec_stats.num_draft_tokens > 0 for o in outs)


def test_missing_undeclared_and_conflicting_norms_are_refused(dirs, tmp_path):
    src = dirs["eagle31-speculators"]
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())

    def head(name, weights, config):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps(config))
        save_file(weights, str(out / "model.safetensors"))
        return str(out)

    lacking = {k: v for k, v in tensors.items() if k != "fc_norm.1.weight"}
    cases = [(head("lacking", lacking, cfg), "lacks fc_norm.1.weight"),
             (head("undeclared", tensors, {**cfg, "fc_norm": False}), "does not declare"),
             (head("both", tensors, {**cfg, "norm_before_fc": True}), "exclusive")]
    for path, match in cases:
        with pytest.raises(ValueError, match=match):
            make_engine(dirs["target"], eagle3=path)
