"""Speculative decoding end to end through the offline ``LLM`` (the server's output side), with the real drafters.

Greedy outputs with ``speculative_config`` (ngram prompt lookup, suffix trees), on the synchronous loop and with
async scheduling (the hybrid loop), equal those without it, token for token and in text, on a tiny random
checkpoint (and the bundled model with ngram), over prompts that make the drafters hit (repeated code) and ones
that do not; stop strings that end inside a verify step, ``max_tokens`` inside a draft and ``n`` > 1 give the
same outputs too, and no KV block leaks.
"""
from __future__ import annotations

import pytest

from onecard import LLM, SamplingParams

_CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
         "    return a * b\n\n\ndef div(a, b):\n")
_PROMPTS = [_CODE, "import os\nimport sys\nimport re\nimport os\nimport sys\n", "class Queue:\n    def",
            "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
            "The quick brown fox", "x = 1\ny = 2\nz = 3\n"]
_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


_SUFFIX = {"method": "suffix", "num_speculative_tokens": 5}


@pytest.fixture(scope="module")
def tiny(tiny_moe_gptq_dir):
    """The plain engine, then ngram and suffix speculation on the synchronous loop and on the async hybrid loop."""
    kw = dict(device="cpu", max_model_len=256)
    path = str(tiny_moe_gptq_dir)
    return (LLM(path, **kw), LLM(path, speculative_config=_NGRAM, **kw), LLM(path, speculative_config=_SUFFIX, **kw),
            LLM(path, speculative_config=_NGRAM, async_scheduling=True, **kw),
            LLM(path, speculative_config=_SUFFIX, async_scheduling=True, **kw))


def _outs(llm, prompts, sp):
    res = llm.generate(prompts, sp)
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in r.outputs] for r in res]


def _check_equal(plain, spec_llms, prompts, max_tokens):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want = _outs(plain, prompts, sp)
    for llm in spec_llms:
        assert _outs(llm, prompts, sp) == want
        s = llm.engine.stats()
        assert s.spec_num_accepted_tokens > 0 and s.spec_num_draft_tokens > s.spec_num_accepted_tokens


def test_greedy_equal_with_drafters(tiny):
    _check_equal(tiny[0], tiny[1:], _PROMPTS, 24)


def test_greedy_equal_on_the_bundled_model():
    kw = dict(device="cpu", max_model_len=256)
    _check_equal(LLM(None, **kw), [LLM(None, speculative_config=_NGRAM, **kw),
                                   LLM(None, speculative_config=_NGRAM, async_scheduling=True, **kw)],
                 [_CODE, _PROMPTS[4], _PROMPTS[1]], 14)


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_stops_max_tokens_and_n(tiny, loop):
    plain, ngram = tiny[0], tiny[1 if loop == "sync" else 3]
    assert ngram.engine.async_scheduling is (loop == "async")
    base = plain.generate(_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    text = base.outputs[0].text
    # stop strings ending at many offsets: some inside verify steps, some at their boundaries
    stops = sorted({text[i:i + 3] for i in range(2, min(len(text) - 3, 40), 3) if text[i:i + 3].strip()})[:8]
    sps = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[s]) for s in stops]
    sps += [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 5, 7)]
    sps += [SamplingParams(temperature=0.0, max_tokens=12, n=3, ignore_eos=True, logprobs=1)]
    prompts = [_PROMPTS[0]] * len(sps)
    assert _outs(ngram, prompts, sps) == _outs(plain, prompts, sps)
    cut = [o for o in _outs(ngram, prompts[:len(stops)], sps[:len(stops)]) if o[0][2] == "stop"]
    assert len(cut) >= 3                                   # the stop strings really cut outputs short


def test_json_schema_with_accepted_and_rejected_drafts(tiny):
    """The grammar masks every draft position: an oracle drafter (the true continuation, every third token
    corrupted) gets drafts accepted and rejected inside constrained output; greedy output is unchanged, and
    sampled output stays valid JSON."""
    import json

    from onecard.sampling_params import StructuredOutputsParams
    from tests.engine.spec_helpers import OracleDrafter, enable_spec

    plain = tiny[0]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "array", "items": {"enum": ["x", "yy"]},
                                                     "maxItems": 4}}, "required": ["a", "b"]}

    def sp(**kw):
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return SamplingParams(max_tokens=60, structured_outputs=so, **kw)

    prompts = ["{", "Reply in JSON: "]
    want = plain.generate(prompts, sp(temperature=0.0))
    refs = {str(i): r.prompt_token_ids + r.outputs[0].token_ids for i, r in enumerate(want)}
    vocab = int(plain.config.model.hf_config["vocab_size"])
    from onecard import LLM

    llm = LLM(str(plain.engine_args.model), device="cpu", max_model_len=256)
    spec = enable_spec(llm.engine, OracleDrafter(refs, vocab), k=4)
    got = llm.generate(prompts, sp(temperature=0.0))
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert all(isinstance(json.loads(g.outputs[0].text), dict) for g in got)
    st = spec.stats()
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    sampled = llm.generate(prompts * 3, [sp(temperature=1.0, seed=s) for s in range(6)])
    for s in sampled:
        json.loads(s.outputs[0].text)
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
