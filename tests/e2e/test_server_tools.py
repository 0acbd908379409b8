"""Parser → HTTP end to end: scripted model texts (reasoning, hermes JSON and Qwen3-Coder XML tool calls)
through a real server started with the deployment's parser flags; whole and streamed responses must agree
with the parsers' own whole-text results, and the stream must follow OpenAI's delta protocol."""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from onecard import parsers
from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import collect_chat_stream, scripted_engine_config, start_server, wait_health
from tests.e2e.scripted import Script, ScriptedCoreClient

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>')
XML_TWO = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
           "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
           "Berlin\n</parameter>\n</function>\n</tool_call>")
THINK = "<think>\nThe user wants a number.\n</think>\n\nThe answer is 42."
MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
# named tool_choice: the grammar makes the model write the whole call (this scripted model writes it anyway)
NAMED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.fixture(scope="module")
def gate():
    return threading.Event()


@pytest.fixture(scope="module")
def server(e2e_tokenizer_dir, e2e_tokenizer, gate):
    script = Script(e2e_tokenizer, default="plain answer", replies=[
        ("HERMES", HERMES), ("XMLTWO", XML_TWO), ("THINK", THINK), ("MALFORMED", MALFORMED),
        ("NAMED", NAMED_CALL)])
    config = scripted_engine_config(e2e_tokenizer_dir, e2e_tokenizer, names=("coder", "reasoning"),
                                    max_model_len=1024)
    core = ScriptedCoreClient(config, script, gate=gate, num_blocks=128)
    settings = settings_from(config, api_key="sekret", reasoning_parser="qwen3", tool_call_parser="hermes",
                             enable_auto_tool_choice=True)
    srv = start_server(make_state(config, core, settings, e2e_tokenizer), wait_ready=False)
    yield srv
    gate.set()
    srv.stop()


def test_health_is_503_while_loading_then_200(server, gate):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 503
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200  # model cards do not need the engine
    gate.set()
    wait_health(server.url, 200)


@pytest.fixture(scope="module")
def client(server, gate):
    gate.set()
    wait_health(server.url, 200)
    return openai.OpenAI(base_url=server.base_url, api_key="sekret", max_retries=0)


def test_api_key(server, client):
    body = {"model": "coder", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json() == {"error": {"message": "Unauthorized: a valid API key is required.",
                                      "type": "AuthenticationError", "param": None, "code": 401}}
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert client.chat.completions.create(**body).choices[0].message.content


def _chat(client, trigger, stream, **kw):
    return client.chat.completions.create(model="reasoning", messages=[{"role": "user", "content": trigger}],
                                          tools=TOOLS, max_tokens=200, stream=stream, **kw)


@pytest.mark.parametrize("trigger,text", [("HERMES", HERMES), ("XMLTWO", XML_TWO)])
def test_tool_calls_whole_and_streamed(client, trigger, text):
    expected = parsers.get_tool_parser("hermes").parse(text, TOOLS)
    assert expected.tool_calls  # the table is meaningful
    r = _chat(client, trigger, False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == expected.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [(c.name, json.loads(c.arguments_json)) for c in expected.tool_calls]
    assert all(c.id and c.type == "function" for c in msg.tool_calls)

    content, reasoning, calls, finish = collect_chat_stream(_chat(client, trigger, True))
    assert finish == "tool_calls" and reasoning == ""
    assert (content or None) == expected.content
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == \
        [(c.name, json.loads(c.arguments_json)) for c in expected.tool_calls]


def test_reasoning_split_whole_and_streamed(client):
    r = client.chat.completions.create(model="reasoning", messages=[{"role": "user", "content": "THINK"}],
                                       max_tokens=200)
    msg = r.choices[0].message
    exp_reasoning, exp_content = parsers.get_reasoning_parser("qwen3").parse(THINK, False)
    assert msg.content == exp_content == "The answer is 42."
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == exp_reasoning
    content, reasoning, _, finish = collect_chat_stream(client.chat.completions.create(
        model="reasoning", messages=[{"role": "user", "content": "THINK"}], max_tokens=200, stream=True))
    assert (content, reasoning, finish) == (exp_content, exp_reasoning, "stop")


def test_enable_thinking_false_is_all_content(client):
    r = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "THINK"}],
                                       max_tokens=200, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == THINK.strip() or r.choices[0].message.content == THINK
    assert r.choices[0].message.model_extra["reasoning_content"] is None


def test_plain_answer_never_lands_in_reasoning(client):
    r = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "hi"}], max_tokens=50)
    assert r.choices[0].message.content == "plain answer"
    assert r.choices[0].message.model_extra["reasoning"] is None
    assert r.choices[0].message.tool_calls in (None, [])


def test_malformed_call_comes_back_as_content(client):
    r = _chat(client, "MALFORMED", False)
    assert r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    assert "get_weather" in r.choices[0].message.content
    content, _, calls, finish = collect_chat_stream(_chat(client, "MALFORMED", True))
    assert not calls and finish == "stop" and content == r.choices[0].message.content


def test_named_tool_choice_parses_the_call(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(client, "NAMED", False, tool_choice=choice)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    _, _, scalls, finish = collect_chat_stream(_chat(client, "NAMED", True, tool_choice=choice))
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in scalls.values()] == [("get_weather", {"city": "Rome"})]


def test_tool_result_round_trip_renders(client):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="coder", messages=msgs, tools=TOOLS, max_tokens=20)
    assert r.choices[0].message.content == "plain answer"


def test_unknown_named_tool_is_400(server):
    r = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": "Bearer sekret"},
                   json={"model": "coder", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                         "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    r = _chat(client, "XMLTWO", False, parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["city"] == "Paris"
    _, _, calls, finish = collect_chat_stream(_chat(client, "XMLTWO", True, parallel_tool_calls=False))
    assert list(calls) == [0] and finish == "tool_calls"
