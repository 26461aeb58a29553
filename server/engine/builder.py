"""Builds an Engine from EngineConfig: device and dtype choice, model + tokenizer loading, KV sizing."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from server.config import EngineConfig
from server.engine.block_manager import BlockManager
from server.engine.engine import Engine
from server.engine.kv_cache import cache_dtype, kv_cache_bytes_per_block
from server.engine.model_runner import ModelRunner
from server.engine.scheduler import Scheduler
from server.engine.spec_dispatch import SpecDispatcher
from server.engine.spec_policy import calibrated_policy
from server.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_TARGET = REPO_ROOT / "models" / "target"
EMBEDDED_TOKENIZER = REPO_ROOT / "models" / "tokenizer"
EMBEDDED_DRAFT = REPO_ROOT / "models" / "draft"
EMBEDDED_EAGLE3 = REPO_ROOT / "models" / "eagle3"

# The stand-in default until the embedded family ships: ~30M-parameter Llama, random weights.
RANDOM_DEFAULT = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512,
                      intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=True)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA, fp32 on CPU, even on CPUs where bf16 is faster (AMX Xeon: packed bf16 linears
    ~1.9-2.3x fp32 at 1 row, ~4x at 32; server/models/linear.py).

    Why: greedy output would no longer be exactly independent of batching. With bf16 weights (linears
    row-stable, attention in fp32, kv_cache.cache_dtype) the attention output still differs at the 1e-7
    level between a token decoded alone, among drafts or in a padded batch, and its cast back to bf16
    turns that into a 1-ulp change often enough to flip a near-tie now and then (measured: 1 of 8
    code-editing prompts diverged at token 54 between batch 8 and batch 1). fp32 keeps the project's
    promise that speculation never changes greedy output; `--dtype bfloat16` is an explicit choice.
    """
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_model_dir(cfg: EngineConfig) -> tuple[Path | None, Path]:
    """(model dir or None for the random stand-in, tokenizer dir)."""
    if cfg.model is not None:
        path = Path(cfg.model)
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {path}: no config.json there (expected a HF-layout directory)")
        return path, path
    if (EMBEDDED_TARGET / "config.json").is_file():
        return EMBEDDED_TARGET, EMBEDDED_TARGET
    return None, EMBEDDED_TOKENIZER


def build_engine(cfg: EngineConfig) -> tuple[Engine, str]:
    from sampling.rejection import RejectionSampler
    from server.models.config import ModelConfig
    from server.models.loader import build_random_model, load_model

    cfg.validate()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    model_dir, tok_dir = resolve_model_dir(cfg)
    tokenizer = Tokenizer(str(tok_dir))
    if model_dir is None:
        mcfg = ModelConfig.from_dict({**RANDOM_DEFAULT, "vocab_size": tokenizer.vocab_size})
        model = build_random_model(mcfg, seed=cfg.seed, dtype=dtype, device=device)
        name = "specserve-random-llama"
        log.warning("no --model and no embedded model in %s: serving a ~30M Llama with RANDOM weights "
                    "(text will be gibberish)", EMBEDDED_TARGET)
    else:
        model, mcfg = load_model(str(model_dir), dtype=dtype, device=device)
        name = model_dir.name
    if mcfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {mcfg.vocab_size}")
    max_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    budget = int(cfg.kv_cache_memory_gb * (1 << 30))
    # One budget for everyone: each target block comes with one block in every drafter's own cache.
    kv_dtype = cache_dtype(dtype, device)
    target_bpb = kv_cache_bytes_per_block(mcfg, cfg.block_size, kv_dtype)
    drafter_bpb = drafter_bytes_per_block(cfg, model_dir, mcfg, cfg.block_size, kv_dtype, dtype)
    num_blocks = budget // (target_bpb + drafter_bpb)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory-gb {cfg.kv_cache_memory_gb} holds no KV block "
                         f"({target_bpb + drafter_bpb} bytes each); raise it")
    log.info("model %s: %s, %s on %s (KV cache %s), %d KV blocks of %d tokens (%.2f GiB), max_model_len %d",
             name, mcfg.architecture, dtype, device, kv_dtype, num_blocks, cfg.block_size,
             cfg.kv_cache_memory_gb, max_len)
    runner = ModelRunner(model, mcfg, num_blocks, cfg.block_size, dtype, device)
    bm = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
    sched = Scheduler(bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, max_len)
    sampler = RejectionSampler(eos_token_ids=tokenizer.eos_token_ids)
    spec = SpecDispatcher(build_speculators(cfg, runner, tokenizer))
    runner.aux_layer_ids = tuple(sorted({i for sp in spec.speculators.values()
                                         for i in getattr(sp, "aux_layer_ids", ())}))
    if cfg.compile:
        compile_models(runner, spec.speculators)
    if cfg.speculation_policy == "goodput":     # timed with the aux taps on, before any request exists
        spec.policy = calibrated_policy(runner, cfg.max_num_seqs)
    return Engine(runner, sched, tokenizer, sampler, spec, max_len), cfg.served_model_name or name


