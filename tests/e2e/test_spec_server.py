"""Speculative decoding over HTTP (tiny random-weight 4-bit Qwen3-MoE on the CPU, engine core in a thread), with
the official ``openai`` client: a server with ``--speculative-config`` (the real ngram drafter) answers as the
plain server does, greedy, for JSON-schema outputs (the grammar masks every draft position), forced tool calls
through the hermes parser, and streamed chat with stop strings; its /metrics carry vLLM's spec-decode series. Each
with the synchronous engine loop and with async scheduling (the hybrid loop: plain steps pipelined, verify steps
synchronous)."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from onecard.config import EngineArgs
from onecard.frontend.core_client import make_core_client
from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import collect_chat_stream, metric, start_server
from tests.e2e.test_structured_outputs import ARGS, M9, M14, M16, MSGS, TOOLS

_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _server(model_dir, spec, async_scheduling: bool = False):
    config = EngineArgs(model=str(model_dir), speculative_config=spec, async_scheduling=async_scheduling,
                        **ARGS).create_config()
    assert config.scheduler.async_scheduling is async_scheduling
    settings = settings_from(config, tool_call_parser="hermes", enable_auto_tool_choice=True,
                             structured_outputs_config='{"disable_any_whitespace": true}')
    return start_server(make_state(config, make_core_client(config, single_process=True), settings))


@pytest.fixture(scope="module")
def plain_server(tiny_moe_gptq_dir):
    plain = _server(tiny_moe_gptq_dir, None)
    yield plain
    plain.stop()


@pytest.fixture(scope="module", params=["sync", "async"])
def servers(request, tiny_moe_gptq_dir, plain_server):
    """The plain server and a speculative one, on the synchronous loop or the async hybrid loop."""
    spec = _server(tiny_moe_gptq_dir, _SPEC, async_scheduling=request.param == "async")
    yield plain_server, spec
    spec.stop()


def _calls():
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = [lambda c, m=m: c.chat.completions.create(
        model="coder", messages=MSGS, max_tokens=300, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": m.__name__, "schema": m.model_json_schema()}})
        for m in (M9, M14, M16)]
    out += [lambda c, ch=ch: c.chat.completions.create(model="coder", messages=[{"role": "user", "content": "call"}],
                                                      max_tokens=110, tools=TOOLS, tool_choice=ch, temperature=0)
            for ch in ("required", named)]
    out += [lambda c, i=i: c.chat.completions.create(
        model="coder", messages=[{"role": "user", "content": f"def f{i}(x):\n    return x\n" * 3}], max_tokens=40,
        temperature=0) for i in range(3)]
    return out


async def _gather(server, calls):
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600) as c:
        return await asyncio.gather(*(f(c) for f in calls))


def _msg(m):
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in (m.tool_calls or [])]
    return m.content, calls


def test_same_answers_as_the_plain_server(servers):
    plain, spec = servers
    want = [(_msg(r.choices[0].message), r.choices[0].finish_reason, r.usage.completion_tokens)
            for r in asyncio.run(_gather(plain, _calls()))]
    got = [(_msg(r.choices[0].message), r.choices[0].finish_reason, r.usage.completion_tokens)
           for r in asyncio.run(_gather(spec, _calls()))]
    assert got == want
    M14.model_validate_json(got[1][0][0])
    assert got[3][1] == "tool_calls" and got[4][0][1][0][0] == "get_weather"
    drafts = metric(spec.url, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(spec.url, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > accepted > 0
    assert metric(spec.url, "vllm:spec_decode_num_drafts_total") > 0
    assert metric(spec.url, "vllm:kv_cache_usage_perc") == 0.0


def test_streaming_with_stop_strings(servers):
    plain, spec = servers
    msgs = [{"role": "user", "content": "import os\nimport sys\nimport os\nimport sys\n"}]
    pc = openai.OpenAI(base_url=plain.base_url, api_key="x", max_retries=0)
    whole = pc.chat.completions.create(model="coder", messages=msgs, temperature=0, max_tokens=40).choices[0]
    text = whole.message.content
    stops = [text[i:i + 2] for i in (5, 11, 17) if len(text) > i + 2 and text[i:i + 2].strip()]
    for stop in [None, *stops]:
        kw = {"model": "coder", "messages": msgs, "temperature": 0, "max_tokens": 40, "stop": stop}
        ref = pc.chat.completions.create(**kw).choices[0]
        sc = openai.OpenAI(base_url=spec.base_url, api_key="x", max_retries=0)
        chunks = list(sc.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = [c.usage for c in chunks if c.usage]
        assert (streamed, finish) == (ref.message.content, [ref.finish_reason]), stop
        assert usage[-1].completion_tokens == pc.chat.completions.create(**kw).usage.completion_tokens
    assert metric(spec.url, "vllm:kv_cache_usage_perc") == 0.0


def test_streamed_tool_calls_equal_the_plain_server(servers):
    """Several tokens per delta through the hermes parser's streaming path: the argument fragments concatenate
    to the plain server's call."""
    plain, spec = servers
    named = {"type": "function", "function": {"name": "add"}}
    kw = {"model": "coder", "messages": [{"role": "user", "content": "call"}], "tools": TOOLS, "tool_choice": named,
          "temperature": 0, "max_tokens": 110}
    whole = openai.OpenAI(base_url=plain.base_url, api_key="x", max_retries=0).chat.completions.create(**kw)
    want = [(t.function.name, json.loads(t.function.arguments)) for t in whole.choices[0].message.tool_calls]
    sc = openai.OpenAI(base_url=spec.base_url, api_key="x", max_retries=0)
    _, _, calls, finish = collect_chat_stream(sc.chat.completions.create(stream=True, **kw))
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == want
    assert finish == whole.choices[0].finish_reason == "tool_calls"
