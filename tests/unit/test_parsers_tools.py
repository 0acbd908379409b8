"""Tool-call parsers: a table of model outputs → expected message, and streaming == whole-text for every cut.

The whole-text parser (tool_parse.py) and the streaming state machine (tool_stream.py) are separate
implementations; the streaming tests and the fuzz test compare one against the other.
"""
from __future__ import annotations

import json
import random

import pytest

from onecard.parsers import (
    counter_ids,
    get_tool_parser,
    merge_deltas,
    prefill_for_tool_choice,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "extra": {"type": "null"}, "opts": {"type": "object"},
        "tags": {"type": "array"}, "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
]

W = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
CODE = 'def f(a, b):\n    if a < b and "x" != \'y\':\n        return "</div>"\n\treturn {a: b}\n'

# (id, text, expected content, expected [(name, arguments dict)])
CASES = [
    ("plain", "Hello, world!\n", "Hello, world!\n", []),
    ("empty", "", None, []),
    ("whitespace_only", "  \n ", None, []),
    ("hermes_one", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>', "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes_two", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {}}\n</tool_call>\n', None, [("a", {"x": 1}), ("b", {})]),
    ("hermes_compact_spacing", '<tool_call>{"name":"a","arguments":{"y":[1,2],"x":"é"}}</tool_call>', None,
     [("a", {"y": [1, 2], "x": "é"})]),
    ("hermes_string_args", '<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 2}"}\n</tool_call>', None,
     [("a", {"x": 2})]),
    ("xml_typed", "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
     "<parameter=days>\n140.0\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n<parameter=metric>\nTrue\n"
     "</parameter>\n<parameter=extra>\nnull\n</parameter>\n<parameter=opts>\n{'a': True, 'b': None}\n"
     "</parameter>\n<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
     "</function>\n</tool_call>", None,
     [("get_weather", {"city": "San Francisco", "days": 140, "temp": 21.5, "metric": True, "extra": None,
                       "opts": {"a": True, "b": None}, "tags": ["x", "y"], "note": None})]),
    ("xml_quoted_int", '<tool_call>\n<function=get_weather>\n<parameter=days>\n"7"\n</parameter>\n'
     "</function>\n</tool_call>", None, [("get_weather", {"days": 7})]),
    ("xml_code_value", "I'll write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n"
     f"</parameter>\n<parameter=content>\n{CODE}\n</parameter>\n</function>\n</tool_call>", "I'll write it.",
     [("write_file", {"path": "/tmp/a.py", "content": CODE})]),
    ("xml_unknown_types", "<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n<parameter=s>\nabc\n"
     "</parameter>\n<parameter=o>\n{\"k\": [1]}\n</parameter>\n</function>\n</tool_call>", None,
     [("other", {"n": 5, "s": "abc", "o": {"k": [1]}})]),
    ("xml_no_params", "<tool_call>\n<function=ping>\n</function>\n</tool_call>", None, [("ping", {})]),
    ("xml_several", W.format(city="Paris") + "\n" + W.format(city="东京 🗼"), None,
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "东京 🗼"})]),
    ("xml_two_functions_one_block", "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n"
     "<function=b>\n<parameter=y>\n2\n</parameter>\n</function>\n</tool_call>", None,
     [("a", {"x": 1}), ("b", {"y": 2})]),
    ("content_calls_content", "Before.\n" + W.format(city="Rome") + "\n\nAfter the call.", "Before.After the call.",
     [("get_weather", {"city": "Rome"})]),
    ("ws_between_calls", "\n" + W.format(city="A") + "\n\n  \n" + W.format(city="B") + "\n", None,
     [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
    ("missing_close_then_next", '<tool_call>\n{"name": "a", "arguments": {}}\n<tool_call>\n'
     '{"name": "b", "arguments": {"z": null}}\n</tool_call>', None, [("a", {}), ("b", {"z": None})]),
    ("malformed_json", 'Hi.\n<tool_call>\n{"name": "a", "arguments": {"x": }\n</tool_call>\nBye',
     'Hi.\n<tool_call>\n{"name": "a", "arguments": {"x": }\n</tool_call>\nBye', []),
    ("json_without_name", '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',
     '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>', []),
    ("xml_without_name", "<tool_call>\n<function=>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
     "<tool_call>\n<function=>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>", []),
    ("empty_call", "<tool_call>\n</tool_call>", "<tool_call>\n</tool_call>", []),
    ("malformed_then_valid", "<tool_call>oops</tool_call>\n" + W.format(city="Oslo"),
     "<tool_call>oops</tool_call>", [("get_weather", {"city": "Oslo"})]),
    ("unterminated_json", 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"q": "ü"}}', "Sure.",
     [("a", {"q": "ü"})]),
    ("unterminated_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
     "<parameter=days>\n2\n", None, [("get_weather", {"city": "Lima", "days": 2})]),
    ("truncated_mid_close_tag", "<tool_call>\n<function=write_file>\n<parameter=content>\nabc\n</param",
     None, [("write_file", {"content": "abc"})]),
    ("truncated_function_name", "Text <tool_call>\n<function=get_wea", "Text <tool_call>\n<function=get_wea", []),
    ("tag_lookalikes_in_content", "Use <tool_c or <tool_callx> and </parameter>? <think> no.",
     "Use <tool_c or <tool_callx> and </parameter>? <think> no.", []),
    ("string_value_null", "<tool_call>\n<function=write_file>\n<parameter=path>\nNULL\n</parameter>\n"
     "<parameter=content>\nnullable\n</parameter>\n</function>\n</tool_call>", None,
     [("write_file", {"path": None, "content": "nullable"})]),
    ("value_newlines_kept_inside", "<tool_call>\n<function=write_file>\n<parameter=content>\n\n\nx\n\n\n"
     "</parameter>\n</function>\n</tool_call>", None, [("write_file", {"content": "\n\nx\n\n"})]),
    ("value_ends_at_next_param", "<tool_call>\n<function=write_file>\n<parameter=path>\na\n<parameter=content>"
     "\nb\n</function>\n</tool_call>", None, [("write_file", {"path": "a", "content": "b"})]),
    ("json_in_qwen_model_trailing_brace", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}}\n</tool_call>',
     None, [("a", {"x": 1})]),
]

