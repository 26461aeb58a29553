"""The grammar library in use: llguidance (guidance-ai), behind backend.py's interface.

Why llguidance: its wheel depends on nothing (xgrammar's pulls triton and apache-tvm-ffi into a CPU
install), it reads tokenizer.json itself (no transformers import), it compiles lazily (a JSON schema
takes well under a millisecond to compile; the token trie walk happens per mask) and bounds the work
of every mask step with fuel limits, and it takes JSON Schema, regular expressions, Lark and GBNF.

Its matcher never raises on user input: a grammar error leaves it in an error state, read here once
after construction and turned into GrammarError.
"""
from __future__ import annotations

import json
from pathlib import Path

import llguidance
import numpy as np

from specserve.grammar.backend import GrammarError

# JSON as json.dumps writes it (", " and ": ", no other whitespace): with free whitespace a weak model can
# spend its whole budget on blanks between tokens; a schema's own "x-guidance" options still override this.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar_text(kind: str, value: str) -> str:
    """The llguidance grammar for one StructuredSpec, or GrammarError when the input is malformed."""
    try:
        if kind == "json":
            schema = json.loads(value)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            choices = json.loads(value)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise GrammarError("choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", choices)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", value)   # GBNF / EBNF, or Lark
    except GrammarError:
        raise
    except (ValueError, TypeError) as exc:    # json.JSONDecodeError is a ValueError
        raise GrammarError(f"invalid {kind}: {exc}") from exc
    raise GrammarError(f"unknown constraint kind {kind!r}")


class LLGuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fill_mask(self, bitmask: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def valid_prefix(self, tokens: list[int]) -> int:
        return self._m.validate_tokens(tokens) if tokens else 0

    def consume(self, tokens: list[int]) -> None:
        if tokens and not self._m.consume_tokens(tokens):
            raise RuntimeError(f"grammar matcher refused accepted tokens: {self._m.get_error()}")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar matcher could not roll back {num_tokens}: {self._m.get_error()}")

    @property
    def is_finished(self) -> bool:
        return self._m.is_stopped()


class LLGuidanceGrammar:
    def __init__(self, pristine: llguidance.LLMatcher) -> None:
        self._pristine = pristine      # never advanced: each request gets a copy

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._pristine.deep_copy())


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        path = Path(tokenizer_dir) / "tokenizer.json"
        # n_vocab = the model's vocabulary (it may pad past the tokenizer's): padding ids are never allowed.
        self.tokenizer = llguidance.LLTokenizer(str(path), n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    def compile(self, kind: str, value: str) -> LLGuidanceGrammar:
        text = _grammar_text(kind, value)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {kind}: {_first_line(matcher.get_error())}")
        return LLGuidanceGrammar(matcher)


def _first_line(message: str) -> str:
    """llguidance's errors carry a caret diagram over several lines; the first line names the problem."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return " ".join(lines[:3])[:500] if lines else "rejected by the grammar compiler"
