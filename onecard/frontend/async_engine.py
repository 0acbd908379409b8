"""AsyncEngine: process A's asyncio front of the engine core (text in, text deltas out).

Contract: ``AsyncEngine(core, tokenizer, model_config)``; ``await start()`` runs the core's start-up in a
thread (``CoreClient.start`` + ``wait_ready``) and then one output-dispatch task that routes every
``EngineOutput`` to its request's queue. ``generate(request_id, prompt_token_ids, params)`` is an async
iterator of ``GenerationDelta`` (new text, new token ids, logprobs, finish); the output side (detokenizer,
stop strings with ``min_tokens``, finish reasons) is ``output_processor.RequestOutputState``, the same one
offline ``LLM`` uses; on a stop-string match the engine request is aborted. It raises
``EngineRequestError`` when the engine rejects the request. Leaving the iterator early (client gone,
cancelled) aborts the engine request, which frees its KV blocks. ``generate_n`` fans ``n`` out into child
requests (``output_processor.fan_out``) and merges them as ``(index, delta)``.

Reliability: with ``max_in_flight`` set (``--max-num-seqs`` + ``--max-num-queued-reqs``), a request that
would exceed it is refused at once with a 503 ``EngineRequestError``, before anything reaches the engine
(more in flight than running slots means a queue). When the core dies (``EngineDiedError`` from
``get_outputs``), every request in flight fails with ``EngineDeadError`` naming the cause, later requests
fail the same way, ``error`` is set (``/health`` answers 503) and ``on_dead`` callbacks run on the event loop.
``fail_all(error)`` ends every request in flight with ``error`` (the shutdown deadline).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from onecard.config import ModelConfig
from onecard.frontend.core_client import CoreClient, EngineDiedError
from onecard.frontend.output_processor import (
    EngineRequestError,
    GenerationDelta,
    RequestOutputState,
    fan_out,
    merge_streams,
)
from onecard.protocol import EngineInfo, EngineOutput, EngineRequest, EngineStats
from onecard.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core stopped while serving (its process died, or the output loop failed): a 500."""


class EngineNotReadyError(RuntimeError):
    """The engine is still loading (or failed to start): a 503."""


class MetricsSink(Protocol):
    def on_first_token(self, seconds: float, prompt_tokens: int) -> None: ...
    def on_tokens(self, count: int, gap_seconds: float) -> None: ...
    def on_finish(self, *, prompt_tokens: int, output_tokens: int, finish_reason: str, e2e_seconds: float,
                  timing: RequestTiming) -> None: ...


@dataclass(slots=True)
class RequestTiming:
    """time.monotonic() stamps of one engine request (None where it never got there)."""

    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass(slots=True)
