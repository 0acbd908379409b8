"""The one place that maps errors to HTTP responses, in OpenAI's shape (as vLLM >= 0.10.1 sends them).

Contract: route code raises ``APIError`` (or a subclass: ``BadRequest``, ``NotFound``, ``Unauthorized``,
``ServiceUnavailable``); ``install_error_handlers(app)`` turns those, FastAPI's request-validation errors
(422 → 400), engine rejections (``EngineRequestError``, status from the engine), a dead engine
(``EngineDeadError``: 500 naming the cause, as vLLM), a loading one (503), ``ValueError`` from parameter
validation (400) and anything else (500, no traceback in the body) into
``{"error": {"message", "type", "param", "code"}}``, or Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` under /v1/messages (``error_response_for`` picks by path; 503 becomes 529 there). Every 503
carries ``Retry-After``; Starlette's own errors keep their headers (405's ``Allow``). ``error_body`` /
``anthropic_error_body`` build the same dicts for SSE streams.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from onecard.frontend.async_engine import EngineDeadError, EngineNotReadyError, EngineRequestError

logger = logging.getLogger(__name__)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 405: "MethodNotAllowed", 413: "RequestTooLargeError",
          422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
          501: "NotImplementedError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    status = 400

    def __init__(self, message: str, param: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status


class BadRequest(APIError):
    status = 400


class Unauthorized(APIError):
    status = 401


class NotFound(APIError):
    status = 404


class ServiceUnavailable(APIError):
    status = 503


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"), "param": param,
                      "code": status}}


RETRY_AFTER_S = 1     # what a 503 asks clients to wait: the queue bound answers at once, so retry soon


def error_response(message: str, status: int, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if status == 503:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers or None)


# Anthropic's Messages API answers in its own shape: {"type": "error", "error": {"type", "message"}}, and
# says "overloaded" with 529 where OpenAI-style APIs send 503.
ANTHROPIC_PATH_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    529: "overloaded_error"}


def anthropic_error_body(message: str, status: int) -> tuple[dict[str, Any], int]:
    """(body, status) in Anthropic's shape; 503 becomes 529 overloaded_error, other statuses keep theirs."""
    if status == 503:
        status = 529
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}, status


def error_response_for(path: str, message: str, status: int, param: str | None = None,
                       headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the shape of the API that ``path`` belongs to (Anthropic's under /v1/messages)."""
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        headers = dict(headers or {})
        if status == 503:
            headers.setdefault("Retry-After", str(RETRY_AFTER_S))
        body, status = anthropic_error_body(message, status)
        return JSONResponse(body, status_code=status, headers=headers or None)
    return error_response(message, status, param, headers)


def model_not_found(name: str) -> NotFound:
    return NotFound(f"The model `{name}` does not exist.", param="model")


def to_api_error(exc: BaseException) -> APIError:
    """Any exception → the APIError a client sees (logs internal faults with their traceback)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineRequestError):
        return APIError(exc.message, status=exc.status)
    if isinstance(exc, EngineDeadError):
        return APIError(f"EngineDeadError: the engine core died, so this request failed ({exc}). The server "
                        "is exiting so that it can be restarted.", status=500)
    if isinstance(exc, EngineNotReadyError):
        return ServiceUnavailable(f"the engine is not ready: {exc}")
    if isinstance(exc, ValueError):
        return BadRequest(str(exc), param=getattr(exc, "param", None))   # e.g. ConstraintError names its field
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError("Internal server error; see the server log.", status=500)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg", "invalid value"))
        parts.append(f"{where}: {msg}" if where else msg)
    n = len(errors)
    head = f"{n} validation error{'s' if n != 1 else ''} for request"
    return head + ": " + "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response_for(request.url.path, message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response_for(request.url.path, str(exc.detail), exc.status_code, headers=exc.headers)

    async def _mapped(request: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc)
        return error_response_for(request.url.path, err.message, err.status, err.param)

    # Known types are handled inside the app; the bare Exception handler runs in Starlette's outermost
    # middleware (which also logs the traceback) and answers 500 without one.
    for exc_type in (APIError, EngineRequestError, EngineDeadError, EngineNotReadyError, ValueError, Exception):
        app.add_exception_handler(exc_type, _mapped)
