"""The one place defaults live. Config flows one way: CLI -> EngineConfig/ServerConfig -> engine/app.

Every field is validated once in `validate()`; unknown keys passed to `from_dict` are errors.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from specserve.server.models.backend_names import ATTENTION_BACKENDS, DEVICE_BACKENDS
from specserve.speculators import registry
from specserve.speculators.base import DraftTree, SpecParams
from specserve.speculators.tree_shape import TREE_MAX_NODES, TREE_METHODS, check_tree

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = DTYPES             # auto = the model dtype where attention is exact in it (kv_cache.cache_dtype)
SPECULATION_POLICIES = ("goodput", "fixed")
METRICS_COMPAT = ("none", "vllm")        # server/metrics.py: which other names /metrics carries
SUFFIX_SCOPES = ("request", "user", "global")
MAX_PROBE_TOKENS = 512                   # --speculation-probe-tokens
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")   # server/api/tool_parsers.py


@dataclass
class EngineConfig:
    model: str | None = None               # HF-layout directory; None = the default (embedded) model
    models_dir: str | None = None          # the embedded family's folder (server/models/embedded.py says the rule)
    served_model_name: str | None = None   # name in /v1/models; default: the model dir's basename
    dtype: str = "auto"                    # auto = bf16 on CUDA, and on CPUs where fast and exact (pick_dtype)
    device: str = "auto"                   # auto = cuda if available else cpu
    block_size: int = 0                    # tokens per KV block; 0 = auto (attention.pick_block_size)
    kv_cache_memory_gb: float = 1.0        # KV cache budget; number of blocks = budget // bytes per block
    kv_cache_dtype: str = "auto"           # auto = model dtype (fp32 under the CPU SDPA fallback)
    attention_backend: str = "auto"        # auto: CPU the in-place paged kernel (else sdpa), CUDA triton
    max_model_len: int | None = None       # default: the model's max_position_embeddings
    max_num_seqs: int = 64                 # running requests per step
    max_num_batched_tokens: int = 2048     # token budget per step (prefill chunks + decode + drafts)
    max_speculative_tokens: int = 8        # upper bound on k a request may ask for
    # server default for requests without a `speculation` field; None = the best loaded method
    # (registry.default_speculation: auto, k = 8)
    speculation: SpecParams | None = None
    speculation_policy: str = "goodput"    # goodput = draft only the positions that raise tokens/s; fixed = all k
    # start-up acceptance probe: new tokens each model drafter drafts on built-in texts before the first
    # request (server/engine/spec_probe.py); 0 = none
    speculation_probe_tokens: int = 64
    # the draft tree of requests (of a tree-drafting method) that name none: top_k 1 = chains
    draft_tree_top_k: int = 1
    draft_tree_depth: int = 4
    draft_model: str | None = None
    eagle3: str | None = None
    eagle: str | None = None               # an EAGLE-1 head (method "eagle")
    # the suffix method's cross-request cache: its token budget (oldest evicted first; ~90 B per token)
    # and who shares it (request: nobody; user: same API key and `user` field; global: everyone)
    suffix_cache_tokens: int = 1_000_000
    suffix_scope: str = "user"
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch default
    compile: bool = False  # torch.compile the layer stacks of target and draft model
    engine_process: bool = False  # step the engine in its own process (server/engine/process_engine.py)
    tensor_parallel_size: int = 1  # ranks the target is sharded over (server/engine/tp_runner.py)
    # structured outputs (specserve/grammar): limits on a constraint's text and compile time, and the LRU size
    max_grammar_bytes: int = 65536
    grammar_compile_timeout: float = 5.0   # seconds
    grammar_cache_size: int = 256
    tool_call_parser: str = "hermes"       # the model family's tool-call format (TOOL_CALL_PARSERS)

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        kind = "cuda" if self.device.startswith("cuda") else self.device
        if kind != "auto" and self.attention_backend not in ("auto", *DEVICE_BACKENDS[kind]):
            raise ValueError(f"attention_backend {self.attention_backend} does not run on {kind}; choose auto or "
                             f"one of {DEVICE_BACKENDS[kind]}")
        if self.block_size not in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be 0 (auto) or a power of two in [1, 256], got {self.block_size}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_speculative_tokens + 1:
            raise ValueError("max_num_batched_tokens must be > max_speculative_tokens")
        if not 0 <= self.max_speculative_tokens <= 64:
            raise ValueError("max_speculative_tokens must be in [0, 64]")
        if self.speculation_policy not in SPECULATION_POLICIES:
            raise ValueError(
                f"speculation_policy must be one of {SPECULATION_POLICIES}, got {self.speculation_policy!r}"
            )
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.compile:
            raise ValueError("--compile does not support --tensor-parallel-size > 1 (the collectives of a "
                             "sharded forward are not traced); start without one of them")
        if not 0 <= self.speculation_probe_tokens <= MAX_PROBE_TOKENS:
            raise ValueError(f"speculation_probe_tokens must be in [0, {MAX_PROBE_TOKENS}], "
                             f"got {self.speculation_probe_tokens}")
        if not 0 <= self.suffix_cache_tokens <= 1 << 30:
            raise ValueError(f"suffix_cache_tokens must be in [0, 2^30], got {self.suffix_cache_tokens}")
        if self.suffix_scope not in SUFFIX_SCOPES:
            raise ValueError(f"suffix_scope must be one of {SUFFIX_SCOPES}, got {self.suffix_scope!r}")
        if self.draft_tree_top_k > 1 and self.tensor_parallel_size > 1:
            raise ValueError("--draft-tree-top-k > 1 does not support --tensor-parallel-size > 1 (draft trees "
                             "are verified on unsharded targets); start without one of them")
        if self.draft_tree_top_k > 1:
            try:
                check_tree(DraftTree(self.draft_tree_top_k, self.draft_tree_depth),
                           max(self.draft_tree_depth, min(self.max_speculative_tokens, TREE_MAX_NODES)))
            except ValueError as exc:
                raise ValueError(f"draft_tree_top_k / draft_tree_depth: {exc}") from None
        elif not 1 <= self.draft_tree_top_k or not 1 <= self.draft_tree_depth <= 16:
            raise ValueError("draft_tree_top_k must be >= 1 and draft_tree_depth in [1, 16]")
        if self.speculation is not None:
            self._validate_default_speculation(self.speculation)
        if not 64 <= self.max_grammar_bytes <= 16 * 2**20:
            raise ValueError(f"max_grammar_bytes must be in [64, 16 MiB], got {self.max_grammar_bytes}")
        if not 0.01 <= self.grammar_compile_timeout <= 600:
            raise ValueError(f"grammar_compile_timeout must be in [0.01, 600] s, got {self.grammar_compile_timeout}")
        if not 1 <= self.grammar_cache_size <= 100_000:
            raise ValueError(f"grammar_cache_size must be in [1, 100000], got {self.grammar_cache_size}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")

    def _validate_default_speculation(self, spec: SpecParams) -> None:
        if spec.method not in registry.METHODS:
            raise ValueError(f"speculation method must be one of {registry.METHODS}")
        if not 0 <= spec.num_speculative_tokens <= self.max_speculative_tokens:
            raise ValueError(f"default speculation k must be in [0, max_speculative_tokens = "
                             f"{self.max_speculative_tokens}], got {spec.num_speculative_tokens}")
        try:  # the method's own options check, before any model loads (builder checks it is loaded)
            registry.validator(spec.method)(spec.options)
            if spec.draft_tree is not None:
                check_tree(spec.draft_tree, spec.num_speculative_tokens, spec.method)
        except ValueError as exc:
            raise ValueError(f"speculation: {exc}") from None

    def default_speculation(self, loaded: list[str]) -> SpecParams:
        """The default a request without `speculation` gets, given the methods the engine loaded."""
        if self.speculation is not None:
            return self.with_default_tree(self.speculation)
        return self.with_default_tree(registry.default_speculation(loaded, self.max_speculative_tokens))

    def with_default_tree(self, spec: SpecParams) -> SpecParams:
        """spec with the server's default draft tree when it names none and its method drafts trees."""
        if (spec.draft_tree is not None or self.draft_tree_top_k <= 1 or spec.method not in TREE_METHODS
                or not 1 <= spec.num_speculative_tokens <= TREE_MAX_NODES):
            return spec         # a k beyond what a tree verifies keeps its chain
        tree = DraftTree(self.draft_tree_top_k, min(self.draft_tree_depth, spec.num_speculative_tokens))
        check_tree(tree, spec.num_speculative_tokens, spec.method)
        return dataclasses.replace(spec, draft_tree=tree)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # also from env SPECSERVE_API_KEY
    log_level: str = "info"
    metrics_compat: str = "none"  # vllm = /metrics also carries the vllm: names (server/metrics.py)

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_compat not in METRICS_COMPAT:
            raise ValueError(f"metrics_compat must be one of {METRICS_COMPAT}, got {self.metrics_compat!r}")


