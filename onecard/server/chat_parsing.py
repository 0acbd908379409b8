"""Generated text → an assistant message: reasoning, content and tool calls (whole or streamed).

Contract: ``ChoiceParser(reasoning_parser, prompt_opened_think, tool_parser, tools, prefill)`` for one
choice. ``whole(text) -> (reasoning | None, content | None, tool_calls)`` with OpenAI tool-call dicts;
streaming: ``start()`` (deltas owed to the prefill), ``feed(text_delta)``, ``finish()`` each return a list
of OpenAI delta dicts (``{"reasoning_content", "reasoning"}``, ``{"content"}``, ``{"tool_calls": [...]}``);
``tools_called`` says whether any call was produced. The prefill (the tool-choice opening written into the
prompt) is parsed as if the model had written it. Reasoning text goes to both ``reasoning_content`` and
``reasoning`` (vLLM renamed the field; clients read either). This module adapts the parser package's API
(``onecard.parsers``: whole-text ``parse``, streams of ``DeltaItem`` folded with ``merge_deltas``).
"""
from __future__ import annotations

from typing import Any

from onecard import parsers


def tool_prefill(tool_choice: Any, tool_parser: str) -> str:
    return parsers.prefill_for_tool_choice(tool_choice, tool_parser)


def _reasoning_delta(text: str) -> dict[str, Any]:
    return {"reasoning_content": text, "reasoning": text}


class ChoiceParser:
    def __init__(self, reasoning_parser: str | None, prompt_opened_think: bool, tool_parser: str | None,
                 tools: list[dict[str, Any]], prefill: str = "", parallel_tool_calls: bool = True):
        # A tool-choice prefill starts the assistant turn with a call: nothing in it is reasoning.
        self.reasoning = parsers.get_reasoning_parser(reasoning_parser) if reasoning_parser and not prefill else None
        self.opened = prompt_opened_think
        self.tool = parsers.get_tool_parser(tool_parser) if tool_parser else None
        self.tools = tools
        self.prefill = prefill
        self.tools_called = False
        self.parallel = parallel_tool_calls    # False: only the first call is returned (as vLLM)
        self._rstream = self.reasoning.stream(prompt_opened_think) if self.reasoning else None
        self._tstream = self.tool.stream(tools) if self.tool else None

    # ------------------------------------------------------------------ whole text
    def whole(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        reasoning, content = (self.reasoning.parse(text, self.opened) if self.reasoning else (None, text))
        calls: list[dict[str, Any]] = []
        if self.tool is not None:
            result = self.tool.parse(self.prefill + (content or ""), self.tools)
            content = result.content
            calls = [c.to_openai() for c in result.tool_calls][: None if self.parallel else 1]
        self.tools_called = bool(calls)
        return reasoning or None, content or None, calls

    # ------------------------------------------------------------------ streaming
    def _content_deltas(self, content: str, final: bool = False) -> list[dict[str, Any]]:
        if self._tstream is None:
            return [{"content": content}] if content else []
        items = self._tstream.finish() if final else self._tstream.feed(content)
        delta = parsers.merge_deltas(items)
        if delta is None:
            return []
        if delta.get("tool_calls") and not self.parallel:
            delta["tool_calls"] = [c for c in delta["tool_calls"] if c["index"] == 0]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        if delta.get("tool_calls"):
            self.tools_called = True
        return [delta] if delta else []

    def start(self) -> list[dict[str, Any]]:
        return self._content_deltas(self.prefill) if self.prefill else []

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._rstream is None:
            return self._content_deltas(text)
        r, c = self._rstream.feed(text)
        out = [_reasoning_delta(r)] if r else []
        if c:
            out += self._content_deltas(c)
        return out

    def finish(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._rstream is not None:
            r, c = self._rstream.finish()
            if r:
                out.append(_reasoning_delta(r))
            if c:
                out += self._content_deltas(c)
        if self._tstream is not None:
            out += self._content_deltas("", final=True)
        return out
