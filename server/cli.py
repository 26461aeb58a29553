"""`specserve serve [flags]`: flags -> EngineConfig / ServerConfig / Limits / LifecycleConfig -> app -> uvicorn.

Every config field has exactly one flag (tests/test_cli.py and tests/test_lifecycle.py derive the
field lists from the dataclasses, so a new field without a flag fails). Defaults are read from the
dataclasses, never repeated here.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from specserve.server.api.lifecycle import LifecycleConfig
from specserve.server.api.limits import Limits
from specserve.server.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    METRICS_COMPAT,
    SPECULATION_POLICIES,
    SUFFIX_SCOPES,
    TOOL_CALL_PARSERS,
    EngineConfig,
    ServerConfig,
    parse_speculation,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Config fields whose flag is not `--field-name` (tests/test_cli.py reads this too).
FLAG_NAMES = {"enable_prefix_caching": "--no-prefix-caching"}


def flag_for(field_name: str) -> str:
    return FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


def _engine_flags(p: argparse.ArgumentParser) -> None:
    e = EngineConfig()
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=e.model, metavar="DIR",
                   help="HF-layout model directory (config.json + *.safetensors + tokenizer). Default: the "
                        "embedded model in models/, or a small random-weight Llama if that is absent")
    g.add_argument("--models-dir", default=e.models_dir, metavar="DIR",
                   help="the embedded model family's folder (target/, draft/, eagle3/, tokenizer/). Default: "
                        "$SPECSERVE_MODELS_DIR, else the models/ folder of the checkout an editable install "
                        "came from")
    g.add_argument("--served-model-name", default=e.served_model_name, metavar="NAME",
                   help="model id in /v1/models and the `model` every request must send. "
                        "Default: the model directory's name")
    g.add_argument("--dtype", default=e.dtype, choices=DTYPES,
                   help="weight and activation dtype; auto = bf16 on CUDA, and on CPUs with AMX or AVX512-BF16 "
                        "where the paged attention kernel builds and bf16 linears are row-stable (greedy output "
                        "then independent of batching and speculation), else float32 (default: %(default)s)")
    g.add_argument("--device", default=e.device, help="auto, cpu, cuda or cuda:N; auto = cuda if available "
                                                     "(default: %(default)s)")
    g.add_argument("--block-size", type=int, default=e.block_size, metavar="N",
                   help="tokens per KV cache block, a power of two; 0 = auto: 256 on CUDA with flash-attn (its paged "
                        "kernel reads such blocks in place), else 16 (default: %(default)s)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=e.kv_cache_memory_gb, metavar="GB",
                   help="memory for the KV cache; its block count follows (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default=e.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV cache storage; auto = the model dtype (a bf16 cache holds twice the tokens of "
                        "fp32), except fp32 on CPU under the SDPA attention fallback (default: %(default)s)")
    g.add_argument("--attention-backend", default=e.attention_backend, choices=ATTENTION_BACKENDS,
                   help="attention kernel. CPU: paged = a C++ kernel reading the paged cache in place, built "
                        "at first start into ~/.cache/specserve/kernels (needs g++). CUDA: triton = a Triton "
                        "kernel reading the paged cache in place; flash = flash-attn (extra 'gpu'). Both: sdpa = "
                        "torch SDPA over gathered blocks. auto = paged on CPU if it builds, triton on CUDA, else "
                        "sdpa with the reason logged (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=e.max_model_len, metavar="N",
                   help="context length (prompt + output). Default: the model's max_position_embeddings")
    g.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, metavar="N",
                   help="requests in the running batch (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens, metavar="N",
                   help="token budget per step: prefill chunks + decodes + drafts (default: %(default)s)")
    g.add_argument("--seed", type=int, default=e.seed, metavar="N",
                   help="seed for random weights and unseeded sampling (default: %(default)s)")
    g.add_argument("--num-threads", type=int, default=e.num_threads, metavar="N",
                   help="torch intra-op threads on CPU. Default: torch's choice (all cores)")
    g.add_argument("--compile", action="store_true", default=e.compile,
                   help="torch.compile the layer stacks of the target and draft model (a draft with latency-tuned "
                        "linears stays eager, see server/models/latency_tuning.py): fuses the small ops "
                        "between the matmuls (fewer dispatches per step, most useful at small batches); "
                        "start-up compiles one graph per model (tens of seconds on CPU the first time, "
                        "then cached by torch; needs a C++ compiler) (default: off)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=e.engine_process,
                   help="step the engine in a process of its own instead of a thread of the server's: the "
                        "event loop's per-chunk work (JSON, HTTP, socket writes) then runs beside the step "
                        "instead of holding the GIL the engine needs (server/engine/process_engine.py) "
                        "(default: %(default)s)")
    g.add_argument("--tensor-parallel-size", type=int, default=e.tensor_parallel_size, metavar="N",
                   help="shard the target over N ranks, one process each (Megatron-style: heads and MLP rows "
                        "split, one all-reduce per attention and MLP block): NCCL on CUDA (GPUs cuda:0..N-1 "
                        "from --device's index), gloo on CPU. The scheduler and drafters run on rank 0 "
                        "(default: %(default)s)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=e.enable_prefix_caching,
                   help="disable reuse of KV blocks across requests with a common prefix (default: enabled)")


def _speculation_flags(p: argparse.ArgumentParser) -> None:
    e = EngineConfig()
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--max-speculative-tokens", type=int, default=e.max_speculative_tokens, metavar="K",
                   help="largest k (draft tokens per step) a request may ask for (default: %(default)s)")
    g.add_argument("--speculation", default=None, metavar="JSON",
                   help="server default for requests without a `speculation` field, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or '{\"method\": \"none\"}'. "
                        "Checked at start-up like a request's. Default: the best method loaded, k = 4 "
                        "(hybrid when a model drafter is loaded, else ngram); GET /v1/speculators shows it")
    g.add_argument("--speculation-policy", default=e.speculation_policy, choices=SPECULATION_POLICIES,
                   help="goodput: each step, draft only the positions expected to raise "
                        "tokens/s given the request's acceptance so far and the batch's measured step cost "
                        "(never for seeded sampled requests; a request opts out with \"adaptive\": false; "
                        "every cut is counted). fixed: always draft the k asked for (default: %(default)s)")
    g.add_argument("--speculation-probe-tokens", type=int, default=e.speculation_probe_tokens, metavar="N",
                   help="at start-up, each loaded model drafter drafts N new tokens on built-in code and "
                        "prose, greedy and sampled, so `auto` starts from measured acceptance and the "
                        "drafters' first, slowest calls are paid before traffic; 0 = no probe "
                        "(default: %(default)s)")
    g.add_argument("--draft-tree-top-k", type=int, default=e.draft_tree_top_k, metavar="K",
                   help="default draft tree branching for tree-drafting methods (eagle3) when a request "
                        "names no draft_tree: each depth keeps the K best nodes; 1 = chains "
                        "(default: %(default)s)")
    g.add_argument("--draft-tree-depth", type=int, default=e.draft_tree_depth, metavar="D",
                   help="default draft tree depth (expansions), capped at the request's "
                        "num_speculative_tokens (default: %(default)s)")
    g.add_argument("--suffix-cache-tokens", type=int, default=e.suffix_cache_tokens, metavar="N",
                   help="token budget of the suffix method's cache of earlier requests' texts, oldest "
                        "evicted first, about 90 bytes per token; 0 = no cross-request cache "
                        "(default: %(default)s)")
    g.add_argument("--suffix-scope", default=e.suffix_scope, choices=SUFFIX_SCOPES,
                   help="who shares the suffix cache: request = nobody, user = requests with the same "
                        "API key and OpenAI `user` field, global = every request (draft speed can reveal "
                        "that similar text was generated before: SECURITY.md). Default: %(default)s")
    g.add_argument("--draft-model", default=e.draft_model, metavar="DIR",
                   help="draft model directory for method 'draft'. Default: none loaded")
    g.add_argument("--eagle3", default=e.eagle3, metavar="DIR",
                   help="EAGLE-3 head directory for method 'eagle3'. Default: none loaded")
    g.add_argument("--eagle", default=e.eagle, metavar="DIR",
                   help="EAGLE-1 head directory (SafeAILab layout) for method 'eagle'. Default: none loaded")


def _structured_flags(p: argparse.ArgumentParser) -> None:
    e = EngineConfig()
    g = p.add_argument_group("structured outputs and tool calls (see SECURITY.md)")
    g.add_argument("--max-grammar-bytes", type=int, default=e.max_grammar_bytes, metavar="N",
                   help="largest JSON schema, regex, choice list or grammar a request may send; larger "
                        "ones get a 400 (default: %(default)s)")
    g.add_argument("--grammar-compile-timeout", type=float, default=e.grammar_compile_timeout, metavar="SECONDS",
                   help="longest a constraint may take to compile; then the request gets a 400 "
                        "(default: %(default)s)")
    g.add_argument("--grammar-cache-size", type=int, default=e.grammar_cache_size, metavar="N",
                   help="compiled constraints kept for reuse, least recently used dropped first "
                        "(default: %(default)s)")
    g.add_argument("--tool-call-parser", default=e.tool_call_parser, choices=TOOL_CALL_PARSERS,
                   help="the model family's tool-call format, read from the output when tool_choice is "
                        "auto: hermes (Hermes/Qwen <tool_call> JSON), llama3_json (Llama 3 JSON), "
                        "mistral ([TOOL_CALLS]) (default: %(default)s)")


def _server_flags(p: argparse.ArgumentParser) -> None:
    s = ServerConfig()
    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", default=s.host, help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=int, default=s.port, help="port to bind (default: %(default)s)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/*. Default: $SPECSERVE_API_KEY if set, "
                        "else no authentication")
    g.add_argument("--log-level", default=s.log_level, choices=LOG_LEVELS,
                   help="log level (default: %(default)s)")
    g.add_argument("--metrics-compat", default=s.metrics_compat, choices=METRICS_COMPAT,
                   help="vllm: /metrics also exports the vllm: names (vllm:num_requests_waiting, "
                        "vllm:kv_cache_usage_perc, ...) beside the specserve: ones, for routers and autoscalers "
                        "set up for vLLM (default: %(default)s)")


def _limit_flags(p: argparse.ArgumentParser) -> None:
    lim = Limits()
    g = p.add_argument_group("request limits (larger requests get a 400, 413 or 431; see SECURITY.md)")
    docs = {"max_n": "choices per request (n, best_of)",
            "max_logprobs": "completions `logprobs` and chat `top_logprobs`",
            "max_stop": "stop strings (and stop_token_ids) per request",
            "max_stop_len": "characters per stop string",
            "max_logit_bias": "logit_bias entries per request",
            "max_prompts": "prompts in one /v1/completions request",
            "max_messages": "messages in one chat request",
            "max_body_bytes": "bytes in a request body (413 beyond, before the body is read)",
            "max_header_bytes": "bytes in all request headers together (431 beyond)",
            "max_waiting_requests": "engine requests (prompts x n) admitted but without a first token "
                                    "yet; beyond it new requests get 429 with Retry-After",
            "max_waiting_tokens": "prompt tokens of those waiting requests (429 beyond)"}
    for name, doc in docs.items():
        g.add_argument(flag_for(name), type=int, default=getattr(lim, name), metavar="N",
                       help=f"most {doc} (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=lim.request_timeout, metavar="SECONDS",
                   help="longest a request may take from arrival to its last token; then its unfinished "
                        "choices end with finish_reason 'length'. A request's `request_timeout` field may "
                        "ask for less. Default: no limit")


def _lifecycle_flags(p: argparse.ArgumentParser) -> None:
    lc = LifecycleConfig()
    g = p.add_argument_group("lifecycle and probes")
    g.add_argument("--drain-timeout", type=float, default=lc.drain_timeout, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may finish (new ones get 503) before "
                        "the rest are failed with 503 and the server exits 0 (default: %(default)s)")
    g.add_argument("--public-health", action=argparse.BooleanOptionalAction, default=lc.public_health,
                   help="/health and /ready answer without the API key (default: %(default)s)")
    g.add_argument("--public-metrics", action=argparse.BooleanOptionalAction, default=lc.public_metrics,
                   help="/metrics answers without the API key (default: %(default)s; without --api-key "
                        "everything is public)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="OpenAI-compatible inference server "
                                     "with per-request speculative decoding")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over HTTP", description="Serve a model with an "
                           "OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, "
                           "/v1/speculators, /health, /metrics).")
    for add in (_engine_flags, _speculation_flags, _structured_flags, _server_flags, _limit_flags,
                _lifecycle_flags):
        add(serve)
    return parser


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig, Limits]:
    """Validated configs from parsed flags; ValueError with a readable message otherwise."""
    try:
        speculation = None if args.speculation is None else parse_speculation(args.speculation)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculation is not valid JSON: {exc}") from None
    engine = EngineConfig(**{f: getattr(args, f) for f in _names(EngineConfig) if f != "speculation"},
                          speculation=speculation)
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPECSERVE_API_KEY") or None
    server = ServerConfig(host=args.host, port=args.port, api_key=api_key, log_level=args.log_level,
                          metrics_compat=args.metrics_compat)
    limits = Limits(**{f: getattr(args, f) for f in _names(Limits)})
    engine.validate()
    server.validate()
    limits.validate()
    return engine, server, limits


def lifecycle_from_args(args: argparse.Namespace) -> LifecycleConfig:
    lifecycle = LifecycleConfig(**{f: getattr(args, f) for f in _names(LifecycleConfig)})
    lifecycle.validate()
    return lifecycle


def _names(cls: type) -> list[str]:
    import dataclasses
    return [f.name for f in dataclasses.fields(cls)]


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig, limits: Limits,
          lifecycle: LifecycleConfig | None = None) -> int:
    from specserve.server.api.app import create_app, drain
    from specserve.server.api.http_server import DrainingServer, uvicorn_config

    failed: list[BaseException] = []
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True
    app = create_app(engine_cfg, server_cfg, limits, on_fatal=on_fatal, lifecycle=lifecycle)
    config = uvicorn_config(app, server_cfg.host, server_cfg.port, server_cfg.log_level,
                            limits.max_header_bytes)
    server = DrainingServer(config, drain=lambda: drain(app))
    server.run()
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 2
    try:
        engine_cfg, server_cfg, limits = configs_from_args(args)
        lifecycle = lifecycle_from_args(args)
    except ValueError as exc:
        print(f"specserve serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server_cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(engine_cfg, server_cfg, limits, lifecycle)


if __name__ == "__main__":
    sys.exit(main())