def parse_speculation(text: str | dict[str, Any] | None) -> SpecParams:
    """Parse the `speculation` JSON (flag or request field) into SpecParams; unknown methods are errors.

    Example: '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
      -> SpecParams("ngram", 4, {"prompt_lookup_max": 3})
    """
    if text is None:
        return SpecParams()
    data = json.loads(text) if isinstance(text, str) else dict(text)
    if not isinstance(data, dict):
        raise ValueError("speculation must be a JSON object")
    method = data.pop("method", "none")
    if method not in registry.METHODS:
        raise ValueError(f"unknown speculation method {method!r}; expected one of {list(registry.METHODS)}")
    k = data.pop("num_speculative_tokens", 0 if method == "none" else 4)
    if not isinstance(k, int) or isinstance(k, bool):
        raise ValueError("num_speculative_tokens must be an integer")
    adaptive = data.pop("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError("speculation.adaptive must be true or false")
    tree = parse_draft_tree(data.pop("draft_tree", None), k, method)
    return SpecParams(method=method, num_speculative_tokens=k, options=data, adaptive=adaptive, draft_tree=tree)


def parse_draft_tree(value: Any, k: int, method: str) -> DraftTree | None:
    """`{"top_k": K, "depth": D}` -> DraftTree (checked: speculators/draft_tree.check_tree); None when absent.

    Example: {"top_k": 4, "depth": 3} with k = 8 -> DraftTree(4, 3); {"top_k": 1} -> DraftTree(1, k) (the chain).
    """
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"top_k", "depth"} or "top_k" not in value:
        raise ValueError('speculation.draft_tree must be an object {"top_k": K, "depth": D} (depth optional)')
    top_k, depth = value["top_k"], value.get("depth", k)
    for name, v in (("top_k", top_k), ("depth", depth)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"speculation.draft_tree.{name} must be an integer")
    tree = DraftTree(top_k, depth)
    check_tree(tree, k, method)
    return tree


def config_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]
