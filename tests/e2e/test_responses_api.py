"""POST /v1/responses end to end with the official ``openai`` client (``client.responses.create``), streamed
and not, on a scripted token source behind the real engine and Qwen3-Coder's published chat template:
text, reasoning, tool calls in the Qwen3-Coder XML and hermes forms, a ``function_call_output`` round trip,
usage equal to the token counts, the event protocol, errors, and abort on disconnect."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from onecard import parsers
from tests.e2e.agent_server import (
    API_KEY,
    FINAL,
    HERMES_CALLS,
    LONG,
    PLAIN,
    RESPONSES_TOOLS,
    THINK,
    XML_CALLS,
    kv_idle,
    last_prompt,
    reply_len,
    wait_for,
)
from tests.e2e.harness import metric


@pytest.fixture(scope="module")
def client(agent_server):
    return openai.OpenAI(base_url=agent_server.base_url, api_key=API_KEY, max_retries=0)


def _stream(client, **kw):
    """(events, final response) of a streamed call, checking sequence numbers and item bookkeeping."""
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [i.id for i in done] == [i.id for i in events[-1].response.output]
    return events, events[-1].response


def test_text_whole_and_streamed_with_usage(client, agent_server, e2e_tokenizer):
    r = client.responses.create(model="coder", input="hello", instructions="Be brief.")
    assert r.status == "completed" and r.model == "coder" and r.object == "response"
    assert r.output_text == PLAIN
    assert [i.type for i in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    prompt = last_prompt(agent_server)
    expected = e2e_tokenizer.encode(e2e_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}], tokenize=False,
        add_generation_prompt=True, chat_template=agent_server.state.settings.chat_template),
        add_special_tokens=False)
    assert prompt == expected
    assert r.usage.input_tokens == len(prompt)
    assert r.usage.output_tokens == reply_len(e2e_tokenizer, PLAIN)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens

    events, final = _stream(client, model="reasoning", input="hello", instructions="Be brief.")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == PLAIN
    assert [e.type for e in events if e.type.startswith("response.content_part")] == \
        ["response.content_part.added", "response.content_part.done"]
    assert [e.text for e in events if e.type == "response.output_text.done"] == [PLAIN]
    assert final.status == "completed" and final.model == "reasoning" and final.output_text == PLAIN
    assert (final.usage.input_tokens, final.usage.output_tokens) == (r.usage.input_tokens, r.usage.output_tokens)


def test_reasoning_item(client):
    exp_reasoning, exp_content = parsers.get_reasoning_parser("qwen3").parse(THINK, False)
    r = client.responses.create(model="coder", input="THINK")
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == exp_reasoning and r.output_text == exp_content
    events, final = _stream(client, model="coder", input="THINK")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == exp_reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == exp_content
    assert [i.type for i in final.output] == ["reasoning", "message"]


def _calls(output):
    return [(i.name, json.loads(i.arguments)) for i in output if i.type == "function_call"]


@pytest.mark.parametrize("trigger,calls,text", [("XMLCALL", XML_CALLS, None),
                                                ("HERMESCALL", HERMES_CALLS, "Let me check.")])
def test_tool_calls_whole_and_streamed(client, trigger, calls, text):
    r = client.responses.create(model="coder", input=f"{trigger} weather?", tools=RESPONSES_TOOLS)
    assert _calls(r.output) == calls
    assert all(i.call_id and i.id.startswith("fc_") and i.status == "completed"
               for i in r.output if i.type == "function_call")
    assert (r.output_text or None) == text
    events, final = _stream(client, model="coder", input=f"{trigger} weather?", tools=RESPONSES_TOOLS)
    assert _calls(final.output) == calls
    for item in (i for i in final.output if i.type == "function_call"):
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == item.id]
        dones = [e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == item.id]
        assert "".join(pieces) == item.arguments == dones[0].arguments
    assert (final.output_text or None) == text


def test_function_call_output_round_trip(client, agent_server, e2e_tokenizer):
    first = client.responses.create(model="coder", input="XMLCALL weather in Paris and Berlin?",
                                    tools=RESPONSES_TOOLS)
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 2
    history = [{"role": "user", "content": "XMLCALL weather in Paris and Berlin?"}]
    history += [{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                for c in calls]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": out}
                for c, out in zip(calls, ["sunny", "rainy"])]
    for stream in (False, True):
        if stream:
            _, final = _stream(client, model="coder", input=history, tools=RESPONSES_TOOLS)
        else:
            final = client.responses.create(model="coder", input=history, tools=RESPONSES_TOOLS)
        assert final.output_text == FINAL and not _calls(final.output)
        text = e2e_tokenizer.decode(last_prompt(agent_server))
        # both results in one user turn, after the assistant turn that made both calls
        assert ("<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>\n<|im_end|>"
                in text)
        assert "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>" in text


def test_max_output_tokens_is_incomplete(client, e2e_tokenizer):
    r = client.responses.create(model="coder", input="LONG", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    assert r.output_text == e2e_tokenizer.decode(e2e_tokenizer.encode(LONG, add_special_tokens=False)[:5])
    _, final = _stream(client, model="coder", input="LONG", max_output_tokens=5)
    assert final.status == "incomplete" and final.output_text == r.output_text


def test_errors(client, agent_server):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="nope", input="hi")
    assert e.value.status_code == 404 and "nope" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="coder", input="word " * 3000)
    assert "maximum model length of 2048" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="coder", input="word " * 3000, stream=True)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="coder", input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="coder", input="hi", text={"format": {"type": "xml"}})
    assert e.value.body["param"] == "text.format" and "xml" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="coder", input="hi", tools=[{"type": "web_search"}])
    assert "web_search" in e.value.message
    r = httpx.post(agent_server.base_url + "/responses", json={"model": "coder", "input": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(agent_server.url + "/health").status_code == 200


def test_disconnect_mid_stream_aborts(agent_server):
    runner = agent_server.state.engine.core.runner
    runner.hold_after, _ = 5, runner.release.clear()
    try:
        with httpx.stream("POST", agent_server.base_url + "/responses",
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "coder", "input": "LONG", "stream": True}) as r:
            assert r.status_code == 200
            deltas = 0
            lines = r.iter_lines()       # held: dropping the iterator would close the connection here
            for line in lines:
                deltas += line.startswith("event: response.output_text.delta")
                if deltas >= 3:
                    break
            assert metric(agent_server.url, "vllm:kv_cache_usage_perc") > 0       # still running while connected
            assert agent_server.state.engine.num_in_flight == 1
        assert wait_for(lambda: agent_server.state.engine.num_in_flight == 0)
    finally:
        runner.hold_after = None
        runner.release.set()
    assert wait_for(lambda: kv_idle(agent_server))
    assert len(LONG.split()) > 100           # the reply was far from done


def test_queue_full_is_503_and_metrics_move(client, agent_server):
    sched = agent_server.state.engine.core.engine_core.scheduler
    old = sched.config.max_num_queued_reqs, sched.config.max_num_seqs
    # no free running slot and no queue: every new request finds the queue full (--max-num-queued-reqs)
    sched.config.max_num_queued_reqs, sched.config.max_num_seqs = 0, 0
    try:
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as e:
                client.responses.create(model="coder", input="x", stream=stream)
            assert e.value.status_code == 503 and "--max-num-queued-reqs=0" in e.value.message
    finally:
        sched.config.max_num_queued_reqs, sched.config.max_num_seqs = old
    gen0 = metric(agent_server.url, "vllm:generation_tokens_total")
    r = client.responses.create(model="reasoning", input="hi")
    assert metric(agent_server.url, "vllm:generation_tokens_total") == gen0 + r.usage.output_tokens


@pytest.mark.parametrize("choice,trigger,calls", [
    ({"type": "function", "name": "get_weather"}, "NAMEDCALL", [("get_weather", {"city": "Rome"})]),
    ("required", "ANYCALL", [("get_weather", {"city": "Oslo"})])])
def test_tool_choice_named_and_required(client, choice, trigger, calls):
    """Named / required take chat's path (structured outputs' grammar)."""
    r = client.responses.create(model="coder", input=trigger, tools=RESPONSES_TOOLS, tool_choice=choice)
    assert _calls(r.output) == calls
    _, final = _stream(client, model="coder", input=trigger, tools=RESPONSES_TOOLS, tool_choice=choice)
    assert _calls(final.output) == calls


def test_text_format_json_schema_goes_through_structured_outputs(client, agent_server):
    """text.format json_schema is compiled by the structured-outputs machinery (chat's response_format path):
    accepted, attached to the request; a schema that is not a schema is a 400 naming text.format."""
    fmt = {"type": "json_schema", "name": "answer", "strict": True,
           "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
    r = client.responses.create(model="coder", input="hi", text={"format": fmt})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="coder", input="hi", text={"format": {**fmt, "schema": {"type": 5}}})
    assert e.value.body["param"] == "text.format"
