"""AsyncEngine: process A's asyncio front of the engine core (text in, text deltas out).

Contract: ``AsyncEngine(core, tokenizer, model_config)``; ``await start()`` runs the core's start-up in a
thread (``CoreClient.start`` + ``wait_ready``) and then one output-dispatch task that routes every
``EngineOutput`` to its request's queue. ``generate(request_id, prompt_token_ids, params)`` is an async
iterator of ``GenerationDelta`` (new text, new token ids, logprobs, finish); it detokenizes incrementally,
matches stop strings (on a match it aborts the engine request and finishes with ``"stop"``) and raises
``EngineRequestError`` when the engine rejects the request. Leaving the iterator early (client gone,
cancelled) aborts the engine request, which frees its KV blocks. ``generate_n`` fans ``n`` out into child
requests ``f"{id}-{i}"`` (seed + i) and merges them as ``(index, delta)``.

Reliability: with ``max_in_flight`` set (``--max-num-seqs`` + ``--max-num-queued-reqs``), a request that
would exceed it is refused at once with a 503 ``EngineRequestError``, before anything reaches the engine
(more in flight than running slots means a queue). When the core dies (``EngineDiedError`` from
``get_outputs``), every request in flight fails with ``EngineDeadError`` naming the cause, later requests
fail the same way, ``error`` is set (``/health`` answers 503) and ``on_dead`` callbacks run on the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from onecard.config import ModelConfig
from onecard.frontend.core_client import CoreClient, EngineDiedError
from onecard.protocol import EngineInfo, EngineOutput, EngineRequest, EngineStats, FinishReason, TokenLogprobs
from onecard.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineRequestError(Exception):
    """The engine rejected or failed a request; ``status`` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


class EngineDeadError(RuntimeError):
    """The engine core stopped while serving (its process died, or the output loop failed): a 500."""


class EngineNotReadyError(RuntimeError):
    """The engine is still loading (or failed to start): a 503."""


@dataclass(slots=True)
class GenerationDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None            # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int               # cumulative for the request


class MetricsSink(Protocol):
    def on_first_token(self, seconds: float, prompt_tokens: int) -> None: ...
    def on_tokens(self, count: int, gap_seconds: float) -> None: ...
    def on_finish(self, *, prompt_tokens: int, output_tokens: int, finish_reason: str, e2e_seconds: float,
                  timing: "RequestTiming") -> None: ...


@dataclass(slots=True)
class RequestTiming:
    """time.monotonic() stamps of one engine request (None where it never got there)."""

    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


def _make_detokenizer(tokenizer, prompt_ids: list[int], params: SamplingParams):
    from onecard.frontend.detokenizer import IncrementalDetokenizer

    return IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens,
                                  params.spaces_between_special_tokens, list(params.stop or []),
                                  params.include_stop_str_in_output, min_tokens=params.min_tokens)


