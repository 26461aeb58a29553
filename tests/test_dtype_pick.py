"""--dtype auto: an explicit dtype passes through; on CPU auto is fp32 (exact greedy equivalence) and
leaves the RNG alone."""
import torch

from specserve.server.engine.builder import pick_dtype


def test_explicit_dtypes_pass_through():
    assert pick_dtype("float32", torch.device("cpu")) is torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16


def test_auto_on_cpu_probes_without_touching_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    picked = pick_dtype("auto", torch.device("cpu"))
    assert picked is torch.float32
    assert torch.equal(torch.rand(4), expected)
