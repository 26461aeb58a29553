"""The server default (`--speculation`) is checked at start-up like a request's `speculation` field."""
from __future__ import annotations

import pytest

from specserve.server.config import EngineConfig, parse_speculation
from specserve.server.engine.builder import build_engine


def engine_config(tiny_model_dir, speculation: str) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), kv_cache_memory_gb=0.05, num_threads=1,
                        speculation=parse_speculation(speculation))


@pytest.mark.parametrize("speculation,message", [
    ('{"method": "draft"}', r"'draft' is not loaded on this server \(draft needs --draft-model"),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "'eagle3' is not loaded"),
    ('{"method": "hybrid"}', "'hybrid' is not loaded"),
    ('{"method": "prediction"}', "cannot be the default"),
    ('{"method": "ngram", "prompt_lookup_min": 0}', "prompt_lookup_min must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 9}', "k must be in"),
])
def test_a_default_the_engine_cannot_serve_fails_the_start(tiny_model_dir, speculation, message):
    with pytest.raises(ValueError, match=message):
        build_engine(engine_config(tiny_model_dir, speculation))


def test_a_loaded_default_builds_and_serves(tiny_model_dir):
    engine, _ = build_engine(engine_config(tiny_model_dir, '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert "ngram" in engine.spec.methods
