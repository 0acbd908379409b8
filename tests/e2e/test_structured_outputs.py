"""Structured outputs over HTTP on the real engine (tiny random-weight 4-bit Qwen3-MoE on the CPU, engine core
in a thread), checked by the official ``openai`` client and LangChain: a random model cannot write valid JSON by
chance, so validity is the test. The schemas bound every string, number and array, so a constrained output
always ends well inside max_tokens; the server runs with ``disable_any_whitespace`` (a random model would
otherwise spend its tokens on whitespace). Requests go out concurrently so the engine batches them."""
from __future__ import annotations

import asyncio
import json
import re
from enum import Enum
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from onecard.config import EngineArgs
from onecard.frontend.core_client import make_core_client
from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import collect_chat_stream, metric, start_server

ARGS = {"served_model_name": ["coder"], "max_model_len": 512, "device": "cpu", "seed": 0, "max_num_seqs": 64}
MSGS = [{"role": "user", "content": "Reply in JSON."}]
S = Field(max_length=6)
Small = Annotated[int, Field(ge=-9, le=99)]


class Color(str, Enum):
    red = "red"
    green = "green"


class Point(BaseModel):
    x: int = Field(ge=-5, le=5)
    y: int = Field(ge=0, le=9)


class M1(BaseModel):
    name: str = S
    age: int = Field(ge=0, le=120)


class M2(BaseModel):
    color: Color
    ok: bool


class M3(BaseModel):
    p: Point
    label: str = S


class M4(BaseModel):
    items: list[Small] = Field(min_length=1, max_length=3)


class M5(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{2}[0-9]{2}$")


class M6(BaseModel):
    kind: Literal["a", "b", "c"]
    n: int = Field(ge=1, le=3)


class M7(BaseModel):
    v: Small | Annotated[str, Field(max_length=4)] = Field(union_mode="left_to_right")


class M7b(BaseModel):
    v: Point | Color


class M8(BaseModel):
    note: str | None = Field(default=None, max_length=5)
    flag: bool


class M9(BaseModel):
    points: list[Point] = Field(min_length=1, max_length=2)


class M10(BaseModel):
    tags: list[Color] = Field(min_length=2, max_length=2)


class M11(BaseModel):
    a: Point
    b: Point


class M12(BaseModel):
    pair: tuple[Small, bool]


class M13(BaseModel):
    word: str = Field(pattern=r"^(yes|no)$")


class M14(BaseModel):
    nested: M1
    extra: M2


class M15(BaseModel):
    matrix: list[Annotated[list[Small], Field(max_length=2)]] = Field(min_length=1, max_length=2)


class M16(BaseModel):
    id: int = Field(ge=100, le=999)
    slug: str = Field(pattern=r"^[a-z]{1,5}-[0-9]$")


class M17(BaseModel):
    maybe: Point | None = None
    k: Literal[1, 2]


class M18(BaseModel):
    first: str = S
    second: str = S
    third: bool


class M19(BaseModel):
    choice: Literal["x"] | Literal["y"]  # noqa: PYI030 - an anyOf of consts, on purpose
    count: int = Field(ge=0, le=2)


class M20(BaseModel):
    deep: M3
    more: M6


SCHEMAS = [M1, M2, M3, M4, M5, M6, M7, M7b, M8, M9, M10, M11, M12, M13, M14, M15, M16, M17, M18, M19, M20]
for _m in SCHEMAS:          # short strings inside lists of strings too
    _m.model_rebuild()

# small schemas: the fixture tokenizer spends ~2 tokens per character and the context is 512 tokens
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "maximum": 99, "minimum": 0},
                                              "b": {"type": "boolean"}}, "required": ["a", "b"]}}}]


class Weather(BaseModel):
    city: str = Field(max_length=6)
    unit: Literal["c", "f"] | None = None


class Add(BaseModel):
    a: int = Field(ge=0, le=99)
    b: bool


ARG_MODELS = {"get_weather": Weather, "add": Add}


