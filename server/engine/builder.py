"""Builds an Engine from EngineConfig: device and dtype choice, model + tokenizer loading, KV sizing."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from specserve.grammar.compiler import GrammarCompiler, GrammarLimits
from specserve.grammar.llguidance_backend import LLGuidanceBackend
from specserve.server.config import EngineConfig
from specserve.server.engine.engine import Engine
from specserve.server.engine.model_runner import ModelRunner
from specserve.server.engine.scheduler import Scheduler
from specserve.server.engine.spec_dispatch import SpecDispatcher
from specserve.server.engine.spec_policy import calibrated_policy
from specserve.server.engine.spec_probe import probe_drafters
from specserve.server.engine.tokenizer import Tokenizer
from specserve.server.kv.block_manager import BlockManager
from specserve.server.kv.kv_cache import cache_dtype, configure_kv_cache_dtype, kv_cache_bytes_per_block
from specserve.server.models import embedded
from specserve.server.models.attention import configure_backend, pick_block_size
from specserve.speculators import registry
from specserve.speculators.base import BuildContext

log = logging.getLogger(__name__)

# The stand-in default until the embedded family ships: ~30M-parameter Llama, random weights.
RANDOM_DEFAULT = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512,
                      intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=True)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, attention_backend: str = "auto") -> torch.dtype:
    """auto: bf16 on CUDA; on CPU bf16 where it is both fast and exact, else fp32 (the reason logged).

    bf16 on CPU is ~1.4x fp32 at batch 1 here (AMX / AVX512-BF16: packed bf16 linears ~1.9-2.3x fp32 at
    1 row, ~4x at 32; server/models/linear.py), and greedy output stays independent of batching and
    speculation only when every row is computed the same way whatever the rows around it: the packed bf16
    linear in blocks of 32 rows (probed here: linear.bf16_rows_stable) and the paged attention kernel
    (fp32 accumulation in a fixed order per row; SDPA rounds a bf16 row by the batch's shape). Where a
    CPU lacks native bf16 (emulated: slower than fp32), the kernel does not build, `--attention-backend
    sdpa` is asked for, or the probe fails, auto stays fp32. Measured with the paged kernel: 0 of 192
    batched greedy outputs differ from their lone plain decoding in bf16 (loadtest.batch_invariance).
    """
    if name != "auto":
        if name == "bfloat16" and device.type == "cpu" and (problem := cpu_bf16_problem(attention_backend)):
            log.warning("--dtype bfloat16 on this CPU: %s; greedy and seeded output may then depend on the "
                        "batch and on speculation (--dtype auto would pick float32)", problem)
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    problem = cpu_bf16_problem(attention_backend)
    if problem is None:
        return torch.bfloat16
    log.info("--dtype auto: float32 (%s)", problem)
    return torch.float32


def cpu_bf16_problem(attention_backend: str) -> str | None:
    """Why bf16 is not this CPU's auto dtype, or None when it is."""
    from specserve.server.models import native_build, paged_kernel
    from specserve.server.models.linear import bf16_rows_stable
    flags = native_build.cpu_flags()
    if not flags & {"avx512_bf16", "amx_bf16"}:
        return "no AVX512-BF16 or AMX: bf16 matmuls would be emulated, slower than fp32"
    if attention_backend == "sdpa":
        return "--attention-backend sdpa: its bf16 rows depend on the batch"
    if paged_kernel.load() is None:
        return f"the paged attention kernel does not build ({paged_kernel.load_error()})"
    if not bf16_rows_stable():
        return "oneDNN's packed bf16 linear gives a row other bits beside other rows on this CPU"
    return None


def resolve_model_dir(cfg: EngineConfig) -> tuple[Path | None, Path]:
    """(model dir or None for the random stand-in, tokenizer dir)."""
    if cfg.model is not None:
        path = Path(cfg.model)
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {path}: no config.json there (expected a HF-layout directory)")
        return path, path
    family = embedded.require(cfg.models_dir)
    if family.has("target"):
        return family.target, family.target
    return None, family.tokenizer


def build_engine(cfg: EngineConfig) -> tuple[Engine, str]:
    from specserve.server.models.config import ModelConfig, load_config
    from specserve.server.models.loader import build_random_model, load_model

    cfg.validate()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device, cfg.attention_backend)
    model_dir, tok_dir = resolve_model_dir(cfg)
    tokenizer = Tokenizer(str(tok_dir))
    session = None
    if model_dir is None:
        mcfg = ModelConfig.from_dict({**RANDOM_DEFAULT, "vocab_size": tokenizer.vocab_size})
        name = "specserve-random-llama"
        log.warning("no --model and no embedded target in %s: serving a ~30M Llama with RANDOM weights "
                    "(text will be gibberish)", tok_dir.parent)
    else:
        mcfg = load_config(model_dir)
        name = model_dir.name
    if cfg.tensor_parallel_size > 1:
        from specserve.server.engine.tp_runner import start_sharded
        model, session = start_sharded(cfg, model_dir, mcfg, dtype, device)
    elif model_dir is None:
        model = build_random_model(mcfg, seed=cfg.seed, dtype=dtype, device=device)
    else:
        model, mcfg = load_model(str(model_dir), dtype=dtype, device=device)
    try:
        return _assemble(cfg, model, mcfg, name, model_dir, tok_dir, tokenizer, dtype, device, session)
    except BaseException:
        if session is not None:       # the ranks started must not outlive a failed start-up
            session.close()
        raise


