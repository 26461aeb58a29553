"""p99 latency of normal requests while a flood of bad requests runs, as a ratio to the p99 without it.

Phases alternate (quiet, flood, quiet, flood, ...) so drift on a shared machine hits both sides alike.
In every phase --clients loops send normal non-streamed completions (max_tokens --max-tokens); in
flood phases a separate process (so the flood does not slow this process's own event loop, which
times the normal requests) runs --flood-clients loops that send bad requests from loadtest/soak.py's
list (malformed JSON, out-of-range numbers, context overflow, lone surrogates, huge headers, a 100 MB
Content-Length, ...) as fast as the server answers them. Every bad request must get a 4xx.

  python -m loadtest.flood_latency --tiny --phase-s 20 --rounds 2
  make flood ARGS="--url http://127.0.0.1:8000"
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from loadtest.soak import (
    Server,
    _close,
    _open,
    _request_bytes,
    bad_requests,
    start_server,
    tiny_model,
)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def _normal(server: Server, stop_at: float, max_tokens: int, out: list[float], errors: Counter) -> None:
    body = {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    if server.served_name:
        body["model"] = server.served_name
    payload = _request_bytes("/v1/completions", body, server.headers)
    while time.monotonic() < stop_at:
        start = time.perf_counter()
        reader, writer = await _open(server.url)
        try:
            writer.write(payload)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
            await reader.read()
            status = int(head.split(b" ", 2)[1])
            if status == 200:
                out.append(time.perf_counter() - start)
            else:
                errors[f"normal HTTP {status}"] += 1
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            errors[f"normal {type(exc).__name__}"] += 1
        finally:
            await _close(writer, reset=False)


async def _flood(server: Server, stop_at: float, bad: list[bytes], seed: int, statuses: Counter,
                 interval: float = 0.0) -> None:
    rng = random.Random(seed)
    next_at = time.monotonic()
    while time.monotonic() < stop_at:
        if interval:                        # paced: one request per `interval` seconds per client
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        reader, writer = await _open(server.url)
        try:
            writer.write(bad[rng.randrange(len(bad))])
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            statuses[int(head.split(b" ", 2)[1])] += 1
        except (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError):
            statuses["reset"] += 1
        except (OSError, asyncio.TimeoutError) as exc:
            statuses[type(exc).__name__] += 1
        finally:
            await _close(writer, reset=True)


def _flood_process(url: str, served_name: str | None, seconds: float, clients: int, rate: float, seed: int,
                   results: multiprocessing.Queue) -> None:
    server = Server(url, served_name=served_name)
    bad = bad_requests(served_name)
    statuses: Counter = Counter()
    interval = clients / rate if rate else 0.0

    async def run() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_flood(server, stop_at, bad, seed + i, statuses, interval)
                               for i in range(clients)))
    asyncio.run(run())
    results.put(dict(statuses))


def phase(server: Server, seconds: float, clients: int, flood_clients: int, max_tokens: int,
          seed: int, rate: float = 0.0) -> tuple[list[float], Counter, Counter]:
    latencies: list[float] = []
    errors: Counter = Counter()
    results: multiprocessing.Queue = multiprocessing.Queue()
    flood = None
    if flood_clients:
        flood = multiprocessing.Process(target=_flood_process, args=(
            server.url, server.served_name, seconds, flood_clients, rate, seed, results))
        flood.start()

    async def run() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_normal(server, stop_at, max_tokens, latencies, errors) for _ in range(clients)))
    asyncio.run(run())
    statuses: Counter = Counter()
    if flood is not None:
        statuses.update({int(k) if str(k).isdigit() else k: v for k, v in results.get(timeout=120).items()})
        flood.join(30)
    return latencies, errors, statuses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.flood_latency", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url")
    where.add_argument("--model")
    where.add_argument("--tiny", action="store_true", help="a tiny random Llama (default)")
    p.add_argument("--api-key")
    p.add_argument("--served-model-name")
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--flood-clients", type=int, default=8)
    p.add_argument("--flood-rate", type=float, default=0.0,
                   help="bad requests per second in all (default: 0 = as fast as they are answered)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--server-args", default="--device cpu --dtype float32 --num-threads 1 "
                   "--kv-cache-memory-gb 0.05")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="specserve-flood-"))
    if args.url:
        server = Server(args.url.rstrip("/"), api_key=args.api_key, served_name=args.served_model_name)
    else:
        server = start_server(args.model or str(tiny_model(tmp / "tiny-llama")), args.server_args.split(),
                              tmp / "server.log")
    quiet: list[float] = []
    flood: list[float] = []
    errors: Counter = Counter()
    statuses: Counter = Counter()
    try:
        phase(server, 3, args.clients, 0, args.max_tokens, 0)                        # warm-up
        for r in range(args.rounds):
            for flooding in (False, True):
                lat, err, st = phase(server, args.phase_s, args.clients,
                                     args.flood_clients if flooding else 0, args.max_tokens, r,
                                     args.flood_rate)
                (flood if flooding else quiet).extend(lat)
                errors.update(err)
                statuses.update(st)
                print(f"round {r} {'flood' if flooding else 'quiet'}: {len(lat)} normal requests, "
                      f"p50 {statistics.median(lat):.3f}s p99 {p99(lat):.3f}s; bad answered {sum(st.values())}",
                      flush=True)
    finally:
        if not args.url:
            with contextlib.suppress(Exception):
                server.stop()
    non_4xx = {k: v for k, v in statuses.items() if not (isinstance(k, int) and 400 <= k < 500) and k != "reset"}
    out = {"flood_rate_limit": args.flood_rate or "unlimited",
           "normal_requests": {"quiet": len(quiet), "flood": len(flood)},
           "p50_s": {"quiet": round(statistics.median(quiet), 4), "flood": round(statistics.median(flood), 4)},
           "p99_s": {"quiet": round(p99(quiet), 4), "flood": round(p99(flood), 4)},
           "p99_ratio_flood_over_quiet": round(p99(flood) / p99(quiet), 3),
           "bad_requests_answered": {str(k): v for k, v in sorted(statuses.items(), key=str)},
           "bad_requests_per_s": round(sum(statuses.values()) / (args.phase_s * args.rounds), 1),
           "normal_request_errors": dict(errors), "bad_requests_not_4xx": non_4xx}
    print(json.dumps(out, indent=2))
    return 0 if not errors and not non_4xx else 1


if __name__ == "__main__":
    sys.exit(main())
