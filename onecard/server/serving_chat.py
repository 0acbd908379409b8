"""POST /v1/chat/completions, streamed (SSE) and not, with reasoning and tool-call parsing.

Contract: ``create_chat_completion(state, body, request)`` renders the messages with the chat template
(tools, chat_template_kwargs), compiles the request's output constraint before queueing it (response_format,
structured_outputs / guided_*, tool_choice required / named / strict tools: ``frontend.constraints``; a bad
one is a 400 naming the field), generates ``n`` choices and returns OpenAI's ``chat.completion`` or a stream
of ``chat.completion.chunk`` events (role first, then content / reasoning / tool-call deltas, finish_reason, optional usage, [DONE]).
The request → prompt ids → parsers step is ``chat_prompt.prepare_chat`` (shared with /v1/responses and
/v1/messages); the text → message step lives in ``chat_parsing.ChoiceParser``.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from onecard.server.chat_prompt import prepare_chat
from onecard.server.openai_types import ChatCompletionRequest, NamedToolChoice, now, random_id
from onecard.server.streaming import DONE, logprob_entries, sse, sse_response, start_stream, usage

__all__ = ["ChatCompletionRequest", "create_chat_completion"]


def _tool_choice_value(choice: Any) -> Any:
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "function": {"name": choice.function.name}}
    return choice


async def create_chat_completion(state, body: ChatCompletionRequest, request: Request) -> Response:
    name = state.model_name(body.model)
    s = state.settings
    params = body.to_sampling_params(s.default_sampling)     # a bad field is a 400 before any work
    state.engine.check_available(params.n)                   # loading, dead or full: answered now
    prepared = await prepare_chat(
        state, [m.model_dump(exclude_none=True) for m in body.messages],
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        tool_choice=_tool_choice_value(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls is not False,
        add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
        chat_template=body.chat_template, chat_template_kwargs=body.chat_template_kwargs,
        add_special_tokens=body.add_special_tokens, params=params, constraint_fields=body.constraint_fields())
    prompt_ids = prepared.prompt_ids
    new_parser = prepared.new_parser
    rid = random_id("chatcmpl")
    created = now()
    gen = state.engine.generate_n(rid, prompt_ids, params)
    top_n = params.logprobs
    if body.stream:
        agen = await start_stream(gen)
        return sse_response(_stream(state, body, name, rid, created, agen, params.n, len(prompt_ids),
                                    new_parser, top_n))

    n = params.n
    texts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    finish: list[tuple[str | None, Any]] = [(None, None)] * n
    out_tokens = [0] * n
    cached = 0
    async for i, d in gen:
        texts[i].append(d.text)
        out_tokens[i] = d.num_output_tokens
        cached = max(cached, d.num_cached_tokens)
        if d.logprobs:
            lps[i].extend(d.logprobs)
        if d.finish_reason is not None:
            finish[i] = (d.finish_reason, d.stop_reason)
    choices = []
    for i in range(n):
        parser = new_parser()
        reasoning, content, calls = parser.whole("".join(texts[i]))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if s.options.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
            message["reasoning"] = reasoning
        message["tool_calls"] = calls
        reason, stop_reason = finish[i]
        if calls:
            reason = "tool_calls"
        logprobs = None
        if top_n is not None:
            logprobs = {"content": logprob_entries(state.tokenizer, lps[i], top_n)}
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason,
                        "stop_reason": stop_reason})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": name,
                         "choices": choices, "usage": usage(len(prompt_ids), sum(out_tokens)),
                         "prompt_logprobs": None})


async def _stream(state, body: ChatCompletionRequest, name: str, rid: str, created: int, agen: AsyncIterator,
                  n: int, num_prompt: int, new_parser, top_n: int | None) -> AsyncIterator[str]:
    include_usage = body.include_usage

    def chunk(i: int, delta: dict[str, Any], reason: str | None = None, stop_reason: Any = None,
              logprobs: Any = None) -> str:
        choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        if reason is not None:
            choice["stop_reason"] = stop_reason
        obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                               "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    parsers = [new_parser() for _ in range(n)]
    out_tokens = [0] * n
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
        for delta in parsers[i].start():
            yield chunk(i, delta)
    async for i, d in agen:
        out_tokens[i] = d.num_output_tokens
        deltas = parsers[i].feed(d.text) if d.text else []
        logprobs = None
        if top_n is not None and d.logprobs:
            logprobs = {"content": logprob_entries(state.tokenizer, d.logprobs, top_n)}
        if d.finish_reason is not None:
            deltas += parsers[i].finish()
        if logprobs is not None and not deltas:
            deltas = [{"content": ""}]
        for k, delta in enumerate(deltas):
            yield chunk(i, delta, logprobs=logprobs if k == 0 else None)
        if d.finish_reason is not None:
            reason = "tool_calls" if parsers[i].tools_called else d.finish_reason
            yield chunk(i, {}, reason, d.stop_reason)
    if include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                   "choices": [], "usage": usage(num_prompt, sum(out_tokens))})
    yield DONE
