"""Tool-call parsers by ``--tool-call-parser`` name, and the tool_choice prefill.

Contract: ``HermesToolParser`` and ``Qwen3CoderToolParser`` read BOTH formats (hermes JSON and qwen3_coder
XML inside ``<tool_call>``), because Qwen3-Coder writes XML even where a deployment configured hermes; they
differ only in the form ``prefill`` writes for a named tool_choice.

Prefill contract (tool_choice "required" or a named function): the server appends
``prefill_for_tool_choice(tool_choice, fmt)`` to the rendered prompt (the start of the assistant turn) and
passes ``prefill + generated_text`` to ``parse``; when streaming it feeds the prefill as the first delta of
``stream(...)`` and then the generated deltas. The prefill is not content: it is part of the call text.
"""
from __future__ import annotations

import json
from typing import Any

from onecard.parsers.tool_parse import parse_tool_calls
from onecard.parsers.tool_stream import ToolCallStream
from onecard.parsers.tool_types import IdFactory, ToolParseResult
from onecard.parsers.tool_values import FUNC_OPEN, TOOL_OPEN

PREFILL_FORMATS = ("hermes", "qwen3_coder")


def _choice_name(tool_choice: Any) -> str | None:
    """The function name of a named tool_choice (a dict or a pydantic model), else None."""
    if hasattr(tool_choice, "model_dump"):
        tool_choice = tool_choice.model_dump()
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
        raise ValueError(f"tool_choice {tool_choice!r} names no function.")
    return None


def prefill_for_tool_choice(tool_choice: Any, fmt: str) -> str:
    """Text written into the assistant turn before generation: "" for none/auto/None."""
    if fmt not in PREFILL_FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(PREFILL_FORMATS)}.")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return ""
    if tool_choice == "required":
        return TOOL_OPEN + "\n"
    name = _choice_name(tool_choice)
    if name is None:
        raise ValueError(f"unsupported tool_choice {tool_choice!r}.")
    if fmt == "hermes":
        return TOOL_OPEN + '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    return f"{TOOL_OPEN}\n{FUNC_OPEN}{name}>\n"


class _ToolParser:
    name = ""
    prefill_format = ""

    def parse(self, text: str, tools: list[Any] | None = None,
              id_factory: IdFactory | None = None) -> ToolParseResult:
        return parse_tool_calls(text, tools, id_factory)

    def stream(self, tools: list[Any] | None = None, id_factory: IdFactory | None = None) -> ToolCallStream:
        return ToolCallStream(tools, id_factory)

    def prefill(self, tool_choice: Any) -> str:
        return prefill_for_tool_choice(tool_choice, self.prefill_format)


class HermesToolParser(_ToolParser):
    name = "hermes"
    prefill_format = "hermes"


class Qwen3CoderToolParser(_ToolParser):
    name = "qwen3_coder"
    prefill_format = "qwen3_coder"
