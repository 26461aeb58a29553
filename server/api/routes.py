"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /v1/speculators, /health, /metrics.

The request body classes come from the server's Limits (RequestModels), so the routes are built per
app. (No `from __future__ import annotations` here: FastAPI must see the real body classes.)
"""
import hmac
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from server.api.chat import ChatServing
from server.api.completions import CompletionServing
from server.api.errors import APIError
from server.api.responses import ChatCompletionResponse, CompletionResponse
from server.api.state import ServerState
from server.metrics import CONTENT_TYPE


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

    @router.post("/v1/completions", response_model=CompletionResponse, dependencies=auth)
    async def create_completion(body: CompletionBody, request: Request) -> Response:
        return await completions.create(body, request)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=auth)
    async def create_chat_completion(body: ChatBody, request: Request) -> Response:
        return await chat.create(body, request)

    @router.get("/v1/models", dependencies=auth)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @router.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return _model_card(state)

    @router.get("/v1/speculators", dependencies=auth)
    async def list_speculators() -> dict[str, Any]:
        engine = state.require_engine()
        default = engine.resolve_speculation(None)
        return {"object": "list",
                "default": {"method": default.method, "num_speculative_tokens": default.k,
                            "options": dict(default.options)},
                "data": [{"method": method, "max_num_speculative_tokens": k}
                         for method, k in engine.speculators().items()]}

    @router.get("/health")
    async def health() -> JSONResponse:
        dead = getattr(state.engine, "dead", None) if state.engine is not None else None
        if dead is not None:
            return JSONResponse({"status": "unhealthy", "error": str(dead)}, status_code=503)
        if state.status != "ready":
            body = {"status": state.status, **({"error": state.error} if state.error else {})}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "model": state.engine.model_name})

    @router.get("/metrics")
    async def metrics() -> Response:
        if state.engine is not None and state.status == "ready":
            state.metrics.set_queue_sizes(state.engine.num_running, state.engine.num_waiting)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return router


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.require_engine()
    return {"id": engine.model_name, "object": "model", "created": state.created, "owned_by": "specserve",
            "root": state.engine_config.model or engine.model_name, "parent": None,
            "max_model_len": engine.max_model_len, "speculators": engine.speculators()}
