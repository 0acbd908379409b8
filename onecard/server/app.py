"""The FastAPI application: routes, API-key check, start-up in the background.

Contract: ``build_app(state)`` returns the app for one ``ServerState`` (settings, the AsyncEngine, the
tokenizer, metrics). Its lifespan starts loading the engine in the background and returns at once, so
``/health`` answers 503 while loading and 200 once ready; a start-up failure is logged and reported to
``state.on_fatal`` (the CLI exits 1). On shutdown the engine core is stopped. Routes: GET /health, /version,
/metrics, /v1/models, /v1/models/{id}; POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize.
With ``api_key`` set every /v1/* route needs ``Authorization: Bearer <key>`` (401 otherwise).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import onecard
from onecard.frontend.async_engine import AsyncEngine
from onecard.frontend.tokenizer import encode_prompt, render_chat
from onecard.server import serving_chat, serving_completion
from onecard.server.errors import error_response, install_error_handlers, model_not_found
from onecard.server.metrics import ServerMetrics
from onecard.server.openai_types import DetokenizeRequest, TokenizeRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str]
    model_root: str                       # --model as given (the `root` of model cards)
    max_model_len: int
    api_key: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    chat_template: str | None = None      # resolved template text (--chat-template), None = tokenizer's
    default_sampling: dict[str, Any] = field(default_factory=dict)   # from generation_config.json


@dataclass(slots=True)
class ServerState:
    settings: ServerSettings
    engine: AsyncEngine
    tokenizer: Any
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    on_fatal: Callable[[str], None] | None = None
    started_at: float = field(default_factory=time.perf_counter)
    _start_task: asyncio.Task | None = None

    def model_name(self, requested: str | None) -> str:
        """The served name a request addressed (None → the first); unknown names are a 404."""
        names = self.settings.served_model_names
        if requested is None or requested == "":
            return names[0]
        if requested in names:
            return requested
        raise model_not_found(requested)


def log_engine_info(state: ServerState) -> None:
    info = state.engine.info
    s = state.settings
    if info is None:
        return
    logger.info(
        "onecard ready: model=%s served as %s; dtype=%s, quantization=%s, device=%s; weights %.2f GiB; "
        "KV cache %s (%d B/token) %.2f GiB = %d tokens (%d blocks of %d), max concurrency at max-model-len %d: "
        "%.2fx; engine load %.1f s, ready in %.1f s", s.model_root, ", ".join(s.served_model_names), info.dtype,
        info.quantization or "none", info.device, info.weights_bytes / 2**30, info.kv_cache_dtype,
        info.kv_bytes_per_token, info.kv_cache_bytes / 2**30, info.kv_capacity_tokens, info.num_gpu_blocks, info.block_size, s.max_model_len,
        info.max_concurrency_at_max_len, info.load_seconds, time.perf_counter() - state.started_at)


async def _start_engine(state: ServerState) -> None:
    try:
        await state.engine.start()
    except Exception as e:  # noqa: BLE001 - a failed start-up ends the server with the reason
        logger.error("engine start-up failed: %s", e)
        if state.on_fatal is not None:
            state.on_fatal(str(e))
        return
    log_engine_info(state)


class _APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass through."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            auth = dict(scope.get("headers") or []).get(b"authorization")
            if auth != self.expected:
                response = error_response("Unauthorized: a valid API key is required.", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state._start_task = asyncio.create_task(_start_engine(state), name="onecard-engine-start")
        try:
            yield
        finally:
            if not state._start_task.done():
                state._start_task.cancel()
            await state.engine.shutdown()

    app = FastAPI(title="onecard", version=onecard.__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.onecard = state
    install_error_handlers(app)

    if state.settings.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=state.settings.api_key)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.ready:
            return Response(status_code=200)
        if state.engine.error:
            return error_response(f"the engine failed: {state.engine.error}", 503)
        return error_response("the model is loading", 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": onecard.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, ctype = state.metrics.render()
        return Response(content=body, media_type=ctype)

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "onecard",
                "root": state.settings.model_root, "parent": None, "max_model_len": state.settings.max_model_len,
                "permission": [{"id": f"modelperm-{name}", "object": "model_permission", "created": state.created,
                                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                "organization": "*", "group": None, "is_blocking": False}]}

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card(n) for n in state.settings.served_model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        return JSONResponse(card(state.model_name(model_id)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: serving_chat.ChatCompletionRequest, request: Request) -> Response:
        return await serving_chat.create_chat_completion(state, body, request)

    @app.post("/v1/completions")
    async def completions(body: serving_completion.CompletionRequest, request: Request) -> Response:
        return await serving_completion.create_completion(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        state.model_name(body.model)   # 404 for an unknown model, as elsewhere
        if body.messages is not None:
            text = render_chat(state.tokenizer, [m.model_dump(exclude_none=True) for m in body.messages],
                               tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               chat_template=state.settings.chat_template,
                               chat_template_kwargs=body.chat_template_kwargs)
            ids = encode_prompt(state.tokenizer, text, add_special_tokens=False)
        else:
            ids = encode_prompt(state.tokenizer, body.prompt or "", add_special_tokens=body.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.settings.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        state.model_name(body.model)
        vocab = len(state.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            return error_response(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab}).", 400, "tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})

    return app
