"""Data types shared by the tool-call parsers: parsed calls, results, and OpenAI-style streaming deltas.

Contract: ``ToolCall.arguments_json`` is the JSON text of the arguments object exactly as sent to clients
(``json.dumps(..., ensure_ascii=False)`` spacing); streaming fragments of one call concatenate to it.
``DeltaItem`` is either a content piece or one tool-call delta; ``merge_deltas`` folds a feed's items
into one OpenAI ``delta`` dict (``{"content": ..., "tool_calls": [...]}``) or None when empty.
"""
from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

IdFactory = Callable[[], str]
_ALNUM = string.ascii_letters + string.digits


def random_call_id() -> str:
    """OpenAI-style id: "call_" + 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def counter_ids(prefix: str = "call_") -> IdFactory:
    """Deterministic ids (tests, reproducible logs): call_0, call_1, ..."""
    n = iter(range(1 << 62))
    return lambda: f"{prefix}{next(n)}"


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str

    @property
    def arguments(self) -> str:
        """Alias of ``arguments_json`` (the OpenAI field name)."""
        return self.arguments_json

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(slots=True)
class ToolParseResult:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(slots=True)
class ToolCallDelta:
    """A call's first delta: index, id, type, name, arguments "". Later: index and an arguments fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        out["function"] = fn
        return out


@dataclass(slots=True)
class DeltaItem:
    content: str | None = None
    tool_call: ToolCallDelta | None = None


def merge_deltas(items: list[DeltaItem]) -> dict[str, Any] | None:
    """One OpenAI chat-completion ``delta`` from a feed's items; consecutive deltas of one call are joined."""
    content = "".join(i.content for i in items if i.content)
    calls: list[dict[str, Any]] = []
    for item in items:
        tc = item.tool_call
        if tc is None:
            continue
        if calls and calls[-1]["index"] == tc.index and tc.id is None:
            fn = calls[-1]["function"]
            fn["arguments"] = fn.get("arguments", "") + (tc.arguments or "")
        else:
            calls.append(tc.to_openai())
    if not content and not calls:
        return None
    out: dict[str, Any] = {}
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = calls
    return out