def compile_models(runner: ModelRunner, speculators: dict) -> None:
    """torch.compile the target's (and a draft model's) layer stack and compile the graphs now, before
    any request exists (server/models/compiled.py)."""
    from server.models.compiled import warm_up
    from server.models.latency_tuning import is_latency_tuned
    start = time.perf_counter()
    models = [(runner.model, runner.kv_caches, runner.aux_layer_ids)]
    if "draft" in speculators:
        draft = speculators["draft"].model
        if is_latency_tuned(draft):
            # Its small linears run on MKL's fp32 route (server/models/latency_tuning.py), which beats the
            # compiled packed graph (1.0 vs 1.3-1.8 ms per draft forward) and which inductor's C++ wrapper
            # fails to compile between bf16 ops.
            log.info("draft model left eager: its linears are latency-tuned")
        else:
            models.append((draft, speculators["draft"].cache.caches, ()))
    try:
        for model, caches, aux in models:
            model.enable_compile()
            warm_up(model, caches, runner.block_size, runner.device, aux)
    except Exception as exc:   # e.g. no C++ compiler on this machine: say so and how to start anyway
        raise RuntimeError(f"--compile: torch.compile failed ({type(exc).__name__}: {exc}); "
                           "start without --compile") from exc
    log.info("compiled the layer stacks of %d model(s) in %.1f s", len(models), time.perf_counter() - start)


def build_speculators(cfg: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer) -> dict:
    """method -> Speculator for everything this server can offer (grows with speculators/).

    draft: --draft-model (refused unless it shares the target's vocabulary); eagle3: --eagle3;
    mtp: automatic when the target checkpoint declares num_nextn_predict_layers > 0; hybrid (n-gram lookup,
    else a model drafter: speculators/hybrid.py) whenever one of those is loaded. Serving the embedded
    target (no --model), the embedded draft and EAGLE-3 head come along unless flags name others.
    Each model-based drafter owns a KV cache with the target's block count (speculators/draft_kv.py);
    build_engine sizes the target's count so that all caches together fit --kv-cache-memory-gb.
    """
    from speculators.ngram import NgramSpeculator
    from speculators.prediction import PredictionSpeculator
    del tokenizer
    specs: dict = {"ngram": NgramSpeculator(), "prediction": PredictionSpeculator()}
    model_dir, tok_dir = resolve_model_dir(cfg)
    draft_dir, eagle3_dir = resolve_drafters(cfg, model_dir)
    if draft_dir is not None:
        from speculators.draft_model import DraftModelSpeculator
        specs["draft"] = DraftModelSpeculator.load(
            draft_dir, runner.cfg, tok_dir, runner.kv_caches[0][0].shape[0], runner.block_size,
            runner.dtype, runner.device)
    if eagle3_dir is not None:
        from speculators.eagle3 import Eagle3Speculator
        specs["eagle3"] = Eagle3Speculator.load(eagle3_dir, runner, stash_states=cfg.enable_prefix_caching)
    if model_dir is not None and runner.cfg.num_nextn_predict_layers > 0:
        from speculators.mtp import MtpSpeculator
        specs["mtp"] = MtpSpeculator.load(model_dir, runner, stash_states=cfg.enable_prefix_caching)
    from speculators.hybrid import HybridSpeculator
    hybrid = HybridSpeculator.over(specs)          # n-gram first, the first loaded model drafter elsewhere
    if hybrid is not None:
        specs["hybrid"] = hybrid
    return specs



def resolve_drafters(cfg: EngineConfig, model_dir: Path | None) -> tuple[str | None, str | None]:
    """(draft model dir, EAGLE-3 dir): the flags, else the embedded family's when serving its target."""
    draft_dir, eagle3_dir = cfg.draft_model, cfg.eagle3
    if cfg.model is None and model_dir is not None:
        if draft_dir is None and (EMBEDDED_DRAFT / "config.json").is_file():
            draft_dir = str(EMBEDDED_DRAFT)
        if eagle3_dir is None and (EMBEDDED_EAGLE3 / "config.json").is_file():
            eagle3_dir = str(EMBEDDED_EAGLE3)
    return draft_dir, eagle3_dir


def drafter_bytes_per_block(cfg: EngineConfig, model_dir: Path | None, mcfg, block_size: int,
                            dtype: torch.dtype, model_dtype: torch.dtype) -> int:
    """Bytes the drafters hold per target block: a draft model's KV layers, one KV layer per head layer,
    and with prefix caching each head's state stash (speculators/state_stash.py).
    dtype: the KV cache dtype (kv_cache.cache_dtype); model_dtype: the activations' (the stash's)."""
    from server.models.config import load_config
    from speculators.state_stash import TargetStateStash
    per_layer = kv_cache_bytes_per_block(mcfg, block_size, dtype) // mcfg.num_hidden_layers
    stash = TargetStateStash.bytes_per_block(mcfg.hidden_size, block_size, model_dtype)
    draft_dir, eagle3_dir = resolve_drafters(cfg, model_dir)
    total = 0
    if draft_dir is not None:
        total += kv_cache_bytes_per_block(load_config(draft_dir), block_size, dtype)
    if eagle3_dir is not None:
        # an EAGLE-3 head's layer is as wide as the target here (its config may say otherwise: a few %)
        total += per_layer + (stash if cfg.enable_prefix_caching else 0)
    if model_dir is not None and mcfg.num_nextn_predict_layers > 0:
        total += per_layer * mcfg.num_nextn_predict_layers + (stash if cfg.enable_prefix_caching else 0)
    return total
