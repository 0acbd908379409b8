"""Request fields → one output constraint (``StructuredOutputsParams``): the one place every API surface uses.

Contract: ``constraint_for_request(...) -> RequestConstraint | None`` reads, in vLLM's order of precedence:
``structured_outputs`` (vLLM's extra body), the older ``guided_*`` fields, ``response_format`` (chat and
completions: ``text`` / ``json_object`` / ``json_schema``; the Responses API's flat ``text.format`` shape
``{"type": "json_schema", "name", "schema", "strict"}`` is read too; vLLM's ``structural_tag``), then the
tool choice: ``"required"`` (also Anthropic's ``{"type": "any"}``) and a named function (OpenAI chat
``{"type": "function", "function": {"name"}}``, Responses ``{"type": "function", "name"}``, Anthropic
``{"type": "tool", "name"}``) constrain the whole output to tool calls whose arguments satisfy the tool's
schema, written in the tool parser's format (``hermes``: ``<tool_call>\\n{"name": …, "arguments": …}\\n
</tool_call>``; ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n</parameter>…``);
``"auto"`` with ``strict: true`` tools leaves text free until the model opens ``<tool_call>`` (structural
tag with triggers). Tools may be OpenAI chat (``{"type": "function", "function": {...}}``), Responses
(``{"type": "function", "name", "parameters"}``) or Anthropic (``{"name", "input_schema"}``) shaped.
A bad field raises ``ConstraintError`` (a ``ValueError`` whose ``param`` names the field: a 400).
The result is not compiled yet: ``onecard.frontend.grammar.GrammarService`` compiles it off the event loop.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from onecard.sampling_params import StructuredOutputsParams

TOOL_FORMATS = ("hermes", "qwen3_coder")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_OPTION_FIELDS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                  "whitespace_pattern")


class ConstraintError(ValueError):
    """An invalid constraint field; ``param`` is the request field to name in the 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class RequestConstraint:
    params: StructuredOutputsParams
    param: str                      # the request field it came from (named in compile errors)
    is_tool_call: bool = False      # tool_choice required / named: the output is only tool calls


@dataclass(slots=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]
    strict: bool = False


def _as_dict(value: Any) -> Any:
    return value.model_dump(exclude_none=True, by_alias=True) if hasattr(value, "model_dump") else value


def normalize_tools(tools: list[Any] | None) -> list[ToolSpec]:
    """OpenAI chat, Responses or Anthropic tool definitions → (name, parameters schema, strict)."""
    out = []
    for t in tools or []:
        t = _as_dict(t)
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            continue
        params = fn.get("parameters", fn.get("input_schema"))
        if params is None:
            params = {"type": "object", "properties": {}}
        strict = bool(fn.get("strict", t.get("strict", False)))
        out.append(ToolSpec(name, params, strict))
    return out


def tool_choice_name(tool_choice: Any) -> str | None:
    """The forced function's name, or None for "none" / "auto" / "required" / any."""
    tc = _as_dict(tool_choice)
    if not isinstance(tc, dict):
        return None
    fn = tc.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tc.get("name")
    return name if isinstance(name, str) and name else None


def _is_required(tool_choice: Any) -> bool:
    tc = _as_dict(tool_choice)
    return tc == "required" or tc == "any" or (isinstance(tc, dict) and tc.get("type") == "any")


# ---------------------------------------------------------------------------------------------------------
# tool calls as xgrammar structural tags (JSON form; the same text the tool parsers read)

def _tool_tag(tool: ToolSpec, fmt: str) -> dict[str, Any]:
    if fmt == "hermes":
        begin = '<tool_call>\n{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
        return {"type": "tag", "begin": begin, "end": "}\n</tool_call>",
                "content": {"type": "json_schema", "json_schema": tool.parameters, "style": "json"}}
    return {"type": "tag", "begin": f"<tool_call>\n<function={tool.name}>\n", "end": "\n</function>\n</tool_call>",
            "content": {"type": "json_schema", "json_schema": tool.parameters, "style": "qwen_xml"}}


def tool_call_structural_tag(tools: list[ToolSpec], fmt: str, *, mode: str,
                             parallel_tool_calls: bool = True) -> dict[str, Any]:
    """``mode``: "required" (one call, or calls separated by newlines when parallel), "auto" (free text; a
    call starts at ``<tool_call>`` and is then constrained)."""
    if fmt not in TOOL_FORMATS:
        raise ConstraintError(f"unknown tool-call format {fmt!r}; known: {', '.join(TOOL_FORMATS)}.",
                              "tool_choice")
    tags = [_tool_tag(t, fmt) for t in tools]
    if mode == "required":
        body: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                                "at_least_one": True, "stop_after_first": not parallel_tool_calls}
    else:
        trigger = "<tool_call>" if fmt == "hermes" else "<tool_call>\n<function="
        body = {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                "stop_after_first": not parallel_tool_calls}
    return {"type": "structural_tag", "format": body}


