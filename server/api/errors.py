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
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("specserve.api")

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "invalid_request_error",
                   404: "invalid_request_error", 405: "invalid_request_error",
                   413: "invalid_request_error", 429: "rate_limit_error",
                   503: "service_unavailable"}

# Parts of a pydantic error location that name a union member or a validator, not a field.
_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|tuple|set|literal)(\[.*\])?$"
                  r"|^(constrained|function|json-or-python|lax|strict|tagged-union|nullable)-"
                  r"|^\[key\]$|\[")


class APIError(Exception):
    """An error with an HTTP status that the handlers turn into the OpenAI body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the field path in `param`.

    Example: [{"loc": ("body", "messages", 0, "role"), "msg": "Input should be 'user' ..."}]
      -> 400, param "messages.0.role", message "messages.0.role: Input should be 'user' ..."
    """
    if not errors:
        return bad_request("invalid request")
    # The deepest location is the most specific one: for a union like `stop: str | list[str]`
    # it is the member that matched the type ("stop.0: at most 256 characters"), not "stop: not a str".
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    param = _param(first.get("loc", ()))
    # A union (prompt, stop, ...) reports one error per member: say them together.
    messages = [_clean(e.get("msg", "")) for e in errors if _param(e.get("loc", ())) == param]
    distinct = list(dict.fromkeys(messages))
    text = " or ".join(distinct[:4])
    if param is None:
        return bad_request(f"request body: {text}")
    return bad_request(text if text.startswith(param) else f"{param}: {text}", param=param)


def _param(loc: Any) -> str | None:
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _TAG.search(p))]
    return ".".join(parts) or None


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
    return error_response(err, headers=getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, f"internal server error ({type(exc).__name__})",
                                   type="server_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected)
