"""POST /v1/responses (OpenAI's Responses API), streamed (SSE events) and not; stateless.

Contract: ``create_response(state, body, request)`` maps the request onto the chat path
(``responses_types`` → chat messages, ``chat_prompt.prepare_chat`` → prompt ids and parsers, the engine, the
output processor) and returns a ``response`` object whose ``output`` holds ``reasoning``, ``message``
(``output_text``) and ``function_call`` items (``call_id`` to answer with ``function_call_output``), with
``usage`` in input/output tokens; ``status`` is ``incomplete`` (reason ``max_output_tokens``) when the
length limit ended it. Streaming sends the Responses event sequence with ``sequence_number``s:
``response.created``, ``response.in_progress``, per item ``response.output_item.added`` → deltas
(``response.reasoning_text.delta``, ``response.content_part.added`` + ``response.output_text.delta``,
``response.function_call_arguments.delta``) → their ``.done`` events → ``response.output_item.done``, and
``response.completed`` (or ``response.incomplete``) with usage. ``text.format`` json_schema / json_object
and ``tool_choice`` required / named go through structured outputs (``frontend.constraints``), as chat's.
``previous_response_id`` is refused with a 400: nothing is stored.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from onecard.server.chat_prompt import PreparedChat, prepare_chat
from onecard.server.errors import APIError, BadRequest
from onecard.server.openai_types import now
from onecard.server.output_blocks import Block, BlockAssembler, BlockEvent, blocks_from_whole
from onecard.server.responses_types import ResponsesRequest
from onecard.server.streaming import sse_response, start_stream

__all__ = ["ResponsesRequest", "create_response"]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class _Shaper:
    """The response object and its items for one request."""

    def __init__(self, body: ResponsesRequest, name: str):
        self.body = body
        self.name = name
        self.id = _id("resp")
        self.created = now()
        self.item_ids: dict[int, str] = {}

    def item_id(self, block: Block) -> str:
        prefix = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}[block.kind]
        return self.item_ids.setdefault(block.index, _id(prefix))

    def item(self, block: Block, done: bool = True) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": self.item_id(block), "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
        if block.kind == "text":
            return {"type": "message", "id": self.item_id(block), "role": "assistant", "status": status,
                    "content": [self.text_part(block.text)] if done else []}
        return {"type": "function_call", "id": self.item_id(block), "call_id": block.call_id, "name": block.name,
                "arguments": block.text if done else "", "status": status}

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.name,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": b.reasoning, "store": False,
                "temperature": b.temperature, "text": b.text or {"format": {"type": "text"}},
                "tool_choice": b.tool_choice, "tools": b.tools or [], "top_p": b.top_p, "truncation": "disabled",
                "usage": usage, "user": b.user, "metadata": b.metadata or {}}


async def _prepare(state, body: ResponsesRequest, params) -> PreparedChat:
    try:
        body.check_supported()
        messages = body.to_chat_messages()
        tools = body.chat_tools()
        tool_choice = body.chat_tool_choice()
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return await prepare_chat(state, messages, tools=tools, tool_choice=tool_choice,
                        parallel_tool_calls=body.parallel_tool_calls is not False,
                        chat_template_kwargs=body.chat_template_kwargs, params=params,
                        constraint_fields={"response_format": body.response_format()},
                        response_format_param="text.format")


async def create_response(state, body: ResponsesRequest, request: Request) -> Response:
    name = state.model_name(body.model)
    params = body.to_sampling_params(state.settings.default_sampling)     # a bad field is a 400 before any work
    state.engine.check_available(params.n)                                # loading, dead or full: answered now
    prepared = await _prepare(state, body, params)
    shaper = _Shaper(body, name)
    gen = state.engine.generate_n(shaper.id, prepared.prompt_ids, params)
    if body.stream:
        agen = await start_stream(gen)
        return sse_response(_stream(shaper, prepared, agen), error_events=_error_events)
    texts: list[str] = []
    finish, out_tokens, cached = None, 0, 0
    async for _, d in gen:
        texts.append(d.text)
        out_tokens, cached = d.num_output_tokens, max(cached, d.num_cached_tokens)
        finish = d.finish_reason or finish
    blocks = blocks_from_whole(*prepared.new_parser().whole("".join(texts)))
    status = "incomplete" if finish == "length" else "completed"
    return JSONResponse(shaper.response(status, [shaper.item(b) for b in blocks],
                                        _usage(len(prepared.prompt_ids), out_tokens, cached)))


def _event(kind: str, seq: int, **fields: Any) -> str:
    data = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_events(err: APIError) -> list[str]:
    return [_event("error", 0, code=str(err.status), message=err.message, param=err.param)]


async def _stream(shaper: _Shaper, prepared: PreparedChat, agen: AsyncIterator) -> AsyncIterator[str]:
    seq = 0

    def ev(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **fields)

    def render(e: BlockEvent) -> list[str]:
        b = e.block
        iid, out_idx = shaper.item_id(b), b.index
        if e.kind == "start":
            out = [ev("response.output_item.added", output_index=out_idx, item=shaper.item(b, done=False))]
            if b.kind == "text":
                out.append(ev("response.content_part.added", item_id=iid, output_index=out_idx, content_index=0,
                              part=shaper.text_part("")))
            return out
        if e.kind == "delta":
            if b.kind == "reasoning":
                return [ev("response.reasoning_text.delta", item_id=iid, output_index=out_idx, content_index=0,
                           delta=e.text)]
            if b.kind == "text":
                return [ev("response.output_text.delta", item_id=iid, output_index=out_idx, content_index=0,
                           delta=e.text, logprobs=[])]
            return [ev("response.function_call_arguments.delta", item_id=iid, output_index=out_idx, delta=e.text)]
        if b.kind == "reasoning":
            out = [ev("response.reasoning_text.done", item_id=iid, output_index=out_idx, content_index=0,
                      text=b.text)]
        elif b.kind == "text":
            out = [ev("response.output_text.done", item_id=iid, output_index=out_idx, content_index=0,
                      text=b.text, logprobs=[]),
                   ev("response.content_part.done", item_id=iid, output_index=out_idx, content_index=0,
                      part=shaper.text_part(b.text))]
        else:
            out = [ev("response.function_call_arguments.done", item_id=iid, output_index=out_idx, name=b.name,
                      arguments=b.text)]
        return out + [ev("response.output_item.done", output_index=out_idx, item=shaper.item(b))]

    parser = prepared.new_parser()
    blocks = BlockAssembler()
    yield ev("response.created", response=shaper.response("in_progress", [], None))
    yield ev("response.in_progress", response=shaper.response("in_progress", [], None))
    events = blocks.feed(parser.start())
    finish, out_tokens, cached = None, 0, 0
    try:
        async for _, d in agen:
            out_tokens, cached = d.num_output_tokens, max(cached, d.num_cached_tokens)
            deltas = parser.feed(d.text) if d.text else []
            if d.finish_reason is not None:
                finish = d.finish_reason
                deltas += parser.finish()
            for e in events + blocks.feed(deltas):
                for s in render(e):
                    yield s
            events = []
    finally:
        await agen.aclose()       # a client that went away aborts the engine request now
    for e in events + blocks.close():
        for s in render(e):
            yield s
    status = "incomplete" if finish == "length" else "completed"
    yield ev(f"response.{status}", response=shaper.response(
        status, [shaper.item(b) for b in blocks.blocks], _usage(len(prepared.prompt_ids), out_tokens, cached)))
