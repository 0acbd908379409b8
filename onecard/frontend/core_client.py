"""Process A's handle on the engine core (process B, or a thread in --single-process mode).

Contract (``CoreClient``): ``start()`` begins loading in the background and returns at once;
``wait_ready()`` blocks until B has loaded the model (returns ``EngineInfo``) or raises the start-up error;
``add_request`` / ``abort`` never block; ``get_outputs()`` awaits the next list of ``EngineOutput`` (from any
requests); ``stats`` is the latest ``EngineStats``; ``shutdown()`` stops B. One client per engine.
"""
from __future__ import annotations

import abc
import asyncio
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable
from typing import Any

from onecard.config import ConfigError, EngineConfig
from onecard.protocol import Abort, EngineInfo, EngineOutput, EngineRequest, EngineStats

logger = logging.getLogger(__name__)


class CoreClient(abc.ABC):
    info: EngineInfo | None = None

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def wait_ready(self, timeout: float | None = None) -> EngineInfo: ...

    @property
    @abc.abstractmethod
    def ready(self) -> bool: ...

    @abc.abstractmethod
    def add_request(self, request: EngineRequest) -> None: ...

    @abc.abstractmethod
    def abort(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    async def get_outputs(self) -> list[EngineOutput]: ...

    @property
    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------
# Implementations. Both run the same loop (``run_engine_loop``) over a message channel; they differ only in
# where B lives: a thread of this process (--single-process, tests) or a spawned process (default).


class EngineStartupError(RuntimeError):
    """B failed to start (bad config, does not fit, load error); the message says why."""


def run_engine_loop(config: EngineConfig, recv: Callable[[float | None], Any], send: Callable[[tuple], None],
                    core_factory: Callable[[EngineConfig], Any] | None = None) -> None:
    """B's main loop. ``recv(timeout)`` returns a message or None on timeout; ``send(msg)`` never blocks long.

    Messages in: EngineRequest, Abort, "stop". Out: ("ready", EngineInfo), ("error", text, is_config),
    ("out", [EngineOutput], EngineStats). ``core_factory`` (default ``EngineCore``) lets tests run the same
    loop over a core with a scripted runner.
    """
    if core_factory is None:
        from onecard.core.engine_core import EngineCore as core_factory

    try:
        core = core_factory(config)
    except ConfigError as e:
        send(("error", str(e), True))
        return
    except Exception as e:
        logger.exception("engine start-up failed")
        send(("error", f"{type(e).__name__}: {e}", False))
        return
    send(("ready", core.info))
    while True:
        msg = recv(None if not core.has_unfinished() else 0.0)
        outs: list = []
        while msg is not None:
            if isinstance(msg, str) and msg == "stop":
                return
            if isinstance(msg, Abort):
                outs.extend(core.abort(msg.request_ids))
            else:
                err = core.add_request(msg)
                if err is not None:
                    outs.append(err)
            msg = recv(0.0)
        if core.has_unfinished():
            outs.extend(core.step())
        send(("out", outs, core.stats()))


class _ClientBase(CoreClient):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.info: EngineInfo | None = None
        self._stats = EngineStats()
        self._ready = threading.Event()
        self._error: tuple[str, bool] | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aq: asyncio.Queue | None = None
        self._early: list[list[EngineOutput]] = []
        self._started = False

    def _first_start(self) -> bool:
        """True once: start() is idempotent (the launcher starts B early, AsyncEngine.start calls it again)."""
        with self._lock:
            if self._started:
                return False
            self._started = True
            return True

    # called from B's side (a thread) for every message
    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            self.info = msg[1]
            self._ready.set()
        elif kind == "error":
            self._error = (msg[1], msg[2])
            self._ready.set()
        elif kind == "out":
            self._stats = msg[2]
            if msg[1]:
                self._emit(msg[1])

    def _emit(self, outs: list[EngineOutput]) -> None:
        with self._lock:
            if self._loop is None:
                self._early.append(outs)
                return
            loop, aq = self._loop, self._aq
        loop.call_soon_threadsafe(aq.put_nowait, outs)

    async def get_outputs(self) -> list[EngineOutput]:
        if self._aq is None:
            with self._lock:
                self._loop = asyncio.get_running_loop()
                self._aq = asyncio.Queue()
                for item in self._early:
                    self._aq.put_nowait(item)
                self._early.clear()
        return await self._aq.get()

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not become ready in time")
        if self._error is not None:
            text, is_config = self._error
            raise (ConfigError(text) if is_config else EngineStartupError(text))
        assert self.info is not None
        return self.info

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._error is None

    @property
    def failed(self) -> str | None:
        return self._error[0] if self._error else None

    @property
    def stats(self) -> EngineStats:
        return self._stats


class ThreadCoreClient(_ClientBase):
    """B in a daemon thread of this process (``--single-process``)."""

    _core_factory: Callable[[EngineConfig], Any] | None = None   # None = EngineCore (tests override)

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self._in: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self._first_start():
            return

        def recv(timeout: float | None):
            try:
                return self._in.get(timeout=timeout) if timeout != 0.0 else self._in.get_nowait()
            except queue.Empty:
                return None

        self._thread = threading.Thread(target=run_engine_loop,
                                        args=(self.config, recv, self._on_message, self._core_factory),
                                        name="onecard-engine", daemon=True)
        self._thread.start()

    def add_request(self, request: EngineRequest) -> None:
        self._in.put(request)

    def abort(self, request_ids: list[str]) -> None:
        self._in.put(Abort(list(request_ids)))

    def shutdown(self) -> None:
        self._in.put("stop")
        if self._thread is not None:
            self._thread.join(timeout=10)


def _process_main(config: EngineConfig, conn_in, conn_out) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)    # A decides when B stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.env.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def recv(timeout: float | None):
        if conn_in.poll(timeout):
            try:
                return conn_in.recv()
            except EOFError:
                return "stop"
        return None

    run_engine_loop(config, recv, conn_out.send)


class ProcessCoreClient(_ClientBase):
    """B in a spawned process, messages over two pipes (the default)."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        ctx = mp.get_context("spawn")
        self._a_in, self._b_out = ctx.Pipe(duplex=False)    # B -> A
        self._b_in, self._a_out = ctx.Pipe(duplex=False)    # A -> B
        self._proc = ctx.Process(target=_process_main, args=(config, self._b_in, self._b_out),
                                 name="onecard-engine", daemon=True)
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        if not self._first_start():
            return
        self._proc.start()

        def read() -> None:
            while True:
                try:
                    msg = self._a_in.recv()
                except (EOFError, OSError):
                    if not self._ready.is_set():
                        self._error = ("the engine process exited during start-up", False)
                        self._ready.set()
                    return
                self._on_message(msg)

        self._reader = threading.Thread(target=read, name="onecard-engine-reader", daemon=True)
        self._reader.start()

    def _send(self, msg: Any) -> None:
        with self._send_lock:
            self._a_out.send(msg)

    def add_request(self, request: EngineRequest) -> None:
        self._send(request)

    def abort(self, request_ids: list[str]) -> None:
        self._send(Abort(list(request_ids)))

    def shutdown(self) -> None:
        try:
            self._send("stop")
        except (OSError, BrokenPipeError):
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()


def make_core_client(engine_config: EngineConfig, single_process: bool = False) -> CoreClient:
    return ThreadCoreClient(engine_config) if single_process else ProcessCoreClient(engine_config)
