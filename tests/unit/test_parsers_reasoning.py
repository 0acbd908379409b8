"""Qwen3 reasoning parser: table of outputs → (reasoning, content); streaming == whole text for every cut;
and the reasoning → tool-call pipeline as the server runs it."""
from __future__ import annotations

import json
import random

import pytest

from onecard.parsers import counter_ids, get_reasoning_parser, get_tool_parser, prompt_opens_think

# (id, text, prompt_opened_think, reasoning, content)
CASES = [
    ("think_block", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", False,
     "\nLet me think.\n", "The answer is 4."),
    ("no_think_is_content", "def f():\n    return 1\n", False, None, "def f():\n    return 1\n"),
    ("coder_mentions_think_later", "Use the <think> tag like <think>x</think>.", False, None,
     "Use the <think> tag like <think>x</think>."),
    ("prompt_opened", "The user wants X.\n</think>\n\nHere is X.", True, "The user wants X.\n", "Here is X."),
    ("prompt_opened_model_repeats_open", "<think>\nhmm\n</think>\nok", True, "\nhmm\n", "ok"),
    ("enable_thinking_false", "Just the answer.", False, None, "Just the answer."),
    ("cut_off_while_thinking", "<think>\nstill going", False, "\nstill going", None),
    ("prompt_opened_cut_off", "still going", True, "still going", None),
    ("empty_think", "<think>\n\n</think>\n\nHello", False, None, "Hello"),
    ("prompt_opened_immediate_close", "</think>\n\nHello", True, None, "Hello"),
    ("partial_tags_inside", "<think>a </th b <thi</think>c </think> d", False, "a </th b <thi", "c </think> d"),
    ("leading_whitespace_then_think", "\n\n <think>x</think>y", False, "x", "y"),
    ("thinking_is_not_think", "<thinking> out loud", False, None, "<thinking> out loud"),
    ("only_whitespace_content", "<think>r</think>\n\n", False, "r", None),
    ("empty", "", False, None, None),
    ("empty_prompt_opened", "", True, None, None),
    ("unicode", "<think>考虑一下 🤔</think>答案：😀", False, "考虑一下 🤔", "答案：😀"),
    ("whitespace_content_no_think", "  \n", False, None, "  \n"),
]


def _stream(text: str, opened: bool, chunks: list[str]):
    s = get_reasoning_parser("qwen3").stream(opened)
    r_parts, c_parts = [], []
    for ch in chunks + [None]:
        r, c = s.feed(ch) if ch is not None else s.finish()
        assert r != "" and c != ""                 # empty deltas are None
        r_parts.append(r or "")
        c_parts.append(c or "")
    return "".join(r_parts) or None, "".join(c_parts) or None


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_whole_text(name, case):
    _, text, opened, reasoning, content = case
    assert get_reasoning_parser(name).parse(text, opened) == (reasoning, content)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stream_equals_whole(case):
    _, text, opened, reasoning, content = case
    rng = random.Random(len(text))
    chunkings = [list(text), [text]] + [[text[:k], text[k:]] for k in range(len(text) + 1)]
    for _ in range(5):
        cuts, i = [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            cuts.append(text[i:i + n])
            i += n
        chunkings.append(cuts)
    for chunks in chunkings:
        assert _stream(text, opened, chunks) == (reasoning, content), chunks


def test_partial_open_tag_is_held_back():
    s = get_reasoning_parser("qwen3").stream(False)
    assert s.feed("<thi") == (None, None)
    assert s.feed("nk>abc") == ("abc", None)
    s = get_reasoning_parser("qwen3").stream(False)
    assert s.feed("<thi") == (None, None)
    assert s.feed("s is code") == (None, "<this is code")


def test_prompt_opens_think():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # enable_thinking=false
    assert not prompt_opens_think("<|im_start|>assistant\n")


def test_unknown_reasoning_parser():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        get_reasoning_parser("granite")


def test_reasoning_then_tool_calls_pipeline():
    """Server order: reasoning parser first, the tool parser reads the content stream."""
    text = ("<think>\nI should call the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
    reasoning, content = get_reasoning_parser("qwen3").parse(text, False)
    whole = get_tool_parser("hermes").parse(content, None, counter_ids())
    rs = get_reasoning_parser("qwen3").stream(False)
    ts = get_tool_parser("hermes").stream(None, counter_ids())
    r_acc = ""
    for ch in list(text) + [None]:
        r, c = rs.feed(ch) if ch is not None else rs.finish()
        r_acc += r or ""
        if c:
            ts.feed(c)
    ts.finish()
    assert r_acc == reasoning == "\nI should call the tool.\n"
    assert whole.content is None and ts.content is None
    assert [(c.name, json.loads(c.arguments_json)) for c in ts.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert [c.arguments_json for c in ts.tool_calls] == [c.arguments_json for c in whole.tool_calls]
