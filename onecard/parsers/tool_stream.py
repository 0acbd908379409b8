"""Streaming tool-call parser: text deltas in, OpenAI-style content / tool-call deltas out.

Contract: ``ToolCallStream(tools, id_factory)``; ``feed(delta) -> list[DeltaItem]`` and ``finish()``
(the same).
The streamed content pieces and argument fragments concatenate to exactly what ``parse_tool_calls`` returns
for the whole text (same rules, see tool_parse.py), for any way the text is cut into deltas.

- A call's first delta carries index, id, name and ``arguments: ""``; then fragments follow.
- XML calls: the header goes out once ``<function=NAME>`` is complete; each parameter goes out when it
  closes, and string-typed parameters stream their characters as they arrive (one trailing newline and any
  partial closing tag held back). JSON calls are held until the block ends (a JSON body is only known to be
  valid when complete, and a call once announced cannot be withdrawn).
- Text that may still become a tag (``<tool_c``) and trailing whitespace are held back until decided.
"""
from __future__ import annotations

from typing import Any

from onecard.parsers.tool_parse import parse_body
from onecard.parsers.tool_types import DeltaItem, IdFactory, ToolCall, ToolCallDelta, random_call_id
from onecard.parsers.tool_values import (
    BLOCK_END,
    FUNC_CLOSE,
    FUNC_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    VALUE_END,
    arg_fragment,
    close_args,
    convert_value,
    dumps,
    escape_json_chars,
    find_first,
    is_string_type,
    normalize_tools,
    param_type,
    partial_suffix_len,
    strip_value_newlines,
)

_BETWEEN_TAGS = (PARAM_OPEN, FUNC_CLOSE) + BLOCK_END
_AFTER_FUNC_TAGS = (FUNC_OPEN,) + BLOCK_END
_SKIP_FUNC_TAGS = (FUNC_CLOSE,) + BLOCK_END


