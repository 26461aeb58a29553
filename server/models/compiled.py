"""torch.compile of the decoder stack (`--compile`): inductor fuses the small ops between the matmuls.

At batch 1 on a small model most of a step is not matmul time but the ~70 small ops per layer around
them (RMSNorm, RoPE, SiLU-gate, residual adds, casts), each a separate eager dispatch. Compiling the
layer stack turns those into a few generated kernels per layer.

What stays outside the graph, called through custom ops so the compiled code runs exactly the eager
kernels: every packed Linear (`specserve::packed_linear`: the opaque oneDNN weight of server/models/linear.py
cannot be traced, and its row-stable kernel is what keeps greedy speculation exact; a Linear on the AMX
tile kernel calls that kernel's own C++ operator, `specserve_native::tiled_linear`, server/models/bf16_gemm.py,
with its packed weight as a graph input of fixed shape) and paged
attention (`specserve::paged_attention` below: the KV cache and the per-step metadata are Python
structures that change every step; the op finds them in a per-thread forward context instead of as
graph inputs, so nothing is re-traced and the cache is never copied by functionalization). RoPE's
cos/sin lookup runs eagerly too (it depends on the step's largest position, a Python int).

Inductor options (COMPILE_OPTIONS): a C++ wrapper around the kernels and no per-call size/stride
asserts; the generated Python wrapper with asserts ran at 0.94-1.25x eager at batch 1, this at 1.31-1.48x
(bf16, 26.7M random Llama, 2-core AMX Xeon, interleaved rounds).

Shapes: ONE graph for every token count. The token dimension is marked unbacked, because torch otherwise
specialises 1-token inputs into a graph of their own, and in bf16 that graph rounded differently from the
general one (a decoded token's hidden state differed from the same token verified among drafts by 0.03, and
greedy n-gram output changed; tests/test_compiled.py). ModelRunner start-up warms it (builder.compile_models)
so no request pays the compile.

Still not exact in bf16 (as without --compile, builder.pick_dtype): the generated kernels keep bf16
intermediates in fp32, so compiled and eager bf16 differ slightly; rows stay batch-independent.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specserve.server.models.attention import AttentionMetadata, paged_attention

COMPILE_OPTIONS = {"cpp_wrapper": True, "size_asserts": False,
                   # Dynamo re-checks every module attribute the graph read before each call: ~0.37 ms per
                   # target forward on the 2-core Xeon (profiler), ~0.12 ms without them. Our modules do not
                   # change once compiled (weights are final, handles fixed); input-tensor and argument
                   # guards (aux layer ids, dtypes) stay.
                   "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}

_MODULES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()
_context = threading.local()      # .attn: AttentionMetadata, .kv_caches: list[KVCache] of the running forward


def register(module: torch.nn.Module) -> int:
    """Handle by which a compiled graph's custom op finds `module` (a packed Linear, a LlamaAttention)."""
    handle = next(_HANDLES)
    _MODULES[handle] = module
    return handle


# The two ops are defined with torch.library.Library rather than the @custom_op decorator: a decorated op's
# call passes through Python autograd and aliasing layers, ~10.5 us a call against ~3.6 us here (measured
# on a 2-core EPYC, inference mode), and a decode step makes 40 of them (32 linears, 8 attentions).
_LIB = torch.library.Library("specserve", "DEF")
_LIB.define("packed_linear(Tensor x, int handle) -> Tensor")
_LIB.define("paged_attention(Tensor q, Tensor k, Tensor v, int handle) -> Tensor")


def _packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _MODULES[handle].run_packed(x)


_LIB.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
packed_linear_op = torch.ops.specserve.packed_linear.default


@torch.library.register_fake("specserve::packed_linear")
def _packed_linear_shape(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _MODULES[handle].out_features))


@contextmanager
def forward_context(attn: AttentionMetadata, kv_caches: list) -> Iterator[None]:
    _context.attn, _context.kv_caches = attn, kv_caches
    try:
        yield
    finally:
        _context.attn = _context.kv_caches = None


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int) -> torch.Tensor:
    layer = _MODULES[handle]
    out = paged_attention(q, k, v, _context.kv_caches[layer.layer_idx], _context.attn, layer.scale, layer.window)
    return out.contiguous()          # the graph was traced with a contiguous result (the fake below)


_LIB.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")
paged_attention_op = torch.ops.specserve.paged_attention.default


@torch.library.register_fake("specserve::paged_attention")
def _paged_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(q)


def attend(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache,
           attn: AttentionMetadata | None) -> torch.Tensor:
    """Paged attention for `module` (a LlamaAttention): eager call, or the custom op inside a compiled graph."""
    if torch.compiler.is_compiling():
        return paged_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), module.attention_handle)
    return paged_attention(q, k, v, kv_cache, attn, module.scale, module.window)


@torch.inference_mode()
def warm_up(model: torch.nn.Module, kv_caches: list, block_size: int, device: torch.device,
            aux_layer_ids: tuple[int, ...] = ()) -> None:
    """Compile the graph before serving (a 1-token and a 2-token step: both must use it). Writes K/V into
    block 0 of `kv_caches`: start-up only, before any request owns a block (see ModelRunner.time_verify_step)."""
    from specserve.server.models.attention import build_attention_metadata
    for query_len in (1, 2):
        attn = build_attention_metadata([query_len], [block_size], [[0]], block_size, device)
        ids = torch.zeros(query_len, dtype=torch.long, device=device)
        model.forward_states(ids, attn, kv_caches, aux_layer_ids)
