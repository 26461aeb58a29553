"""The FastAPI app factory and its lifespan.

The model loads in a worker thread after the server starts listening, so `/health` answers 503
("loading") until the engine is ready, then 200. A load failure marks the server failed (503 with the
reason) and calls `on_fatal` (the CLI uses it to exit non-zero instead of serving nothing forever).
Every request first passes RequestGuard (header and body caps, drain, catch-all 500); `drain()` is
what SIGTERM runs (server/api/lifecycle.py, server/api/http_server.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from specserve.server.api.errors import APIError, install_error_handlers, without_422
from specserve.server.api.guard import RequestGuard
from specserve.server.api.lifecycle import Lifecycle, LifecycleConfig
from specserve.server.api.limits import Limits
from specserve.server.api.protocol import RequestModels
from specserve.server.api.routes import build_router
from specserve.server.api.state import ServerState
from specserve.server.config import EngineConfig, ServerConfig
from specserve.server.heap import freeze_startup_objects
from specserve.server.metrics import Metrics, instrument_app

logger = logging.getLogger("specserve.api")

EngineFactory = Callable[..., Any]        # (EngineConfig, on_step=...) -> AsyncEngine


def _load_engine(cfg: EngineConfig, on_step: Callable[..., None]) -> Any:
    if cfg.engine_process:
        from specserve.server.engine.process_engine import ProcessEngine
        return ProcessEngine.from_config(cfg, on_step=on_step)
    from specserve.server.engine.async_engine import AsyncEngine
    return AsyncEngine.from_config(cfg, on_step=on_step)


def create_app(engine_config: EngineConfig, server_config: ServerConfig | None = None,
               limits: Limits | None = None, *, engine: Any = None,
               engine_factory: EngineFactory | None = None,
               on_fatal: Callable[[BaseException], None] | None = None,
               lifecycle: LifecycleConfig | None = None) -> FastAPI:
    """Build the app. Pass `engine` to serve an already-built AsyncEngine (the caller then owns it);
    otherwise the lifespan builds one from `engine_config` and shuts it down at exit."""
    server_config = server_config or ServerConfig()
    limits = limits or Limits()
    limits.validate()
    lifecycle = lifecycle or LifecycleConfig()
    lifecycle.validate()
    state = ServerState(engine_config, server_config, limits, RequestModels.build(limits),
                        Metrics(compat=server_config.metrics_compat),
                        Lifecycle(lifecycle))
    if engine is not None:
        _ready(state, engine)
    factory = engine_factory or _load_engine

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader = None if engine is not None else asyncio.create_task(_load(state, factory, on_fatal))
        try:
            yield
        finally:
            if loader is not None:
                loader.cancel()
                if state.engine is not None:
                    await state.engine.shutdown()

    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible inference server with per-request speculative decoding")
    app.state.specserve = state
    install_error_handlers(app)
    without_422(app)
    app.add_middleware(RequestGuard, state=state)     # added first: the HTTP metrics see its answers
    instrument_app(app, state.metrics)
    app.include_router(build_router(state))
    return app


async def drain(app: FastAPI) -> bool:
    """Stop admitting, let in-flight requests finish up to --drain-timeout, fail the rest (503)."""
    state: ServerState = app.state.specserve

    def cut() -> None:
        if state.engine is not None:
            state.engine.fail_all(lambda: APIError(
                503, "The server shut down before this request finished; retry it.",
                code="server_shutting_down"))
    return await state.lifecycle.drain(cut)


async def _load(state: ServerState, factory: EngineFactory,
                on_fatal: Callable[[BaseException], None] | None) -> None:
    try:
        engine = await asyncio.to_thread(factory, state.engine_config, on_step=state.metrics.on_step)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("loading the model failed")
        state.status, state.error = "failed", f"{type(exc).__name__}: {exc}"
        if on_fatal is not None:
            on_fatal(exc)
        return
    freeze_startup_objects()
    _ready(state, engine)
    logger.info("serving %s (max_model_len %d; speculators %s)", engine.model_name,
                engine.max_model_len, engine.speculators())
    print(ready_banner(state, engine), flush=True)


def ready_banner(state: ServerState, engine: Any) -> str:
    """What a person starting the server needs once it is ready: where, which model, which default
    speculation, and one request to paste."""
    cfg = state.server_config
    url = f"http://{cfg.host}:{cfg.port}"
    spec = engine.resolve_speculation(None)
    default = "none" if spec.k == 0 else f"{spec.method}, k = {spec.num_speculative_tokens}"
    auth = ' -H "Authorization: Bearer $SPECSERVE_API_KEY"' if cfg.api_key else ""
    body = json.dumps({"model": engine.model_name, "prompt": "def fibonacci(n):", "max_tokens": 64})
    return (f"specserve ready at {url}/v1 | model {engine.model_name} | default speculation: {default} | "
            f"loaded: {', '.join(engine.speculators())}\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'")


def _ready(state: ServerState, engine: Any) -> None:
    state.metrics.set_model_name(engine.model_name, engine.speculators())
    state.engine = engine
    state.status = "ready"
