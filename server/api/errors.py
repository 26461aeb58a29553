"""OpenAI error bodies and the exception handlers that make every failure one.

Body: {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}.
Bad input is a 4xx that says what to change; only our own bugs are a 500 (and are logged).
"""
from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("specserve.api")

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "invalid_request_error",
                   404: "invalid_request_error", 405: "invalid_request_error",
                   413: "invalid_request_error", 431: "invalid_request_error",
                   429: "rate_limit_error", 503: "service_unavailable"}

# Parts of a pydantic error location that name a union member or a validator, not a field.
_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|tuple|set|literal)(\[.*\])?$"
                  r"|^(constrained|function|json-or-python|lax|strict|tagged-union|nullable)-"
                  r"|^\[key\]$|\[")


class APIError(Exception):
    """An error with an HTTP status that the handlers turn into the OpenAI body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    # Messages may quote user input; input with lone surrogates must not make the error unsendable.
    return {"error": {"message": printable(message), "type": type,
                      "param": printable(param) if param is not None else None, "code": code}}


def printable(text: str) -> str:
    """`text` as valid UTF-8: lone surrogates (which json.loads lets through) become `\\udxxx`."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers or err.headers)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the field path in `param`.

    Example: [{"loc": ("body", "messages", 0, "role"), "msg": "Input should be 'user' ..."}]
      -> 400, param "messages.0.role", message "messages.0.role: Input should be 'user' ..."
    """
    if not errors:
        return bad_request("invalid request")
    invalid_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if invalid_json is not None:
        detail = (invalid_json.get("ctx") or {}).get("error", "")
        return bad_request(f"request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    # A union (prompt, stop, ...) reports errors for every member. The member whose type matched says
    # what is really wrong: prefer errors that are not type mismatches ("at most 64 items" over "not
    # a string"), then the deepest location ("stop.0: at most 256 characters" over "stop: ...").
    first = min(errors, key=lambda e: (_is_type_error(e), -len(e.get("loc", ()))))
    param = _param(first.get("loc", ()))
    messages = [_clean(e.get("msg", "")) for e in errors if _param(e.get("loc", ())) == param
                and _is_type_error(e) == _is_type_error(first)]
    distinct = list(dict.fromkeys(messages))
    text = " or ".join(distinct[:4])
    if param is None:
        return bad_request(f"request body: {text}")
    return bad_request(text if text.startswith(param) else f"{param}: {text}", param=param)


def _param(loc: Any) -> str | None:
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _TAG.search(p))]
    return ".".join(parts) or None


def _is_type_error(error: dict[str, Any]) -> bool:
    kind = str(error.get("type", ""))
    return kind.endswith(("_type", "_parsing")) or kind in ("literal_error", "missing", "union_tag_invalid")


def _clean(msg: str) -> str:
    return msg.removeprefix("Value error, ")


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _request_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(list(exc.errors())))


async def _http_exception(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    err = APIError(exc.status_code, message)
    if exc.status_code == 400 and exc.__cause__ is not None:      # FastAPI could not parse the body
        err = bad_request(f"request body is not valid JSON: {_parse_failure(exc.__cause__)}",
                          code="invalid_json")
    return error_response(err, headers=getattr(exc, "headers", None))


def _parse_failure(cause: BaseException) -> str:
    """Why json.loads failed, in words (the body itself is never echoed)."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"it is not UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset {cause.start}); "
                "send UTF-8 encoded JSON")
    if isinstance(cause, RecursionError):
        return "it is nested too deeply"
    return str(cause)[:200] or type(cause).__name__


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"internal server error ({type(exc).__name__})", type="server_error")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body (documentation: what every non-2xx answer of /v1 carries)."""
    error: ErrorDetail


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# What the routes may answer besides their 200, for the OpenAPI schema (and so for schemathesis).
# RequestGuard may answer 400 (bad Content-Length), 413, 431 and, on /v1 while draining, 503 anywhere.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _err("Invalid request: the message and `param` say what to change"),
    401: _err("Missing or wrong API key"),
    404: _err("Unknown model or route"),
    413: _err("Request body larger than --max-body-bytes"),
    431: _err("Request headers larger than --max-header-bytes"),
    500: _err("The engine failed"),
    503: _err("Loading or shutting down"),
}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The response; with `stream: true` server-sent events of chunks",
          "content": {"text/event-stream": {"schema": {
              "type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE]"}}}}}},
    **ERROR_RESPONSES,
    429: _err("Too much work waiting (--max-waiting-requests / --max-waiting-tokens); see Retry-After"),
}


class ProbeStatus(BaseModel):
    """/health and /ready: `status` is ok/ready/draining/loading/failed/unhealthy."""
    status: str
    model: str | None = None
    error: str | None = None


PROBE_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": ProbeStatus, "description": "Not live (/health) or not ready (/ready)"},
    **{code: ERROR_RESPONSES[code] for code in (400, 401, 413, 431)},
}


def without_422(app: FastAPI) -> None:
    """Drop FastAPI's default 422 answers from the schema: validation errors here are 400s."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    if isinstance(operation, dict):
                        operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    """Handlers for the errors we expect. Anything else is caught by server/api/guard.py, which
    answers 500 without re-raising: Starlette's own catch-all re-raises after answering, and uvicorn
    then drops the keep-alive connection under the client's next request."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
