"""Limits: the configurable caps on what one request may ask for and on how much may wait.

They bound what one request may ask for, so that no single request can take the server down
(huge n, thousands of stop strings, a giant logit_bias, a 100 MB body, a megabyte of headers), and
how much work may queue up, so that a flood cannot starve the requests already admitted. The models
in protocol.py are built from one Limits value, so the per-field caps appear in the OpenAPI schema
and in validation at once; the transport caps are enforced by server/api/guard.py and the queue
bounds by server/api/admission.py. Every field has a CLI flag (server/cli.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    max_n: int = 16                 # choices per request (n, best_of)
    max_logprobs: int = 20          # completions `logprobs`, chat `top_logprobs`
    max_stop: int = 16              # stop strings (and stop_token_ids) per request
    max_stop_len: int = 256         # characters per stop string
    max_logit_bias: int = 1024      # logit_bias entries
    max_prompts: int = 64           # prompts in one completions request (list of strings / of id lists)
    max_messages: int = 1024        # chat messages in one request
    # transport: checked before the body is parsed (413 / 431)
    max_body_bytes: int = 4 * MIB   # request body; a 128k-token prompt as text or ids is < 1 MiB
    max_header_bytes: int = 16384   # all request headers together (names + values)
    # admission: engine requests admitted but without their first token yet (429 beyond)
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1048576     # their prompt tokens
    request_timeout: float | None = None  # seconds from arrival to the last token; None = no limit

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "request_timeout":
                if value is not None and not (isinstance(value, (int, float)) and 0 < value <= 86400):
                    raise ValueError(f"request_timeout must be in (0, 86400] seconds, got {value!r}")
                continue
            low = {"max_logprobs": 0, "max_body_bytes": 1024, "max_header_bytes": 1024}.get(f.name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{f.name} must be an integer >= {low}, got {value!r}")
