"""loadtest's streaming client (loadtest/sse_client.py) against the real server, beside the official one."""
import asyncio
import json

import aiohttp
import pytest

from loadtest import serve
from loadtest.sse_client import raw_body, stream_completion


def test_raw_body_merges_extra_body_like_the_openai_client():
    body = {"model": "m", "prompt": "x", "stream": True, "extra_body": {"ignore_eos": True, "speculation": {"k": 1}}}
    assert raw_body(body) == {"model": "m", "prompt": "x", "stream": True, "ignore_eos": True,
                              "speculation": {"k": 1}}
    assert raw_body({"model": "m"}) == {"model": "m"}


def test_both_clients_measure_the_same_requests(server_url, tmp_path):
    """Greedy requests through aiohttp and through the openai package: same completions, same token counts,
    the same drafts counted by the server (k fixed: the goodput policy's cuts depend on step timings), and a
    TTFT and ITL per request from the chunks each saw."""
    res = {}
    for client in ("aiohttp", "openai"):
        out = tmp_path / f"{client}.json"
        serve.main(["--url", server_url, "--method", "ngram", "--k", "2", "--concurrency", "2", "--num-prompts", "6",
                    "--max-tokens", "16", "--fixed-k", "--quiet", "--client", client, "--output-json", str(out)])
        (res[client],) = json.loads(out.read_text())
    for r in res.values():
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
    assert res["aiohttp"]["client"] == "aiohttp" and res["openai"]["client"] == "openai"
    assert res["aiohttp"]["total_output_tokens"] == res["openai"]["total_output_tokens"] > 0
    assert res["aiohttp"]["speculation"]["ngram"]["draft_tokens"] > 0
    assert res["aiohttp"]["speculation"] == res["openai"]["speculation"]      # greedy: the same drafts


async def _one(url: str, body: dict):
    async with aiohttp.ClientSession() as session:
        return await stream_completion(session, f"{url}/v1/completions", body, {})


def test_stream_counts_chunks_and_usage(server_url):
    body = {"model": "m", "prompt": "def add(a, b):", "max_tokens": 9, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
    model = asyncio.run(_models(server_url))
    rec = asyncio.run(_one(server_url, dict(body, model=model)))
    assert rec.ok and rec.error == ""
    assert rec.output_tokens == 9 and rec.prompt_tokens > 0
    # plain decoding: one chunk per token, so 8 gaps after the first; E2EL covers them all
    assert len(rec.itl) == 8 and rec.e2el == pytest.approx(rec.ttft + sum(rec.itl))


def test_refused_request_is_a_failure_with_the_servers_message(server_url):
    model = asyncio.run(_models(server_url))
    body = {"model": model, "prompt": "x", "max_tokens": 4, "stream": True,
            "extra_body": {"speculation": {"method": "no-such-method", "num_speculative_tokens": 2}}}
    rec = asyncio.run(_one(server_url, body))
    assert not rec.ok and rec.error.startswith("HTTP 400: ") and "no-such-method" in rec.error


def test_unreachable_server_is_a_failure_not_an_exception():
    from loadtest.server_proc import free_port
    rec = asyncio.run(_one(f"http://127.0.0.1:{free_port()}", {"model": "m", "prompt": "x", "stream": True}))
    assert not rec.ok and "ClientConnectorError" in rec.error


async def _models(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]
