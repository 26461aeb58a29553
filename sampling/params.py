"""SamplingParams: what one request asked the sampler for. Validated once, at the HTTP edge's request."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

_INT64_MAX = 2**63 - 1
# Temperatures below this are decoded greedily: the scaled distribution is one-hot up to float
# rounding, and dividing by ~0 would overflow float32 logits to inf (softmax -> NaN). The one rule
# for "greedy" everywhere (sampler, drafters, goodput policy, engine).
GREEDY_TEMPERATURE = 1e-5

# What a structured-output constraint may be (specserve/grammar compiles it): a JSON schema, any JSON
# object, a regular expression, one of a list of strings, or a context-free grammar (GBNF/EBNF or Lark).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on the output text. `value`: the schema as JSON text (json), the regex, the choices
    as a JSON list of strings (choice), the grammar text (grammar); "" for json_object."""
    kind: str
    value: str = ""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # < GREEDY_TEMPERATURE (0 in practice) = greedy
    top_p: float = 1.0                # (0, 1]
    top_k: int = 0                    # 0 or -1 = off
    min_p: float = 0.0                # [0, 1]
    presence_penalty: float = 0.0     # [-2, 2]
    frequency_penalty: float = 0.0    # [-2, 2]
    repetition_penalty: float = 1.0   # (0, 2], 1 = off; applies to prompt + output tokens
    logit_bias: dict[int, float] | None = None   # token id -> added logit, [-100, 100]
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # None = off; N >= 0 = sampled token + top-N alternatives
    include_stop_str_in_output: bool = False
    structured: StructuredSpec | None = None   # output constrained by a grammar (None = free text)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def coupled(self) -> bool:
        """Sampled with a seed: every decision is a Gumbel-max over noise keyed by position (coupled.py)."""
        return self.seed is not None and not self.greedy

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a message a user can act on."""
        def finite(name: str, v: float) -> None:
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed <= _INT64_MAX:
            raise ValueError("seed must fit in a signed 64-bit integer")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        ids = list(self.stop_token_ids) + list((self.logit_bias or {}).keys())
        if vocab_size is not None:
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        for tok, bias in (self.logit_bias or {}).items():
            finite(f"logit_bias[{tok}]", bias)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