# ---------------------------------------------------------------------------------------------------------

def _from_structured_outputs(so: Any, param: str) -> StructuredOutputsParams:
    if isinstance(so, StructuredOutputsParams):
        return so
    so = _as_dict(so)
    if not isinstance(so, dict):
        raise ConstraintError(f"{param} must be an object, got {type(so).__name__}.", param)
    known = set(StructuredOutputsParams.__dataclass_fields__) - {"_compiled"}
    unknown = set(so) - known - {"backend", "_backend", "_backend_was_auto"}
    if unknown:
        raise ConstraintError(f"{param} has unknown field(s) {sorted(unknown)}; known: {sorted(known)}.", param)
    try:
        return StructuredOutputsParams(**{k: v for k, v in so.items() if k in known})
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"{param}: {e}", param) from None


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    rf = _as_dict(rf)
    if rf is None:
        return None
    if not isinstance(rf, dict) or "type" not in rf:
        raise ConstraintError("response_format must be an object with a type.", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema", rf)          # chat: nested json_schema; Responses text.format: flat
        js = _as_dict(js)
        schema = js.get("schema", js.get("schema_")) if isinstance(js, dict) else None
        if schema is None:
            raise ConstraintError("response_format json_schema needs a schema (json_schema.schema).",
                                  "response_format")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items()}
        return StructuredOutputsParams(structural_tag=tag)
    raise ConstraintError(f"response_format type {kind!r} is not supported; use text, json_object, json_schema "
                          "or structural_tag.", "response_format")


def constraint_for_request(*, structured_outputs: Any = None, guided: dict[str, Any] | None = None,
                           response_format: Any = None, tools: list[Any] | None = None, tool_choice: Any = None,
                           tool_format: str | None = None, parallel_tool_calls: bool = True,
                           options: dict[str, Any] | None = None,
                           response_format_param: str = "response_format") -> RequestConstraint | None:
    """The constraint a request asks for, or None (see the module contract). ``guided`` holds the request's
    ``guided_*`` fields (None values ignored); ``options`` vLLM's ``guided_whitespace_pattern`` and the like
    (``StructuredOutputsParams`` option names) applied to a guided/response_format constraint."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if structured_outputs is not None:
        found.append((_from_structured_outputs(structured_outputs, "structured_outputs"), "structured_outputs"))
    guided = {k: v for k, v in (guided or {}).items() if v is not None}
    if guided:
        unknown = set(guided) - set(GUIDED_FIELDS) - {"guided_json_object"}
        if unknown:
            raise ConstraintError(f"unknown guided decoding field(s) {sorted(unknown)}.", min(unknown))
        values = {GUIDED_FIELDS[k]: v for k, v in guided.items() if k in GUIDED_FIELDS}
        if guided.get("guided_json_object"):
            values["json_object"] = True
        param = next(iter(guided))
        try:
            found.append((StructuredOutputsParams(**values), param))
        except ValueError as e:
            raise ConstraintError(str(e).replace("structured_outputs", "guided decoding"), param) from None
    try:
        rf = _from_response_format(response_format)
    except ValueError as e:
        raise ConstraintError(str(e), response_format_param) from None
    if rf is not None:
        found.append((rf, response_format_param))
    if len(found) > 1:
        names = ", ".join(p for _, p in found)
        raise ConstraintError(f"give one output constraint, not several ({names}).", found[1][1])
    specs = normalize_tools(tools)
    forced = tool_choice_name(tool_choice)
    required = _is_required(tool_choice)
    if (forced or required) and specs:
        if found:
            raise ConstraintError(f"tool_choice {'required' if required else 'named'} cannot be combined with "
                                  f"{found[0][1]}.", "tool_choice")
        chosen = [t for t in specs if t.name == forced] if forced else specs
        if not chosen:
            raise ConstraintError(f"tool_choice names function {forced!r}, which is not among the tools.",
                                  "tool_choice")
        tag = tool_call_structural_tag(chosen, tool_format or "hermes", mode="required",
                                       parallel_tool_calls=parallel_tool_calls and not forced)
        return RequestConstraint(StructuredOutputsParams(structural_tag=tag), "tools", is_tool_call=True)
    if found:
        params, param = found[0]
        for k, v in (options or {}).items():
            if v is not None and k in _OPTION_FIELDS:
                setattr(params, k, v)
        return RequestConstraint(params, param)
    strict = [t for t in specs if t.strict]
    if strict and tool_format and _as_dict(tool_choice) in ("auto", None):
        tag = tool_call_structural_tag(strict, tool_format, mode="auto", parallel_tool_calls=parallel_tool_calls)
        return RequestConstraint(StructuredOutputsParams(structural_tag=tag), "tools")
    return None
