"""A choice's parsed output as an ordered list of blocks (reasoning, text, tool call), whole or streamed.

Contract: the Responses API (output items) and the Messages API (content blocks) both present a reply as
blocks; this module turns what ``ChoiceParser`` yields into them once. ``blocks_from_whole(reasoning,
content, calls)`` builds the list from the whole-text result. ``BlockAssembler.feed(deltas)`` takes the
parser's streamed chat deltas (``reasoning_content``, ``content``, ``tool_calls`` fragments) and returns
``BlockEvent``s: ``start`` (a new block: its kind, and for a call its id and name), ``delta`` (text, or a
fragment of the call's JSON arguments) and ``stop``; a block is stopped when the next one starts, and
``close()`` stops the last one. Concatenated deltas equal the block's final ``text``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass(slots=True)
class Block:
    index: int                 # position among the choice's blocks
    kind: BlockKind
    text: str = ""             # reasoning or text, or the call's arguments as JSON text
    call_id: str | None = None
    name: str | None = None

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as a mapping ({} when empty; the raw text under "_raw" when not JSON)."""
        try:
            value = json.loads(self.text) if self.text.strip() else {}
        except json.JSONDecodeError:
            return {"_raw": self.text}
        return value if isinstance(value, dict) else {"_value": value}


@dataclass(slots=True)
class BlockEvent:
    kind: Literal["start", "delta", "stop"]
    block: Block
    text: str = ""


def blocks_from_whole(reasoning: str | None, content: str | None, calls: list[dict[str, Any]]) -> list[Block]:
    blocks: list[Block] = []
    if reasoning:
        blocks.append(Block(len(blocks), "reasoning", reasoning))
    if content:
        blocks.append(Block(len(blocks), "text", content))
    for c in calls:
        blocks.append(Block(len(blocks), "tool_call", c["function"]["arguments"], c["id"], c["function"]["name"]))
    return blocks


class BlockAssembler:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}     # the parser's tool-call index → its block

    def _start(self, kind: BlockKind, call_id: str | None = None, name: str | None = None) -> list[BlockEvent]:
        events = self.close()
        self._open = Block(len(self.blocks), kind, call_id=call_id, name=name)
        self.blocks.append(self._open)
        return events + [BlockEvent("start", self._open)]

    def _append(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        events = [] if self._open is not None and self._open.kind == kind else self._start(kind)
        assert self._open is not None
        self._open.text += text
        return events + [BlockEvent("delta", self._open, text)]

    def feed(self, deltas: list[dict[str, Any]]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._append("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._append("text", delta["content"])
            for tc in delta.get("tool_calls") or []:
                fn = tc.get("function") or {}
                block = self._calls.get(tc["index"])
                if block is None:
                    events += self._start("tool_call", tc.get("id"), fn.get("name"))
                    block = self._calls[tc["index"]] = self._open
                args = fn.get("arguments") or ""
                if args:
                    block.text += args
                    events.append(BlockEvent("delta", block, args))
        return events

    def close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block)]
