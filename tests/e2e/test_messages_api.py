"""POST /v1/messages and /v1/messages/count_tokens end to end with the official ``anthropic`` client
(``messages.create``, ``messages.stream``, ``messages.count_tokens``) on a scripted token source behind the
real engine and Qwen3-Coder's published chat template: text, thinking, a ``tool_use`` round trip with
``tool_result`` (Qwen3-Coder XML and hermes forms), every ``stop_reason``, usage, ``x-api-key`` with
``--api-key``, errors in Anthropic's shape, and abort on disconnect."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from onecard import parsers
from tests.e2e.agent_server import (
    ANTHROPIC_TOOLS,
    API_KEY,
    FINAL,
    HERMES_CALLS,
    LONG,
    PLAIN,
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
    # the anthropic client sends the key as x-api-key
    return anthropic.Anthropic(base_url=agent_server.url, api_key=API_KEY, max_retries=0)


def _user(text):
    return [{"role": "user", "content": text}]


def _full_usage(u) -> int:
    return u.input_tokens + (u.cache_read_input_tokens or 0)


def test_text_create_and_stream_with_usage(client, agent_server, e2e_tokenizer):
    msgs = _user("hello")
    m = client.messages.create(model="coder", max_tokens=100, system="Be brief.", messages=msgs)
    assert m.type == "message" and m.role == "assistant" and m.model == "coder"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == PLAIN
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = last_prompt(agent_server)
    expected = e2e_tokenizer.encode(e2e_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *msgs], tokenize=False, add_generation_prompt=True,
        chat_template=agent_server.state.settings.chat_template),
        add_special_tokens=False)
    assert prompt == expected
    assert _full_usage(m.usage) == len(prompt) and m.usage.output_tokens == reply_len(e2e_tokenizer, PLAIN)
    counted = client.messages.count_tokens(model="coder", system="Be brief.", messages=msgs)
    assert counted.input_tokens == len(prompt)

    with client.messages.stream(model="reasoning", max_tokens=100, system="Be brief.", messages=msgs) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == PLAIN
    assert final.content[0].text == PLAIN and final.stop_reason == "end_turn" and final.model == "reasoning"
    assert _full_usage(final.usage) == len(prompt) and final.usage.output_tokens == m.usage.output_tokens


def test_thinking_block(client):
    exp_reasoning, exp_content = parsers.get_reasoning_parser("qwen3").parse(THINK, False)
    m = client.messages.create(model="coder", max_tokens=100, messages=_user("THINK"))
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == exp_reasoning and m.content[1].text == exp_content
    with client.messages.stream(model="coder", max_tokens=100, messages=_user("THINK")) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == \
        [("thinking", exp_reasoning), ("text", exp_content)]


def _tool_uses(content):
    return [(b.name, b.input) for b in content if b.type == "tool_use"]


@pytest.mark.parametrize("trigger,calls,text", [("XMLCALL", XML_CALLS, None),
                                                ("HERMESCALL", HERMES_CALLS, "Let me check.")])
def test_tool_use_create_and_stream(client, trigger, calls, text):
    m = client.messages.create(model="coder", max_tokens=200, tools=ANTHROPIC_TOOLS, messages=_user(trigger))
    assert m.stop_reason == "tool_use" and _tool_uses(m.content) == calls
    assert all(b.id for b in m.content if b.type == "tool_use")
    assert [b.text for b in m.content if b.type == "text"] == ([text] if text else [])
    with client.messages.stream(model="coder", max_tokens=200, tools=ANTHROPIC_TOOLS, messages=_user(trigger)) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and _tool_uses(final.content) == calls
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)


def test_tool_result_round_trip(client, agent_server, e2e_tokenizer):
    first = client.messages.create(model="coder", max_tokens=200, tools=ANTHROPIC_TOOLS,
                                   messages=_user("XMLCALL weather in Paris and Berlin?"))
    uses = [b for b in first.content if b.type == "tool_use"]
    history = _user("XMLCALL weather in Paris and Berlin?") + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": out}
                                     for b, out in zip(uses, ["sunny", "rainy"])]}]
    m = client.messages.create(model="coder", max_tokens=200, tools=ANTHROPIC_TOOLS, messages=history)
    assert m.stop_reason == "end_turn" and m.content[0].text == FINAL
    text = e2e_tokenizer.decode(last_prompt(agent_server))
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>\n<|im_end|>" in text
    with client.messages.stream(model="coder", max_tokens=200, tools=ANTHROPIC_TOOLS, messages=history) as s:
        assert s.get_final_text() == FINAL


def test_stop_reasons(client, e2e_tokenizer):
    m = client.messages.create(model="coder", max_tokens=200, messages=_user("STOPPY"), stop_sequences=["STOP"])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "STOP", "alpha beta ")
    with client.messages.stream(model="coder", max_tokens=200, messages=_user("STOPPY"),
                                stop_sequences=["STOP"]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", "STOP", "alpha beta ")
    m = client.messages.create(model="coder", max_tokens=4, messages=_user("LONG"))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4
    assert m.content[0].text == e2e_tokenizer.decode(e2e_tokenizer.encode(LONG, add_special_tokens=False)[:4])


def test_api_key_and_errors(client, agent_server):
    # x-api-key (the anthropic client's header) and Bearer both pass; a wrong key is a 401 in Anthropic's shape
    r = httpx.post(agent_server.url + "/v1/messages/count_tokens",
                   headers={"Authorization": f"Bearer {API_KEY}"}, json={"model": "coder", "messages": _user("hi")})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    bad = anthropic.Anthropic(base_url=agent_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="coder", max_tokens=10, messages=_user("hi"))
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=10, messages=_user("hi"))
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="coder", max_tokens=10, messages=_user("word " * 3000))
    assert e.value.body["error"]["type"] == "invalid_request_error" and "2048" in e.value.body["error"]["message"]
    r = httpx.post(agent_server.url + "/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": "coder", "messages": _user("hi")})          # max_tokens is required
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="coder", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in e.value.body["error"]["message"]
    assert httpx.get(agent_server.url + "/health").status_code == 200


def test_disconnect_mid_stream_aborts(agent_server):
    runner = agent_server.state.engine.core.runner
    runner.hold_after, _ = 5, runner.release.clear()
    try:
        with httpx.stream("POST", agent_server.url + "/v1/messages", headers={"x-api-key": API_KEY},
                          json={"model": "coder", "max_tokens": 500, "stream": True, "messages": _user("LONG")}) as r:
            assert r.status_code == 200
            deltas = 0
            lines = r.iter_lines()       # held: dropping the iterator would close the connection here
            for line in lines:
                deltas += line.startswith("event: content_block_delta")
                if deltas >= 3:
                    break
            assert metric(agent_server.url, "vllm:kv_cache_usage_perc") > 0       # still running while connected
            assert agent_server.state.engine.num_in_flight == 1
        assert wait_for(lambda: agent_server.state.engine.num_in_flight == 0)
    finally:
        runner.hold_after = None
        runner.release.set()
    assert wait_for(lambda: kv_idle(agent_server))


def test_queue_full_is_529_overloaded_and_metrics_move(client, agent_server):
    sched = agent_server.state.engine.core.engine_core.scheduler
    old = sched.config.max_num_queued_reqs, sched.config.max_num_seqs
    # no free running slot and no queue: every new request finds the queue full (--max-num-queued-reqs)
    sched.config.max_num_queued_reqs, sched.config.max_num_seqs = 0, 0
    try:
        for stream in (False, True):
            r = httpx.post(agent_server.url + "/v1/messages", headers={"x-api-key": API_KEY},
                           json={"model": "coder", "max_tokens": 10, "stream": stream, "messages": _user("x")})
            assert r.status_code == 529
            assert r.json()["error"]["type"] == "overloaded_error"
            assert "--max-num-queued-reqs=0" in r.json()["error"]["message"]
    finally:
        sched.config.max_num_queued_reqs, sched.config.max_num_seqs = old
    gen0 = metric(agent_server.url, "vllm:generation_tokens_total")
    m = client.messages.create(model="reasoning", max_tokens=100, messages=_user("hi"))
    assert metric(agent_server.url, "vllm:generation_tokens_total") == gen0 + m.usage.output_tokens


@pytest.mark.parametrize("choice,trigger,calls", [
    ({"type": "tool", "name": "get_weather"}, "NAMEDCALL", [("get_weather", {"city": "Rome"})]),
    ({"type": "any"}, "ANYCALL", [("get_weather", {"city": "Oslo"})])])
def test_tool_choice_tool_and_any(client, choice, trigger, calls):
    """``tool`` / ``any`` take chat's named / required path (structured outputs' grammar)."""
    m = client.messages.create(model="coder", max_tokens=100, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                               messages=_user(trigger))
    assert m.stop_reason == "tool_use" and _tool_uses(m.content) == calls
    with client.messages.stream(model="coder", max_tokens=100, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                                messages=_user(trigger)) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and _tool_uses(final.content) == calls
