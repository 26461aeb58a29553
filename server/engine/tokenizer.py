"""Tokenizer facade over transformers' AutoTokenizer (fast tokenizers only; no remote code)."""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False, use_fast=True)
        eos = set()
        if self._tok.eos_token_id is not None:
            eos.add(int(self._tok.eos_token_id))
        self.eos_token_ids: list[int] = sorted(eos)
        self.vocab_size = len(self._tok)
        self._special_ids = set(self._tok.all_special_ids)
        # token id -> its raw bytes, for logprobs' `bytes` and token strings; built lazily
        self._byte_decoder: dict[str, int] | None = None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_str(self, token_id: int) -> str:
        """Human-readable text of one token (partial UTF-8 shows as U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """Raw bytes of one token (byte-level BPE), for the chat logprobs `bytes` field."""
        tok = self._tok.convert_ids_to_tokens(token_id)
        if tok is None:
            return []
        if self._byte_decoder is None:
            self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        if all(c in self._byte_decoder for c in tok):
            return [self._byte_decoder[c] for c in tok]
        return list(tok.encode("utf-8"))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-unicode table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table
