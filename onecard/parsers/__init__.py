"""Reasoning and tool-call parsers: pure text in, structured out (no torch, no tokenizer).

Contract: ``get_reasoning_parser(name)`` ("qwen3", alias "deepseek_r1") and ``get_tool_parser(name)``
("hermes", "qwen3_coder") return parser objects; unknown names raise ``ValueError`` listing the known ones
(the CLI reports it against --reasoning-parser / --tool-call-parser). Pipeline in the server: the reasoning
parser splits model text into reasoning and content; the tool parser then reads the content.
"""
from __future__ import annotations

from onecard.parsers.reasoning import Qwen3ReasoningParser, ReasoningStream, prompt_opens_think
from onecard.parsers.tool_parsers import (
    HermesToolParser,
    Qwen3CoderToolParser,
    prefill_for_tool_choice,
)
from onecard.parsers.tool_stream import ToolCallStream
from onecard.parsers.tool_types import (
    DeltaItem,
    ToolCall,
    ToolCallDelta,
    ToolParseResult,
    counter_ids,
    merge_deltas,
    random_call_id,
)

REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": Qwen3ReasoningParser}
TOOL_PARSERS = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser}


def get_reasoning_parser(name: str) -> Qwen3ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        known = ", ".join(REASONING_PARSERS)
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}.") from None


def get_tool_parser(name: str) -> HermesToolParser | Qwen3CoderToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}.") from None


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "DeltaItem",
    "HermesToolParser",
    "Qwen3CoderToolParser",
    "Qwen3ReasoningParser",
    "ReasoningStream",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParseResult",
    "counter_ids",
    "get_reasoning_parser",
    "get_tool_parser",
    "merge_deltas",
    "prefill_for_tool_choice",
    "prompt_opens_think",
    "random_call_id",
]
