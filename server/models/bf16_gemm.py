"""bf16 linear layers on AMX tiles (Intel Sapphire Rapids and later): a small C++ kernel, bf16_gemm.cpp.

Why: oneDNN's packed bf16 linear (linear.py) costs ~15-20 µs a call before it reads a byte, and the
target's decode step makes 33 such calls; at 1-16 rows the 33 linears of the embedded target ran 2.5-2.8 ms
through oneDNN and 1.4-1.5 ms through this kernel (2-core AMX Xeon, weights cycling through the caches as
in a step; `python -m loadtest.bench_linear`; 2.8-2.9x at 64-256 rows). The kernel also keeps what exact
speculation rests on: a row's result depends on that row only (bf16_gemm.cpp says how), at every batch
size, so it needs none of the 32-row blocking oneDNN's bf16 kernel needs.

Where it applies: the CPU has AMX-BF16 and Linux grants the tile state, the weight is bf16 with K a
multiple of 32 and N of 16. Elsewhere linear.py keeps oneDNN. Set SPECSERVE_LINEAR_KERNEL=onednn to keep
oneDNN everywhere (for A/B measurements). Built like the paged attention kernel (native_build.py).

Two entries into the one kernel: `bf16_gemm_op.cpp` makes it the torch operator
`specserve_native::tiled_linear`, built against the installed torch's headers (~5 s with g++), which eager
layers and compiled graphs call with no Python in between; where that does not build, `bind` calls the
plain library through ctypes (~4 µs more a call). Compiled through the operator, the embedded target's
decode step ran 2.2-2.5 ms at batch 1 against 2.8-3.2 ms through a Python custom op around ctypes.
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from specserve.server.models import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16_gemm.cpp")
OP_SOURCE = Path(__file__).with_name("bf16_gemm_op.cpp")      # the same kernel as a torch operator
KERNEL_ENV = "SPECSERVE_LINEAR_KERNEL"
TILE_ROWS = 16             # rows per tile: a forward one row past a multiple of it runs one more tile of every weight
KERNEL_CHOICES = ("auto", "onednn")

_lock = threading.Lock()
_state: dict[str, object] = {}      # "lib": ctypes.CDLL | None, "error": str
_op_lock = threading.Lock()
_op_state: dict[str, object] = {}   # "lib": the operator's library | None, "error": str, "fake": registered


def load() -> ctypes.CDLL | None:
    """The built kernel where this CPU and process can run it, else None (reason in `load_error()`)."""
    return native_build.load_once(_state, _lock, _open)


def _open() -> ctypes.CDLL | None:
    lib, error = None, None
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    if choice == "onednn":
        error = f"{KERNEL_ENV}=onednn"
    elif not native_build.cpu_flags() & {"amx_bf16"}:
        error = "this CPU has no AMX-BF16"
    else:
        try:
            lib = ctypes.CDLL(str(native_build.build(SOURCE)))
            fn = lib.specserve_bf16_linear
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            fn.restype = ctypes.c_int
            if lib.specserve_amx_ready() != 1:
                lib, error = None, "Linux did not grant this process the AMX tile state"
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            lib, error = None, f"the kernel does not build: {exc}"
    if error is not None:
        logger.info("bf16 linears: oneDNN (%s)", error)
    _state["error"] = error
    return lib


def load_op():
    """torch.ops.specserve_native.tiled_linear where the operator builds against this torch (and the kernel
    runs here), else None: callers then use the ctypes entry (`bind`)."""
    lib = native_build.load_once(_op_state, _op_lock, _open_op)
    return None if lib is None else torch.ops.specserve_native.tiled_linear.default


def _open_op():
    if load() is None:
        _op_state["error"] = load_error()
        return None
    from torch.utils.cpp_extension import include_paths
    torch_lib = Path(torch.__file__).parent / "lib"
    extra = ["-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{p}" for p in include_paths()), f"-L{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10",
             f"-Wl,-rpath,{torch_lib}"]
    try:
        path = native_build.build(OP_SOURCE, (SOURCE,), extra=extra, key_text=torch.__version__)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _op_state["error"] = str(exc)
        logger.info("bf16 linears: the kernel through ctypes (its torch operator does not build: %s)", exc)
        return None

    if not _op_state.get("fake"):       # once per process, however often the state is reset
        torch.library.register_fake("specserve_native::tiled_linear", _tiled_linear_shape)
        _op_state["fake"] = True
    return path


def _tiled_linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0] * 16))


def load_error() -> str | None:
    return _state.get("error")


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight [out, in] (bf16 on CPU, in % 32 == 0, out % 16 == 0)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and weight.shape[0] % 16 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the kernel's tile layout [N/16, K/32, 16, 16, 2] (bf16_gemm.cpp)."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def bind(packed: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear` with this weight and bias bound: the per-call work trimmed to one allocation and the kernel
    call for the 2-D contiguous rows a model step passes (other inputs go through `linear`)."""
    fn = _state["lib"].specserve_bf16_linear
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    w_ptr, b_ptr = packed.data_ptr(), None if bias is None else bias.data_ptr()
    empty, bf16, threads = torch.empty, torch.bfloat16, torch.get_num_threads

    def call(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != k or x.dtype != bf16 or not x.is_contiguous():
            return linear(x, packed, bias)
        out = empty(x.shape[0], n, dtype=bf16)
        fn(x.data_ptr(), x.shape[0], k, w_ptr, n, b_ptr, out.data_ptr(), threads())
        return out
    return call


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] bf16 -> [..., N] bf16 with the packed weight; bias fp32 [N] or None."""
    lib = _state["lib"]
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"bf16 linear: input {tuple(x.shape)} {x.dtype} against a [{n}, {k}] bf16 weight")
    rows = x.reshape(-1, k)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    rc = lib.specserve_bf16_linear(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(), n,
                                   None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"bf16 linear: shapes {tuple(x.shape)} x [{n}, {k}] not taken")
    return out.view(*x.shape[:-1], n)
