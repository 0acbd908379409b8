"""Tool-call pieces shared by the whole-text and streaming parsers: tags, schema-typed value conversion,
the JSON (hermes) body parser and the arguments-text builder.

Contract: both parsers build arguments text only through ``arg_fragment`` so that streamed fragments and
the whole-text result are the same characters. XML values are converted by the tool's JSON-schema type
(``convert_value``); the JSON form is re-serialised with ``json.dumps(ensure_ascii=False)``.
"""
from __future__ import annotations

import ast
import json
import logging
import math
from typing import Any

logger = logging.getLogger(__name__)

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
FUNC_OPEN = "<function="
FUNC_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
# A call body ends at its closing tag or where the model starts the next call without closing this one.
BLOCK_END = (TOOL_CLOSE, TOOL_OPEN)
VALUE_END = (PARAM_CLOSE, PARAM_OPEN, FUNC_CLOSE) + BLOCK_END

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INT_TYPES = {"integer", "int"}
_NUMBER_TYPES = {"number", "float", "double"}
_BOOL_TYPES = {"boolean", "bool"}
_CONTAINER_TYPES = {"object", "array", "dict", "list"}


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def escape_json_chars(text: str) -> str:
    """The inside of a JSON string literal; escaping is per character, so pieces concatenate."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def partial_suffix_len(text: str, tags: tuple[str, ...] | str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags`` (held back)."""
    if isinstance(tags, str):
        tags = (tags,)
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def find_first(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """Earliest occurrence of any tag at or after ``start``: (position, tag) or (-1, None)."""
    best, which = -1, None
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, tag
    return best, which


# ---------------------------------------------------------------------------- schemas
def normalize_tools(tools: list[Any] | None) -> dict[str, dict[str, Any]]:
    """OpenAI tools (dicts or pydantic models) → {function name: {param: schema}}."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def param_type(schemas: dict[str, dict[str, Any]], func: str, param: str) -> str | None:
    """The parameter's JSON-schema type name (lower case), None when unknown."""
    schema = schemas.get(func, {}).get(param)
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):                       # ["string", "null"] → "string"
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind is None:
        for key in ("anyOf", "oneOf"):
            for alt in schema.get(key) or []:
                if isinstance(alt, dict) and alt.get("type") not in (None, "null"):
                    kind = alt["type"]
                    break
            if kind is not None:
                break
    if kind is None and "enum" in schema:
        kind = "enum"
    return str(kind).lower() if isinstance(kind, str) else None


def is_string_type(kind: str | None) -> bool:
    return kind in _STRING_TYPES


# ---------------------------------------------------------------------------- conversion
def _try_json(text: str) -> tuple[bool, Any]:
    def no_constants(name: str) -> Any:
        raise ValueError(name)                       # NaN / Infinity are not valid JSON for clients

    try:
        return True, json.loads(text, parse_constant=no_constants)
    except ValueError:
        return False, None


def _serialisable(value: Any) -> bool:
    try:
        dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _to_number(text: str) -> tuple[bool, Any]:
    """An integer- or number-typed value: quotes tolerated, whole floats become ints (vLLM's rule; models print
    140 as "140.0"), a fraction stays a float even for an integer type, non-finite values do not convert."""
    t = text.strip().strip("\"'").strip()
    try:
        return True, int(t)
    except ValueError:
        pass
    try:
        f = float(t)
    except ValueError:
        return False, None
    if not math.isfinite(f):
        return False, None
    return True, (int(f) if f.is_integer() else f)  # vLLM's rule: whole floats become ints


def strip_value_newlines(raw: str) -> str:
    """The template writes a newline after <parameter=P> and before </parameter>: drop one of each."""
    raw = raw.removeprefix("\n")
    raw = raw.removesuffix("\n")
    return raw


def convert_value(value: str, kind: str | None) -> Any:
    """An XML parameter value (newlines already stripped) → a JSON value by schema type."""
    if value.strip().lower() == "null":
        return None
    if kind in _STRING_TYPES:
        return value
    t = value.strip()
    if kind in _INT_TYPES or kind in _NUMBER_TYPES:
        ok, out = _to_number(t)
        if ok:
            return out
    elif kind in _BOOL_TYPES:
        low = t.strip("\"'").lower()
        if low in ("true", "false"):
            return low == "true"
    elif kind in _CONTAINER_TYPES:
        ok, out = _try_json(t)
        if ok:
            return out
        try:
            out = ast.literal_eval(t)                # Python-style dicts/lists: {'a': True}
            if _serialisable(out):
                return out
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            pass
        return value
    elif kind == "null":
        return value
    # unknown parameter or type, or a typed value that did not convert: JSON if it parses, else the text
    ok, out = _try_json(t)
    return out if ok and t else value


def arg_fragment(first: bool, key: str, value_json: str) -> str:
    """One ``"key": value`` member of the arguments object; the first one opens it."""
    return ("{" if first else ", ") + dumps(key) + ": " + value_json


def close_args(num_params: int) -> str:
    return "}" if num_params else "{}"


# ---------------------------------------------------------------------------- hermes JSON
def parse_json_body(body: str) -> tuple[str, str] | None:
    """``{"name": ..., "arguments": {...}}`` → (name, arguments JSON), or None when malformed.

    Text after the object (a stray brace, a newline) is ignored; a missing ``arguments`` is ``{}``; arguments
    given as a JSON string holding an object are accepted.
    """
    s = body.strip()
    try:
        obj, _ = json.JSONDecoder().raw_decode(s)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        ok, parsed = _try_json(args) if args.strip() else (True, {})
        if not ok or not isinstance(parsed, dict):
            return None
        args = parsed
    if not isinstance(args, dict) or not _serialisable(args):
        return None
    return name.strip(), dumps(args)
