"""specserve: an OpenAI-compatible inference server with per-request speculative decoding.

The public offline entry point is `specserve.LLM` (specserve/llm.py); the HTTP server is
`specserve serve` (specserve.server.cli). Names resolve lazily so `import specserve` stays cheap.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "specserve.llm",
    "Completion": "specserve.server.engine.offline",
    "SamplingParams": "specserve.sampling.params",
    "SpecParams": "specserve.speculators.base",
    "EngineConfig": "specserve.server.config",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specserve' has no attribute {name!r}")
    return getattr(import_module(module), name)
