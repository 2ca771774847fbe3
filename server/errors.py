"""Typed errors, mapped once to OpenAI's error shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
import typing

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)


class OpenAIError(Exception):
    status_code = 400
    type = "invalid_request_error"
    code: str | None = None
    headers: dict[str, str] = {}  # extra response headers

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(OpenAIError):
    pass


class ModelNotFound(OpenAIError):
    status_code = 404
    code = "model_not_found"


class EngineUnavailable(OpenAIError):
    status_code = 503
    type = "service_unavailable"


class InternalError(OpenAIError):
    status_code = 500
    type = "internal_error"


class Unauthorized(OpenAIError):
    status_code = 401
    code = "invalid_api_key"
    headers = {"WWW-Authenticate": "Bearer"}

    def __init__(self) -> None:
        super().__init__("missing or incorrect API key; send it as 'Authorization: Bearer <key>'")


class Overloaded(OpenAIError):
    """The queue is full: come back later (HTTP 429 with Retry-After)."""

    status_code = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, max_queue: int, retry_after_s: int) -> None:
        super().__init__(f"the server is busy: {max_queue} requests are already waiting; retry later")
        self.headers = {"Retry-After": str(retry_after_s)}


class RequestTimeout(OpenAIError):
    status_code = 504
    type = "timeout_error"
    code = "request_timeout"


def _validation_param(location: tuple) -> str | None:
    parts = [str(part) for part in location if part != "body"]
    # pydantic names union members (e.g. "str", "list[int]") in the location; keep the field path only
    fields = [part for part in parts if not any(ch in part for ch in "[]") and part not in {"str", "int"}]
    return ".".join(fields) or None


def _not_an_object(request: Request) -> BadRequest:
    """A body that is missing or not a JSON object, named by the fields the route's model requires."""
    endpoint = request.scope.get("endpoint")
    model = typing.get_type_hints(endpoint).get("body") if endpoint is not None else None
    fields = getattr(model, "model_fields", {})
    required = [name for name, info in fields.items() if info.is_required()]
    if not required:
        return BadRequest("the request body must be a JSON object")
    model = " (and model: the served model's id)" if "model" in fields and "model" not in required else ""
    return BadRequest(f"the request body must be a JSON object with {' and '.join(required)}{model}", required[0])


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            return error_response(BadRequest("the request body is not valid JSON", code="invalid_json"))
        if tuple(first.get("loc", ())) == ("body",):  # no body, or not an object: say what it needs
            return error_response(_not_an_object(request))
        param = _validation_param(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid request")
        return error_response(BadRequest(f"{param}: {message}" if param else message, param=param))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = OpenAIError(str(exc.detail))
        error.status_code, error.type = exc.status_code, kind
        return error_response(error)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(InternalError(f"internal error: {type(exc).__name__}"))
