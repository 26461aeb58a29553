"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /v1/speculators, /v1/engine/stats,
/health (liveness), /ready (readiness), /metrics.

The request body classes come from the server's Limits (RequestModels), so the routes are built per
app. (No `from __future__ import annotations` here: FastAPI must see the real body classes.)
With --api-key every /v1 route needs it; /health and /ready need it unless --public-health (the
default), /metrics unless --public-metrics. See SECURITY.md.
"""
import hmac
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from specserve.server.api.chat import ChatServing
from specserve.server.api.completions import CompletionServing
from specserve.server.api.errors import (
    ERROR_RESPONSES,
    GENERATION_RESPONSES,
    PROBE_RESPONSES,
    APIError,
    ProbeStatus,
)
from specserve.server.api.responses import ChatCompletionResponse, CompletionResponse
from specserve.server.api.state import ServerState
from specserve.server.metrics import CONTENT_TYPE


def api_key_check(api_key: str | None) -> Any:
    """Dependency: `Authorization: Bearer <key>` must match (constant-time) when a key is set."""
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "Incorrect or missing API key. Send it as `Authorization: Bearer <key>`.",
                           code="invalid_api_key")
    return check


def build_router(state: ServerState) -> APIRouter:
    CompletionBody = state.models.completion
    ChatBody = state.models.chat
    completions = CompletionServing(state)
    chat = ChatServing(state)
    router = APIRouter()
    auth = [Depends(api_key_check(state.server_config.api_key))]
    lifecycle = state.lifecycle.config
    health_auth = [] if lifecycle.public_health else auth
    metrics_auth = [] if lifecycle.public_metrics else auth

    @router.post("/v1/completions", response_model=CompletionResponse, dependencies=auth,
                 responses=GENERATION_RESPONSES)
    async def create_completion(body: CompletionBody, request: Request) -> Response:
        return await completions.create(body, request)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=auth,
                 responses=GENERATION_RESPONSES)
    async def create_chat_completion(body: ChatBody, request: Request) -> Response:
        return await chat.create(body, request)

    @router.get("/v1/models", dependencies=auth, responses=ERROR_RESPONSES)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @router.get("/v1/models/{model_id:path}", dependencies=auth, responses=ERROR_RESPONSES)
    async def get_model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return _model_card(state)

    @router.get("/v1/speculators", dependencies=auth, responses=ERROR_RESPONSES)
    async def list_speculators() -> dict[str, Any]:
        engine = state.require_engine()
        default = engine.resolve_speculation(None)
        return {"object": "list",
                "default": {"method": default.method, "num_speculative_tokens": default.k,
                            "options": dict(default.options)},
                "data": [{"method": method, "max_num_speculative_tokens": k}
                         for method, k in engine.speculators().items()]}

    @router.get("/v1/engine/stats", dependencies=auth, responses=ERROR_RESPONSES)
    async def engine_stats() -> dict[str, Any]:
        """What is queued and held right now: the numbers a leak check needs (exact, not sampled)."""
        engine = state.require_engine()
        return {"object": "engine.stats", "num_requests_running": engine.num_running,
                "num_requests_waiting": engine.num_waiting, "num_kv_blocks": engine.num_kv_blocks,
                "num_free_kv_blocks": engine.num_free_kv_blocks,
                "admission": {"waiting_requests": state.admission.num_requests,
                              "waiting_prompt_tokens": state.admission.num_tokens,
                              "rejected": state.admission.num_rejected},
                "http_requests_in_flight": state.lifecycle.in_flight,
                "draining": state.lifecycle.draining}

    @router.get("/health", dependencies=health_auth, response_model=ProbeStatus, responses=PROBE_RESPONSES)
    async def health() -> JSONResponse:
        """Liveness: 200 while the engine is loaded and alive (draining included)."""
        status, code = _probe(state)
        if code == 200 or status == "draining":
            return JSONResponse({"status": "draining" if status == "draining" else "ok",
                                 "model": state.engine.model_name})
        return JSONResponse(_probe_body(state, status), status_code=503)

    @router.get("/ready", dependencies=health_auth, response_model=ProbeStatus, responses=PROBE_RESPONSES)
    async def ready() -> JSONResponse:
        """Readiness: 200 only when new requests are welcome (not loading, draining or failed)."""
        status, code = _probe(state)
        return JSONResponse(_probe_body(state, status), status_code=code)

    @router.get("/metrics", dependencies=metrics_auth, response_class=PlainTextResponse,
                responses={code: ERROR_RESPONSES[code] for code in (400, 401, 413, 431)})
    async def metrics() -> Response:
        engine = state.engine
        if engine is not None and state.status == "ready":
            # The engine records these once per step; after the last step's aborts free their blocks
            # no step follows, so refresh them here or an idle server would show stale usage.
            state.metrics.set_queue_sizes(engine.num_running, engine.num_waiting)
            used = 1.0 - engine.num_free_kv_blocks / engine.num_kv_blocks
            state.metrics.kv_cache_usage.labels(state.metrics.model_name).set(used)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return router


def _probe(state: ServerState) -> tuple[str, int]:
    if state.engine_dead is not None:
        return "unhealthy", 503
    if state.status != "ready":
        return state.status, 503
    if state.lifecycle.draining:
        return "draining", 503
    return "ready", 200


def _probe_body(state: ServerState, status: str) -> dict[str, Any]:
    body: dict[str, Any] = {"status": status}
    dead = state.engine_dead
    if dead is not None:
        body["error"] = f"{type(dead).__name__}: {dead}"
    elif state.error:
        body["error"] = state.error
    return body


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.require_engine()
    return {"id": engine.model_name, "object": "model", "created": state.created, "owned_by": "specserve",
            "root": state.engine_config.model or engine.model_name, "parent": None,
            "max_model_len": engine.max_model_len, "speculators": engine.speculators(),
            "structured_outputs": _structured_card(state)}


def _structured_card(state: ServerState) -> dict[str, Any]:
    """What structured outputs and tool calls this server takes (README: Structured outputs)."""
    cfg = state.engine_config
    return {"response_format": ["text", "json_object", "json_schema"],
            "structured_outputs": ["json", "regex", "choice", "grammar", "json_object"],
            "tool_choice": ["none", "auto", "required", "function"], "tool_call_parser": cfg.tool_call_parser,
            "backend": "llguidance", "max_grammar_bytes": cfg.max_grammar_bytes,
            "grammar_compile_timeout_s": cfg.grammar_compile_timeout,
            "speculation": "exact with every method: drafts are verified under the grammar's mask"}