def _assemble(cfg: EngineConfig, model, mcfg, name: str, model_dir: Path | None, tok_dir: Path,
              tokenizer: Tokenizer, dtype: torch.dtype, device: torch.device, session) -> tuple[Engine, str]:
    from specserve.sampling.rejection import RejectionSampler
    if mcfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {mcfg.vocab_size}")
    max_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    budget = int(cfg.kv_cache_memory_gb * (1 << 30))
    backend = configure_backend(cfg.attention_backend, device)
    cfg = dataclasses.replace(cfg, block_size=pick_block_size(cfg.block_size, device))
    configure_kv_cache_dtype(cfg.kv_cache_dtype)
    # One budget for everyone: each target block comes with one block in every drafter's own cache.
    kv_dtype = cache_dtype(dtype, device)
    # Per rank under tensor parallelism: each holds its KV heads of every block (model.config, the shard's).
    target_bpb = kv_cache_bytes_per_block(model.config, cfg.block_size, kv_dtype)
    ctx = build_context(cfg, model_dir, tok_dir, mcfg, kv_dtype, dtype)
    drafter_bpb = registry.kv_bytes_per_block(ctx)
    num_blocks = budget // (target_bpb + drafter_bpb)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory-gb {cfg.kv_cache_memory_gb} holds no KV block "
                         f"({target_bpb + drafter_bpb} bytes each); raise it")
    log.info("model %s: %s, %s on %s (KV cache %s, attention %s), %d KV blocks of %d tokens = %d KV tokens "
             "(%.2f GiB), max_model_len %d", name, mcfg.architecture, dtype, device, kv_dtype, backend,
             num_blocks, cfg.block_size, num_blocks * cfg.block_size, cfg.kv_cache_memory_gb, max_len)
    if session is not None:
        from specserve.server.engine.tp_runner import TPModelRunner
        runner = TPModelRunner(model, num_blocks, cfg.block_size, dtype, device, session)
    else:
        runner = ModelRunner(model, mcfg, num_blocks, cfg.block_size, dtype, device)
    bm = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
    sched = Scheduler(bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, max_len)
    sampler = RejectionSampler(eos_token_ids=tokenizer.eos_token_ids)
    ctx.target = runner
    spec = SpecDispatcher(registry.build_all(ctx))
    # a tree's mask and K/V compaction live on rank 0 only: sharded targets verify chains
    spec.trees_allowed = cfg.tensor_parallel_size == 1
    runner.aux_layer_ids = tuple(sorted({i for sp in spec.speculators.values() for i in sp.aux_layer_ids}))
    check_default_speculation(cfg, spec)
    if cfg.compile:
        compile_models(runner, spec.speculators)
    if cfg.speculation_policy == "goodput":     # timed with the aux taps on, before any request exists
        spec.policy = calibrated_policy(runner, cfg.max_num_seqs)
    grammars = build_grammar_compiler(cfg, tok_dir, mcfg.vocab_size, tokenizer.eos_token_ids)
    engine = Engine(runner, sched, tokenizer, sampler, spec, max_len, grammars)
    probe_drafters(engine, cfg.speculation_probe_tokens, max(cfg.max_speculative_tokens, 1))
    return engine, cfg.served_model_name or name


