"""A truthful ``/openapi.json``: the statuses, media types and bodies the server really sends.

Contract: ``install_openapi(app)`` replaces FastAPI's generated ``responses`` of every operation with the
ones this server answers: request-validation errors are 400 (FastAPI's 422 never leaves the server, see
``errors.py``), every error body is ``ErrorResponse`` (OpenAI's shape), 401 on ``/v1/*`` (the guard's API key),
413 on bodies (the guard's size limit), 503 where the engine may be loading/overloaded, 500 where a request
can fail inside the engine; generation routes answer ``application/json`` or ``text/event-stream``. Request
bodies keep FastAPI's schemas (from the pydantic models, bounds included). Routes not listed in ``_OK``
(added by other modules) keep FastAPI's success response and get the error statuses by the same rules.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from onecard.sampling_params import INT64_MAX

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}
_JSON_OBJECT = {"type": "object"}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}
# Responses and Messages streams name their events (``event: response.created``) and carry JSON objects of
# several shapes: declared without a schema for the events, so no shape is claimed that some event breaks.
_SSE_EVENTS = {"text/event-stream": {"schema": {}}}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


_MODEL_CARD = {"type": "object", "required": ["id", "object", "created", "owned_by"],
               "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                              "created": {"type": "integer"}, "owned_by": {"type": "string"},
                              "root": {"type": "string"}, "max_model_len": {"type": "integer"}}}
_CHOICES = {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"]}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"]}

# (path, method) -> (description, content) of the success response; None content = an empty body.
_OK: dict[tuple[str, str], tuple[str, dict[str, Any] | None]] = {
    ("/health", "get"): ("The engine is ready (empty body).", None),
    ("/version", "get"): ("The server version.", _json({"type": "object", "required": ["version"],
                                                        "properties": {"version": {"type": "string"}}})),
    ("/metrics", "get"): ("Prometheus text exposition (vLLM's metric names).",
                          {"text/plain": {"schema": {"type": "string"}}}),
    ("/v1/models", "get"): ("The served model names.", _json({
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL_CARD}}})),
    ("/v1/models/{model_id}", "get"): ("One served model.", _json(_MODEL_CARD)),
    ("/v1/chat/completions", "post"): (("A chat.completion, or with stream=true a stream of "
                                        "chat.completion.chunk events ending in [DONE]."), {
        **_json({"type": "object", "required": ["id", "object", "created", "model", "choices"],
                 "properties": {"object": {"const": "chat.completion"}, "choices": _CHOICES, "usage": _USAGE}}),
        **_SSE}),
    ("/v1/completions", "post"): (("A text_completion, or with stream=true a stream of events ending in "
                                   "[DONE]."), {
        **_json({"type": "object", "required": ["id", "object", "created", "model", "choices"],
                 "properties": {"object": {"const": "text_completion"}, "choices": _CHOICES,
                                "usage": _USAGE}}),
        **_SSE}),
    ("/v1/responses", "post"): (("A response object, or with stream=true the Responses event stream "
                                 "(response.created ... response.completed)."), {
        **_json({"type": "object", "required": ["id", "object", "status", "output"],
                 "properties": {"object": {"const": "response"}, "output": {"type": "array"}}}),
        **_SSE_EVENTS}),
    ("/v1/messages", "post"): (("An Anthropic message, or with stream=true Anthropic's event stream "
                                "(message_start ... message_stop)."), {
        **_json({"type": "object", "required": ["id", "type", "role", "content", "usage"],
                 "properties": {"type": {"const": "message"}, "content": {"type": "array"}}}),
        **_SSE_EVENTS}),
    ("/v1/messages/count_tokens", "post"): ("The prompt's token count.", _json({
        "type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}})),
    ("/tokenize", "post"): ("The prompt's token ids.", _json({
        "type": "object", "required": ["count", "max_model_len", "tokens"],
        "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                       "tokens": {"type": "array", "items": {"type": "integer"}},
                       "token_strs": {"type": "array", "items": {"type": "string"}}}})),
    ("/detokenize", "post"): ("The text of the token ids.", _json({
        "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}})),
}

_GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


_ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
_ANTHROPIC_PREFIX = "/v1/messages"      # Anthropic's API: its own error shape, 529 where others send 503


def _error(description: str, path: str = "") -> dict[str, Any]:
    ref = ("#/components/schemas/AnthropicErrorResponse" if path.startswith(_ANTHROPIC_PREFIX)
           else _ERROR_REF["$ref"])
    return {"description": description, "content": _json({"$ref": ref})}


def _responses(path: str, method: str, generated: dict[str, Any], has_body: bool,
               has_params: bool) -> dict[str, Any]:
    ok = _OK.get((path, method))
    if ok is None:
        success = {k: v for k, v in generated.items() if k.startswith("2")}
    else:
        description, content = ok
        success = {"200": {"description": description, **({"content": content} if content else {})}}
    out: dict[str, Any] = dict(success)
    if has_body or has_params or path.startswith("/v1/models/"):
        out["400"] = _error("Invalid request (validation errors included: never 422).", path)
    if path.startswith("/v1"):
        out["401"] = _error("Missing or wrong API key (only when the server has --api-key).", path)
    if has_body or "{" in path or path in _GENERATING:
        out["404"] = _error("The model named in the request is not served.", path)
    if has_body:
        out["413"] = _error("The request body is larger than --max-request-body-bytes.", path)
    if path in _GENERATING or has_body:
        out["500"] = _error("The engine failed this request (e.g. the engine core died).", path)
    if path in _GENERATING or path == "/health":
        out["529" if path.startswith(_ANTHROPIC_PREFIX) else "503"] = _error(
            "The engine is loading, dead, the queue is full (with Retry-After) or the server is shutting down.",
            path)
    return out


def _exact_integers(node: Any) -> None:
    """FastAPI's OpenAPI model holds bounds as floats (2**63 - 1 comes out as 2.0**63): put the integers back,
    so a fuzzer or client reading ``maximum`` gets the bound the server enforces."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("maximum", "minimum", "exclusiveMaximum", "exclusiveMinimum", "default") \
                    and isinstance(value, float) and value.is_integer():
                node[key] = INT64_MAX if value == 2.0**63 else int(value)
            else:
                _exact_integers(value)
    elif isinstance(node, list):
        for item in node:
            _exact_integers(item)


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="onecard: an OpenAI-compatible server with vLLM's flags and behaviour.")
        for path, operations in schema.get("paths", {}).items():
            for method, op in operations.items():
                op["responses"] = _responses(path, method, op.get("responses", {}), "requestBody" in op,
                                             bool(op.get("parameters")))
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        components["ErrorResponse"] = _ERROR_SCHEMA
        components["AnthropicErrorResponse"] = _ANTHROPIC_ERROR_SCHEMA
        _exact_integers(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
