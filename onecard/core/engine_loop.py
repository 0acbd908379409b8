"""Process B's busy loop over an ``EngineCore``, and the entry point of the engine core process.

Contract: ``run_engine_loop(config, recv, send, core_factory=None)`` builds the core (``EngineCore`` unless a
factory is given: tests run the same loop over a scripted runner), reports ``(READY, EngineInfo)`` or
``(ERROR, text, is_config_error)``, then loops until it receives ``STOP`` (the tags: ``protocol.MessageKind``):
it takes every message waiting (``EngineRequest``: admitted, or answered at once with an error output;
``Abort``), runs one ``step()`` while requests are unfinished, and sends ``(OUT, [EngineOutput], EngineStats)``
once per turn. ``recv(timeout)``
returns a message or None (it blocks only while the core is idle); ``send(msg)`` must not block for long. A fault
while admitting one request fails that request only. ``process_main`` runs the loop in a spawned process over
two pipes (frontend/core_client.py is the other end); ``set_engine_threads`` sets torch's thread count there.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from onecard.config import ConfigError, EngineConfig
from onecard.protocol import Abort, EngineOutput, EngineRequest, FinishReason, MessageKind

logger = logging.getLogger(__name__)


def run_engine_loop(config: EngineConfig, recv: Callable[[float | None], Any], send: Callable[[tuple], None],
                    core_factory: Callable[[EngineConfig], Any] | None = None) -> None:
    if core_factory is None:
        from onecard.core.engine_core import EngineCore as core_factory

    try:
        core = core_factory(config)
    except ConfigError as e:
        send((MessageKind.ERROR, str(e), True))
        return
    except Exception as e:
        logger.exception("engine start-up failed")
        send((MessageKind.ERROR, f"{type(e).__name__}: {e}", False))
        return
    send((MessageKind.READY, core.info))
    while True:
        msg = recv(None if not core.has_unfinished() else 0.0)
        outs: list = []
        while msg is not None:
            if msg is MessageKind.STOP:
                return
            if isinstance(msg, Abort):
                outs.extend(core.abort(msg.request_ids))
            else:
                err = _admit(core, msg)
                if err is not None:
                    outs.append(err)
            msg = recv(0.0)
        if core.has_unfinished():
            outs.extend(core.step())
        send((MessageKind.OUT, outs, core.stats()))


def _admit(core: Any, request: EngineRequest) -> EngineOutput | None:
    """Add one request; a fault while admitting it fails that request only (attributable), never the loop."""
    try:
        return core.add_request(request)
    except Exception as e:  # reported to its request, with the traceback in the log
        logger.exception("admitting request %s failed", getattr(request, "request_id", "?"))
        rid = getattr(request, "request_id", "?")
        status = 400 if isinstance(e, ValueError) else 500
        return EngineOutput(rid, [], FinishReason.ERROR, error=f"the request could not be admitted: "
                            f"{type(e).__name__}: {e}", error_status=status)


def process_main(config: EngineConfig, conn_in, conn_out, core_factory=None) -> None:
    """The engine core process: ``conn_in`` / ``conn_out`` are its ends of the A -> B and B -> A pipes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)    # A decides when B stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.env.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_engine_threads(config)
    if core_factory is None:
        import torch  # noqa: F401 - the runner needs it anyway; loaded now, with the thread count set

    def recv(timeout: float | None):
        if conn_in.poll(timeout):
            try:
                return conn_in.recv()
            except EOFError:
                return MessageKind.STOP      # A is gone: nobody to serve
        return None

    run_engine_loop(config, recv, conn_out.send, core_factory)


def set_engine_threads(config: EngineConfig) -> None:
    """Torch's intra-op threads in B (``--engine-threads``): oversubscribed spinning threads on a busy box
    cost far more than they give (see config.default_engine_threads). B is a fresh process: the OpenMP
    runtime reads this when torch loads."""
    import os
    import sys

    os.environ["OMP_NUM_THREADS"] = str(config.engine_threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(config.engine_threads)