def build_grammar_compiler(cfg: EngineConfig, tok_dir: str | Path, vocab_size: int,
                           eos_token_ids: list[int]) -> GrammarCompiler:
    """Structured outputs: the grammar library over this tokenizer, with the server's limits (the engine
    and, with --engine-process, the front end that checks requests build the same one)."""
    backend = LLGuidanceBackend(tok_dir, vocab_size, eos_token_ids)
    return GrammarCompiler(backend, GrammarLimits(max_bytes=cfg.max_grammar_bytes,
                                                  timeout_s=cfg.grammar_compile_timeout,
                                                  cache_size=cfg.grammar_cache_size))


def check_default_speculation(cfg: EngineConfig, spec: SpecDispatcher) -> None:
    """The server default (`--speculation`) passes the checks a request's `speculation` passes, at start-up:
    a default the engine cannot serve would otherwise fail inside a step, for every request without one."""
    default = cfg.speculation
    if default is None:        # chosen from what is loaded (registry.default_speculation): valid by construction
        return
    if default.method not in spec.methods:
        entry = registry.BY_NAME.get(default.method)
        needs = f" ({default.method} needs {entry.needs})" if entry else ""
        raise ValueError(f"--speculation: method {default.method!r} is not loaded on this server{needs}; "
                         f"loaded: {spec.methods}")
    if default.method == "prediction":
        raise ValueError("--speculation: 'prediction' drafts from a request's own `prediction` field and cannot "
                         "be the default; requests that send a `prediction` use it without asking")
    try:
        spec.validate(default)
    except ValueError as exc:
        raise ValueError(f"--speculation: {exc}") from None


def compile_models(runner: ModelRunner, speculators: dict) -> None:
    """torch.compile the target's (and a draft model's) layer stack and compile the graphs now, before
    any request exists (server/models/compiled.py)."""
    from specserve.server.models.compiled import warm_up
    from specserve.server.models.latency_tuning import is_latency_tuned
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


def build_context(cfg: EngineConfig, model_dir: Path | None, tok_dir: Path, mcfg, kv_dtype: torch.dtype,
                  dtype: torch.dtype) -> BuildContext:
    """What the registry's methods need to decide availability, size their memory and load (no target yet).

    draft: --draft-model (refused unless it shares the target's vocabulary); eagle3: --eagle3;
    mtp: automatic when the target checkpoint declares num_nextn_predict_layers > 0; hybrid (n-gram lookup,
    else a model drafter: speculators/hybrid.py) whenever one of those is loaded. Serving the embedded
    target (no --model), the embedded draft and EAGLE-3 head come along unless flags name others.
    """
    draft_dir, eagle3_dir = resolve_drafters(cfg, model_dir)
    return BuildContext(target_cfg=mcfg, model_dir=model_dir, tokenizer_dir=tok_dir, draft_dir=draft_dir,
                        eagle3_dir=eagle3_dir, block_size=cfg.block_size, kv_dtype=kv_dtype, model_dtype=dtype,
                        stash_states=cfg.enable_prefix_caching, suffix_cache_tokens=cfg.suffix_cache_tokens,
                        suffix_scope=cfg.suffix_scope, eagle_dir=resolve_eagle1(cfg, model_dir))


def resolve_drafters(cfg: EngineConfig, model_dir: Path | None) -> tuple[str | None, str | None]:
    """(draft model dir, EAGLE-3 dir): the flags, else the embedded family's when serving its target."""
    draft_dir, eagle3_dir = cfg.draft_model, cfg.eagle3
    if cfg.model is None and model_dir is not None:
        family = embedded.require(cfg.models_dir)
        if draft_dir is None and family.has("draft"):
            draft_dir = str(family.draft)
        if eagle3_dir is None and family.has("eagle3"):
            eagle3_dir = str(family.eagle3)
    return draft_dir, eagle3_dir


def resolve_eagle1(cfg: EngineConfig, model_dir: Path | None) -> str | None:
    """The EAGLE-1 head dir: --eagle, else the embedded family's when serving its target."""
    if cfg.eagle is None and cfg.model is None and model_dir is not None:
        family = embedded.require(cfg.models_dir)
        return str(family.eagle) if family.has("eagle") else None
    return cfg.eagle
