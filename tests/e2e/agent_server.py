"""A scripted server for the agent APIs' e2e tests (Responses, Messages, chat): Qwen3-Coder's published chat
template (tests/data/qwen3_coder.jinja), the deployment's parser flags (qwen3 reasoning, hermes tool calls,
auto tool choice), an API key, and scripted replies in both tool-call forms (hermes JSON, Qwen3-Coder XML).

The scripted runner picks a reply by the first trigger found in the decoded prompt; a prompt holding a tool
result gets the final answer, so a tool loop runs call → result → answer.
"""
from __future__ import annotations

import time
from pathlib import Path

from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import metric, scripted_engine_config, start_server
from tests.e2e.scripted import Script, ScriptedCoreClient

TEMPLATE = (Path(__file__).resolve().parent.parent / "data" / "qwen3_coder.jinja").read_text()
API_KEY = "sekret"

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                                "parameters": WEATHER_SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city.",
                    "parameters": WEATHER_SCHEMA}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city.", "input_schema": WEATHER_SCHEMA}]

XML_TWO = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
           "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
           "Berlin\n</parameter>\n</function>\n</tool_call>")
XML_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Berlin"})]
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
          '</tool_call>')
HERMES_CALLS = [("get_weather", {"city": "Rome", "days": 2})]
FINAL = "Sunny in Paris, rainy in Berlin."
THINK = "<think>\nThe user wants a number.\n</think>\n\nThe answer is 42."
STOPPY = "alpha beta STOP gamma delta"
LONG = " ".join(f"word{i}" for i in range(120))
PLAIN = "plain answer"
# constrained tool choice (structured outputs' grammar makes the model write the whole call; the scripted
# source writes it as the grammar would, in the configured hermes form)
NAMED_REST = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
REQUIRED_REST = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

REPLIES = [("<tool_response>", FINAL), ("XMLCALL", XML_TWO), ("HERMESCALL", HERMES), ("THINK", THINK),
           ("STOPPY", STOPPY), ("LONG", LONG), ("NAMEDCALL", NAMED_REST), ("ANYCALL", REQUIRED_REST)]


def start_agent_server(tokenizer_dir: Path, tokenizer, max_model_len: int = 1024):
    config = scripted_engine_config(tokenizer_dir, tokenizer, names=("coder", "reasoning"),
                                    max_model_len=max_model_len)
    core = ScriptedCoreClient(config, Script(tokenizer, default=PLAIN, replies=REPLIES), num_blocks=256)
    settings = settings_from(config, api_key=API_KEY, reasoning_parser="qwen3", tool_call_parser="hermes",
                             enable_auto_tool_choice=True)
    settings.chat_template = TEMPLATE
    return start_server(make_state(config, core, settings, tokenizer))


def reply_len(tokenizer, text: str) -> int:
    """Output tokens of a scripted reply: its ids plus the EOS that ends it."""
    return len(tokenizer.encode(text, add_special_tokens=False)) + 1


def last_prompt(server) -> list[int]:
    """The prompt ids of the request the scripted engine saw last."""
    prompts = server.state.engine.core.runner.prompts
    return prompts[next(reversed(prompts))]


def wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def kv_idle(server) -> bool:
    return (metric(server.url, "vllm:num_requests_running") == 0
            and metric(server.url, "vllm:kv_cache_usage_perc") == 0.0)
