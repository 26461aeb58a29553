"""Limits: the configurable caps the request schemas declare (CLI flags --max-n, --max-logprobs, ...).

They bound what one request may ask for, so that no single request can take the server down
(huge n, thousands of stop strings, a giant logit_bias). The models in protocol.py are built from
one Limits value, so the caps appear in the OpenAPI schema and in validation at once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_n: int = 16                 # choices per request (n, best_of)
    max_logprobs: int = 20          # completions `logprobs`, chat `top_logprobs`
    max_stop: int = 16              # stop strings (and stop_token_ids) per request
    max_stop_len: int = 256         # characters per stop string
    max_logit_bias: int = 1024      # logit_bias entries
    max_prompts: int = 64           # prompts in one completions request (list of strings / of id lists)
    max_messages: int = 1024        # chat messages in one request

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "max_logprobs" else 1
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{f.name} must be an integer >= {low}, got {value!r}")
