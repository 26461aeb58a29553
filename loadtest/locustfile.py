"""Locust load for people who prefer it: `locust -f loadtest/locustfile.py --host http://127.0.0.1:8000`.

Uses the same request builder as loadtest.serve. Settings via env: SPEC_METHOD, SPEC_K, PROMPT_SET,
MAX_TOKENS, TEMPERATURE, MODEL.
"""
from __future__ import annotations

import os
import random
from types import SimpleNamespace

from locust import HttpUser, between, task

from loadtest.prompt_sets import load_prompt_set
from loadtest.request_builder import build_request
from loadtest.sse_client import raw_body

ARGS = SimpleNamespace(method=os.environ.get("SPEC_METHOD"), k=int(os.environ.get("SPEC_K", "4")),
                       max_tokens=int(os.environ.get("MAX_TOKENS", "128")),
                       temperature=float(os.environ.get("TEMPERATURE", "0")), ignore_eos=False)
ROWS = load_prompt_set(os.environ.get("PROMPT_SET", "code_completion"))


class CompletionUser(HttpUser):
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        self.model = os.environ.get("MODEL") or self.client.get("/v1/models").json()["data"][0]["id"]

    @task
    def complete(self) -> None:
        body = raw_body(build_request(self.model, random.choice(ROWS), ARGS, stream=False))   # extensions inline
        self.client.post("/v1/completions", json=body, name="/v1/completions")
