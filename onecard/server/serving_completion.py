"""POST /v1/completions (the legacy text API), streamed and not.

Contract: ``create_completion(state, body, request)`` returns a JSONResponse or an SSE StreamingResponse in
OpenAI's ``text_completion`` shape. A prompt is a string, a list of strings, a list of token ids or a list of
those; choice index = prompt_index * n + i. ``echo`` prepends the prompt text; ``logprobs`` N gives the
legacy tokens/token_logprobs/top_logprobs/text_offset block. An output constraint (response_format,
structured_outputs, guided_*) is compiled before any prompt is queued (a bad one is a 400 naming the field).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from onecard.frontend.constraints import constraint_for_request
from onecard.frontend.output_processor import merge_streams
from onecard.frontend.tokenizer import surely_too_long
from onecard.server.errors import BadRequest
from onecard.server.openai_types import CompletionRequest, now, random_id
from onecard.server.streaming import DONE, CompletionLogprobs, sse, sse_response, start_stream, usage

__all__ = ["CompletionRequest", "create_completion"]


async def create_completion(state, body: CompletionRequest, request: Request) -> Response:
    name = state.model_name(body.model)
    tok = state.tokenizer
    max_len = state.settings.max_model_len
    params = body.to_sampling_params(state.settings.default_sampling)   # a bad field is a 400 before any work
    raw = body.prompts()
    state.engine.check_available(params.n * len(raw))                   # loading, dead or full: answered now
    vocab = len(tok)
    for p in raw:
        if isinstance(p, str):
            least = surely_too_long(tok, len(p), max_len)
            if least is not None:
                raise BadRequest(f"The prompt is at least {least} tokens long, longer than the maximum model "
                                 f"length of {max_len}. Please reduce the length of the prompt.", param="prompt")
        elif any(not (type(t) is int and 0 <= t < vocab) for t in p):
            raise BadRequest(f"prompt token ids must be integers in [0, {vocab}).", param="prompt")

    def encode() -> tuple[list[list[int]], list[str]]:
        # On the text threads: tokenizing must not stall the event loop.
        ids, texts = [], []
        for p in raw:
            if isinstance(p, str):
                ids.append(list(tok.encode(p, add_special_tokens=body.add_special_tokens)))
                texts.append(p)
            else:
                ids.append(list(p))
                texts.append(tok.decode(p) if body.echo else "")
        return ids, texts

    prompts, prompt_texts = await state.run_blocking(encode)
    await state.grammar.attach(params, constraint_for_request(**body.constraint_fields()))
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
