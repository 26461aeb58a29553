"""The CUDA attention backend's choice, and its Triton kernel's cases (tests/triton_cases.py) run on CPU
under Triton's interpreter.

The CPU torch build ships no triton, so `make test` installs one into .venv/triton-interp, outside the
test environment's own packages; the cases run in a subprocess with TRITON_INTERPRET=1 and that folder on
PYTHONPATH. On a CUDA machine `make gpu-check` runs the same cases natively.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve.server.config import EngineConfig
from specserve.server.models import attention

ROOT = Path(__file__).resolve().parent.parent
TRITON_DIR = Path(sys.prefix) / "triton-interp"


def test_kernel_cases_pass_under_the_triton_interpreter():
    assert (TRITON_DIR / "triton").is_dir(), f"no triton in {TRITON_DIR}: `make test` installs it there"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TRITON_DIR), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/triton_cases.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 20 and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_cuda_prefers_triton_then_flash_then_sdpa(monkeypatch, caplog):
    monkeypatch.setattr(attention, "_choice", {"requested": "auto"})
    monkeypatch.setattr(attention.triton_attention, "available", lambda: True)
    monkeypatch.setattr(attention.triton_attention, "self_check", lambda device: None)
    monkeypatch.setattr(attention, "FLASH_ATTN_AVAILABLE", True)
    assert attention.default_backend("cuda") == "triton"
    assert attention.pick_block_size(0, "cuda") == 16          # the Triton kernel pages at any block size
    assert attention.configure_backend("flash", "cuda") == "flash"
    assert attention.pick_block_size(0, "cuda") == 256
    monkeypatch.setattr(attention, "_choice", {"requested": "auto"})
    monkeypatch.setattr(attention.triton_attention, "self_check", lambda device: "the kernel failed: planted")
    with caplog.at_level("WARNING"):
        assert attention.default_backend("cuda") == "flash"     # a kernel that fails its start-up check is not used
    assert "falls back to flash-attn: the kernel failed: planted" in caplog.text
    with pytest.raises(RuntimeError, match="planted"):
        attention.configure_backend("triton", "cuda")           # asked for by name: a start-up error
    monkeypatch.setattr(attention.triton_attention, "available", lambda: False)
    assert attention.default_backend("cuda") == "flash"
    monkeypatch.setattr(attention, "FLASH_ATTN_AVAILABLE", False)
    assert attention.default_backend("cuda") == "sdpa"
    assert attention.default_backend("cpu") in ("paged", "sdpa")


def test_a_backend_the_device_cannot_run_is_a_start_up_error(monkeypatch):
    monkeypatch.setattr(attention, "_choice", {"requested": "auto"})
    with pytest.raises(ValueError, match="does not run on cpu"):
        attention.configure_backend("triton", "cpu")
    with pytest.raises(ValueError, match="does not run on cuda"):
        attention.configure_backend("paged", "cuda")
    with pytest.raises(RuntimeError, match="triton"):
        attention.configure_backend("triton", "cuda")         # no triton in the CPU torch build
    monkeypatch.setattr(attention, "FLASH_ATTN_AVAILABLE", False)
    with pytest.raises(RuntimeError, match="flash_attn is not importable"):
        attention.configure_backend("flash", "cuda")
    assert attention._choice["requested"] == "auto"            # a refused choice changes nothing
    with pytest.raises(ValueError, match="does not run on cpu"):
        EngineConfig(device="cpu", attention_backend="flash").validate()
    with pytest.raises(ValueError, match="does not run on cuda"):
        EngineConfig(device="cuda:0", attention_backend="paged").validate()


def test_the_kernel_refuses_mismatched_caches():
    from specserve.server.models import triton_attention
    if not triton_attention.available():
        with pytest.raises(RuntimeError, match="needs triton"):
            triton_attention.paged_attention_triton(torch.zeros(1, 2, 16), torch.zeros(1, 16, 1, 16),
                                                    torch.zeros(1, 16, 1, 16), torch.zeros(1, 1, dtype=torch.int32),
                                                    torch.ones(1, dtype=torch.int32),
                                                    torch.tensor([0, 1], dtype=torch.int32), 1, 0.25, None)
        return
    with pytest.raises(ValueError, match="one layout"):
        triton_attention.paged_attention_triton(torch.zeros(1, 2, 16), torch.zeros(1, 16, 1, 16),
                                                torch.zeros(1, 16, 1, 16, dtype=torch.bfloat16),
                                                torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                                torch.tensor([0, 1], dtype=torch.int32), 1, 0.25, None)