PARSERS = ["hermes", "qwen3_coder"]


def _whole(parser: str, text: str, tools=TOOLS):
    return get_tool_parser(parser).parse(text, tools, counter_ids())


def _streamed(parser: str, chunks: list[str], tools=TOOLS):
    """Reassemble the stream's deltas into (content, [(id, name, arguments)]) and check delta shapes."""
    stream = get_tool_parser(parser).stream(tools, counter_ids())
    items = []
    for chunk in chunks:
        items.extend(stream.feed(chunk))
    items.extend(stream.finish())
    content = "".join(i.content for i in items if i.content) or None
    calls: list[list] = []
    for item in items:
        tc = item.tool_call
        if tc is None:
            continue
        if tc.id is not None:                 # a call's first delta: index, id, name, arguments ""
            assert tc.index == len(calls) and tc.name and tc.arguments == ""
            calls.append([tc.id, tc.name, ""])
        else:
            assert tc.index == len(calls) - 1 and tc.name is None and tc.arguments
            calls[-1][2] += tc.arguments
    assert stream.content == content
    assert [[c.id, c.name, c.arguments_json] for c in stream.tool_calls] == calls
    return content, [tuple(c) for c in calls]


def _as_tuple(result):
    return result.content, [(c.id, c.name, c.arguments_json) for c in result.tool_calls]


def _chunkings(text: str, rng: random.Random):
    yield list(text)                                            # every character boundary, 1-char deltas
    for _ in range(4):
        cuts, i = [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            cuts.append(text[i:i + n])
            i += n
        yield cuts
    yield [text]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_whole_text_table(parser, case):
    _, text, content, calls = case
    result = _whole(parser, text)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments_json)) for c in result.tool_calls] == calls
    for c, (_, args) in zip(result.tool_calls, calls):
        assert c.arguments_json == json.dumps(args, ensure_ascii=False)   # same key order and spacing
    if calls:                                   # tags of a parsed call never leak into the content
        assert "</parameter>" not in (result.content or "")


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stream_equals_whole(parser, case):
    _, text, _, _ = case
    expected = _as_tuple(_whole(parser, text))
    rng = random.Random(hash(case[0]) & 0xFFFF)
    for chunks in _chunkings(text, rng):
        assert _streamed(parser, chunks) == expected, chunks
    for k in range(len(text) + 1):                              # two deltas, cut at every boundary
        assert _streamed(parser, [text[:k], text[k:]]) == expected, k


def test_string_values_stream_before_the_parameter_closes():
    text = ("<tool_call>\n<function=write_file>\n<parameter=content>\n" + "line of code\n" * 20
            + "</parameter>\n</function>\n</tool_call>")
    stream = get_tool_parser("qwen3_coder").stream(TOOLS, counter_ids())
    close = text.index("</parameter>")
    streamed = "".join(i.tool_call.arguments or "" for i in stream.feed(text[:close]) if i.tool_call)
    assert streamed.startswith('{"content": "line of code\\n') and len(streamed) > 200
    rest = stream.feed(text[close:]) + stream.finish()
    streamed += "".join(i.tool_call.arguments or "" for i in rest if i.tool_call)
    assert json.loads(streamed) == {"content": "line of code\n" * 19 + "line of code"}