def _server(model_dir, async_scheduling: bool):
    config = EngineArgs(model=str(model_dir), async_scheduling=async_scheduling, **ARGS).create_config()
    settings = settings_from(config, tool_call_parser="hermes", enable_auto_tool_choice=True,
                             structured_outputs_config='{"disable_any_whitespace": true}')
    return start_server(make_state(config, make_core_client(config, single_process=True), settings))


@pytest.fixture(scope="module")
def server(tiny_moe_gptq_dir):
    srv = _server(tiny_moe_gptq_dir, False)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def _aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600)


async def _gather(server, calls):
    async with _aclient(server) as c:
        return await asyncio.gather(*(f(c) for f in calls))


def test_parse_validates_over_many_schemas(server):
    settings = [{"temperature": 0}] + [{"temperature": 1.0, "seed": s} for s in (1, 2)]

    def call(model, kw):
        return lambda c: c.chat.completions.parse(model="coder", messages=MSGS, response_format=model,
                                                  max_tokens=300, **kw)

    results = asyncio.run(_gather(server, [call(m, kw) for m in SCHEMAS for kw in settings]))
    for (model, kw), r in zip([(m, kw) for m in SCHEMAS for kw in settings], results):
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", (model.__name__, kw, msg.content)
        assert isinstance(msg.parsed, model), (model.__name__, kw, msg.content)
        model.model_validate_json(msg.content)        # the text itself validates (not just the client's view)


