"""The AMX bf16 linear kernel (server/models/bf16_gemm.py): its tile layout, its rows at every batch size,
and where linear.py routes bf16 weights to it or keeps oneDNN."""
from __future__ import annotations

import pytest
import torch

from specserve.server.models import bf16_gemm, linear, native_build

AMX = bf16_gemm.load() is not None
needs_amx = pytest.mark.skipif(not AMX, reason="runs the AMX kernel: this CPU or process has no AMX-BF16")


def test_packed_layout_puts_each_weight_where_the_kernel_reads_it():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=gen).to(torch.bfloat16)
    p = bf16_gemm.pack(w)
    assert p.shape == (3, 3, 16, 16, 2) and p.is_contiguous()
    for nb, kb, pair, col, e in [(0, 0, 0, 0, 0), (2, 1, 7, 15, 1), (1, 2, 15, 3, 0), (2, 2, 15, 15, 1)]:
        assert p[nb, kb, pair, col, e] == w[16 * nb + col, 32 * kb + 2 * pair + e]


def test_route_follows_the_cpu_the_shape_and_the_override(monkeypatch):
    fitting = linear.Linear(64, 48, bias=False).to(torch.bfloat16)
    fitting.pack()
    assert fitting.tiled == AMX and (fitting.packed is not None or not AMX)   # oneDNN may lack bf16 on old CPUs
    if "amx_bf16" not in native_build.cpu_flags():
        assert not AMX and "no AMX" in bf16_gemm.load_error()
    odd = linear.Linear(40, 24, bias=False).to(torch.bfloat16)       # in 40 is no multiple of 32
    odd.pack()
    assert not odd.tiled
    fp32 = linear.Linear(64, 48, bias=False)
    fp32.pack()
    assert not fp32.tiled
    monkeypatch.setattr(bf16_gemm, "_state", {})
    monkeypatch.setenv(bf16_gemm.KERNEL_ENV, "onednn")
    fitting.pack()
    assert not fitting.tiled and bf16_gemm.load_error() == "SPECSERVE_LINEAR_KERNEL=onednn"
    monkeypatch.setattr(bf16_gemm, "_state", {})
    monkeypatch.setenv(bf16_gemm.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="onednn"):
        fitting.pack()


def test_row_block_is_the_tile_where_the_linears_run_on_the_kernel_else_onednns_block():
    model = torch.nn.Sequential(linear.Linear(64, 48, bias=False), torch.nn.ReLU()).to(torch.bfloat16)
    linear.pack_linears(model)
    assert linear.row_block(model) == (bf16_gemm.TILE_ROWS if AMX else linear.BF16_ROW_BLOCK)
    fp32 = linear.Linear(64, 48)
    fp32.pack()
    assert linear.row_block(fp32) == linear.BF16_ROW_BLOCK


@needs_amx
@pytest.mark.parametrize("shape", [(512, 2816), (192, 64), (1024, 512), (32, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_rows_match_float64_and_do_not_depend_on_the_batch(shape, bias):
    torch.manual_seed(sum(shape) + bias)
    layer = linear.Linear(*shape, bias=bias).to(torch.bfloat16)
    layer.pack()
    assert layer.tiled
    x = torch.randn(70, shape[0]).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[r:r + 1]) for r in range(x.shape[0])])
        for m in (2, 5, 15, 16, 17, 32, 33, 70):
            assert torch.equal(layer(x[:m]), alone[:m]), m
        torch.set_num_threads(1)
        try:
            one_thread = layer(x)
        finally:
            torch.set_num_threads(2)
    assert torch.equal(one_thread, alone)
    ref = torch.nn.functional.linear(x.double(), layer.weight.double(),
                                     None if layer.bias is None else layer.bias.double())
    # fp32 accumulation, one bf16 rounding of the result: within a bf16 ulp of the exact product
    assert ((alone.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3).all()


@needs_amx
def test_tiled_linear_takes_batched_and_strided_inputs():
    torch.manual_seed(1)
    layer = linear.Linear(64, 32, bias=False).to(torch.bfloat16)
    layer.pack()
    x = torch.randn(3, 5, 128).to(torch.bfloat16)[..., ::2]             # [3, 5, 64], not contiguous
    with torch.inference_mode():
        out = layer(x)
        assert out.shape == (3, 5, 32)
        assert torch.equal(out, layer(x.contiguous().reshape(15, 64)).view(3, 5, 32))
        assert layer(x[:0].reshape(0, 64)).shape == (0, 32)


@needs_amx
def test_bench_linear_prints_both_kernels_side_by_side():
    from loadtest import bench_linear
    rows = bench_linear.main(["--hidden", "64", "--intermediate", "128", "--heads", "2", "--kv-heads", "1",
                              "--head-dim", "32", "--layers", "1", "--vocab", "256", "--rows", "1,17",
                              "--rounds", "1", "--passes", "1"])
    assert [r["rows"] for r in rows] == [1, 17]
    assert all(r["agree"] and r["onednn_us"] > 0 and r["tiled_us"] > 0 for r in rows)


@needs_amx
def test_the_torch_operator_gives_the_ctypes_entrys_bits_and_is_what_packed_layers_call():
    """Both entries run one kernel: same bits for 1 and 37 rows, batched input, bias; a layer packed where the
    operator builds calls it (tiled_op), one packed where it does not keeps the ctypes entry."""
    op = bf16_gemm.load_op()
    assert op is not None, bf16_gemm._op_state.get("error")
    torch.manual_seed(2)
    layer = linear.Linear(64, 48, bias=True).to(torch.bfloat16)
    layer.pack()
    assert layer.tiled_op
    bound = bf16_gemm.bind(layer.packed, layer.tiled_bias)
    with torch.inference_mode():
        for x in (torch.randn(1, 64), torch.randn(37, 64)):
            x = x.to(torch.bfloat16)
            assert torch.equal(op(x, layer.packed, layer.tiled_bias), bound(x))
            assert torch.equal(layer(x), bound(x))
        x3 = torch.randn(2, 3, 64).to(torch.bfloat16)
        assert torch.equal(op(x3, layer.packed, layer.tiled_bias), bound(x3.reshape(6, 64)).view(2, 3, 48))
        with pytest.raises(RuntimeError, match="input must be CPU bf16"):
            op(torch.randn(2, 32).to(torch.bfloat16), layer.packed, None)


@needs_amx
def test_without_the_operator_layers_keep_the_ctypes_entry(monkeypatch):
    monkeypatch.setattr(bf16_gemm, "_op_state", {"lib": None, "error": "no operator under test"})
    layer = linear.Linear(64, 48, bias=False).to(torch.bfloat16)
    layer.pack()
    assert layer.tiled and not layer.tiled_op
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), bf16_gemm.bind(layer.packed, None)(x))
