"""POST /v1/completions (the legacy text API), streamed and not.

Contract: ``create_completion(state, body, request)`` returns a JSONResponse or an SSE StreamingResponse in
OpenAI's ``text_completion`` shape. A prompt is a string, a list of strings, a list of token ids or a list of
those; choice index = prompt_index * n + i. ``echo`` prepends the prompt text; ``logprobs`` N gives the
legacy tokens/token_logprobs/top_logprobs/text_offset block.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from onecard.frontend.output_processor import merge_streams
from onecard.server.errors import BadRequest
from onecard.server.openai_types import CompletionRequest, now, random_id
from onecard.server.streaming import DONE, CompletionLogprobs, sse, sse_response, start_stream, usage

__all__ = ["CompletionRequest", "create_completion"]


async def create_completion(state, body: CompletionRequest, request: Request) -> Response:
    name = state.model_name(body.model)
    tok = state.tokenizer
    prompts: list[list[int]] = []
    prompt_texts: list[str] = []
    for p in body.prompts():
        if isinstance(p, str):
            prompts.append(list(tok.encode(p, add_special_tokens=body.add_special_tokens)))
            prompt_texts.append(p)
        else:
            vocab = len(tok)
            if any(not (isinstance(t, int) and 0 <= t < vocab) for t in p):
                raise BadRequest(f"prompt token ids must be in [0, {vocab}).", param="prompt")
            prompts.append(list(p))
            prompt_texts.append(tok.decode(p) if body.echo else "")
    params = body.to_sampling_params(state.settings.default_sampling)
    n = params.n
    rid = random_id("cmpl")
    created = now()
    streams = [_indexed(state.engine.generate_n(f"{rid}-{pi}" if len(prompts) > 1 else rid, ids, params), pi * n)
               for pi, ids in enumerate(prompts)]
    merged = merge_streams(streams)
    top_n = params.logprobs

    if body.stream:
        agen = await start_stream(merged)
        return sse_response(_stream(state, body, name, rid, created, agen, prompts, prompt_texts, n, top_n))

    texts = {i: [] for i in range(len(prompts) * n)}
    finish: dict[int, tuple[str | None, Any]] = {}
    out_tokens: dict[int, int] = {}
    lps: dict[int, CompletionLogprobs] = {}
    async for idx, d in merged:
        texts[idx].append(d.text)
        out_tokens[idx] = d.num_output_tokens
        if top_n is not None and d.logprobs:
            lps.setdefault(idx, CompletionLogprobs(tok, top_n)).add(d.logprobs)
        if d.finish_reason is not None:
            finish[idx] = (d.finish_reason, d.stop_reason)
    choices = []
    for idx in range(len(prompts) * n):
        pi = idx // n
        text = "".join(texts[idx])
        if body.echo:
            text = prompt_texts[pi] + text
        reason, stop_reason = finish.get(idx, (None, None))
        logprobs = None
        if top_n is not None:
            logprobs = (lps.get(idx) or CompletionLogprobs(tok, top_n)).data
        choices.append({"index": idx, "text": text, "logprobs": logprobs, "finish_reason": reason,
                        "stop_reason": stop_reason, "prompt_logprobs": None})
    prompt_tokens = sum(len(p) for p in prompts)
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": name,
                         "choices": choices, "usage": usage(prompt_tokens, sum(out_tokens.values()))})


async def _indexed(agen, base: int):
    async for i, d in agen:
        yield base + i, d


async def _stream(state, body: CompletionRequest, name: str, rid: str, created: int, agen: AsyncIterator,
                  prompts: list[list[int]], prompt_texts: list[str], n: int, top_n: int | None) -> AsyncIterator[str]:
    include_usage = body.include_usage
    echoed: set[int] = set()
    out_tokens: dict[int, int] = {}
    lps: dict[int, CompletionLogprobs] = {}

    def chunk(idx: int, text: str, logprobs, reason, stop_reason) -> str:
        obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": name,
                               "choices": [{"index": idx, "text": text, "logprobs": logprobs,
                                            "finish_reason": reason, "stop_reason": stop_reason}]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    async for idx, d in agen:
        text = d.text
        if body.echo and idx not in echoed:
            echoed.add(idx)
            text = prompt_texts[idx // n] + text
        out_tokens[idx] = d.num_output_tokens
        logprobs = None
        if top_n is not None and d.logprobs:
            logprobs = lps.setdefault(idx, CompletionLogprobs(state.tokenizer, top_n)).add(d.logprobs)
        if text or d.finish_reason is not None or logprobs:
            yield chunk(idx, text, logprobs, d.finish_reason, d.stop_reason)
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": name, "choices": [],
                   "usage": usage(sum(len(p) for p in prompts), sum(out_tokens.values()))})
    yield DONE