def test_no_tools_given_still_parses():
    r = get_tool_parser("hermes").parse("<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n"
                                        "<parameter=s>\nhi there\n</parameter>\n</function>\n</tool_call>", None)
    assert [(c.name, json.loads(c.arguments_json)) for c in r.tool_calls] == [("f", {"n": 3, "s": "hi there"})]
    assert r.tool_calls[0].id.startswith("call_") and len(r.tool_calls[0].id) == 5 + 24


def test_pydantic_style_tools_accepted():
    class Model:
        def model_dump(self):
            return TOOLS[0]
    r = get_tool_parser("hermes").parse(W.format(city="12"), [Model()])
    assert json.loads(r.tool_calls[0].arguments_json) == {"city": "12"}   # string by schema, not 12


# ---------------------------------------------------------------------------- tool_choice prefill
@pytest.mark.parametrize("parser", PARSERS)
def test_prefill_required_and_named(parser):
    p = get_tool_parser(parser)
    assert p.prefill("auto") == p.prefill("none") == p.prefill(None) == ""
    assert p.prefill("required") == "<tool_call>\n"
    named = {"type": "function", "function": {"name": "get_weather"}}
    pre = p.prefill(named)
    if parser == "hermes":
        assert pre == '<tool_call>\n{"name": "get_weather", "arguments": '
        generated = '{"city": "Paris", "days": 2}}\n</tool_call>'
    else:
        assert pre == "<tool_call>\n<function=get_weather>\n"
        generated = "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n" \
                    "</tool_call>"
    for text in (pre + generated, p.prefill("required") + W.format(city="Paris")[len("<tool_call>\n"):]):
        result = _whole(parser, text)
        assert result.content is None and result.tool_calls[0].name == "get_weather"
        assert json.loads(result.tool_calls[0].arguments_json)["city"] == "Paris"
        assert _streamed(parser, [pre if text.startswith(pre) else "<tool_call>\n"] + list(
            text[len(pre) if text.startswith(pre) else len("<tool_call>\n"):])) == _as_tuple(result)


def test_prefill_errors_and_registry():
    with pytest.raises(ValueError, match="hermes"):
        prefill_for_tool_choice("required", "mistral")
    with pytest.raises(ValueError, match="hermes, qwen3_coder"):
        get_tool_parser("llama3_json")


def test_merge_deltas_builds_openai_delta():
    stream = get_tool_parser("hermes").stream(TOOLS, counter_ids())
    items = stream.feed("Hi " + W.format(city="Paris")) + stream.finish()
    merged = merge_deltas(items)
    assert merged == {"content": "Hi", "tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert merge_deltas([]) is None


# ---------------------------------------------------------------------------- fuzz: stream vs whole
_PIECES = ["<tool_call>", "</tool_call>", "\n", " ", "<function=get_weather>", "<function=write_file>",
           "<function=>", "<function=", "<parameter=city>", "<parameter=days>", "<parameter=content>",
           "<parameter=", "</parameter>", "</function>", ">", "{", "}", '{"name": "g", "arguments": {"x": 1}}',
           '"name"', "text", "null", "12.0", "<", "</", "<tool_", "é😀", "nul", "\n\n", "</tool"]


def test_fuzz_stream_matches_whole_text():
    rng = random.Random(1234)
    for n in range(400):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 18)))
        expected = _as_tuple(_whole("qwen3_coder", text))
        for _, _, args in expected[1]:
            json.loads(args)                                   # arguments are always valid JSON
        chunks = list(text) if n % 2 else [text[i:i + 3] for i in range(0, len(text), 3)]
        assert _streamed("qwen3_coder", chunks) == expected, text


@pytest.mark.parametrize(("text", "expected"), [
    ("140", 140), ("140.0", 140), ('"7"', 7), ("'7'", 7), (" 12 ", 12), ("1_000", 1000), ("1e3", 1000),
    ("-0.0", 0), ("2.5", 2.5), ("-3.25", -3.25), ("inf", "inf"), ("nan", "nan"), ("abc", "abc"), ("", "")])
def test_integer_and_number_parameters_convert_alike(text, expected):
    """Every spelling of an integer or number schema type follows one rule (whole floats become ints, as vLLM;
    a fraction stays a float; text that is no finite number is kept as written)."""
    from onecard.parsers.tool_values import convert_value

    for kind in ("integer", "int", "number", "float", "double"):
        out = convert_value(text, kind)
        assert out == expected and type(out) is type(expected), (kind, text, out)
