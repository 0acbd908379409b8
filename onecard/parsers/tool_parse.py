"""Whole-text tool-call parsing (both hermes JSON and qwen3_coder XML inside ``<tool_call>`` blocks).

Contract: ``parse_tool_calls(text, tools, id_factory) -> ToolParseResult``. This is the reference the
streaming parser (tool_stream.py) must reproduce character for character, so the rules are spelled out:

- A block starts at ``<tool_call>`` and its body ends at ``</tool_call>``, at the next ``<tool_call>`` (a
  model that forgot to close) or at the end of the text (unterminated: still parsed).
- Body (after leading whitespace) starting with ``{``: JSON; with ``<function=``: XML; else malformed.
  JSON is malformed when it does not decode or has no name; XML when the first function has no name or
  its ``>`` is missing. A malformed block stays in the content as its raw text: nothing is dropped.
- XML: ``<function=NAME>`` then parameters ``<parameter=P>VALUE`` ending at ``</parameter>``, the next
  ``<parameter=`` or ``</function>``; one newline is stripped at each end of a value; values convert by the
  tool's schema type. Further ``<function=`` after ``</function>`` in the same block are further calls.
  A value running to the very end of an unterminated text loses a trailing partial closing tag.
- Content: the text outside valid calls. Whitespace touching a valid call is dropped (before it: rstrip,
  after it: lstrip); content that is only whitespace becomes None. Text after calls is kept.
"""
from __future__ import annotations

from typing import Any

from onecard.parsers.tool_types import IdFactory, ToolCall, ToolParseResult, random_call_id
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
    find_first,
    normalize_tools,
    param_type,
    parse_json_body,
    partial_suffix_len,
    strip_value_newlines,
)


def _xml_params(fbody: str, func: str, schemas: dict, at_eof: bool) -> str:
    """Arguments JSON of one function body (text between ``<function=NAME>`` and ``</function>``)."""
    parts: list[str] = []
    k = fbody.find(PARAM_OPEN)
    while k >= 0:
        name_start = k + len(PARAM_OPEN)
        gt = fbody.find(">", name_start)
        if gt < 0:
            break                                          # parameter name cut off: ignored
        pname = fbody[name_start:gt].strip()
        end, tag = find_first(fbody, (PARAM_CLOSE, PARAM_OPEN), gt + 1)
        raw = fbody[gt + 1:end if end >= 0 else len(fbody)]
        if end < 0 and at_eof:
            raw = raw[:len(raw) - partial_suffix_len(raw, VALUE_END)]
        if pname:
            value = convert_value(strip_value_newlines(raw), param_type(schemas, func, pname))
            parts.append(arg_fragment(not parts, pname, dumps(value)))
        if end < 0:
            break
        k = end + len(PARAM_CLOSE) if tag == PARAM_CLOSE else end
        if tag == PARAM_CLOSE:
            k = fbody.find(PARAM_OPEN, k)
    return "".join(parts) + close_args(len(parts))


def _xml_calls(body: str, schemas: dict, at_eof: bool) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) per function in an XML body, or None when the first function is malformed."""
    calls: list[tuple[str, str]] = []
    i = body.find(FUNC_OPEN)
    first = True
    while i >= 0:
        name_start = i + len(FUNC_OPEN)
        gt = body.find(">", name_start)
        if gt < 0:
            if first:
                return None
            break
        name = body[name_start:gt].strip()
        fend = body.find(FUNC_CLOSE, gt + 1)
        fbody = body[gt + 1:fend if fend >= 0 else len(body)]
        if name:
            calls.append((name, _xml_params(fbody, name, schemas, at_eof and fend < 0)))
        elif first:
            return None
        first = False
        if fend < 0:
            break
        i = body.find(FUNC_OPEN, fend + len(FUNC_CLOSE))
    return calls


def parse_body(body: str, schemas: dict, at_eof: bool) -> list[tuple[str, str]] | None:
    """One block body → its calls, or None when malformed (the block then stays content)."""
    s = body.lstrip()
    if s.startswith("{"):
        call = parse_json_body(s)
        return [call] if call else None
    if s.startswith(FUNC_OPEN):
        return _xml_calls(s, schemas, at_eof) or None
    return None


def parse_tool_calls(text: str, tools: list[Any] | None = None,
                     id_factory: IdFactory | None = None) -> ToolParseResult:
    new_id = id_factory or random_call_id
    schemas = normalize_tools(tools)
    calls: list[ToolCall] = []
    segments: list[list[str]] = [[]]              # content pieces between valid blocks
    pos = 0
    while True:
        start = text.find(TOOL_OPEN, pos)
        if start < 0:
            segments[-1].append(text[pos:])
            break
        segments[-1].append(text[pos:start])
        body_start = start + len(TOOL_OPEN)
        end, tag = find_first(text, BLOCK_END, body_start)
        body = text[body_start:end if end >= 0 else len(text)]
        block_end = len(text) if end < 0 else (end + len(TOOL_CLOSE) if tag == TOOL_CLOSE else end)
        parsed = parse_body(body, schemas, at_eof=end < 0)
        if parsed is None:
            segments[-1].append(text[start:block_end])     # malformed: raw text stays content
        else:
            calls.extend(ToolCall(new_id(), name, args) for name, args in parsed)
            segments.append([])
        pos = block_end
        if end < 0:
            segments[-1].append("")
            break
    pieces = []
    for n, seg in enumerate(segments):
        s = "".join(seg)
        if n > 0:
            s = s.lstrip()
        if n < len(segments) - 1:
            s = s.rstrip()
        pieces.append(s)
    content = "".join(pieces)
    return ToolParseResult(content if content.strip() else None, calls)
