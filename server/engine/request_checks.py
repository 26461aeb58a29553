"""What a request must satisfy before the engine takes it, from four numbers of the engine's shape.

Kept apart from Engine so that a front end whose engine steps in another process (process_engine.py)
refuses a bad request at once, with the same error and message, without asking the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from specserve.sampling.params import SamplingParams
from specserve.server.engine.errors import ContextLengthError


@dataclass(frozen=True)
class RequestChecks:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError / ContextLengthError (HTTP 400) for a request this engine can never serve."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        params.validate(vocab)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{len(prompt_token_ids)} prompt tokens and max_tokens={params.max_tokens} "
                f"({total} in total). Shorten the prompt or lower max_tokens.")
        need = -(-total // self.block_size)
        if need > self.num_blocks:
            raise ContextLengthError(
                f"the request needs {total} tokens of KV cache but the server's cache holds "
                f"{self.num_blocks * self.block_size}; lower max_tokens or raise --kv-cache-memory-gb")
