"""The benchmark's default client: one streaming completions request over aiohttp, SSE parsed by hand.

Why not the official `openai` client here: it turns every chunk into pydantic objects, and on a small
machine the client's CPU is taken from the server it measures. Measured on a 2-core VM (128-token greedy
requests at concurrency 1, client CPU per output token): openai 1.33-1.36 ms, httpx line reader
0.40-0.51 ms, aiohttp 0.28 ms. vLLM's `bench serve` reads the stream the same way (aiohttp, `data:` lines,
json.loads). `loadtest.serve --client openai` keeps the official client for checking compatibility.

The stream is OpenAI's: `data: {json}` events, blank-line separated, ending with `data: [DONE]`; an error
after the stream started arrives as `data: {"error": {...}}`. A request that carries `extra_body` (the
openai client's way to send extensions) has it merged into the JSON body, as that client would.
"""
from __future__ import annotations

import json
import time
from typing import Any

from loadtest.serve_metrics import RequestRecord


def raw_body(body: dict[str, Any]) -> dict[str, Any]:
    """The JSON an OpenAI client would send for `body`: extra_body merged in, nothing else changed."""
    out = {k: v for k, v in body.items() if k != "extra_body"}
    out.update(body.get("extra_body") or {})
    return out


def _error_text(payload: Any) -> str:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(payload)[:200]


async def stream_completion(http, url: str, body: dict[str, Any], headers: dict[str, str]) -> RequestRecord:
    """POST url with body (stream=True) on an aiohttp ClientSession `http`; times every content chunk.

    TTFT / ITL / E2EL as loadtest.serve_metrics defines them: a chunk counts when its first choice
    carries text; output tokens come from the final usage chunk (stream_options.include_usage).
    """
    rec = RequestRecord(ok=False)
    t0 = time.perf_counter()
    try:
        async with http.post(url, json=raw_body(body), headers=headers) as resp:
            if resp.status != 200:
                text = await resp.text()
                try:
                    detail = _error_text(json.loads(text))
                except ValueError:
                    detail = text[:200]
                rec.error = f"HTTP {resp.status}: {detail}"[:200]
                return rec
            async for raw in resp.content:          # one SSE line per iteration
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = _error_text(chunk)[:200]
                    return rec
                usage = chunk.get("usage")
                if usage:
                    rec.output_tokens = usage.get("completion_tokens", 0)
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                choices = chunk.get("choices")
                if choices and choices[0].get("text"):
                    rec.content_at(t0, now)
        rec.close(t0, time.perf_counter())
    except Exception as exc:   # noqa: BLE001 - a benchmark records failures, it does not stop
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    return rec
