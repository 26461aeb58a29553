"""The interface a grammar library sits behind: compile a constraint once, match tokens per request.

Everything above this file speaks only these two types, so another library (e.g. xgrammar, whose
GrammarMatcher also accepts, rolls back and fills a 32-bit bitmask) can replace the one in use by
implementing them.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class GrammarError(ValueError):
    """The constraint cannot be used (invalid schema, regex or grammar; over a limit): an HTTP 400."""


class Matcher(Protocol):
    """One request's position in a grammar. Tokens are target vocabulary ids."""

    def fill_mask(self, bitmask: np.ndarray) -> None:
        """Write the allowed next tokens into `bitmask` ([ceil(vocab / 32)] int32, bit t of word t // 32)."""

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts from here (nothing is consumed)."""

    def consume(self, tokens: list[int]) -> None:
        """Advance over tokens that valid_prefix accepted."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed tokens."""

    @property
    def is_finished(self) -> bool:
        """The constraint is complete and admits no more tokens (the request ends here)."""


class CompiledGrammar(Protocol):
    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start (cheap: the compiled grammar is shared)."""


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, kind: str, value: str) -> CompiledGrammar:
        """Compile one constraint (StructuredSpec.kind/value); GrammarError when it cannot be used."""
