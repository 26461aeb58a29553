"""Serving benchmark over the OpenAI streaming API (works against any OpenAI-compatible server).

  python -m loadtest.serve --url http://127.0.0.1:8000 --method ngram --k 4 --concurrency 1,4,16 \
      --num-prompts 64 [--request-rate 4] [--goodput ttft:500 tpot:50] [--output-json out.json]

Fixed concurrency by default; with --request-rate, arrivals are Poisson at that rate (capped by the
concurrency). The client is aiohttp reading the SSE lines itself (loadtest/sse_client.py: a quarter of the
official client's CPU per chunk, which on a small machine is CPU the server does not get); `--client openai`
sends the same requests through the official `openai` package instead. Reports TTFT, TPOT, ITL, E2EL
(mean/p50/p90/p99, ms), request and output-token
throughput, goodput, failures, and acceptance per method from the server's /metrics before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time

import httpx

from loadtest.prompt_sets import load_prompt_set
from loadtest.request_builder import build_request
from loadtest.serve_metrics import (
    RequestRecord,
    parse_spec_counters,
    spec_delta,
    summarize,
)
from loadtest.sse_client import stream_completion


async def openai_request(client, body: dict) -> RequestRecord:
    """The same measurement through the official client (`--client openai`)."""
    t0 = time.perf_counter()
    rec = RequestRecord(ok=False)
    try:
        stream = await client.completions.create(**body)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                rec.output_tokens = chunk.usage.completion_tokens
                rec.prompt_tokens = chunk.usage.prompt_tokens
            if chunk.choices and chunk.choices[0].text:
                rec.content_at(t0, now)
        rec.close(t0, time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - a benchmark records failures, it does not stop
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    return rec


async def run_level(args, send, prompts: list[dict], concurrency: int, model: str) -> tuple[list, float]:
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(args.seed)
    done = 0
    total = len(prompts)

    async def task(i: int, prompt: dict) -> RequestRecord:
        nonlocal done
        async with sem:
            rec = await send(build_request(model, prompt, args))
        done += 1
        if not args.quiet:
            bar = "#" * (30 * done // total)
            print(f"\r  c={concurrency:<3} [{bar:<30}] {done}/{total}", end="", file=sys.stderr, flush=True)
        return rec

    t0 = time.perf_counter()
    tasks = []
    for i, p in enumerate(prompts):
        tasks.append(asyncio.create_task(task(i, p)))
        if args.request_rate:
            await asyncio.sleep(rng.expovariate(args.request_rate))
    records = await asyncio.gather(*tasks)
    if not args.quiet:
        print(file=sys.stderr)
    return records, time.perf_counter() - t0


def print_table(results: list[dict]) -> None:
    cols = [
        "concurrency",
        "completed",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "ITL p50",
        "ITL p99",
        "E2EL p50",
        "accept len",
    ]
    print(" | ".join(f"{c:>10}" for c in cols))
    for r in results:
        spec = r["speculation"]
        acc = ", ".join(f"{m}:{v['mean_acceptance_length']:.2f}" for m, v in spec.items()) or "-"
        row = [
            r["concurrency"],
            r["completed"],
            r["failed"],
            f"{r['request_throughput']:.2f}",
            f"{r['output_throughput']:.1f}",
            f"{r['ttft_ms']['p50']:.0f}",
            f"{r['ttft_ms']['p99']:.0f}",
            f"{r['tpot_ms']['p50']:.1f}",
            f"{r['itl_ms']['p50']:.1f}",
            f"{r['itl_ms']['p99']:.1f}",
            f"{r['e2el_ms']['p50']:.0f}",
            acc,
        ]
        print(" | ".join(f"{c!s:>10}" for c in row))


async def amain(args) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with (
        httpx.AsyncClient(base_url=args.url, headers=headers, timeout=30) as http,
        _sender(args, headers) as send,
    ):
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        prompts = load_prompt_set(args.prompt_set, args.num_prompts, args.seed)
        results = []
        for c in args.concurrency:
            before = parse_spec_counters((await http.get("/metrics")).text)
            records, duration = await run_level(args, send, prompts, c, model)
            after = parse_spec_counters((await http.get("/metrics")).text)
            res = {
                "concurrency": c,
                "method": args.method,
                "k": args.k,
                "model": model,
                "prompt_set": args.prompt_set,
                "temperature": args.temperature,
                "client": getattr(args, "client", "aiohttp"),
                **summarize(records, duration, args.goodput),
                "speculation": spec_delta(before, after),
            }
            results.append(res)
    return results


@contextlib.asynccontextmanager
async def _sender(args, headers: dict[str, str]):
    """An async `send(body) -> RequestRecord` on one connection pool, for the chosen client."""
    if getattr(args, "client", "aiohttp") == "openai":
        import openai

        client = openai.AsyncOpenAI(
            base_url=f"{args.url}/v1", api_key=args.api_key or "none", max_retries=0, timeout=args.timeout
        )
        try:
            yield lambda body: openai_request(client, body)
        finally:
            await client.close()
        return
    import aiohttp

    url = f"{args.url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # no connection cap below the concurrency: aiohttp's default of 100 would queue requests silently
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        yield lambda body: stream_completion(session, url, body, headers)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first id in /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument(
        "--method",
        default=None,
        help="speculation method (omit: server default; "
        "'off' sends no speculation field, for servers that do not know it)",
    )
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--fixed-k", action="store_true",
                    help='send "adaptive": false: the server drafts every k, whatever its goodput policy')
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    ap.add_argument("--prompt-set", default="code_completion")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/specserve extension)")
    ap.add_argument("--goodput", nargs="*", default=[], help="SLOs like ttft:500 tpot:50 e2el:5000 (ms)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument(
        "--client",
        choices=["aiohttp", "openai"],
        default="aiohttp",
        help="aiohttp with a hand-rolled SSE reader (default, light), or the official openai client",
    )
    args = ap.parse_args(argv)
    args.goodput = {k: float(v) for k, v in (s.split(":") for s in args.goodput)}
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    results = asyncio.run(amain(args))
    print_table(results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
