"""ServerState: what the routes share (engine once loaded, configs, limits, metrics)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from server.api.errors import APIError
from server.api.limits import Limits
from server.api.protocol import RequestModels
from server.config import EngineConfig, ServerConfig
from server.metrics import Metrics


@dataclass
class ServerState:
    engine_config: EngineConfig
    server_config: ServerConfig
    limits: Limits
    models: RequestModels
    metrics: Metrics
    engine: Any | None = None          # server.engine.async_engine.AsyncEngine once loaded
    status: str = "loading"               # loading | ready | failed
    error: str | None = None           # why loading failed
    created: int = field(default_factory=lambda: int(time.time()))

    def require_engine(self) -> Any:
        if self.engine is None or self.status != "ready":
            reason = f": {self.error}" if self.error else ""
            raise APIError(503, f"the model is not ready ({self.status}{reason}); retry later")
        return self.engine

    def check_model(self, name: str | None) -> None:
        """OpenAI clients always send `model`; it must be the served name (absent = the served model)."""
        engine = self.require_engine()
        if name is not None and name != engine.model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves "
                           f"`{engine.model_name}`.", param="model", code="model_not_found")
