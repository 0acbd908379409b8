"""Pydantic request models for Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
and their mapping onto chat.

Contract: ``MessagesRequest`` (``max_tokens`` required, as Anthropic) and ``CountTokensRequest`` parse
bodies (unknown fields accepted). ``to_chat_messages()`` turns ``system`` (a string or text blocks) and
``messages`` (``text``, ``tool_use``, ``tool_result``, ``thinking`` blocks) into OpenAI chat messages:
an assistant turn's ``tool_use`` blocks become its ``tool_calls`` (``input`` kept as a mapping), a user
turn's ``tool_result`` blocks become tool messages in order, its text a user message. ``chat_tools()``
maps ``input_schema`` tools to OpenAI function tools; ``chat_tool_choice()`` maps ``auto`` / ``any`` /
``tool`` / ``none`` to auto / required / named / none (``disable_parallel_tool_use`` → one call).
What onecard cannot take (images, documents, server tools) raises ``ValueError`` naming it (a 400).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from onecard.sampling_params import SamplingParams
from onecard.server.openai_types import sampling_defaults

_DEFAULTABLE = ("temperature", "top_p", "top_k")


class _Base(BaseModel):
    # strict scalars: a boolean is not a number here (the OpenAPI fuzzer checks that wrong types are refused)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class AnthropicMessage(_Base):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(_Base):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        out = []
        for t in self.tools:
            if t.get("type") not in (None, "custom"):
                raise ValueError(f"tools: type {t.get('type')!r} is not supported; only custom tools with an "
                                 "input_schema are.")
            fn: dict[str, Any] = {"name": t.get("name"),
                                  "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> tuple[Any, bool]:
        """(chat tool_choice, parallel tool calls allowed)."""
        tc = self.tool_choice or {"type": "auto"}
        kind = tc.get("type")
        parallel = not tc.get("disable_parallel_tool_use", False)
        if kind in ("auto", "none"):
            return (kind if self.tools else "none"), parallel
        if not self.tools:
            raise ValueError(f"tool_choice type {kind!r} needs tools.")
        if kind == "any":
            return "required", parallel
        if kind == "tool":
            names = [t.get("name") for t in self.tools]
            if tc.get("name") not in names:
                raise ValueError(f"tool_choice names tool {tc.get('name')!r}, which is not among the tools.")
            return {"type": "function", "function": {"name": tc["name"]}}, parallel
        raise ValueError(f"tool_choice type {kind!r} is not one of auto, any, tool, none.")

    def to_chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text_blocks(self.system, "system")})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
            elif m.role == "assistant":
                out.append(_assistant(m.content))
            else:
                out += _user(m.content)
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        values = sampling_defaults(self, _DEFAULTABLE, defaults)
        return SamplingParams(max_tokens=self.max_tokens, stop=list(self.stop_sequences or []) or None, **values)


def _text_blocks(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if block.get("type") != "text":
            raise ValueError(f"{where}: content block type {block.get('type')!r} is not supported here; only "
                             "text blocks are.")
        texts.append(block.get("text", ""))
    return "\n".join(texts)


def _assistant(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            texts.append(b.get("text", ""))
        elif kind == "tool_use":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": b.get("input") or {}}})
        elif kind == "thinking":
            thinking.append(b.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        else:
            raise ValueError(f"messages: assistant content block type {kind!r} is not supported.")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return msg


def _user(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            texts.append(b.get("text", ""))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            content = b.get("content")
            text = _text_blocks(content, "tool_result") if content is not None else ""
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        else:
            raise ValueError(f"messages: user content block type {kind!r} is not supported; onecard takes text "
                             "and tool_result blocks.")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out
