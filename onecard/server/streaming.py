"""Helpers shared by the HTTP routes: SSE framing, usage, logprob shaping.

Contract: ``sse(obj)`` frames one server-sent event; ``logprob_entries`` / ``CompletionLogprobs`` shape
logprobs for chat and completions; ``start_stream(agen)`` awaits the first item before any byte is sent,
so an engine rejection (prompt too long, queue full) still becomes a proper error status;
``sse_response(events)`` wraps an async iterator of SSE strings, closing the source when the client goes away
(which aborts the engine requests).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from onecard.frontend.output_processor import decode_token
from onecard.protocol import TokenLogprobs
from onecard.server.errors import APIError, error_body, to_api_error

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def start_stream(agen: AsyncIterator) -> AsyncIterator:
    """Await the first item now (errors raise here, before the response starts); iterate the rest later."""
    try:
        first = await agen.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await agen.aclose()
        raise

    async def rest() -> AsyncIterator:
        try:
            if first is not None:
                yield first
            async for item in agen:
                yield item
        finally:
            await agen.aclose()

    return rest()


def _openai_error_events(err: APIError) -> list[str]:
    return [sse(error_body(err.message, err.status, err.param)), DONE]


def sse_response(events: AsyncIterator[str],
                 error_events: Callable[[APIError], list[str]] = _openai_error_events) -> StreamingResponse:
    """``error_events`` frames a mid-stream failure in the route's API (OpenAI's by default)."""
    async def body() -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        except Exception as exc:  # noqa: BLE001 - mid-stream failure: tell the client in-band, as vLLM does
            for e in error_events(to_api_error(exc)):
                yield e
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens}}


class CompletionLogprobs:
    """Legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset (accumulates)."""

    def __init__(self, tokenizer, top_n: int, start_offset: int = 0):
        self.tokenizer = tokenizer
        self.top_n = top_n
        self.offset = start_offset
        self.data: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}

    def add(self, lps: list[TokenLogprobs]) -> dict[str, list]:
        part: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for lp in lps:
            tok = decode_token(self.tokenizer, lp.token_id)
            part["text_offset"].append(self.offset)
            part["token_logprobs"].append(max(lp.logprob, -9999.0))
            part["tokens"].append(tok)
            top = sorted(lp.top.items(), key=lambda kv: -kv[1])[: self.top_n]
            part["top_logprobs"].append({decode_token(self.tokenizer, t): max(v, -9999.0) for t, v in top}
                                        if self.top_n else None)
            self.offset += len(tok)
        for k, v in part.items():
            self.data[k].extend(v)
        return part


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
