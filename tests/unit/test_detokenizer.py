"""IncrementalDetokenizer against the tokenizer's own full decode, on a tiny byte-level BPE built here.

The BPE is trained on a few lines with a 300-entry vocabulary, so emoji and untrained CJK characters are
split into several byte tokens: exactly the case where a naive per-token decode yields U+FFFD.
"""
from __future__ import annotations

import random

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from onecard.frontend.detokenizer import DetokUpdate, IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "hello world 😀 emoji 🎉 party, 你好世界！ 猫と犬 🐈‍⬛ done",
    "naïve café — ünïcode 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 한국어 text\nnew line 🤖🤖🤖",
    "def f(x):\n    return x + 1  # 计算 ✓",
]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    lines = ["hello world 😀 emoji 🎉 party", "你好世界，中文测试。", "naïve café", "def f(x): return x + 1"] * 3
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   clean_up_tokenization_spaces=False)


def _stream(tok, ids, chunks=None, prompt=(), **kw) -> tuple[list[str], IncrementalDetokenizer, DetokUpdate]:
    d = IncrementalDetokenizer(tok, list(prompt), kw.pop("skip", True), True, kw.pop("stop", []),
                               kw.pop("include", False), **kw)
    deltas, last = [], DetokUpdate("", None)
    i = 0
    for n in chunks or [1] * len(ids):
        last = d.update(ids[i:i + n])
        i += n
        deltas.append(last.text_delta)
        if last.stop_string is not None:
            break
    if last.stop_string is None:
        deltas.append(d.flush())
    return deltas, d, last


def _random_chunks(n: int, rng: random.Random) -> list[int]:
    out = []
    while n > 0:
        k = min(n, rng.randint(1, 4))
        out.append(k)
        n -= k
    return out


def test_tokenizer_really_splits_characters(tok):
    ids = tok.encode(TEXTS[0])
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the fixture must split multibyte characters"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("mode", ["one", "random", "all"])
def test_stream_equals_full_decode_no_replacement(tok, text, mode):
    ids = tok.encode(text)
    rng = random.Random(len(text))
    chunks = {"one": None, "random": _random_chunks(len(ids), rng), "all": [len(ids)]}[mode]
    deltas, d, _ = _stream(tok, ids, chunks, prompt=tok.encode("<|im_start|>assistant\n"))
    for delta in deltas:
        assert "\ufffd" not in delta
    assert "".join(deltas) == tok.decode(ids) == text
    assert d.text == text and d.token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = tok.encode("hi 😀") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode("x🎉") \
        + [tok.convert_tokens_to_ids("<|im_start|>")]
    deltas, _, _ = _stream(tok, ids, skip=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is (not skip)


def _boundaries(tok, ids) -> list[int]:
    """Character offsets of token boundaries in the decoded text (where they fall on characters)."""
    out, pos = [], 0
    for k in range(1, len(ids) + 1):
        t = tok.decode(ids[:k])
        if not t.endswith("\ufffd"):
            pos = len(t)
            out.append(pos)
    return out


@pytest.mark.parametrize("stop", ["😀 emoji", "世界", "world 😀", "𝔫𝔦"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok, stop, include):
    text = next(t for t in TEXTS if stop in t)
    ids = tok.encode(text)
    start = text.find(stop)
    # the stop string must really span a token boundary for the test to mean anything
    assert any(start < b < start + len(stop) for b in _boundaries(tok, ids))
    expected = text[:start + len(stop)] if include else text[:start]
    for chunks in (None, _random_chunks(len(ids), random.Random(7)), [len(ids)]):
        deltas, d, last = _stream(tok, ids, chunks, stop=[stop], include=include)
        assert last.stop_string == stop and d.stop_string == stop
        assert "".join(deltas) == expected == d.text
        streamed = ""
        for delta in deltas:          # never stream text that a later stop match would cut away
            streamed += delta
            assert expected.startswith(streamed)
        assert d.update(tok.encode("more")) == DetokUpdate("", None)


def test_partial_stop_is_held_then_released(tok):
    text = "hello world 😀 emoji"
    ids = tok.encode(text)
    deltas, d, last = _stream(tok, ids, stop=["emoji!", "zzz"])
    assert last.stop_string is None
    assert "emoj" not in "".join(deltas[:-1])      # held back while "emoji!" was still possible
    assert "".join(deltas) == text == d.text


def test_first_ending_stop_wins_independent_of_batching(tok):
    text = TEXTS[0]
    ids = tok.encode(text)
    stops = ["emoji 🎉 party", "🎉"]             # the longer one starts first but the short one ends first
    results = {"".join(_stream(tok, ids, ch, stop=stops)[0]) for ch in (None, [len(ids)], [3] * len(ids))}
    assert results == {text[:text.find("🎉")]}


def test_min_tokens_ignores_early_stop(tok):
    text = "hello world hello world"
    ids = tok.encode(text)
    k = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("hello world"))
    deltas, _, last = _stream(tok, ids, stop=["world"], min_tokens=k)
    assert last.stop_string == "world"
    assert "".join(deltas) == text[:text.rfind("world")]


def test_window_stays_small(tok):
    ids = tok.encode(" ".join(TEXTS) * 8)
    d = IncrementalDetokenizer(tok, tok.encode("prompt"), True, True, ["🛑"], False)
    sizes: list[int] = []
    inner = d._decode_ids
    d._decode_ids = lambda window: (sizes.append(len(window)), inner(window))[1]
    out = "".join(d.update([i]).text_delta for i in ids) + d.flush()
    assert out == tok.decode(ids)
    assert max(sizes) <= 12          # O(new tokens): the decoded window never grows with the output
