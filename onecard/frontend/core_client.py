"""Process A's handle on the engine core (process B, or a thread in --single-process mode).

Process A's side only: the loop that B runs, and B's process entry point, are core/engine_loop.py.

Contract (``CoreClient``): ``start()`` begins loading in the background and returns at once;
``wait_ready()`` blocks until B has loaded the model (returns ``EngineInfo``) or raises the start-up error;
``add_request`` / ``abort`` never block (a writer thread owns the pipe, so a full or dead pipe cannot stall
the event loop); ``get_outputs()`` awaits the next list of ``EngineOutput`` (from any requests) and raises
``EngineDiedError`` once B is gone; ``dead`` is then the reason; ``stats`` is the latest ``EngineStats``;
``shutdown()`` stops B. One client per engine.

Watchdog: B's death is noticed at any time, not only during start-up: the process client's reader waits on
B's pipe *and* its process sentinel (A closes its copies of B's pipe ends, so a dead B is an EOF), the thread
client on its thread's exit. Either way ``get_outputs`` raises within milliseconds and ``on_dead`` callbacks
run (on the reader thread).
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
from onecard.core.engine_loop import process_main, run_engine_loop
from onecard.protocol import Abort, EngineInfo, EngineOutput, EngineRequest, EngineStats, MessageKind

logger = logging.getLogger(__name__)


class EngineDiedError(RuntimeError):
    """The engine core (process B or its thread) stopped while serving; the message says how."""


class CoreClient(abc.ABC):
    info: EngineInfo | None = None
    dead: str | None = None

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
# Implementations. Both run B's loop (core/engine_loop.py) over a message channel; they differ only in
# where B lives: a thread of this process (--single-process, tests) or a spawned process (default).


class EngineStartupError(RuntimeError):
    """B failed to start (bad config, does not fit, load error); the message says why."""


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
        self._stopping = False
        self.dead: str | None = None
        self.on_dead: list[Callable[[str], None]] = []
        self.stats_listeners: list[Callable[[EngineStats], None]] = []   # called on the reader thread

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
        if kind is MessageKind.READY:
            self.info = msg[1]
            self._ready.set()
        elif kind is MessageKind.ERROR:
            self._error = (msg[1], msg[2])
            self._ready.set()
        elif kind is MessageKind.OUT:
            self._stats = msg[2]
            for listener in self.stats_listeners:
                listener(msg[2])
            if msg[1]:
                self._emit(msg[1])

    def _emit(self, outs: list[EngineOutput] | EngineDiedError) -> None:
        with self._lock:
            if self._loop is None:
                self._early.append(outs)
                return
            loop, aq = self._loop, self._aq
        try:
            loop.call_soon_threadsafe(aq.put_nowait, outs)
        except RuntimeError:        # the event loop is closed (process exit): nobody is waiting
            pass

    def _died(self, why: str) -> None:
        """B is gone (called once, from the thread that noticed). During start-up it is a start-up error."""
        if self._stopping or self.dead is not None or self._error is not None:
            return                          # a stop we asked for, or a start-up error already reported
        if not self._ready.is_set():
            self._error = (why, False)
            self._ready.set()
            return
        self.dead = why
        logger.error("the engine core died: %s", why)
        self._emit(EngineDiedError(why))
        for callback in list(self.on_dead):
            try:
                callback(why)
            except Exception:  # one listener's fault must not hide the death from others
                logger.exception("an on_dead callback failed")

    async def get_outputs(self) -> list[EngineOutput]:
        if self._aq is None:
            with self._lock:
                self._loop = asyncio.get_running_loop()
                self._aq = asyncio.Queue()
                for item in self._early:
                    self._aq.put_nowait(item)
                self._early.clear()
        item = await self._aq.get()
        if isinstance(item, EngineDiedError):
            self._aq.put_nowait(item)       # every later call raises too
            raise item
        return item

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

        def main() -> None:
            try:
                run_engine_loop(self.config, recv, self._on_message, self._core_factory)
            except BaseException as e:  # the loop's death is reported, not swallowed
                logger.exception("the engine thread died")
                self._died(f"the engine thread died: {type(e).__name__}: {e}")
                return
            self._died("the engine thread exited")

        self._thread = threading.Thread(target=main, name="onecard-engine", daemon=True)
        self._thread.start()

    def add_request(self, request: EngineRequest) -> None:
        self._in.put(request)

    def abort(self, request_ids: list[str]) -> None:
        self._in.put(Abort(list(request_ids)))

    def shutdown(self) -> None:
        self._stopping = True
        self._in.put(MessageKind.STOP)
        if self._thread is not None:
            self._thread.join(timeout=10)


def _exit_text(code: int | None) -> str:
    import signal

    if code is None:
        return "its pipe closed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_STOP_WRITER = object()


class ProcessCoreClient(_ClientBase):
    """B in a spawned process, messages over two pipes (the default).

    ``core_factory`` (a picklable top-level callable) replaces ``EngineCore`` in B (tests run a scripted
    runner in a real process to kill it)."""

    def __init__(self, config: EngineConfig, core_factory: Callable[[EngineConfig], Any] | None = None):
        super().__init__(config)
        ctx = mp.get_context("spawn")
        self._a_in, self._b_out = ctx.Pipe(duplex=False)    # B -> A
        self._b_in, self._a_out = ctx.Pipe(duplex=False)    # A -> B
        self._proc = ctx.Process(target=process_main, args=(config, self._b_in, self._b_out, core_factory),
                                 name="onecard-engine", daemon=True)
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def start(self) -> None:
        if not self._first_start():
            return
        self._proc.start()
        # Only B may hold its ends: with A's copies closed, B's death reads as EOF here (and a write to a dead
        # B fails instead of blocking forever once the pipe buffer is full).
        self._b_in.close()
        self._b_out.close()
        logger.info("engine core process started (pid %d)", self._proc.pid)
        self._reader = threading.Thread(target=self._read, name="onecard-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="onecard-engine-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def _read(self) -> None:
        from multiprocessing.connection import wait

        sentinel = self._proc.sentinel
        while True:
            ready = wait([self._a_in, sentinel])
            if self._a_in in ready:
                try:
                    msg = self._a_in.recv()
                except (EOFError, OSError):
                    break
                self._on_message(msg)
                continue
            # The process ended: deliver what it sent before dying, then report.
            try:
                while self._a_in.poll(0):
                    self._on_message(self._a_in.recv())
            except (EOFError, OSError):
                pass
            break
        self._proc.join(timeout=1.0)
        self._died(f"the engine core process (pid {self._proc.pid}) died: {_exit_text(self._proc.exitcode)}")

    def _write(self) -> None:
        while True:
            msg = self._out.get()
            if msg is _STOP_WRITER:
                return
            if self.dead is not None:
                continue                    # B is gone: drop (requests were failed by the watchdog)
            try:
                self._a_out.send(msg)
            except (OSError, EOFError, ValueError) as e:
                self._died(f"the engine core process stopped reading: {type(e).__name__}: {e}")

    def _send(self, msg: Any) -> None:
        self._out.put(msg)

    def add_request(self, request: EngineRequest) -> None:
        self._send(request)

    def abort(self, request_ids: list[str]) -> None:
        self._send(Abort(list(request_ids)))

    def shutdown(self) -> None:
        self._stopping = True
        if not self._started:
            return
        self._send(MessageKind.STOP)
        self._send(_STOP_WRITER)
        if self._writer is not None:
            self._writer.join(timeout=5)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)


def make_core_client(engine_config: EngineConfig, single_process: bool = False) -> CoreClient:
    return ThreadCoreClient(engine_config) if single_process else ProcessCoreClient(engine_config)