@dataclass(slots=True)
class _Tracked:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


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
        except Exception as e:  # noqa: BLE001 - the core died (EngineDiedError) or this loop broke
            if isinstance(e, EngineDiedError):
                why = str(e)
            else:
                logger.exception("the engine output loop died")
                why = f"the engine output loop died: {type(e).__name__}: {e}"
            self._mark_dead(why)

    def fail_all(self, error: Exception) -> None:
        """End every request in flight with ``error`` (their engine requests are aborted)."""
        for tracked in self._requests.values():
            if not tracked.finished:
                tracked.queue.put_nowait(error)

    def _mark_dead(self, why: str) -> None:
        self.dead = self.error = why
        err = EngineDeadError(why)
        for tracked in self._requests.values():
            tracked.queue.put_nowait(err)
        for callback in list(self.on_dead):
            try:
                callback(why)
            except Exception:  # noqa: BLE001
                logger.exception("an on_dead callback failed")

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
        detok = _make_detokenizer(self.tokenizer, prompt_ids, params)
        tracked = _Tracked()
        self._requests[request_id] = tracked
        start = time.monotonic()
        timing = RequestTiming(arrival=start)
        num_out = 0
        self.core.add_request(self._engine_request(request_id, prompt_ids, params))
        try:
            while True:
                item = await tracked.queue.get()
                if isinstance(item, EngineDeadError):
                    tracked.finished = True         # nothing to abort: the engine is gone
                    raise item
                if isinstance(item, Exception):     # fail_all (shutdown deadline): aborted in `finally`
                    raise item
                out: EngineOutput = item
                if out.finish_reason == FinishReason.ERROR:
                    tracked.finished = True
                    raise EngineRequestError(out.error or "the engine rejected the request", out.error_status)
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
                num_out += len(out.new_token_ids)
                text, stop_str = detok.update(out.new_token_ids) if out.new_token_ids else ("", None)
                finish: str | None = None
                stop_reason: int | str | None = None
                if stop_str is not None:
                    finish, stop_reason = FinishReason.STOP.value, stop_str
                    if not out.finished:
                        self.core.abort([request_id])
                elif out.finished:
                    finish, stop_reason = out.finish_reason.value, out.stop_reason
                if finish is not None:
                    if stop_str is None:
                        text += detok.flush() or ""
                    tracked.finished = True
                    if self.metrics:
                        self.metrics.on_finish(prompt_tokens=out.num_prompt_tokens or len(prompt_ids),
                                               output_tokens=num_out, finish_reason=finish,
                                               e2e_seconds=time.monotonic() - start, timing=timing)
                yield GenerationDelta(text=text, token_ids=list(out.new_token_ids), logprobs=out.new_logprobs,
                                      finish_reason=finish, stop_reason=stop_reason,
                                      num_prompt_tokens=out.num_prompt_tokens or len(prompt_ids),
                                      num_cached_tokens=out.num_cached_tokens, num_output_tokens=num_out)
                if finish is not None:
                    return
        finally:
            if not tracked.finished:
                self.core.abort([request_id])
                if self.metrics:
                    self.metrics.on_finish(prompt_tokens=len(prompt_ids), output_tokens=num_out,
                                           finish_reason="abort", e2e_seconds=time.monotonic() - start,
                                           timing=timing)
            self._requests.pop(request_id, None)

    async def generate_n(self, request_id: str, prompt_ids: list[int],
                         params: SamplingParams) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """``params.n`` children merged in arrival order; any child's error ends the whole stream."""
        n = params.n
        self.check_available(n)
        if n == 1:
            async for d in self.generate(request_id, prompt_ids, params):
                yield 0, d
            return
        merged: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, child: SamplingParams) -> None:
            try:
                async for d in self.generate(f"{request_id}-{i}", prompt_ids, child):
                    await merged.put((i, d))
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                await merged.put((i, e))
            finally:
                await merged.put((i, done))

        tasks = []
        for i in range(n):
            seed = None if params.seed is None else params.seed + i
            tasks.append(asyncio.create_task(pump(i, params.clone(n=1, seed=seed))))
        remaining = n
        try:
            while remaining:
                i, item = await merged.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def decode_token(tokenizer, token_id: int) -> str:
    """The text of one token as logprobs show it (vLLM: the token decoded alone)."""
    return tokenizer.decode([token_id])


def logprob_entries(tokenizer, logprobs: list[TokenLogprobs], top_n: int) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` entries for generated tokens."""
    out = []
    for lp in logprobs:
        tok = decode_token(tokenizer, lp.token_id)
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]
        out.append({
            "token": tok, "logprob": max(lp.logprob, -9999.0), "bytes": list(tok.encode("utf-8", "replace")),
            "top_logprobs": [
                {"token": (t := decode_token(tokenizer, tid)), "logprob": max(v, -9999.0),
                 "bytes": list(t.encode("utf-8", "replace"))} for tid, v in top],
        })
    return out
