"""Soak: N minutes of mixed load with disconnects and bad requests; reports leaked KV blocks (must be 0),
the server's memory growth and error counts. Not part of CI (`make soak ARGS="--minutes 20"`).

The mix, per request (each of --concurrency workers loops until time is up):
  35%  streamed to the end          completions or chat; speculation none / ngram / prediction
  25%  streamed, cut after the first chunk at a random byte (FIN or RST)
  15%  non-streamed to the end
  10%  non-streamed, hung up after 0-300 ms (queued, prefill or mid-generation)
  15%  a bad request (malformed JSON, out-of-range numbers, context overflow, huge header, ...)
Full requests must answer 200, bad ones 4xx; anything else counts as an unexpected error. Every
--sample-s the server's RSS (from /proc, when this script started the server) and /v1/engine/stats
are sampled. At the end the load stops, the server must go idle: leaked blocks = total - free.

  python -m loadtest.soak --tiny --minutes 3              # own server on a tiny random Llama
  python -m loadtest.soak --url http://host:8000 --api-key KEY --minutes 20
Exit status 1 when blocks leaked, an unexpected error happened or the server died.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump. ") * 4


# ---- server ------------------------------------------------------------------------------------------

def tiny_model(out: Path) -> Path:
    """A 2-layer, 64-wide random Llama with the project tokenizer (what the tests use)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok_dir = REPO / "models" / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, out / name)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen | None = None          # when this script started the server
    pid: int | None = None                        # for RSS (the proc's, or --pid)
    api_key: str | None = None
    served_name: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def rss_mb(self) -> float | None:
        if self.pid is None:
            return None
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return None

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def stats(self) -> dict:
        r = httpx.get(f"{self.url}/v1/engine/stats", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(model: str | None, extra: list[str], log_path: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.server", "serve", "--port", str(port), "--log-level", "warning", *extra]
    if model:
        cmd += ["--model", model]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    server = Server(f"http://127.0.0.1:{port}", proc, proc.pid)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        if time.monotonic() > deadline:
            raise SystemExit("server not ready after 300 s")
        time.sleep(0.3)


# ---- requests ----------------------------------------------------------------------------------------

def normal_body(rng: random.Random, model: str | None, stream: bool) -> tuple[str, dict]:
    """A legal request: completions or chat, speculation none / ngram / prediction, n 1-2."""
    body: dict[str, Any] = {"max_tokens": rng.randint(4, 48), "stream": stream, "n": rng.choice((1, 1, 1, 2)),
                            "temperature": rng.choice((0.0, 0.7, 1.0))}
    if model:
        body["model"] = model
    method = rng.choice(("none", "ngram", "prediction"))
    if method == "ngram":
        body["speculation"] = {"method": "ngram", "num_speculative_tokens": rng.randint(1, 6)}
    elif method == "prediction":
        body["prediction"] = {"type": "content", "content": TEXT[: rng.randint(20, 300)]}
    start = rng.randint(0, 100)
    text = TEXT[start: start + rng.randint(10, 300)]
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


def bad_requests(model: str | None) -> list[bytes]:
    """Raw HTTP requests that must each get a 4xx (path, headers and all)."""
    def post(body: bytes, extra: str = "", path: str = "/v1/completions") -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body
    m = {"model": model} if model else {}

    def js(obj: dict, path: str = "/v1/completions") -> bytes:
        return post(json.dumps({**m, **obj}).encode(), path=path)
    return [
        post(b'{"prompt": "x",'), post(b"\xff\xfe not utf-8"), post(b"[" * 50_000 + b"]" * 50_000),
        js({"prompt": ""}), js({"prompt": "x", "max_tokens": -1}), js({"prompt": "x", "max_tokens": 2**63}),
        js({"prompt": "x", "n": 10**6}), js({"prompt": "x", "temperature": -1}), js({"prompt": "x", "top_p": 0}),
        js({"prompt": "x", "seed": 2**64}), js({"prompt": "x", "stop": ["s"] * 1000}),
        js({"prompt": "x", "logit_bias": {"99999999": 1}}), js({"prompt": [7] * 5000}),
        js({"prompt": "a" * 200_000}), js({"prompt": "a\ud800"}),
        js({"prompt": "x", "speculation": {"method": "warp"}}),
        js({"prompt": "x", "speculation": {"method": "ngram", "num_speculative_tokens": -3}}),
        js({"messages": [{"role": "wizard", "content": "x"}]}, "/v1/chat/completions"),
        js({"messages": [{"role": "user", "content": None}]}, "/v1/chat/completions"),
        post(b'{"prompt": "x"}', extra="X-Pad: " + "a" * 40_000 + "\r\n"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
         b"Content-Length: 104857600\r\n\r\n" + b"{" * 65536),                       # "100 MB" body
    ]


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)      # (kind, outcome) -> n
    latencies: list[float] = field(default_factory=list)  # full non-streamed requests, seconds
    unexpected: list[str] = field(default_factory=list)

    def add(self, kind: str, outcome: str) -> None:
        self.counts[(kind, outcome)] += 1

    def fail(self, kind: str, what: str) -> None:
        self.add(kind, "UNEXPECTED")
        if len(self.unexpected) < 50:
            self.unexpected.append(f"{kind}: {what}")


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


def _request_bytes(path: str, body: dict, headers: dict[str, str]) -> bytes:
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


async def _close(writer: asyncio.StreamWriter, reset: bool) -> None:
    if reset:
        writer.transport.abort()
    else:
        writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


async def one_request(server: Server, rng: random.Random, tally: Tally, bad: list[bytes]) -> None:
    roll = rng.random()
    if roll < 0.15:
        return await _bad(server, rng, tally, bad)
    stream = roll < 0.75
    path, body = normal_body(rng, server.served_name, stream)
    cut = (stream and roll < 0.40) or (not stream and roll >= 0.90)
    kind = ("stream" if stream else "plain") + ("-cut" if cut else "")
    reader, writer = await _open(server.url)
    start = time.perf_counter()
    try:
        writer.write(_request_bytes(path, body, server.headers))
        if not stream and cut:                        # hang up while queued / in prefill / generating
            await asyncio.sleep(rng.uniform(0, 0.3))
            return tally.add(kind, "hung-up")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            return tally.fail(kind, f"HTTP {status} {(await reader.read(300))!r}")
        if cut:
            await asyncio.wait_for(reader.readuntil(b"\n\n"), 120)
            with contextlib.suppress(asyncio.IncompleteReadError):
                await asyncio.wait_for(reader.readexactly(rng.randint(0, 3000)), 120)
            return tally.add(kind, "cut")
        rest = await asyncio.wait_for(reader.read(), 300)
        if stream and (b"data: [DONE]" not in rest or b'data: {"error"' in rest):
            return tally.fail(kind, f"stream did not end cleanly: {rest[-300:]!r}")
        if not stream:
            tally.latencies.append(time.perf_counter() - start)
        tally.add(kind, "ok")
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
        tally.fail(kind, f"{type(exc).__name__}: {exc}")
    finally:
        await _close(writer, reset=cut and rng.random() < 0.5)


async def _bad(server: Server, rng: random.Random, tally: Tally, bad: list[bytes]) -> None:
    i = rng.randrange(len(bad))
    reader, writer = await _open(server.url)
    try:
        writer.write(bad[i])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        status = int(head.split(b" ", 2)[1])
        if 400 <= status < 500:
            tally.add("bad", f"{status}")
        else:
            tally.fail("bad", f"request #{i} got HTTP {status}")
    except (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError):
        tally.add("bad", "reset")        # the server closed on an oversized request before we read
    except (OSError, asyncio.TimeoutError) as exc:
        tally.fail("bad", f"request #{i}: {type(exc).__name__}: {exc}")
    finally:
        await _close(writer, reset=True)


# ---- the run -----------------------------------------------------------------------------------------

async def soak(server: Server, seconds: float, concurrency: int, sample_s: float, seed: int) -> dict:
    tally = Tally()
    bad = bad_requests(server.served_name)
    samples: list[dict] = []
    stop_at = time.monotonic() + seconds

    async def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        while time.monotonic() < stop_at and server.alive():
            await one_request(server, rng, tally, bad)

    async def sampler() -> None:
        t0 = time.monotonic()
        while time.monotonic() < stop_at and server.alive():
            with contextlib.suppress(httpx.HTTPError):
                stats = await asyncio.to_thread(server.stats)
                samples.append({"t": round(time.monotonic() - t0, 1), "rss_mb": server.rss_mb(),
                                "running": stats["num_requests_running"],
                                "waiting": stats["num_requests_waiting"],
                                "used_blocks": stats["num_kv_blocks"] - stats["num_free_kv_blocks"]})
            await asyncio.sleep(sample_s)
    await asyncio.gather(sampler(), *(worker(w) for w in range(concurrency)))
    return {"tally": tally, "samples": samples}


def settle(server: Server, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = server.stats()
        if (stats["num_requests_running"] == stats["num_requests_waiting"] == 0
                and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]):
            break
        time.sleep(0.5)
    return stats


def report(result: dict, final: dict, server: Server, seconds: float) -> dict:
    tally: Tally = result["tally"]
    samples = result["samples"]
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    # Growth after warm-up (the first fifth): the KV cache's pages are committed on first touch, and
    # the LRU free list walks through every block before reusing one, so early growth is expected.
    warm = rss[len(rss) // 5:] or rss
    total = sum(tally.counts.values())
    lat = sorted(tally.latencies)
    return {
        "duration_s": round(seconds), "requests": total, "requests_per_s": round(total / seconds, 1),
        "outcomes": {f"{k}/{o}": n for (k, o), n in sorted(tally.counts.items())},
        "unexpected_errors": sum(n for (_, o), n in tally.counts.items() if o == "UNEXPECTED"),
        "unexpected_examples": tally.unexpected[:10],
        "leaked_kv_blocks": final.get("num_kv_blocks", 0) - final.get("num_free_kv_blocks", 0),
        "final_engine_stats": final,
        "rss_mb": {"start": rss[0] if rss else None, "after_warmup": warm[0] if warm else None,
                   "end": rss[-1] if rss else None, "max": max(rss) if rss else None,
                   "growth_after_warmup_mb": round(warm[-1] - warm[0], 1) if warm else None},
        "plain_latency_s": {"p50": round(statistics.median(lat), 3) if lat else None,
                            "p99": round(lat[int(0.99 * (len(lat) - 1))], 3) if lat else None},
        "server_alive": server.alive(),
        "samples": samples,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="soak a running server (no RSS numbers unless --pid)")
    where.add_argument("--model", help="start a server on this model directory")
    where.add_argument("--tiny", action="store_true", help="start a server on a tiny random Llama (default)")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"))
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--device cpu --dtype float32 --num-threads 1 "
                   "--kv-cache-memory-gb 0.05",
                   help="extra flags for the server this script starts (default: %(default)s)")
    p.add_argument("--json", help="write the full report (with samples) here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="specserve-soak-"))
    if args.url:
        server = Server(args.url.rstrip("/"), pid=args.pid, api_key=args.api_key,
                        served_name=args.served_model_name)
    else:
        model = args.model or str(tiny_model(tmp / "tiny-llama"))
        server = start_server(model, args.server_args.split(), tmp / "server.log")
        print(f"server {server.url} (pid {server.proc.pid}), log {tmp / 'server.log'}", flush=True)
    seconds = args.minutes * 60
    try:
        result = asyncio.run(soak(server, seconds, args.concurrency, args.sample_s, args.seed))
        final = settle(server) if server.alive() else {}
        out = report(result, final, server, seconds)
    finally:
        if not args.url:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    summary = {k: v for k, v in out.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    ok = out["leaked_kv_blocks"] == 0 and out["unexpected_errors"] == 0 and out["server_alive"]
    print("SOAK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
