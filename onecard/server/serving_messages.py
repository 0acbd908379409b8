"""POST /v1/messages (Anthropic's Messages API), streamed (SSE events) and not, and /v1/messages/count_tokens.

Contract: ``create_message(state, body, request)`` maps the request onto the chat path
(``messages_types`` → chat messages, ``chat_prompt.prepare_chat`` → prompt ids and parsers, the engine,
the output processor) and returns a ``message`` whose ``content`` holds ``thinking``, ``text`` and
``tool_use`` blocks (``input`` a mapping), ``stop_reason`` ``end_turn`` | ``max_tokens`` |
``stop_sequence`` (with ``stop_sequence``) | ``tool_use``, and usage (``input_tokens`` not served from the
prefix cache, ``cache_read_input_tokens`` those that were, ``output_tokens``). Streaming sends
``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``thinking_delta``, ``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason,
usage) and ``message_stop``; a failure mid-stream is an ``error`` event. ``count_tokens`` renders the same
prompt and answers ``{"input_tokens": N}``. Errors use Anthropic's shape (``errors.error_response_for``).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from onecard.server.chat_prompt import PreparedChat, prepare_chat
from onecard.server.errors import APIError, BadRequest, anthropic_error_body
from onecard.server.messages_types import CountTokensRequest, MessagesRequest
from onecard.server.output_blocks import Block, BlockAssembler, BlockEvent, blocks_from_whole
from onecard.server.streaming import sse_response, start_stream

__all__ = ["CountTokensRequest", "MessagesRequest", "count_tokens", "create_message"]


async def _prepare(state, body: CountTokensRequest, params=None, counting: bool = False) -> PreparedChat:
    try:
        messages = body.to_chat_messages()
        tools = body.chat_tools()
        tool_choice, parallel = body.chat_tool_choice()
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if counting and tool_choice == "auto":
        tool_choice = "none"      # same prompt; counting needs no tool parser configured
    return await prepare_chat(state, messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel,
                              refuse_too_long=not counting, params=params)


async def count_tokens(state, body: CountTokensRequest, request: Request) -> Response:
    state.model_name(body.model)
    return JSONResponse({"input_tokens": len((await _prepare(state, body, counting=True)).prompt_ids)})


def _stop_reason(finish: str | None, stop_reason: Any, tool_used: bool) -> tuple[str, str | None]:
    if tool_used:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def _block(b: Block, done: bool = True) -> dict[str, Any]:
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text if done else "", "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": b.text if done else ""}
    return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": b.arguments() if done else {}}


async def create_message(state, body: MessagesRequest, request: Request) -> Response:
    name = state.model_name(body.model)
    params = body.to_sampling_params(state.settings.default_sampling)     # a bad field is a 400 before any work
    state.engine.check_available(params.n)                                # loading, dead or full: answered now
    prepared = await _prepare(state, body, params)
    mid = f"msg_{uuid.uuid4().hex}"
    gen = state.engine.generate_n(mid, prepared.prompt_ids, params)
    message = {"id": mid, "type": "message", "role": "assistant", "model": name, "content": [],
               "stop_reason": None, "stop_sequence": None}
    if body.stream:
        agen = await start_stream(gen)
        return sse_response(_stream(message, prepared, agen), error_events=_error_events)
    texts: list[str] = []
    finish, stop, out_tokens, cached = None, None, 0, 0
    async for _, d in gen:
        texts.append(d.text)
        out_tokens, cached = d.num_output_tokens, max(cached, d.num_cached_tokens)
        if d.finish_reason is not None:
            finish, stop = d.finish_reason, d.stop_reason
    blocks = blocks_from_whole(*prepared.new_parser().whole("".join(texts)))
    reason, sequence = _stop_reason(finish, stop, any(b.kind == "tool_call" for b in blocks))
    message.update(content=[_block(b) for b in blocks], stop_reason=reason, stop_sequence=sequence,
                   usage=_usage(len(prepared.prompt_ids), cached, out_tokens))
    return JSONResponse(message)


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_events(err: APIError) -> list[str]:
    body, _ = anthropic_error_body(err.message, err.status)
    return [_event("error", {"error": body["error"]})]


def _render(e: BlockEvent) -> str:
    b = e.block
    if e.kind == "start":
        return _event("content_block_start", {"index": b.index, "content_block": _block(b, done=False)})
    if e.kind == "stop":
        return _event("content_block_stop", {"index": b.index})
    if b.kind == "reasoning":
        delta = {"type": "thinking_delta", "thinking": e.text}
    elif b.kind == "text":
        delta = {"type": "text_delta", "text": e.text}
    else:
        delta = {"type": "input_json_delta", "partial_json": e.text}
    return _event("content_block_delta", {"index": b.index, "delta": delta})


async def _stream(message: dict[str, Any], prepared: PreparedChat, agen: AsyncIterator) -> AsyncIterator[str]:
    num_prompt = len(prepared.prompt_ids)
    first = await anext(agen, None)          # already awaited by start_stream: carries the prefix-cache hit
    cached = first[1].num_cached_tokens if first is not None else 0
    yield _event("message_start", {"message": {**message, "usage": _usage(num_prompt, cached, 0)}})
    yield _event("ping", {})
    parser = prepared.new_parser()
    blocks = BlockAssembler()
    events = blocks.feed(parser.start())
    finish, stop, out_tokens = None, None, 0

    async def rest() -> AsyncIterator:
        if first is not None:
            yield first
        async for item in agen:
            yield item

    try:
        async for _, d in rest():
            out_tokens = d.num_output_tokens
            deltas = parser.feed(d.text) if d.text else []
            if d.finish_reason is not None:
                finish, stop = d.finish_reason, d.stop_reason
                deltas += parser.finish()
            for e in events + blocks.feed(deltas):
                yield _render(e)
            events = []
    finally:
        await agen.aclose()       # a client that went away aborts the engine request now
    for e in events + blocks.close():
        yield _render(e)
    reason, sequence = _stop_reason(finish, stop, any(b.kind == "tool_call" for b in blocks.blocks))
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": _usage(num_prompt, cached, out_tokens)})
    yield _event("message_stop", {})
