"""The output side of a request, shared by offline ``LLM`` and the server's ``AsyncEngine``.

Contract: ``RequestOutputState(tokenizer, prompt_ids, params)`` holds one engine request's output state
(incremental detokenizer with stop strings and ``min_tokens``, token ids, logprobs, finish).
``process(out)`` turns one ``EngineOutput`` (one token, or several from a speculative verify step: a stop
string inside them keeps the tokens up to the one that completed it) into a ``GenerationDelta`` (text delta,
ids, raw logprobs, finish reason, stop reason) and says whether the caller must abort the engine request (a stop string
matched while the engine would go on); an engine rejection raises ``EngineRequestError``.
``fan_out(request_id, params)`` is the one rule for ``n``: child ids (``id`` when n == 1, else
``f"{id}-{i}"``) with per-child params (n=1, seed + i). ``merge_streams`` interleaves async iterators (the
first error ends all). ``decode_token`` / ``offline_logprobs`` give logprob token strings (vLLM: each token
decoded alone). Shaping results for an HTTP API stays in ``onecard.server``.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from onecard.frontend.detokenizer import IncrementalDetokenizer
from onecard.outputs import Logprob
from onecard.protocol import EngineOutput, FinishReason, TokenLogprobs
from onecard.sampling_params import SamplingParams


class EngineRequestError(Exception):
    """The engine rejected or failed a request; ``status`` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


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


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[int, str, SamplingParams]]:
    """``(index, child request id, child params)`` for each of ``params.n`` samples."""
    if params.n == 1:
        return [(0, request_id, params)]
    return [(i, f"{request_id}-{i}", params.clone(n=1, seed=None if params.seed is None else params.seed + i))
            for i in range(params.n)]


class RequestOutputState:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams):
        self.num_prompt_tokens = len(prompt_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens,
                                            params.spaces_between_special_tokens, list(params.stop or []),
                                            params.include_stop_str_in_output, min_tokens=params.min_tokens)
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, out: EngineOutput) -> tuple[GenerationDelta, bool]:
        """(the delta for this output, whether the caller must abort the engine request)."""
        if out.finish_reason == FinishReason.ERROR:
            self.finish_reason = FinishReason.ERROR.value
            raise EngineRequestError(out.error or "the engine rejected the request", out.error_status)
        new_ids, new_lps = out.new_token_ids, out.new_logprobs
        before = len(self.detok.token_ids)
        text, stop_str = self.detok.update(new_ids) if new_ids else ("", None)
        abort = False
        if stop_str is not None:
            kept = len(self.detok.token_ids) - before     # several tokens in one output: those up to the stop
            if kept < len(new_ids):
                new_ids = new_ids[:kept]
                new_lps = new_lps[:kept] if new_lps is not None else None
        self.num_output_tokens += len(new_ids)
        if stop_str is not None:
            # the stop string ends the request; B may still produce tokens until it sees the abort
            self.finish_reason, self.stop_reason = FinishReason.STOP.value, stop_str
            abort = not out.finished
        elif out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason.value, out.stop_reason
            text += self.detok.flush() or ""
        if out.num_prompt_tokens:
            self.num_prompt_tokens = out.num_prompt_tokens
        delta = GenerationDelta(text=text, token_ids=list(new_ids), logprobs=new_lps,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                num_prompt_tokens=self.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                                num_output_tokens=self.num_output_tokens)
        return delta, abort


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token as logprobs show it (vLLM: the token decoded alone)."""
    return tokenizer.decode([token_id])


def offline_logprobs(tokenizer: Any, logprobs: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
    """vLLM's offline form: per token, {id: Logprob} for the top alternatives plus the sampled token."""
    out = []
    for tl in logprobs:
        d = {tid: Logprob(lp, rank=r + 1, decoded_token=decode_token(tokenizer, tid))
             for r, (tid, lp) in enumerate(sorted(tl.top.items(), key=lambda kv: -kv[1]))}
        d[tl.token_id] = Logprob(tl.logprob, rank=tl.rank, decoded_token=decode_token(tokenizer, tl.token_id))
        out.append(d)
    return out


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """Items of several async iterators in arrival order; the first error ends all (others cancelled)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(s: AsyncIterator) -> None:
        try:
            async for item in s:
                await q.put(item)
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put(e)
        finally:
            await q.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    left = len(tasks)
    try:
        while left:
            item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
