"""Logprobs formatting: the engine's TokenLogprob values in OpenAI's two wire formats.

Legacy completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, where each
top_logprobs entry maps token string -> logprob and always includes the sampled token (so up to
logprobs + 1 entries, as OpenAI documents); echoed prompt tokens come first, the first one with
null logprob and null top_logprobs. text_offset is the character offset of each token in the
choice's text (prompt text included when echoing), continuing across stream chunks.

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.

Logprobs that are -inf (a token outside top-k/top-p) are sent as -9999.0: JSON has no infinity.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from specserve.sampling.outputs import TokenLogprob
from specserve.server.api.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class CompletionLogprobsFormatter:
    """Builds legacy-format logprobs for one choice, chunk by chunk (keeps the running text offset)."""

    def __init__(self, tokenizer: Any, num_top: int) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.offset = 0

    def prompt(self, token_ids: Sequence[int],
               entries: Sequence[TokenLogprob | None] | None) -> CompletionLogprobs:
        """Echoed prompt tokens; entries[i] is None where there is no logprob (the first token)."""
        out = CompletionLogprobs()
        for i, token_id in enumerate(token_ids):
            entry = entries[i] if entries is not None and i < len(entries) else None
            self._append(out, token_id, entry)
        return out

    def output(self, entries: Sequence[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in entries:
            self._append(out, entry.token_id, entry)
        return out

    def _append(self, out: CompletionLogprobs, token_id: int, entry: TokenLogprob | None) -> None:
        token = self.tokenizer.token_str(token_id)
        out.tokens.append(token)
        out.text_offset.append(self.offset)
        self.offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            return
        out.token_logprobs.append(_finite(entry.logprob))
        top: dict[str, float] = {}
        for alt_id, alt_logprob in entry.top[: self.num_top]:
            top.setdefault(self.tokenizer.token_str(alt_id), _finite(alt_logprob))
        # the sampled token's own entry wins a text collision (two ids decoding to the same string, e.g. two
        # partial UTF-8 bytes shown as U+FFFD): top_logprobs[i][tokens[i]] is always token_logprobs[i]
        top[token] = _finite(entry.logprob)
        out.top_logprobs.append(top)


def merge(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    if a is None:
        return b
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob], num_top: int) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = tokenizer.token_str(entry.token_id)
        top = [_top(tokenizer, alt_id, alt_logprob) for alt_id, alt_logprob in entry.top[:num_top]]
        content.append(ChatTokenLogprob(token=token, logprob=_finite(entry.logprob),
                                        bytes=_bytes(tokenizer, entry.token_id, token), top_logprobs=top))
    return ChatLogprobs(content=content)


def _top(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    token = tokenizer.token_str(token_id)
    return TopLogprob(token=token, logprob=_finite(logprob), bytes=_bytes(tokenizer, token_id, token))


def _bytes(tokenizer: Any, token_id: int, token: str) -> list[int]:
    """The token's raw bytes (a byte-level BPE token may be part of a UTF-8 character)."""
    raw = getattr(tokenizer, "token_bytes", None)
    return raw(token_id) if raw is not None else list(token.encode("utf-8", errors="replace"))