def test_json_object_choice_regex_grammar(server):
    specs = [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"extra_body": {"structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}}},
         lambda t: t in ("alpha", "beta", "gamma delta")),
        ({"extra_body": {"guided_choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"extra_body": {"structured_outputs": {"regex": r"[a-c]{2,4}-[0-9]{1,3}"}}},
         lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", t)),
        ({"extra_body": {"guided_regex": r"(\+|-)?[1-9][0-9]?"}}, lambda t: re.fullmatch(r"(\+|-)?[1-9][0-9]?", t)),
        ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "x" ("+" "x"){0,3}'}}},
         lambda t: re.fullmatch(r"x(\+x){0,3}", t)),
        ({"extra_body": {"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}},
         lambda t: isinstance(json.loads(t), list) and all(isinstance(v, bool) for v in json.loads(t))),
    ]

    def call(kw, seed):
        return lambda c: c.chat.completions.create(model="coder", messages=MSGS, max_tokens=60,
                                                   temperature=1.0, seed=seed, **kw)

    results = asyncio.run(_gather(server, [call(kw, s) for kw, _ in specs for s in (1, 2, 3)]))
    for i, r in enumerate(results):
        kw, check = specs[i // 3]
        text = r.choices[0].message.content
        if "json_object" not in str(kw):
            assert r.choices[0].finish_reason == "stop", (kw, text)
            assert check(text), (kw, text)
        elif r.choices[0].finish_reason == "stop":      # free-form JSON has no length bound: check when ended
            assert check(text), text
    # completions take the same fields
    r = httpx.post(server.base_url + "/completions", timeout=300, json={
        "model": "coder", "prompt": "x =", "max_tokens": 20, "temperature": 1.0, "seed": 4,
        "structured_outputs": {"regex": "[0-9]{1,4}"}})
    assert r.status_code == 200 and re.fullmatch("[0-9]{1,4}", r.json()["choices"][0]["text"])
    r = httpx.post(server.base_url + "/completions", timeout=300, json={
        "model": "coder", "prompt": "x =", "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": Point.model_json_schema()}}})
    assert r.status_code == 200
    Point.model_validate_json(r.json()["choices"][0]["text"])


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_tool_choice_required_and_named(server, client, fmt):
    server.state.settings.options.tool_call_parser = fmt    # the --tool-call-parser flag, switched in place
    try:
        named = {"type": "function", "function": {"name": "add"}}
        results = []
        for choice in ("required", named):
            r = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "call"}],
                                               tools=TOOLS, tool_choice=choice, n=10, temperature=1.0, seed=7,
                                               max_tokens=110, parallel_tool_calls=False)
            results.append((choice, r))
        for choice, r in results:
            assert len(r.choices) == 10
            for ch in r.choices:
                assert ch.finish_reason == "tool_calls", (fmt, choice, repr(ch.message.content))
                assert not ch.message.content
                assert len(ch.message.tool_calls) == 1
                call = ch.message.tool_calls[0]
                if choice != "required":
                    assert call.function.name == "add"
                ARG_MODELS[call.function.name].model_validate_json(call.function.arguments)
        # streamed deltas concatenate to the same call as the whole response (same seed)
        for choice in ("required", named):
            kw = {"model": "coder", "messages": [{"role": "user", "content": "call"}], "tools": TOOLS,
                  "tool_choice": choice, "temperature": 1.0, "seed": 11, "max_tokens": 110}
            whole = client.chat.completions.create(**kw).choices[0]
            _, _, calls, finish = collect_chat_stream(client.chat.completions.create(stream=True, **kw))
            assert finish == "tool_calls" == whole.finish_reason
            assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
                (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    finally:
        server.state.settings.options.tool_call_parser = "hermes"


def test_streaming_equals_whole_and_mixed_batch_leaves_free_text_alone(server, client):
    schema = {"type": "json_schema", "json_schema": {"name": "m", "schema": M14.model_json_schema()}}
    free = [[{"role": "user", "content": f"def f{i}(x):"}] for i in range(3)]
    alone = [client.chat.completions.create(model="coder", messages=m, temperature=0, max_tokens=16)
             .choices[0].message.content for m in free]

    def constrained(c):
        return c.chat.completions.create(model="coder", messages=MSGS, temperature=0, max_tokens=300,
                                         response_format=schema)

    def unconstrained(m):
        return lambda c: c.chat.completions.create(model="coder", messages=m, temperature=0, max_tokens=16)

    results = asyncio.run(_gather(server, [constrained, *[unconstrained(m) for m in free], constrained]))
    assert [r.choices[0].message.content for r in results[1:4]] == alone
    whole = results[0].choices[0].message.content
    M14.model_validate_json(whole)
    assert results[-1].choices[0].message.content == whole
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="coder", messages=MSGS, temperature=0, max_tokens=300, response_format=schema, stream=True)
        if c.choices)
    assert streamed == whole


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_constraint_is_400_naming_the_field(server, body, param):
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={"model": "coder", "messages": MSGS, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["param"] == param, err
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric(server.url, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(server.url, "vllm:num_requests_running") == 0.0


def test_metrics_count_constrained_requests_and_compiles(server):
    assert metric(server.url, "onecard:structured_output_requests_total") > 0
    assert metric(server.url, "onecard:structured_output_compile_seconds_count") > 0


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.base_url, api_key="x", model="coder", temperature=0, max_tokens=110,
                     max_retries=0)
    for method in ("json_schema", "function_calling"):   # (the tool's schema fills most of the 512-token context)
        out = llm.with_structured_output(M2, method=method).invoke("A color.")
        assert isinstance(out, M2), method


def test_async_scheduling_gives_the_same_constrained_outputs(server, tiny_moe_gptq_dir):
    kws = [{"temperature": 0}, {"temperature": 1.0, "seed": 3}]
    named = {"type": "function", "function": {"name": "get_weather"}}

    def calls():
        out = [lambda c, m=m, kw=kw: c.chat.completions.create(
            model="coder", messages=MSGS, max_tokens=300, response_format={
                "type": "json_schema", "json_schema": {"name": m.__name__, "schema": m.model_json_schema()}}, **kw)
            for m in (M9, M16, M20) for kw in kws]
        out.append(lambda c: c.chat.completions.create(model="coder", messages=MSGS, max_tokens=80, tools=TOOLS,
                                                       tool_choice=named, temperature=1.0, seed=5))
        return out

    sync = [r.choices[0].message for r in asyncio.run(_gather(server, calls()))]
    srv = _server(tiny_moe_gptq_dir, True)
    try:
        asy = [r.choices[0].message for r in asyncio.run(_gather(srv, calls()))]
    finally:
        srv.stop()
    assert [m.content for m in asy] == [m.content for m in sync]
    assert asy[-1].tool_calls[0].function.arguments == sync[-1].tool_calls[0].function.arguments
