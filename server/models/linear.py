"""Linear: nn.Linear that runs CPU fp32/bf16 matmuls through oneDNN with a pre-reordered ("packed") weight.

Why, measured on an AVX2-only 2-core dev box (1 thread, best of N, the 33 matmuls of a 30M Llama, fp32):
    rows M                          1        2        5       16       64      256
    F.linear (MKL sgemm/sgemv)    21-24    48       60       71      161      453   ms
    oneDNN, packed weight         25-30    30       36       52      121      326   ms
Whole decode forward (B = batch, q = tokens per sequence, context 200), F.linear -> packed:
    B=1 q=1 28 -> 26 ms, B=1 q=5 42 -> 31 ms, B=16 q=1 82 -> 74 ms, B=16 q=5 144 -> 114 ms.
MKL re-packs the weight on every gemm call, so a 5-token verify cost 1.5x a 1-token decode; with
the weight packed once it costs ~1.2x. MKL also picks different kernels for M = 1, 2-3 and >= 4,
so one token's row differed by ~1e-5 between a decode and a verify step; the packed oneDNN kernel
gives bit-identical rows for every M (tests/test_models_hf_equivalence.py), so greedy decoding with
and without speculation sees the same numbers. Price: the packed copy doubles weight memory.

Packing happens once, after the weights are final (the loader calls pack_linears). The packed
copy is a snapshot: after editing weights in place, call pack_linears again. Calls with grad
enabled, and inputs of another dtype or device than the packed copy (a model moved to CUDA), use
F.linear on the live weights; the engine runs under torch.inference_mode(), which takes the packed path.

bf16 (CPUs with AMX / AVX512-BF16; measured on such a 2-core Xeon, 2 threads, the 5 linears of one
layer of the embedded target incl. lm_head, ms):
    rows M                          1        5       16       64      256
    fp32, packed                  0.92     0.96     1.52     4.64    14.6
    bf16, F.linear                1.32     0.95     1.06     1.99     4.41
    bf16, packed                  0.66     0.65     0.75     1.33     3.53
oneDNN's bf16 kernel switches blocking above 32-36 rows, after which a row's result depends on the
rows around it (1 bf16 ulp); in blocks of at most BF16_ROW_BLOCK rows every row is bit-identical to
the same row computed alone, so bf16 runs in such blocks (256 rows: 5.5 ms instead of 3.5 — still
2.7x faster than fp32) and keeps the property greedy speculation relies on.

On CPUs with AMX, bf16 weights of fitting shapes go to bf16_gemm.py instead (`tiled`): a kernel of this
package whose rows are bit-identical at every batch size by construction, without oneDNN's fixed cost
per call; at 1-16 rows the target's 33 linears take ~0.55x oneDNN's time (numbers there).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.server.models import bf16_gemm, compiled

logger = logging.getLogger(__name__)

ONEDNN_PACKING = (torch.backends.mkldnn.is_available()
                  and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                  and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


BF16_ROW_BLOCK = 32
PACKED_DTYPES = (torch.float32, torch.bfloat16)

class Linear(nn.Linear):
    packed: torch.Tensor | None = None     # oneDNN's copy of weight [out, in] or bf16_gemm's tiles; None: F.linear
    tiled: bool = False                    # packed is bf16_gemm's layout (AMX kernel), not oneDNN's
    tiled_bias: torch.Tensor | None = None   # fp32 bias for the AMX kernel
    tiled_call: Callable[[torch.Tensor], torch.Tensor] | None = None   # the kernel with weight and bias bound
    tiled_op: bool = False                 # the kernel is also a torch operator (compiled graphs call it directly)
    handle: int = -1                       # key of this Linear for compiled graphs (server/models/compiled.py)
    fp32_weight: torch.Tensor | None = None   # drafters only: F.linear on this fp32 copy (latency_tuning.py)
    fp32_bias: torch.Tensor | None = None

    def pack(self) -> None:
        weight = self.weight
        self.packed, self.tiled, self.tiled_bias, self.tiled_call, self.tiled_op = None, False, None, None, False
        self.fp32_weight = self.fp32_bias = None      # a snapshot of the old weights: re-tune after packing
        if bf16_gemm.fits(weight) and bf16_gemm.load() is not None:
            with torch.no_grad():
                self.packed, self.tiled = bf16_gemm.pack(weight), True
                self.tiled_bias = None if self.bias is None else self.bias.detach().float().contiguous()
                op = bf16_gemm.load_op()
                self.tiled_op = op is not None
                if self.tiled_op:               # a graph input of fixed shape: compiled graphs do not generalise it
                    torch._dynamo.mark_static(self.packed)
                    if self.tiled_bias is not None:
                        torch._dynamo.mark_static(self.tiled_bias)
                self.tiled_call = (bf16_gemm.bind(self.packed, self.tiled_bias) if op is None
                                   else functools.partial(op, packed=self.packed, bias=self.tiled_bias))
        elif ONEDNN_PACKING and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES:
            try:
                with torch.no_grad():
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            except RuntimeError as exc:  # an oneDNN build without this CPU's kernels: stay on F.linear
                logger.warning("oneDNN %s weight packing unavailable (%s); using F.linear", weight.dtype, exc)
        if self.packed is not None and self.handle < 0:
            self.handle = compiled.register(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]."""
        # The packed op has no autograd: with grad enabled (training) use the live weights.
        if self.fp32_weight is not None and x.device.type == "cpu" and not torch.is_grad_enabled():
            return F.linear(x.float(), self.fp32_weight, self.fp32_bias).to(x.dtype)
        if (self.packed is not None and x.dtype == self.weight.dtype and x.device.type == "cpu"
                and not torch.is_grad_enabled()):
            if torch.compiler.is_compiling():   # the opaque packed weight cannot be traced: a custom op
                if self.tiled_op:                   # the AMX kernel's own operator
                    return torch.ops.specserve_native.tiled_linear(x, self.packed, self.tiled_bias)
                return compiled.packed_linear_op(x, self.handle)
            return self.run_packed(x)
        return F.linear(x, self.weight, self.bias)

    def use_fp32_route(self) -> None:
        """Run as F.linear on an fp32 copy (MKL on CPU): faster for small products, but its rows depend on
        the batch. Drafters only (server/models/latency_tuning.py); pack() undoes it."""
        with torch.no_grad():
            self.fp32_weight = self.weight.detach().float().contiguous()
            self.fp32_bias = None if self.bias is None else self.bias.detach().float()

    def run_packed(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled_call is not None:
            return self.tiled_call(x)
        if x.dtype == torch.bfloat16 and x.shape[0] > BF16_ROW_BLOCK:
            return torch.cat([self._packed(part) for part in x.split(BF16_ROW_BLOCK)])
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:      # oneDNN's: run_packed took the tiled ones
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(module: nn.Module) -> int:
    """(Re)pack every Linear under module; returns how many now use the packed path."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, Linear):
            sub.pack()
            count += sub.packed is not None
    return count


def row_block(module: nn.Module) -> int:
    """Rows per block of the bf16 linears under `module`: a forward one row past a multiple of it costs a block
    more (the goodput policy's staircase, server/engine/spec_policy.py). bf16_gemm's 16-row tiles where the
    module's linears run on them, oneDNN's BF16_ROW_BLOCK otherwise."""
    tiled = any(isinstance(m, Linear) and m.tiled for m in module.modules())
    return bf16_gemm.TILE_ROWS if tiled else BF16_ROW_BLOCK


def bf16_rows_stable(sizes: tuple[int, ...] = (1, 5, 17, 32, 40, 64, 100)) -> bool:
    """Does the packed bf16 path give every row the same bits whatever the rows around it, on this CPU?

    Probed at start-up (builder.pick_dtype) with a seeded generator of its own, so the global RNG is left
    alone: a [256, 256] layer, each batch size in `sizes` against its rows computed one at a time.
    """
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.utils.skip_init(Linear, 256, 256, bias=False, dtype=torch.bfloat16)   # no RNG draw
    with torch.no_grad():
        layer.weight.copy_(torch.randn(256, 256, generator=gen))
    layer.pack()
    if layer.packed is None:
        return False
    x = torch.randn(max(sizes), 256, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
        return all(torch.equal(layer(x[:n]), alone[:n]) for n in sizes)
