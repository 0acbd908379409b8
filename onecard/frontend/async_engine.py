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
from onecard.frontend.core_client import CoreClient
from onecard.frontend.output_processor import (EngineRequestError, GenerationDelta, RequestOutputState, fan_out,
                                               merge_streams)
from onecard.protocol import EngineInfo, EngineOutput, EngineRequest, EngineStats
from onecard.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core stopped (start-up failed or the output loop died)."""


class MetricsSink(Protocol):
    def on_first_token(self, seconds: float) -> None: ...
    def on_finish(self, *, prompt_tokens: int, output_tokens: int, finish_reason: str,
                  e2e_seconds: float) -> None: ...


@dataclass(slots=True)
class _Tracked:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncEngine:
    def __init__(self, core: CoreClient, tokenizer, model_config: ModelConfig,
                 metrics: MetricsSink | None = None):
        self.core = core
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.metrics = metrics
        self.info: EngineInfo | None = None
        self.error: str | None = None          # start-up or loop failure, shown by /health
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
            logger.exception("the engine output loop died")
            self.error = f"engine output loop died: {type(e).__name__}: {e}"
            for tracked in self._requests.values():
                tracked.queue.put_nowait(e)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await asyncio.to_thread(self.core.shutdown)

    # ------------------------------------------------------------------ requests
    def _engine_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        priority: int = 0) -> EngineRequest:
        return EngineRequest(request_id=request_id, prompt_token_ids=list(prompt_ids), sampling_params=params,
                             arrival_time=time.time(), eos_token_ids=list(self.model_config.eos_token_ids),
                             priority=priority)

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[GenerationDelta]:
        if not self.ready:
            raise EngineDeadError(self.error or "the engine is not ready")
        if request_id in self._requests:
            raise EngineRequestError(f"request id {request_id!r} is already in use.", 400)
        output = RequestOutputState(self.tokenizer, prompt_ids, params)
        tracked = _Tracked()
        self._requests[request_id] = tracked
        start = time.perf_counter()
        first_token_at: float | None = None
        self.core.add_request(self._engine_request(request_id, prompt_ids, params))
        try:
            while True:
                item = await tracked.queue.get()
                if isinstance(item, Exception):
                    raise EngineDeadError(str(item))
                out: EngineOutput = item
                if out.new_token_ids and first_token_at is None:
                    first_token_at = time.perf_counter()
                    if self.metrics:
                        self.metrics.on_first_token(first_token_at - start)
                delta, abort = output.process(out)     # raises EngineRequestError on a rejection
                if abort:
                    self.core.abort([request_id])
                if delta.finish_reason is not None and self.metrics:
                    self.metrics.on_finish(prompt_tokens=delta.num_prompt_tokens,
                                           output_tokens=delta.num_output_tokens,
                                           finish_reason=delta.finish_reason,
                                           e2e_seconds=time.perf_counter() - start)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not output.finished:
                self.core.abort([request_id])
                if self.metrics:
                    self.metrics.on_finish(prompt_tokens=len(prompt_ids), output_tokens=output.num_output_tokens,
                                           finish_reason="abort", e2e_seconds=time.perf_counter() - start)
            self._requests.pop(request_id, None)

    async def generate_n(self, request_id: str, prompt_ids: list[int],
                         params: SamplingParams) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """``params.n`` children merged in arrival order; any child's error ends the whole stream."""
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


__all__ = ["AsyncEngine", "EngineDeadError", "EngineRequestError", "GenerationDelta", "MetricsSink"]
