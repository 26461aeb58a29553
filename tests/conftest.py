"""Shared fixtures: a tiny random Llama checkpoint and real specserve servers started as subprocesses.

Everything heavy is session-scoped and built lazily, so unit tests that use none of it pay nothing.
Integration tests talk to `python -m specserve.server serve ...` over HTTP with the official openai client.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "models" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SERVED_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def single_torch_thread() -> Iterator[None]:
    """One torch thread for a module of tiny models: on a shared 2-core machine OpenMP spin-waits make
    2 threads ~100x slower than 1. Use with `pytestmark = pytest.mark.usefixtures("single_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 64-wide random Llama with the project tokenizer, saved in HF layout (safetensors)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.fail(f"tokenizer files missing in {TOKENIZER_DIR}")
    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=len(tokenizer),
                         max_position_embeddings=MAX_MODEL_LEN,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (TOKENIZER_DIR / name).is_file():
            shutil.copy(TOKENIZER_DIR / name, out / name)
    return out


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m specserve.server serve` on a free port, started at once and waited for only when needed."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str, python: Path | None = None,
                 cwd: Path = REPO) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            str(python or sys.executable),
            "-m",
            "specserve.server",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory-gb",
            "0.05",
            "--num-threads",
            "1",
            "--log-level",
            "warning",
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"SPECSERVE_API_KEY": ""}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._ready = False

    def wait_ready(self) -> str:
        """Block until /health is 200; fail the test with the server log if it exits or times out."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._ready:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self._log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                self._ready = httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            time.sleep(0.0 if self._ready else 0.2)
        return self.url

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


# The second server exercises non-default flags (tests/test_api_auth.py).
LOCKED_API_KEY = "sk-test-secret"
LOCKED_FLAGS = (
    "--api-key",
    LOCKED_API_KEY,
    "--max-n",
    "2",
    "--speculation",
    '{"method": "ngram", "num_speculative_tokens": 3}',
)


@pytest.fixture(scope="session")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Both test servers, launched together (startup is mostly imports: in parallel it costs one)."""
    logs = tmp_path_factory.mktemp("servers")
    procs = {
        "default": ServerProcess(tiny_model_dir, logs / "default.log"),
        "locked": ServerProcess(tiny_model_dir, logs / "locked.log", *LOCKED_FLAGS),
    }
    try:
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="session")
def server_url(servers: dict[str, ServerProcess]) -> str:
    """The server most API tests share: default settings, prefix caching on, no default speculation."""
    return servers["default"].wait_ready()


@pytest.fixture(scope="session")
def locked_url(servers: dict[str, ServerProcess]) -> str:
    """A server with --api-key, --max-n 2 and a default speculation of ngram k=3."""
    return servers["locked"].wait_ready()


@pytest.fixture(scope="session")
def client(server_url: str):
    import openai

    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def async_client(server_url: str):
    import openai

    return openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=60) as c:
        yield c
