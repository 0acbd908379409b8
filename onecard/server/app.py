"""The FastAPI application: routes, the request guard, start-up in the background, the engine watchdog.

Contract: ``build_app(state)`` returns the app for one ``ServerState`` (settings, the AsyncEngine, the
tokenizer, metrics). Its lifespan starts loading the engine in the background and returns at once, so
``/health`` answers 503 while loading and 200 once ready; a start-up failure is logged and reported to
``state.on_fatal`` (the CLI exits 1). When the engine dies later, in-flight requests fail (500 / an error
event naming it), ``/health`` answers 503 and, ``ENGINE_DEAD_EXIT_DELAY_S`` later (so probes see the 503),
``state.on_fatal`` ends the server with a non-zero status. ``state.end_in_flight(why)`` fails every request
still running (shutdown deadline: streams end with an error event and [DONE]). On shutdown the engine core is
stopped. Routes: GET /health, /version, /metrics, /v1/models, /v1/models/{id}, /openapi.json; POST
/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens, /tokenize,
/detokenize. Every route sits behind ``guard.RequestGuard`` (API key on /v1/*, as ``Authorization: Bearer``
or ``x-api-key``; body-size limit, disconnect abort, access log). Templating and tokenizing run in
``state.executor`` (``run_blocking``), never on the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import onecard
from onecard.config import ServerConfig
from onecard.frontend.async_engine import AsyncEngine, EngineRequestError
from onecard.frontend.grammar import GrammarService, StructuredOutputsConfig
from onecard.frontend.tokenizer import encode_prompt, render_chat
from onecard.server import serving_chat, serving_completion, serving_messages, serving_responses
from onecard.server.errors import error_response, install_error_handlers, model_not_found
from onecard.server.guard import RequestGuard
from onecard.server.metrics import ServerMetrics
from onecard.server.openai_types import DetokenizeRequest, TokenizeRequest
from onecard.server.openapi import install_openapi

ENGINE_DEAD_EXIT_DELAY_S = 1.5   # between the engine's death and the server's exit: probes see /health 503
LOG_STATS_INTERVAL_S = 10.0      # the periodic throughput line (vLLM's VLLM_LOG_STATS_INTERVAL)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerSettings:
    """What the routes read: the server's options as the one option table declares them (``options``:
    ``config.ServerConfig``, with ``api_threads`` resolved) and what start-up derives from the engine config
    (launch.settings_from). No server option is declared again here."""

    options: ServerConfig
    served_model_names: list[str]
    model_root: str                       # --model as given (the `root` of model cards)
    max_model_len: int
    chat_template: str | None = None      # resolved template text (--chat-template), None = tokenizer's
    default_sampling: dict[str, Any] = field(default_factory=dict)   # from generation_config.json
    # parsed from options.structured_outputs_config / guided_decoding_backend
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)


@dataclass(slots=True)
class ServerState:
    settings: ServerSettings
    engine: AsyncEngine
    tokenizer: Any
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    grammar: GrammarService | None = None     # structured outputs: compiles constraints (frontend/grammar.py)
    on_fatal: Callable[[str], None] | None = None
    started_at: float = field(default_factory=time.perf_counter)
    executor: ThreadPoolExecutor | None = None
    _start_task: asyncio.Task | None = None

    async def run_blocking(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run CPU work (templating, tokenizing) on the text threads, keeping the event loop free."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=self.settings.options.api_threads,
                                               thread_name_prefix="onecard-text")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def end_in_flight(self, why: str) -> None:
        """Fail every request still running with a 503 (streams get an error event and [DONE])."""
        self.engine.fail_all(EngineRequestError(why, 503))

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


def _on_engine_dead(state: ServerState, why: str) -> None:
    logger.error("the engine core died (%s): in-flight requests failed, /health answers 503; the server exits "
                 "in %.1f s with status 1 so that it can be restarted", why, ENGINE_DEAD_EXIT_DELAY_S)
    if state.on_fatal is not None:
        asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_DELAY_S, state.on_fatal,
                                              f"the engine core died: {why}")


async def _log_stats(state: ServerState) -> None:
    while True:
        await asyncio.sleep(LOG_STATS_INTERVAL_S)
        if state.engine.ready:
            line = state.metrics.throughput_line()
            if line is not None:
                logger.info("%s", line)


class _HTTPMetricsMiddleware:
    """Counts every response by method, status class and route template (not the raw path: bounded labels)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            route = scope.get("route")
            self.metrics.on_http(scope["method"], status, getattr(route, "path", "none"))


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.on_dead.append(lambda why: _on_engine_dead(state, why))
        state._start_task = asyncio.create_task(_start_engine(state), name="onecard-engine-start")
        if state.grammar is not None:
            state.grammar.warm()
        stats_task = asyncio.create_task(_log_stats(state)) if not state.settings.options.disable_log_stats else None
        try:
            yield
        finally:
            for task in (state._start_task, stats_task):
                if task is not None and not task.done():
                    task.cancel()
            await state.engine.shutdown()
            if state.executor is not None:
                state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="onecard", version=onecard.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.onecard = state
    install_error_handlers(app)
    app.add_middleware(RequestGuard, options=state.settings.options)
    app.add_middleware(_HTTPMetricsMiddleware, metrics=state.metrics)   # outermost: 401s are counted too

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

    @app.post("/v1/responses")
    async def responses(body: serving_responses.ResponsesRequest, request: Request) -> Response:
        return await serving_responses.create_response(state, body, request)

    @app.post("/v1/messages")
    async def messages(body: serving_messages.MessagesRequest, request: Request) -> Response:
        return await serving_messages.create_message(state, body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: serving_messages.CountTokensRequest, request: Request) -> Response:
        return await serving_messages.count_tokens(state, body, request)

    def _tokenize(body: TokenizeRequest) -> dict[str, Any]:
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
        return out

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        state.model_name(body.model)   # 404 for an unknown model, as elsewhere
        return JSONResponse(await state.run_blocking(_tokenize, body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        state.model_name(body.model)
        vocab = len(state.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            return error_response(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab}).", 400, "tokens")
        return JSONResponse({"prompt": await state.run_blocking(state.tokenizer.decode, body.tokens)})

    install_openapi(app)
    return app