class _Tracked:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncEngine:
    def __init__(self, core: CoreClient, tokenizer, model_config: ModelConfig,
                 metrics: MetricsSink | None = None, max_in_flight: int | None = None,
                 limits_text: str = ""):
        self.core = core
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.metrics = metrics
        self.max_in_flight = max_in_flight     # engine requests (children of n count one each)
        self.limits_text = limits_text         # names the flags behind max_in_flight, for the 503's message
        self.info: EngineInfo | None = None
        self.error: str | None = None          # start-up or loop failure, shown by /health
        self.dead: str | None = None           # the engine died while serving
        self.on_dead: list = []                # callables(reason), run on the event loop
        self._requests: dict[str, _Tracked] = {}
        self._loop_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def ready(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    async def start(self) -> EngineInfo:
        """Load the engine (blocking work in a thread) and start routing outputs. Raises the start-up error."""
        try:
            self.core.start()
            info = await asyncio.to_thread(self.core.wait_ready)
        except Exception as e:
            self.error = str(e) or type(e).__name__
            raise
        self.info = info
        self._loop_task = asyncio.create_task(self._dispatch_loop(), name="onecard-output-dispatch")
        return info

    async def _dispatch_loop(self) -> None:
        try:
            while True:
                outs = await self.core.get_outputs()
                for out in outs:
                    tracked = self._requests.get(out.request_id)
                    if tracked is not None:
                        tracked.queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if isinstance(e, EngineDiedError):
                why = str(e)
            else:
                logger.exception("the engine output loop died")
                why = f"the engine output loop died: {type(e).__name__}: {e}"
            self._mark_dead(why)

    def fail_all(self, error: Exception) -> None:
        """End every request in flight with ``error`` (their engine requests are aborted)."""
        for tracked in self._requests.values():
            tracked.queue.put_nowait(error)

    def _mark_dead(self, why: str) -> None:
        self.dead = self.error = why
        err = EngineDeadError(why)
        for tracked in self._requests.values():
            tracked.queue.put_nowait(err)
        for callback in list(self.on_dead):
            try:
                callback(why)
            except Exception:
                logger.exception("an on_dead callback failed")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):   # its errors were reported already
                await self._loop_task
        await asyncio.to_thread(self.core.shutdown)

    # ------------------------------------------------------------------ requests
    def _engine_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        priority: int = 0) -> EngineRequest:
        return EngineRequest(request_id=request_id, prompt_token_ids=list(prompt_ids), sampling_params=params,
                             arrival_time=time.time(), eos_token_ids=list(self.model_config.eos_token_ids),
                             priority=priority)

    def check_available(self, count: int = 1) -> None:
        """Raise now (no engine round trip) if ``count`` more engine requests cannot be taken."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if not self.ready:
            raise EngineNotReadyError(self.error or "the model is loading")
        cap = self.max_in_flight
        if cap is None:
            return
        if count > cap:
            raise EngineRequestError(
                f"The request needs {count} sequences at once (n times the number of prompts), more than this "
                f"server holds ({cap}: {self.limits_text or 'its limits'}). Lower n or send fewer prompts.",
                400)
        if len(self._requests) + count > cap:
            raise EngineRequestError(
                f"The server is overloaded: {len(self._requests)} requests are in flight "
                f"({self.limits_text or f'limit {cap}'}). Try again later.", 503)

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[GenerationDelta]:
        self.check_available(1)
        if request_id in self._requests:
            raise EngineRequestError(f"request id {request_id!r} is already in use.", 400)
        output = RequestOutputState(self.tokenizer, prompt_ids, params)
        tracked = _Tracked()
        self._requests[request_id] = tracked
        start = time.monotonic()
        timing = RequestTiming(arrival=start)
        self.core.add_request(self._engine_request(request_id, prompt_ids, params))
        try:
            while True:
                item = await tracked.queue.get()
                if isinstance(item, Exception):     # the engine died, or fail_all: aborted in `finally`
                    raise item                      # (an abort to a dead engine is dropped)
                out: EngineOutput = item
                if out.scheduled_time is not None:
                    timing.scheduled = out.scheduled_time
                if out.new_token_ids:
                    now = time.monotonic()
                    if timing.first_token is None:
                        timing.first_token = now
                        if self.metrics:
                            self.metrics.on_first_token(now - start, out.num_prompt_tokens or len(prompt_ids))
                    elif self.metrics:
                        self.metrics.on_tokens(len(out.new_token_ids), now - timing.last_token)
                    timing.last_token = now
                delta, abort = output.process(out)     # raises EngineRequestError on a rejection
                if abort:
                    self.core.abort([request_id])
                if delta.finish_reason is not None and self.metrics:
                    self.metrics.on_finish(prompt_tokens=delta.num_prompt_tokens,
                                           output_tokens=delta.num_output_tokens,
                                           finish_reason=delta.finish_reason,
                                           e2e_seconds=time.monotonic() - start, timing=timing)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not output.finished:
                self.core.abort([request_id])
                if self.metrics:
                    self.metrics.on_finish(prompt_tokens=len(prompt_ids), output_tokens=output.num_output_tokens,
                                           finish_reason="abort", e2e_seconds=time.monotonic() - start,
                                           timing=timing)
            self._requests.pop(request_id, None)

    async def generate_n(self, request_id: str, prompt_ids: list[int],
                         params: SamplingParams) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """``params.n`` children merged in arrival order; any child's error ends the whole stream."""
        self.check_available(params.n)
        children = fan_out(request_id, params)
        if len(children) == 1:
            async for d in self.generate(request_id, prompt_ids, params):
                yield 0, d
            return

        async def indexed(i: int, rid: str, child: SamplingParams) -> AsyncIterator[tuple[int, GenerationDelta]]:
            async for d in self.generate(rid, prompt_ids, child):
                yield i, d

        # aclosing: a consumer that leaves early cancels every child now (their aborts free KV blocks)
        async with contextlib.aclosing(merge_streams([indexed(i, rid, c) for i, rid, c in children])) as merged:
            async for item in merged:
                yield item


__all__ = ["AsyncEngine", "EngineDeadError", "EngineNotReadyError", "EngineRequestError", "GenerationDelta",
           "MetricsSink", "RequestTiming"]
