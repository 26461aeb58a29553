"""ServerState: what the routes share (engine once loaded, configs, limits, metrics, admission, lifecycle)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specserve.server.api.admission import Admission
from specserve.server.api.errors import APIError
from specserve.server.api.lifecycle import Lifecycle, LifecycleConfig
from specserve.server.api.limits import Limits
from specserve.server.api.protocol import RequestModels
from specserve.server.config import EngineConfig, ServerConfig
from specserve.server.metrics import Metrics


@dataclass
class ServerState:
    engine_config: EngineConfig
    server_config: ServerConfig
    limits: Limits
    models: RequestModels
    metrics: Metrics
    lifecycle: Lifecycle = field(default_factory=lambda: Lifecycle(LifecycleConfig()))
    admission: Admission | None = None
    engine: Any | None = None          # specserve.server.engine.async_engine.AsyncEngine once loaded
    status: str = "loading"               # loading | ready | failed
    error: str | None = None           # why loading failed
    created: int = field(default_factory=lambda: int(time.time()))
    _max_token_chars: int | None = None

    def __post_init__(self) -> None:
        if self.admission is None:
            self.admission = Admission(self.limits)

    @property
    def engine_dead(self) -> BaseException | None:
        return getattr(self.engine, "dead", None) if self.engine is not None else None

    def require_engine(self) -> Any:
        if self.engine is None or self.status != "ready":
            reason = f": {self.error}" if self.error else ""
            raise APIError(503, f"the model is not ready ({self.status}{reason}); retry later")
        dead = self.engine_dead
        if dead is not None:
            raise APIError(500, f"the engine has failed ({type(dead).__name__}: {dead}); this server "
                           "must be restarted", type="server_error", code="engine_dead")
        return self.engine

    def check_model(self, name: str | None) -> None:
        """OpenAI clients always send `model`; it must be the served name (absent = the served model)."""
        engine = self.require_engine()
        if name is not None and name != engine.model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves "
                           f"`{engine.model_name}`.", param="model", code="model_not_found")

    def max_prompt_chars(self, engine: Any) -> int:
        """Characters past which a text cannot fit the context whatever it says (no token is longer
        than the longest vocabulary entry), so it is refused before the tokenizer spends time on it
        (tokenizers holds the GIL: a megabyte of text stalls every request for seconds)."""
        if self._max_token_chars is None:
            tok = engine.tokenizer
            pieces = tok.convert_ids_to_tokens(list(range(tok.vocab_size)))
            self._max_token_chars = max((len(p) for p in pieces if p), default=64)
        return engine.max_model_len * self._max_token_chars
