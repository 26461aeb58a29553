"""--dtype auto: an explicit dtype passes through; on CUDA bf16; on CPU bf16 only where it is fast and exact
(native bf16, the paged attention kernel, row-stable packed bf16 linears), else fp32 with the reason logged.
The start-up probe leaves the global RNG alone."""
import logging

import torch

from specserve.server.engine import builder
from specserve.server.engine.builder import cpu_bf16_problem, pick_dtype
from specserve.server.models import bf16_gemm, linear, native_build, paged_kernel


def test_explicit_dtypes_pass_through():
    assert pick_dtype("float32", torch.device("cpu")) is torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert pick_dtype("auto", torch.device("cuda")) is torch.bfloat16


def test_an_explicit_bfloat16_where_auto_would_not_pick_it_is_warned_about(monkeypatch, caplog):
    monkeypatch.setattr(native_build, "cpu_flags", lambda: {"avx2", "avx512f"})
    with caplog.at_level(logging.WARNING, logger=builder.log.name):
        assert pick_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
        assert pick_dtype("float32", torch.device("cpu")) is torch.float32
    assert len(caplog.records) == 1 and "no AVX512-BF16 or AMX" in caplog.text and "depend on the batch" in caplog.text


def test_auto_on_cpu_follows_what_this_cpu_can_do_and_leaves_the_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    picked = pick_dtype("auto", torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected)
    native = bool(native_build.cpu_flags() & {"avx512_bf16", "amx_bf16"})
    fast_and_exact = native and paged_kernel.load() is not None and linear.bf16_rows_stable()
    assert picked is (torch.bfloat16 if fast_and_exact else torch.float32)


def test_each_reason_keeps_fp32(monkeypatch, caplog):
    monkeypatch.setattr(native_build, "cpu_flags", lambda: {"avx2", "avx512f"})
    with caplog.at_level(logging.INFO, logger=builder.log.name):
        assert pick_dtype("auto", torch.device("cpu")) is torch.float32
    assert "no AVX512-BF16 or AMX" in caplog.text
    monkeypatch.setattr(native_build, "cpu_flags", lambda: {"avx512_bf16"})
    assert "sdpa" in cpu_bf16_problem("sdpa")
    monkeypatch.setattr(paged_kernel, "load", lambda: None)
    assert "does not build" in cpu_bf16_problem("auto")


def test_the_row_stability_probe_fails_on_a_linear_whose_rows_follow_the_batch(monkeypatch):
    monkeypatch.setattr(bf16_gemm, "_state", {"lib": None, "error": "oneDNN under test"})   # oneDNN's blocking
    honest = linear.bf16_rows_stable()     # oneDNN's own answer here (False where it emulates bf16: no AVX512-BF16)
    real = linear.Linear._packed
    planted = lambda self, x: real(self, x) * (1 + 2 ** -6 * (x.shape[0] > 32))   # a blocking switch above 32 rows
    monkeypatch.setattr(linear.Linear, "_packed", planted)
    monkeypatch.setattr(linear, "BF16_ROW_BLOCK", 4096)
    assert not linear.bf16_rows_stable()
    monkeypatch.setattr(linear, "BF16_ROW_BLOCK", 32)          # in blocks of 32 rows the planted switch never fires
    assert linear.bf16_rows_stable() is honest
