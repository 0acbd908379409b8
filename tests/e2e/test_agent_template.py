"""Qwen3-Coder's published chat template through all three APIs: one multi-turn tool conversation (system,
user, an assistant turn with two parallel calls, two tool results, the assistant's answer, a new user turn)
sent as chat completions, Responses and Messages reaches the engine as the same prompt token ids, and those
equal the template rendered directly with the call arguments as mappings and both results in one user
turn."""
from __future__ import annotations

import json

import anthropic
import openai

from tests.e2e.agent_server import (
    ANTHROPIC_TOOLS,
    API_KEY,
    CHAT_TOOLS,
    FINAL,
    RESPONSES_TOOLS,
    TEMPLATE,
    last_prompt,
)

SYSTEM = "You are a coding agent."
QUESTION = "What is the weather in Paris and Berlin?"
CALLS = [("call_a", {"city": "Paris", "days": 3}), ("call_b", {"city": "Berlin"})]
RESULTS = ["sunny", "rainy"]
FOLLOW_UP = "And tomorrow?"


def _direct(tokenizer) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": args}}
                    for cid, args in CALLS]}]
    messages += [{"role": "tool", "tool_call_id": cid, "content": out} for (cid, _), out in zip(CALLS, RESULTS)]
    messages += [{"role": "assistant", "content": FINAL}, {"role": "user", "content": FOLLOW_UP}]
    return tokenizer.apply_chat_template(messages, tools=CHAT_TOOLS, chat_template=TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)


def _via_chat(server):
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(a)}}
                    for cid, a in CALLS]}]
    messages += [{"role": "tool", "tool_call_id": cid, "content": out} for (cid, _), out in zip(CALLS, RESULTS)]
    messages += [{"role": "assistant", "content": FINAL}, {"role": "user", "content": FOLLOW_UP}]
    client.chat.completions.create(model="coder", messages=messages, tools=CHAT_TOOLS, max_tokens=50)


def _via_responses(server):
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    items = [{"role": "user", "content": QUESTION}]
    items += [{"type": "function_call", "call_id": cid, "name": "get_weather", "arguments": json.dumps(a)}
              for cid, a in CALLS]
    items += [{"type": "function_call_output", "call_id": cid, "output": out} for (cid, _), out in zip(CALLS, RESULTS)]
    items += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": FINAL}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": FOLLOW_UP}]}]
    client.responses.create(model="coder", instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS,
                            max_output_tokens=50)


def _via_messages(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": "get_weather", "input": a}
                                                  for cid, a in CALLS]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": out}
                                             for (cid, _), out in zip(CALLS, RESULTS)]},
                {"role": "assistant", "content": [{"type": "text", "text": FINAL}]},
                {"role": "user", "content": FOLLOW_UP}]
    client.messages.create(model="coder", system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=50)
    return client.messages.count_tokens(model="coder", system=SYSTEM, messages=messages,
                                        tools=ANTHROPIC_TOOLS).input_tokens


def test_three_apis_render_the_same_prompt(agent_server, e2e_tokenizer):
    text = _direct(e2e_tokenizer)
    # what the template must have made of it: arguments iterated as a mapping, both results in one user turn
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>") in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n"
            "</tool_response>\n<|im_end|>\n<|im_start|>assistant\n" + FINAL) in text
    assert text.startswith("<|im_start|>system\n" + SYSTEM + "\n\n# Tools")
    expected = e2e_tokenizer.encode(text, add_special_tokens=False)

    _via_chat(agent_server)
    assert last_prompt(agent_server) == expected
    _via_responses(agent_server)
    assert last_prompt(agent_server) == expected
    counted = _via_messages(agent_server)
    assert last_prompt(agent_server) == expected
    assert counted == len(expected)
