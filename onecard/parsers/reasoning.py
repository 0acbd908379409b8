"""Reasoning (``<think>…</think>``) parsing for Qwen3 (and DeepSeek-R1, same tags).

Contract: ``Qwen3ReasoningParser.parse(text, prompt_opened_think) -> (reasoning, content)`` and
``.stream(prompt_opened_think) -> ReasoningStream`` whose ``feed(delta)`` / ``finish()`` return
``(reasoning_delta, content_delta)``; the deltas concatenate to the whole-text result for any cut.

Rules:
- ``prompt_opened_think``: the rendered prompt ends inside an open ``<think>`` (see ``prompt_opens_think``);
  the output is reasoning up to ``</think>``. With ``enable_thinking=false`` the template wrote an empty
  think block, so the prompt did not leave one open and everything is content.
- The model may open ``<think>`` itself, but only at the very start of its output (after whitespace):
  a ``<think>`` later in an answer is content, so a coding model writing about tags never loses its answer
  to reasoning. Without an opening, all output is content.
- Reasoning without ``</think>`` (cut off) is all reasoning. Whitespace right after ``</think>`` is dropped;
  reasoning that is only whitespace is None; empty parts are None.
- Partial tags across deltas are held back until decided (``<thi``, ``</th``).
"""
from __future__ import annotations

from onecard.parsers.tool_values import partial_suffix_len

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_opens_think(prompt_text: str) -> bool:
    """True when the prompt leaves a ``<think>`` block open (the template started the model's thinking)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


class ReasoningStream:
    def __init__(self, prompt_opened_think: bool) -> None:
        self._prompt_opened = prompt_opened_think
        self._state = "start"          # start → reasoning → after_end → content
        self._buf = ""
        self._reasoning_started = False
        self._pending_ws = ""          # leading whitespace of the reasoning, until something else arrives
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []

    @property
    def reasoning(self) -> str | None:
        return "".join(self.reasoning_parts) or None

    @property
    def content(self) -> str | None:
        return "".join(self.content_parts) or None

    @property
    def in_reasoning(self) -> bool:
        """Still inside (or possibly inside) the think block: tool-call parsing waits for content."""
        return self._state == "reasoning" or (self._state == "start" and self._prompt_opened)

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        self._buf += delta
        return self._run(eof=False)

    def finish(self) -> tuple[str | None, str | None]:
        return self._run(eof=True)

    def _run(self, eof: bool) -> tuple[str | None, str | None]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == "start":
                s = self._buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self._buf = s[len(THINK_OPEN):]
                    self._state = "reasoning"
                    continue
                if (not s or THINK_OPEN.startswith(s)) and not eof:
                    break
                self._state = "reasoning" if self._prompt_opened else "content"
                continue
            if self._state == "reasoning":
                i = self._buf.find(THINK_CLOSE)
                if i >= 0:
                    self._reason(self._buf[:i], reasoning, final=True)
                    self._buf = self._buf[i + len(THINK_CLOSE):]
                    self._state = "after_end"
                    continue
                keep = 0 if eof else partial_suffix_len(self._buf, THINK_CLOSE)
                self._reason(self._buf[:len(self._buf) - keep], reasoning, final=eof)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if self._state == "after_end":
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._state = "content"
                continue
            if self._buf:
                content.append(self._buf)
                self._buf = ""
            break
        r, c = "".join(reasoning), "".join(content)
        self.reasoning_parts.extend([r] if r else [])
        self.content_parts.extend([c] if c else [])
        return r or None, c or None

    def _reason(self, text: str, out: list[str], final: bool) -> None:
        """Reasoning text, holding back leading whitespace so whitespace-only reasoning becomes None."""
        if self._reasoning_started:
            out.append(text)
            return
        self._pending_ws += text
        if self._pending_ws.strip():
            out.append(self._pending_ws)
            self._pending_ws = ""
            self._reasoning_started = True
        elif final:
            self._pending_ws = ""


class Qwen3ReasoningParser:
    """Think-tag parser; DeepSeek-R1 uses the same tags and the same rules."""

    name = "qwen3"

    def parse(self, text: str, prompt_opened_think: bool = False) -> tuple[str | None, str | None]:
        body = text
        lead = body.lstrip()
        if lead.startswith(THINK_OPEN):
            body = lead[len(THINK_OPEN):]
        elif not prompt_opened_think:
            return None, (text or None)
        reasoning, sep, rest = body.partition(THINK_CLOSE)
        content = rest.lstrip() if sep else ""
        return (reasoning if reasoning.strip() else None), (content or None)

    def stream(self, prompt_opened_think: bool = False) -> ReasoningStream:
        return ReasoningStream(prompt_opened_think)
