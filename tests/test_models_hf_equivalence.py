"""Our Llama-family forward (paged KV, varlen batches) equals HF transformers' logits (fp32, random weights).

Each case builds a tiny random HF model in code, saves it as safetensors, loads it with our loader and
replays one scripted schedule through a paged cache with block_size 4 and shuffled block ids:
(a) a 3-prompt varlen prefill (one prompt long enough for the per-sequence SDPA path),
(b) batched decode steps, (c) a mixed-q verify step, (d) a 2-chunk prefill that shares steps with
decodes/verifies. Every logits row is compared with HF's full-sequence forward at the same position.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.server.kv.kv_cache import allocate_kv_cache
from specserve.server.models import native_build
from specserve.server.models.attention import SHORT_QUERY_MAX, build_attention_metadata
from specserve.server.models.config import ModelConfig, load_config
from specserve.server.models.linear import ONEDNN_PACKING, Linear, pack_linears
from specserve.server.models.llama import LlamaDecoderLayer
from specserve.server.models.loader import (
    build_random_model,
    load_layer_weights,
    load_model,
    load_tensors,
    weight_files,
)

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK_SIZE = 4
VOCAB = 300
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

CASES = {  # name -> (HF config class, overrides, max_shard_size or None)
    "llama-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}, None),
    "llama3-rope-tied-sharded": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 500000.0,
                                                 "rope_scaling": LLAMA3_ROPE}, "40KB"),
    "llama-linear-rope": ("LlamaConfig", {"num_key_value_heads": 1,
                                          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None),
    "llama-dynamic-rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, None),
    "qwen2-sliding-layers": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 6,
                                             "max_window_layers": 1}, None),
    "qwen3-head-dim": ("Qwen3Config", {"head_dim": 32, "rope_theta": 1e6}, None),
    "mistral-window": ("MistralConfig", {"sliding_window": 6}, None),
}


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_hf_model(config_cls: str, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    hf_cfg = getattr(transformers, config_cls)(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # HF zero-inits biases and one-inits norms: perturb so that mix-ups show
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    config_cls, overrides, shard = CASES[request.param]
    hf = make_hf_model(config_cls, overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size=shard) if shard else hf.save_pretrained(path)
    model, cfg = load_model(path, torch.float32, "cpu")
    return request.param, hf, model, cfg, path


class PagedHarness:
    """A miniature model runner: per-sequence token lists, shuffled block allocation, one forward per step."""

    def __init__(self, model, cfg: ModelConfig, num_blocks: int = 96, seed: int = 0) -> None:
        self.model, self.cfg = model, cfg
        self.kv = allocate_kv_cache(cfg, num_blocks, BLOCK_SIZE, torch.float32, "cpu")
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]], aux_layer_ids: tuple[int, ...] = ()):
        """chunks: (seq_id, new tokens) -> per chunk logits [q, vocab], aux [num_tokens, hidden] list."""
        seq_lens = []
        for seq_id, tokens in chunks:
            total = self.computed.get(seq_id, 0) + len(tokens)
            blocks = self.blocks.setdefault(seq_id, [])
            while len(blocks) * BLOCK_SIZE < total:
                blocks.append(self.free.pop())
            seq_lens.append(total)
        attn = build_attention_metadata([len(t) for _, t in chunks], seq_lens,
                                        [self.blocks[s] for s, _ in chunks], BLOCK_SIZE, "cpu")
        input_ids = torch.tensor([tok for _, t in chunks for tok in t])
        with torch.inference_mode():
            hidden, aux = self.model(input_ids, attn, self.kv, aux_layer_ids)
            logits = self.model.compute_logits(hidden)
        for (seq_id, _), total in zip(chunks, seq_lens):
            self.computed[seq_id] = total
        return list(logits.split([len(t) for _, t in chunks])), aux


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()                # [len, vocab]


def test_varlen_prefill_decode_verify_chunked_match_hf(case):
    name, hf, model, cfg, _ = case
    gen = torch.Generator().manual_seed(1)
    prompt_lens = [5, SHORT_QUERY_MAX + 4, 9]        # the middle prompt takes the long (per-seq) path
    seqs = [torch.randint(0, VOCAB, (n + 7,), generator=gen).tolist() for n in prompt_lens]
    seqs.append(torch.randint(0, VOCAB, (41,), generator=gen).tolist())   # chunked: 13 + 28
    refs = [hf_logits(hf, s) for s in seqs]
    harness = PagedHarness(model, cfg)
    done = [0, 0, 0, 0]

    def run(plan: list[tuple[int, int]], label: str) -> None:
        chunks = [(i, seqs[i][done[i]:done[i] + q]) for i, q in plan]
        outs, _ = harness.step(chunks)
        for (i, q), out in zip(plan, outs):
            expected = refs[i][done[i]:done[i] + q]
            err = (out - expected).abs().max().item()
            assert err < ATOL, f"{name} {label}: seq {i} rows {done[i]}..{done[i] + q - 1} max err {err:.2e}"
            done[i] += q

    run([(0, 5), (1, prompt_lens[1]), (2, 9)], "(a) varlen prefill")
    for step in range(3):
        run([(0, 1), (1, 1), (2, 1)], f"(b) decode {step}")
    run([(0, 3), (1, 1), (2, 2)], "(c) verify q=3/1/2")
    run([(3, 13), (0, 1)], "(d) chunk 1 + decode")
    run([(1, 3), (3, 28), (2, 1)], "(d) chunk 2 (long, with prefix) + verify + decode")


def test_decode_verify_and_batched_rows_agree():
    """The same token gets (nearly) the same logits whether it is decoded alone, verified with drafts,
    or batched with a longer-context neighbour, so speculation cannot change greedy output except at
    float-noise ties. Matmul rows are bit-identical (see the next test); attention may differ by
    ~1e-7 when the padded key length differs."""
    cfg = ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2})
    model = build_random_model(cfg, seed=3)
    prompt, cont = list(range(1, 22)), [7, 99, 5, 250, 42]
    decoded, verified, batched = (PagedHarness(model, cfg, seed=s) for s in (0, 1, 2))
    for harness in (decoded, verified, batched):
        harness.step([(0, prompt)])
    batched.step([(1, list(range(60)))])                     # a neighbour with 3x the context
    alone = torch.cat([decoded.step([(0, [t])])[0][0] for t in cont])
    together = verified.step([(0, cont)])[0][0]
    mixed = batched.step([(1, [3]), (0, cont)])[0][1]
    assert (alone - together).abs().max().item() <= 1e-6
    assert (together - mixed).abs().max().item() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_rows_do_not_depend_on_batch_size(dtype):
    """MKL's sgemm/sgemv round differently for 1, 2-3 and >= 4 rows, oneDNN's bf16 kernel above ~32 rows;
    the packed path must give every row the same bits whatever the rows around it: fp32 everywhere, bf16 on
    CPUs with native bf16 (where --dtype auto picks it). Without it oneDNN emulates bf16 and rounds a row by
    its place in the batch (2.4e-7 at 2 rows on an AVX-512 Xeon without AVX512-BF16): auto stays fp32 there
    (builder.cpu_bf16_problem), and an explicit bfloat16 is warned about."""
    torch.manual_seed(0)
    layer = Linear(512, 2816, bias=True).to(dtype)
    packed = pack_linears(layer) == 1
    assert packed == ONEDNN_PACKING or dtype == torch.bfloat16    # bf16 packing may be missing on old CPUs
    x = torch.randn(130, 512).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([layer(x[r:r + 1]) for r in range(x.shape[0])])
        batches = {m: layer(x[:m]) for m in (2, 3, 4, 5, 16, 17, 32, 33, 40, 64, 130)}
    exact = packed and (dtype == torch.float32 or bool(native_build.cpu_flags() & {"avx512_bf16", "amx_bf16"}))
    tolerance = 0.0 if exact else 1e-4 if dtype == torch.float32 else 2e-2
    for m, rows in batches.items():
        diff = (rows.float() - alone[:m].float()).abs().max().item()
        assert diff <= tolerance, (f"{dtype} linear rows depend on the batch size (M={m}, {diff}): "
                                   "greedy decoding could change with speculation")


def test_aux_hidden_states_match_hf_output_hidden_states(case):
    name, hf, model, cfg, _ = case
    tokens = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 3)]
    harness = PagedHarness(model, cfg)
    ids = (0, 1, cfg.num_hidden_layers - 1)
    _, aux = harness.step([(0, tokens[0]), (1, tokens[1])], aux_layer_ids=ids)
    with torch.no_grad():
        hf_states = [hf(torch.tensor([t]), output_hidden_states=True).hidden_states for t in tokens]
    for j, layer in enumerate(ids):
        expected = torch.cat([states[layer][0] for states in hf_states])
        err = (aux[j] - expected).abs().max().item()
        assert err < ATOL, f"{name}: aux layer {layer} max err {err:.2e}"


def test_config_fields(case):
    name, hf, _, cfg, path = case
    assert cfg.head_dim == getattr(hf.config, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert cfg.num_key_value_heads == hf.config.num_key_value_heads
    assert cfg.tie_word_embeddings == ("tied" in name)
    assert (len(weight_files(path)) > 1) == ("sharded" in name)
    if "llama3" in name:
        assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.original_max_position_embeddings == 16
    if "qwen2" in name:
        assert cfg.attention_bias and not cfg.o_proj_bias and cfg.sliding_layers == (False, True, True)
    if "qwen3" in name:
        assert cfg.qk_norm and cfg.head_dim == 32


@pytest.mark.parametrize("sharded", [False, True])
def test_extra_mtp_tensors_are_ignored_but_readable(tmp_path, sharded):
    hf = make_hf_model("LlamaConfig", {"num_nextn_predict_layers": 1})
    hf.save_pretrained(tmp_path, max_shard_size="40KB") if sharded else hf.save_pretrained(tmp_path)
    layers = hf.config.num_hidden_layers
    block = {
        k.removeprefix("model.layers.0."): v.clone()
        for k, v in hf.state_dict().items()
        if k.startswith("model.layers.0.")
    }
    extra = {  # DeepSeek-V3 style (model.layers.{L}.*) and MiMo style (model.mtp_layers.*)
        f"model.layers.{layers}.eh_proj.weight": torch.randn(64, 128),
        f"model.layers.{layers}.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.mtp_layers.0.input_proj.weight": torch.randn(64, 128),
        **{f"model.mtp_layers.0.{k}": v for k, v in block.items()},
    }
    if sharded:
        save_file(extra, str(tmp_path / "model-mtp.safetensors"), metadata={"format": "pt"})
        index_path = tmp_path / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
        index_path.write_text(json.dumps(index))
    else:
        tensors = load_file(str(tmp_path / "model.safetensors"))
        save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    model, cfg = load_model(tmp_path, torch.float32)
    assert cfg.num_nextn_predict_layers == 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float()
    tokens = list(range(3, 14))
    outs, _ = PagedHarness(model, cfg).step([(0, tokens)])
    assert (outs[0] - hf_logits(hf, tokens)).abs().max().item() < ATOL
    assert (hf_logits(reloaded, tokens) - hf_logits(hf, tokens)).abs().max().item() < ATOL
    got = load_tensors(tmp_path, lambda n: n.startswith(f"model.layers.{layers}.") or ".mtp_layers." in n)
    assert sorted(got) == sorted(extra)
    assert all(torch.equal(got[k], extra[k]) for k in extra)
    # an MTP block is a decoder layer: its HF-named tensors load (fused) through load_layer_weights
    mtp_block = LlamaDecoderLayer(cfg, layers)
    mtp_tensors = {k.removeprefix("model.mtp_layers.0."): v for k, v in got.items() if ".mtp_layers.0." in k}
    assert load_layer_weights(mtp_block, cfg, mtp_tensors) == ["input_proj.weight"]
    for (name, ours), (_, main) in zip(mtp_block.named_parameters(), model.model.layers[0].named_parameters()):
        assert torch.equal(ours, main), name


def test_pickle_checkpoints_are_refused(tmp_path):
    make_hf_model("LlamaConfig", {}).config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_missing_tensor_is_an_error(tmp_path):
    make_hf_model("Qwen2Config", {}).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="qkv_proj.bias"):
        load_model(tmp_path)


def test_config_spellings_and_errors(tmp_path):
    base = {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 5e5,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg = ModelConfig.from_dict(base)  # transformers 4.x spelling: top-level theta, legacy "type"
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.rope_type == "llama3"
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.head_dim == 128  # Qwen3Config's class default, not hidden / heads
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert mistral.sliding_window is None and not mistral.attention_bias
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope type"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"})
    (tmp_path / "config.json").write_text(json.dumps(base))
    assert load_config(tmp_path) == cfg
