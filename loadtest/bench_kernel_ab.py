"""The paged attention kernel against another version of its source, in one process, arms alternating.

    git show REV:server/models/paged_kernel.cpp > /tmp/old_kernel.cpp
    python -m loadtest.bench_kernel_ab /tmp/old_kernel.cpp

Builds OTHER with the flags the server uses, loads it beside the current kernel (server/models/paged_kernel.py)
and times `paged_attention_cpu` with each on the same inputs: decode (1 row per sequence) and verification
(5 rows: 4 drafts) at batch 1, 8 and 16, fp32 and bf16 K/V, context --context, 8 heads over 2 KV heads of
--head-dim. Median of --rounds x --calls calls per arm; the two outputs are compared bit for bit (a change that
only moves work around must keep every bit).

--layers N times the kernel as a forward sees it: N layers' caches of their own, called in turn with a
512 x 2048 linear between calls, so each call starts with the other layers' K/V and the weights in the caches
(only the kernel's calls are timed).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specserve.server.models import native_build
from specserve.server.models import paged_kernel as pk

HEADS, KV_HEADS, BLOCK = 8, 2, 16


def build_other(source: Path, out_dir: Path) -> ctypes.CDLL:
    out = out_dir / "other_kernel.so"
    for flags in native_build.FLAG_SETS:
        cmd = ["g++", *flags, "-fopenmp", "-std=c++17", "-shared", "-fPIC", f"-I{pk.SOURCE.parent}", str(source),
               "-o", str(out)]     # a source that includes the kernel's headers gets today's
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            break
    else:
        raise SystemExit(f"{source} does not build")
    lib = ctypes.CDLL(str(out))
    fn = lib.specserve_paged_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64,
                   ctypes.c_float, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def inputs(batch: int, rows: int, kv_dtype: torch.dtype, context: int, head_dim: int, layer: int = 0):
    per = -(-(context + rows) // BLOCK)
    gen = torch.Generator().manual_seed(batch * 10 + rows + 1000 * layer)
    shape = (batch * per, BLOCK, KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    tables = torch.tensor([[i * per + j for j in range(per)] for i in range(batch)], dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32)
    q = torch.randn(batch * rows, HEADS, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, lens, qsl, head_dim ** -0.5


def timed_calls(layers: list[tuple], calls: int, num_tokens: int) -> float:
    """µs per kernel call: `calls` passes over the layers; with several, a linear runs between calls."""
    x, w = torch.randn(num_tokens, 512).to(torch.bfloat16), torch.randn(2048, 512).to(torch.bfloat16)
    total = 0.0
    for _ in range(calls):
        for layer in layers:
            if len(layers) > 1:
                torch.nn.functional.linear(x, w)
            start = time.perf_counter()
            pk.paged_attention_cpu(*layer, None)
            total += time.perf_counter() - start
    return total / (calls * len(layers)) * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", type=Path, help="another paged_kernel.cpp (e.g. from `git show REV:...`)")
    ap.add_argument("--context", type=int, default=420)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--layers", type=int, default=1, help="caches of their own, a linear between calls (see above)")
    args = ap.parse_args(argv)
    current = pk.load()
    if current is None:
        raise SystemExit(f"the current kernel does not build: {pk.load_error()}")
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        other = build_other(args.other, Path(tmp))
        print(f"threads {torch.get_num_threads()}, context {args.context}, {HEADS} heads over {KV_HEADS} KV heads "
              f"x {args.head_dim}; µs per call, median of {args.rounds} x {args.calls}")
        print(f"{'batch':>5} {'rows':>4} {'KV':>9} {'other':>8} {'current':>8} {'other/current':>13} {'same bits':>9}")
        try:
            for rows in (1, 5):
                for batch in (1, 8, 16):
                    for kv_dtype in (torch.float32, torch.bfloat16):
                        layers = [inputs(batch, rows, kv_dtype, args.context, args.head_dim, seed)
                                  for seed in range(args.layers)]
                        times: dict[str, list[float]] = {"other": [], "current": []}
                        outs = {}
                        for r in range(args.rounds):
                            arms = (("other", other), ("current", current))
                            for name, lib in arms if r % 2 == 0 else arms[::-1]:
                                pk._state["lib"] = lib
                                outs[name] = pk.paged_attention_cpu(*layers[0], None)
                                times[name].append(timed_calls(layers, args.calls, batch * rows))
                        o, c = statistics.median(times["other"]), statistics.median(times["current"])
                        same = torch.equal(outs["other"], outs["current"])
                        rows_out.append(dict(batch=batch, rows=rows, kv=str(kv_dtype), other_us=o, current_us=c,
                                             same_bits=same))
                        print(f"{batch:5d} {rows:4d} {str(kv_dtype)[6:]:>9} {o:8.0f} {c:8.0f} {o / c:13.2f} "
                              f"{'yes' if same else 'NO':>9}", flush=True)
        finally:
            pk._state["lib"] = current
    return rows_out


if __name__ == "__main__":
    main()
