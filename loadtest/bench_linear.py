"""bf16 linears: oneDNN's packed kernel against the AMX tile kernel (server/models/bf16_gemm.py), side by side.

Runs the target's linears of one decode step (by default the embedded target's shapes: 8 layers of qkv,
o, gate-up and down, then lm_head) one after another, so the weights cycle through the caches as they do
in a step, at several row counts; prints µs per pass for each kernel and their ratio, the median of
--rounds alternating rounds, and whether the two agree within a bf16 rounding.

    python -m loadtest.bench_linear
    python -m loadtest.bench_linear --hidden 4096 --intermediate 11008 --heads 32 --kv-heads 32 --layers 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.server.models import bf16_gemm, linear


def layer_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, layers: int,
                 vocab: int) -> list[tuple[int, int]]:
    """(out, in) of each linear in a step, in order."""
    per_layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
                 (2 * intermediate, hidden), (hidden, intermediate)]
    return per_layer * layers + [(vocab, hidden)]


def build(shapes: list[tuple[int, int]], tiled: bool) -> list[linear.Linear]:
    gen = torch.Generator().manual_seed(0)
    layers = []
    for out_f, in_f in shapes:
        layer = torch.nn.utils.skip_init(linear.Linear, in_f, out_f, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5)
        saved = dict(bf16_gemm._state)
        if not tiled:
            bf16_gemm._state.update(lib=None, error="oneDNN arm")
        try:
            layer.pack()
        finally:
            bf16_gemm._state.clear()
            bf16_gemm._state.update(saved)
        layers.append(layer)
    return layers


def one_pass(layers: list[linear.Linear], inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [layer.run_packed(inputs[layer.in_features]) for layer in layers]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passes", type=int, default=20)
    args = ap.parse_args(argv)
    if bf16_gemm.load() is None:
        raise SystemExit(f"the AMX kernel does not run here: {bf16_gemm.load_error()}")
    shapes = layer_shapes(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim, args.layers,
                          args.vocab)
    arms = {"onednn": build(shapes, tiled=False), "tiled": build(shapes, tiled=True)}
    if any(not layer.tiled for layer in arms["tiled"]):
        raise SystemExit("some shapes do not fit the AMX kernel (in % 32, out % 16)")
    mb = sum(o * i for o, i in shapes) * 2 / 1e6
    print(f"threads {torch.get_num_threads()}, {len(shapes)} linears, {mb:.1f} MB of bf16 weights; "
          f"µs per pass, median of {args.rounds} rounds x {args.passes} passes")
    print(f"{'rows':>5} {'oneDNN':>9} {'tiled':>9} {'oneDNN/tiled':>12} {'tiled GB/s':>10} {'agree':>6}")
    results = []
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {i for _, i in shapes}}
            times: dict[str, list[float]] = {name: [] for name in arms}
            for r in range(args.rounds):
                for name in (arms if r % 2 == 0 else list(arms)[::-1]):
                    one_pass(arms[name], inputs)
                    start = time.perf_counter()
                    for _ in range(args.passes):
                        one_pass(arms[name], inputs)
                    times[name].append((time.perf_counter() - start) / args.passes * 1e6)
            a, b = one_pass(arms["onednn"], inputs), one_pass(arms["tiled"], inputs)
            agree = all(((x.float() - y.float()).abs() <= y.float().abs() * 2 ** -7 + 1e-2).all()
                        for x, y in zip(a, b))
            o, t = statistics.median(times["onednn"]), statistics.median(times["tiled"])
            results.append(dict(rows=rows, onednn_us=o, tiled_us=t, agree=agree))
            print(f"{rows:5d} {o:9.0f} {t:9.0f} {o / t:12.2f} {mb / t * 1e3:10.1f} {'yes' if agree else 'NO':>6}",
                  flush=True)
    return results


if __name__ == "__main__":
    main()
