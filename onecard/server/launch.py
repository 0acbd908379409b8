"""Wiring: engine config + flags → tokenizer, core client, AsyncEngine, app, uvicorn server.

Contract: ``make_state(engine_config, core, settings=None, tokenizer=None)`` builds a ``ServerState`` around any
``CoreClient`` (the real one, or a scripted one in tests); ``settings_from(engine_config, options=None, **overrides)``
builds ``ServerSettings`` from the server's options (``config.ServerConfig``, the one option table; ``overrides``
are its field names, e.g. ``api_key="k"``) and the engine config. ``prepare_server(engine_config, server_config)``
does the same and returns a ``Server`` whose ``run()`` blocks until SIGTERM/SIGINT (then: stop accepting, let
in-flight requests finish within ``--shutdown-timeout``; at the deadline the ones still running end with an
error (streams: an error event and [DONE]) and the server stops the engine) and returns the exit status: 0
after a signal, 1 when the engine failed to start or died while serving (the watchdog).
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import time
from typing import Any

from onecard.config import EngineConfig, ServerConfig, default_api_threads
from onecard.frontend.async_engine import AsyncEngine
from onecard.frontend.core_client import CoreClient
from onecard.frontend.grammar import GrammarService, StructuredOutputsConfig
from onecard.frontend.tokenizer import resolve_chat_template
from onecard.server.app import ServerSettings, ServerState, build_app
from onecard.server.metrics import ServerMetrics
from onecard.vocab import load_tokenizer

logger = logging.getLogger(__name__)

_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# Beyond --shutdown-timeout, the requests still running are failed (error event + [DONE]); uvicorn gets this
# much longer to send those endings before it cancels what is left.
SHUTDOWN_FLUSH_S = 5.0


def settings_from(engine_config: EngineConfig, options: ServerConfig | None = None,
                  **overrides: Any) -> ServerSettings:
    """``options`` (default: every server option at its default) with ``overrides`` (``ServerConfig`` field
    names; an unknown one is a TypeError), ``api_threads`` resolved (the flag, else ONECARD_API_THREADS, else
    ``default_api_threads``), plus what the engine config settles: served names, context length, chat
    template, the checkpoint's sampling defaults."""
    m = engine_config.model
    gen = m.generation_config or {}
    env = engine_config.env
    options = dataclasses.replace(options or ServerConfig(), **overrides)
    options.api_threads = options.api_threads or env.api_threads or default_api_threads(env.cpu_count)
    return ServerSettings(
        options=options, served_model_names=list(m.served_model_names) or [m.model], model_root=m.model,
        max_model_len=m.max_model_len, chat_template=resolve_chat_template(m.chat_template),
        default_sampling={k: gen[k] for k in _SAMPLING_DEFAULT_KEYS if gen.get(k) is not None},
        structured_outputs=StructuredOutputsConfig.parse(options.structured_outputs_config,
                                                         options.guided_decoding_backend))


def make_state(engine_config: EngineConfig, core: CoreClient, settings: ServerSettings | None = None,
               tokenizer: Any = None) -> ServerState:
    settings = settings or settings_from(engine_config)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(engine_config.model.tokenizer)
    metrics = ServerMetrics(settings.served_model_names[0], lambda: core.stats, lambda: getattr(core, "info", None))
    listeners = getattr(core, "stats_listeners", None)
    if listeners is not None:
        listeners.append(metrics.on_step)
    sched = engine_config.scheduler
    cap, limits = None, ""
    if sched.max_num_queued_reqs is not None:
        # More in flight than running slots means a queue: bounding the sum bounds the queue, answered in A.
        cap = sched.max_num_seqs + sched.max_num_queued_reqs
        limits = f"--max-num-seqs={sched.max_num_seqs} + --max-num-queued-reqs={sched.max_num_queued_reqs}"
    engine = AsyncEngine(core, tokenizer, engine_config.model, metrics=metrics, max_in_flight=cap,
                         limits_text=limits)
    vocab = int(engine_config.model.hf_config.get("vocab_size") or len(tokenizer))      # the logits' width
    grammar = GrammarService(tokenizer, vocab,
                             list(engine_config.model.eos_token_ids), settings.structured_outputs,
                             on_compile=metrics.on_grammar_compile, on_request=metrics.on_structured_request)
    return ServerState(settings=settings, engine=engine, tokenizer=tokenizer, metrics=metrics, grammar=grammar)


def _uvicorn_server(config, on_shutdown):
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            on_shutdown()
            await super().shutdown(sockets)

    return _Server(config)


class Server:
    def __init__(self, state: ServerState, host: str, port: int, shutdown_timeout: float = 30.0,
                 log_level: str = "info"):
        import uvicorn

        self.state = state
        self.fatal: str | None = None
        self.shutdown_timeout = shutdown_timeout
        state.on_fatal = self._on_fatal
        self.app = build_app(state)
        self.config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                     timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_FLUSH_S,
                                     access_log=False)
        self.server = _uvicorn_server(self.config, self._on_shutdown)

    def _on_shutdown(self) -> None:
        """Shutdown began (signal or fatal error): requests still running at the deadline end with an error."""
        import asyncio

        why = (f"the server is shutting down: --shutdown-timeout={self.shutdown_timeout:g} s passed before "
               "this request finished")
        if self.fatal is not None:
            self.state.end_in_flight(f"the server is exiting: {self.fatal}")
            return
        asyncio.get_running_loop().call_later(self.shutdown_timeout, self.state.end_in_flight, why)

    def _on_fatal(self, why: str) -> None:
        self.fatal = why
        self.server.should_exit = True

    def run(self) -> int:
        # uvicorn re-raises the signal it caught once it has shut down gracefully; with these handlers in place
        # that re-raise is a no-op and the process exits 0, as a graceful SIGTERM should.
        previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.server.run()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        if self.fatal is not None:
            logger.error("exiting with status 1: %s", self.fatal)
            return 1
        return 0


def prepare_server(engine_config: EngineConfig, server: ServerConfig) -> Server:
    from onecard.frontend.core_client import make_core_client

    settings = settings_from(engine_config, server)
    # Start B first: its imports and weight loading overlap A's tokenizer and app set-up (time to ready).
    started_at = time.perf_counter()
    core = make_core_client(engine_config, single_process=server.single_process)
    core.start()
    tokenizer = load_tokenizer(engine_config.model.tokenizer)
    state = make_state(engine_config, core, settings, tokenizer)
    state.started_at = started_at          # "ready in" counts from B's spawn, not from the app's creation
    _limit_api_torch_threads()
    logger.info("starting onecard: model %s as %s on http://%s:%d (engine loading in the background)",
                settings.model_root, ", ".join(settings.served_model_names), server.host or "0.0.0.0", server.port)
    return Server(state, server.host or "0.0.0.0", server.port, server.shutdown_timeout, server.uvicorn_log_level)


def _limit_api_torch_threads() -> None:
    """Process A runs no model: if torch is loaded here at all, one intra-op thread is plenty."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def exit_after_fatal(code: int) -> int:
    """After ``Server.run()``: a non-zero status (the engine died or never started) ends the process at once.
    The graceful part is over by then (in-flight requests answered, the engine stopped, logs flushed here); the
    interpreter's own teardown (a final collection over torch and transformers) took 10+ s on a busy 2-core box,
    and an orchestrator should see the exit now. Status 0 returns normally."""
    if code != 0:
        import os
        import sys

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
