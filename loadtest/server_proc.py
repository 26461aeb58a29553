"""Start `python -m specserve.server serve` as a subprocess for benchmarks (or use a given URL)."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_server(url: str | None, extra: list[str], timeout: float = 300) -> Iterator[str]:
    """Our server on a free port (or the given URL, untouched)."""
    if url:
        yield url
        return
    port = free_port()
    with started_process([sys.executable, "-m", "specserve.server", "serve", "--port", str(port), *extra], port,
                         timeout=timeout) as u:
        yield u


@contextlib.contextmanager
def started_process(cmd: list[str], port: int, env: dict | None = None, timeout: float = 300) -> Iterator[str]:
    """Any OpenAI-compatible server command listening on 127.0.0.1:port; ready when /health answers 200."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("server did not become ready")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()


def offered_methods(url: str) -> list[str]:
    """The speculation methods a running server offers (GET /v1/speculators), without "none"."""
    data = httpx.get(f"{url}/v1/speculators", timeout=30).json()["data"]
    return [d["method"] for d in data if d["method"] != "none"]