class ToolCallStream:
    def __init__(self, tools: list[Any] | None = None, id_factory: IdFactory | None = None) -> None:
        self._schemas = normalize_tools(tools)
        self._new_id = id_factory or random_call_id
        self._buf = ""
        self._state = "content"
        self._out: list[DeltaItem] = []
        self._content_parts: list[str] = []
        self._held_ws = ""            # trailing whitespace of content: dropped if a call follows
        self._block_ws = ""           # whitespace before the current block, restored if it is malformed
        self._block_raw = ""          # the current block's text so far, for a malformed block
        self._emitted_content = False
        self._funcs_in_block = 0
        self._scanned = 0             # buffered state: how much of the buffer was searched for the block end
        self.tool_calls: list[ToolCall] = []
        # the XML call being streamed
        self._call: ToolCall | None = None
        self._call_index = -1
        self._num_params = 0
        self._pname = ""
        self._pkind: str | None = None
        self._val = ""
        self._val_open = False
        self._val_sent = 0
        self._done = False

    # ------------------------------------------------------------------ public
    @property
    def content(self) -> str | None:
        text = "".join(self._content_parts)
        return text or None

    def feed(self, delta: str) -> list[DeltaItem]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        self._run(eof=False)
        return self._drain()

    def finish(self) -> list[DeltaItem]:
        if not self._done:
            self._run(eof=True)
            if self._held_ws and self._emitted_content:
                self._emit_content(self._held_ws)
            self._held_ws = ""
            self._done = True
        return self._drain()

    # ------------------------------------------------------------------ output helpers
    def _drain(self) -> list[DeltaItem]:
        out, self._out = self._out, []
        return out

    def _emit_content(self, text: str) -> None:
        self._out.append(DeltaItem(content=text))
        self._content_parts.append(text)

    def _push_content(self, text: str) -> None:
        if not text:
            return
        combined = self._held_ws + text
        keep = len(combined.rstrip())
        if keep:
            self._emit_content(combined[:keep])
            self._emitted_content = True
        self._held_ws = combined[keep:]

    def _args(self, fragment: str) -> None:
        assert self._call is not None
        self._call.arguments_json += fragment
        self._out.append(DeltaItem(tool_call=ToolCallDelta(self._call_index, arguments=fragment)))

    def _open_call(self, name: str) -> None:
        self._call = ToolCall(self._new_id(), name, "")
        self._call_index = len(self.tool_calls)
        self.tool_calls.append(self._call)
        self._num_params = 0
        self._out.append(DeltaItem(tool_call=ToolCallDelta(self._call_index, self._call.id, name, "")))

    def _close_call(self) -> None:
        if self._call is not None:
            self._args(close_args(self._num_params))
            self._call = None

    # ------------------------------------------------------------------ blocks
    def _start_block(self) -> None:
        self._block_ws, self._held_ws = self._held_ws, ""
        self._block_raw = TOOL_OPEN
        self._funcs_in_block = 0
        self._state = "call_start"

    def _valid_block_done(self) -> None:
        self._block_ws = ""
        self._state = "skip_ws"

    def _malformed(self, raw: str) -> None:
        self._held_ws = self._block_ws
        self._push_content(raw)
        self._state = "content"

    def _consume_block_end(self, pos: int, tag: str) -> str:
        """Remove the body up to a block terminator from the buffer; returns the removed text."""
        n = pos + (len(TOOL_CLOSE) if tag == TOOL_CLOSE else 0)   # a new <tool_call> stays for the next block
        taken, self._buf = self._buf[:n], self._buf[n:]
        return taken

    # ------------------------------------------------------------------ the state machine
    def _run(self, eof: bool) -> None:
        while getattr(self, "_st_" + self._state)(eof):
            pass

    def _st_content(self, eof: bool) -> bool:
        i = self._buf.find(TOOL_OPEN)
        if i >= 0:
            self._push_content(self._buf[:i])
            self._buf = self._buf[i + len(TOOL_OPEN):]
            self._start_block()
            return True
        keep = 0 if eof else partial_suffix_len(self._buf, TOOL_OPEN)
        self._push_content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _st_skip_ws(self, eof: bool) -> bool:
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = "content"
            return True
        return False

    def _st_call_start(self, eof: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith("{"):
            self._state = "buffered"
        elif s.startswith(FUNC_OPEN):
            n = len(self._buf) - len(s) + len(FUNC_OPEN)
            self._block_raw += self._buf[:n]
            self._buf = self._buf[n:]
            self._state = "x_fname"
        elif (not s or FUNC_OPEN.startswith(s)) and not eof:
            return False
        else:
            self._state = "malformed"
        return True

    def _st_buffered(self, eof: bool) -> bool:
        """A JSON body (or one already known to be malformed): wait for the block to end, then parse it."""
        pos, tag = find_first(self._buf, BLOCK_END, max(0, self._scanned - len(TOOL_CLOSE) + 1))
        if pos < 0 and not eof:
            self._scanned = len(self._buf)             # a long JSON body is scanned once, not per delta
            return False
        self._scanned = 0
        body = self._buf[:pos] if pos >= 0 else self._buf
        raw = self._block_raw + (self._consume_block_end(pos, tag) if pos >= 0 else self._buf)
        if pos < 0:
            self._buf = ""
        parsed = None if self._state == "malformed" else parse_body(body, self._schemas, at_eof=pos < 0)
        if parsed is None:
            self._malformed(raw)
            return True
        for name, args in parsed:
            self._open_call(name)
            self._args(args)
            self._call = None
        self._valid_block_done()
        return True

    _st_malformed = _st_buffered

    def _end_xml_block(self, pos: int, tag: str | None) -> bool:
        """The block ended (tag at pos, or eof when tag is None) while inside a valid XML call block."""
        self._close_call()
        if tag is None:
            self._buf = ""
        else:
            self._consume_block_end(pos, tag)
        self._valid_block_done()
        return True

    def _st_x_fname(self, eof: bool) -> bool:
        gt = self._buf.find(">")
        pos, tag = find_first(self._buf, BLOCK_END)
        if gt >= 0 and (pos < 0 or gt < pos):
            name = self._buf[:gt].strip()
            self._block_raw += self._buf[:gt + 1]
            self._buf = self._buf[gt + 1:]
            if name:
                self._funcs_in_block += 1
                self._open_call(name)
                self._state = "x_between"
            elif self._funcs_in_block == 0:
                self._state = "malformed"
            else:
                self._state = "x_skipfunc"
            return True
        if pos < 0 and not eof:
            return False
        if self._funcs_in_block == 0:                  # the first function's name never completed
            self._state = "malformed"
            return True
        return self._end_xml_block(pos, tag)

    def _function_closed(self, pos: int) -> bool:
        """</function> at ``pos``: the call is complete; another <function=...> may follow in this block."""
        self._buf = self._buf[pos + len(FUNC_CLOSE):]
        self._close_call()
        self._state = "x_after"
        return True

    def _hold_partial(self, tags: tuple[str, ...]) -> bool:
        self._buf = self._buf[len(self._buf) - partial_suffix_len(self._buf, tags):]
        return False

    def _st_x_between(self, eof: bool) -> bool:
        pos, tag = find_first(self._buf, _BETWEEN_TAGS)
        if tag == PARAM_OPEN:
            self._buf = self._buf[pos + len(PARAM_OPEN):]
            self._state = "x_pname"
            return True
        if tag == FUNC_CLOSE:
            return self._function_closed(pos)
        if tag is not None or eof:
            return self._end_xml_block(pos, tag)
        return self._hold_partial(_BETWEEN_TAGS)

    def _st_x_pname(self, eof: bool) -> bool:
        gt = self._buf.find(">")
        pos, tag = find_first(self._buf, _SKIP_FUNC_TAGS)
        if gt >= 0 and (pos < 0 or gt < pos):
            self._pname = self._buf[:gt].strip()
            self._buf = self._buf[gt + 1:]
            self._pkind = param_type(self._schemas, self._call.name, self._pname) if self._call else None
            self._val, self._val_open, self._val_sent = "", False, 0
            self._state = "x_value"
            return True
        if tag == FUNC_CLOSE:                          # a parameter name cut off by </function>: ignored
            return self._function_closed(pos)
        if tag is not None or eof:
            return self._end_xml_block(pos, tag)
        return False

    def _st_x_value(self, eof: bool) -> bool:
        pos, tag = find_first(self._buf, VALUE_END)
        if tag is None:
            # held back while it may become a tag; at eof dropped (a cut-off tag), as parse_tool_calls does
            keep = partial_suffix_len(self._buf, VALUE_END)
            self._val += self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            if not eof:
                self._stream_string_value()
                return False
            self._finish_param()
            return self._end_xml_block(0, None)
        self._val += self._buf[:pos]
        self._finish_param()
        if tag in (PARAM_CLOSE, PARAM_OPEN):
            self._buf = self._buf[pos + len(tag):]
            self._state = "x_between" if tag == PARAM_CLOSE else "x_pname"
            return True
        if tag == FUNC_CLOSE:
            return self._function_closed(pos)
        return self._end_xml_block(pos, tag)

    def _st_x_after(self, eof: bool) -> bool:
        pos, tag = find_first(self._buf, _AFTER_FUNC_TAGS)
        if tag == FUNC_OPEN:
            self._buf = self._buf[pos + len(FUNC_OPEN):]
            self._state = "x_fname"
            return True
        if tag is not None or eof:
            return self._end_xml_block(pos, tag)
        return self._hold_partial(_AFTER_FUNC_TAGS)

    def _st_x_skipfunc(self, eof: bool) -> bool:
        pos, tag = find_first(self._buf, _SKIP_FUNC_TAGS)
        if tag == FUNC_CLOSE:
            self._buf = self._buf[pos + len(FUNC_CLOSE):]
            self._state = "x_after"
            return True
        if tag is not None or eof:
            return self._end_xml_block(pos, tag)
        return self._hold_partial(_SKIP_FUNC_TAGS)

    # ------------------------------------------------------------------ parameter values
    def _stream_string_value(self) -> None:
        """Send the settled part of a string-typed value: all but one trailing newline."""
        val = self._val
        if not self._pname or not is_string_type(self._pkind) or not val:
            return
        # offsets, not copies: a long file body must not be re-copied on every delta
        start = 1 if val[0] == "\n" else 0
        end = len(val) - 1 if len(val) > start and val[-1] == "\n" else len(val)
        if not self._val_open:
            if "null".startswith(val[start:end].strip().lower()):
                return                                 # might still be the literal null
            self._args(arg_fragment(self._num_params == 0, self._pname, '"'))
            self._val_open = True
        if end - start > self._val_sent:
            self._args(escape_json_chars(val[start + self._val_sent:end]))
            self._val_sent = end - start

    def _finish_param(self) -> None:
        if not self._pname:
            return
        value = strip_value_newlines(self._val)
        if self._val_open:
            self._args(escape_json_chars(value[self._val_sent:]) + '"')
        else:
            converted = convert_value(value, self._pkind)
            self._args(arg_fragment(self._num_params == 0, self._pname, dumps(converted)))
        self._num_params += 1
        self._pname = ""
