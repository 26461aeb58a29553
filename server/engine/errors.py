"""Errors the engine raises for bad requests (the HTTP layer maps them to 4xx)."""


class ContextLengthError(ValueError):
    """prompt + max_tokens exceeds the model's context (HTTP 400, code context_length_exceeded)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests get 500 and /health reports unhealthy."""
