"""Tensor parallelism on CPU with gloo, 2 ranks (this process is rank 0, one spawned worker is rank 1):
every architecture's logits equal the unsharded model's, greedy output of every speculation method equals
TP=1's, a killed rank fails requests with a clear error and turns /health unhealthy, and no rank outlives
its server."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import TOKENIZER_DIR, TOKENIZER_FILES, ServerProcess
from test_spec_draft_model import GREEDY, TEXTS, write_llama
from test_spec_eagle3 import eagle_weights, write_eagle_original
from test_spec_mtp import write_mtp_target

from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.engine.offline import OfflineEngine
from specserve.server.engine.tp_runner import TPModelRunner
from specserve.server.models.config import ModelConfig
from specserve.server.models.shard_loader import check_shardable, shard_config
from specserve.speculators.base import SpecParams

# One small config per architecture; each exercises a different split: biases on the row-parallel
# o_proj/down_proj (llama), qkv bias (qwen2), q/k norms with one KV head replicated on both ranks (qwen3),
# full multi-head attention (mistral).
ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_key_value_heads=1, head_dim=16)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(num_key_value_heads=4, sliding_window=None)),
}


def write_arch(out: Path, arch: str) -> Path:
    import shutil

    import transformers
    model_cls, config_cls, extra = ARCHS[arch]
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(TOKENIZER_DIR))       # odd: the last vocabulary shard is padded
    config = getattr(transformers, config_cls)(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=4, vocab_size=vocab, max_position_embeddings=512,
                                               tie_word_embeddings=False, **extra)
    torch.manual_seed(1)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():           # HF zero-inits biases: give them values, or a bias added twice would hide
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (TOKENIZER_DIR / name).is_file():
            shutil.copy(TOKENIZER_DIR / name, out / name)
    return out


def make(model_dir, tp: int, **kw) -> OfflineEngine:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_threads=1, kv_cache_memory_gb=0.01,
                       tensor_parallel_size=tp, speculation_policy="fixed", speculation_probe_tokens=0, **kw)
    return OfflineEngine.from_config(cfg)


def close(engine: OfflineEngine) -> None:
    engine.engine.runner.close()


def record_logits(engine: OfflineEngine) -> list[torch.Tensor]:
    runner = engine.engine.runner
    seen: list[torch.Tensor] = []
    original = runner.execute

    def execute(batch):
        result = original(batch)
        seen.append(result.logits.clone())
        return result
    runner.execute = execute
    return seen


def encode(engine: OfflineEngine) -> list[list[int]]:
    return [engine.engine.tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_of_two_ranks_equal_one(arch, tmp_path):
    model_dir = write_arch(tmp_path / arch, arch)
    params = SamplingParams(**GREEDY, max_tokens=6)
    one = make(model_dir, 1)
    prompts = encode(one)
    ref_logits = record_logits(one)
    ref = one.generate(prompts, params)
    two = make(model_dir, 2)
    try:
        assert isinstance(two.engine.runner, TPModelRunner)
        got_logits = record_logits(two)
        got = two.generate(prompts, params)
        procs = two.engine.runner.session.procs
    finally:
        close(two)
    assert len(got_logits) == len(ref_logits) > 1                  # a prefill and decode steps
    for step, (a, b) in enumerate(zip(got_logits, ref_logits)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, msg=f"{arch} step {step}")
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert not any(p.is_alive() for p in procs)                   # close() ended the worker


@pytest.fixture(scope="module")
def spec_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-spec")
    return {"target": write_mtp_target(root / "target", "deepseek_v3", num_mtp=2, num_layers=4),
            "eagle3": write_eagle_original(root / "eagle3", eagle_weights(seed=9)),
            "draft": write_llama(root / "draft", seed=4, num_hidden_layers=1)}


METHODS = [SpecParams(), SpecParams("ngram", 3), SpecParams("draft", 3), SpecParams("eagle3", 3),
           SpecParams("mtp", 2), SpecParams("hybrid", 3)]


def run_every_method(engine: OfflineEngine, prompts) -> dict[str, list[list[int]]]:
    params = SamplingParams(**GREEDY, max_tokens=24)
    out = {m.method: [c.token_ids for c in engine.generate(prompts, params, m)] for m in METHODS}
    ref = out["none"][0]
    exact = engine.generate([prompts[0]], params, SpecParams("prediction", 4), predictions=[ref])[0]
    out["prediction"] = [exact.token_ids]
    return out


def test_greedy_output_of_every_method_equals_one_rank(spec_dirs):
    kw = dict(draft_model=str(spec_dirs["draft"]), eagle3=str(spec_dirs["eagle3"]))
    one = make(spec_dirs["target"], 1, **kw)
    assert {m.method for m in METHODS} <= set(one.engine.spec.methods)
    prompts = encode(one)
    ref = run_every_method(one, prompts)
    two = make(spec_dirs["target"], 2, **kw)
    try:
        assert set(two.engine.spec.methods) == set(one.engine.spec.methods)
        got = run_every_method(two, prompts)
        stats = two.generate(prompts[:1], SamplingParams(**GREEDY, max_tokens=24), SpecParams("eagle3", 3))[0]
    finally:
        close(two)
    assert got == ref
    assert all(tokens == ref["none"] for method, tokens in ref.items() if method != "prediction")
    assert stats.spec_stats.num_draft_tokens > 0                 # the drafters really drafted under TP


def test_a_model_that_does_not_split_is_a_start_up_error():
    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=48, intermediate_size=96, num_hidden_layers=1,
               num_attention_heads=3, num_key_value_heads=3, vocab_size=50)
    cfg = ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match="num_attention_heads 3"):
        check_shardable(cfg, 2)
    local = shard_config(ModelConfig.from_dict({**raw, "num_attention_heads": 4, "num_key_value_heads": 1,
                                                "hidden_size": 64}), 4)
    assert (local.num_attention_heads, local.num_key_value_heads, local.vocab_size) == (1, 1, 13)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="--compile"):
        EngineConfig(tensor_parallel_size=2, compile=True).validate()


# ------------------------------------------------------------------------------------------- servers
def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in out:
                    out.add(child)
                    todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def tp_worker_pids(server: ServerProcess) -> list[int]:
    pids = []
    for pid in descendants(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


@pytest.fixture(scope="module")
def tp_servers(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp-servers")
    servers = {name: ServerProcess(tiny_model_dir, logs / f"{name}.log", "--tensor-parallel-size", "2",
                                   "--speculation", '{"method": "ngram", "num_speculative_tokens": 3}')
               for name in ("killed", "clean")}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def test_a_killed_rank_fails_requests_clearly_and_health_turns_unhealthy(tp_servers):
    server = tp_servers["killed"]
    url = server.wait_ready()
    body = {"model": "tiny-llama", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    workers = tp_worker_pids(server)
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert time.monotonic() - start < 30                      # an error, not a hang
    assert r.status_code >= 500
    assert "tensor-parallel rank 1" in r.json()["error"]["message"]
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert "tensor-parallel rank 1" in health.json()["error"]


def test_shutdown_leaves_no_rank_behind(tp_servers):
    server = tp_servers["clean"]
    url = server.wait_ready()
    body = {"model": "tiny-llama", "prompt": "x = [1, 2, 3]\ny = [1, 2,", "max_tokens": 8, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    family = descendants(server.proc.pid)
    assert tp_worker_pids(server)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 15
    while any(alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in family if alive(p)] == []
