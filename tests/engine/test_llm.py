"""The offline API (vLLM-shaped): LLM.generate / LLM.chat on the tiny GPTQ checkpoint, on the CPU."""
from __future__ import annotations

import pytest

from onecard import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_moe_gptq_dir):
    return LLM(str(tiny_moe_gptq_dir), device="cpu", max_model_len=256)


def test_generate_shapes_and_greedy_repeatable(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a = llm.generate(["def add(a, b):", "import os\n"], sp)
    b = llm.generate([{"prompt_token_ids": a[0].prompt_token_ids}], sp)
    assert len(a) == 2 and all(len(r.outputs) == 1 for r in a)
    assert len(a[0].outputs[0].token_ids) == 12 and a[0].outputs[0].finish_reason == "length"
    assert b[0].outputs[0].token_ids == a[0].outputs[0].token_ids
    assert a[0].outputs[0].text == llm.get_tokenizer().decode(a[0].outputs[0].token_ids)


def test_stop_string_cuts_output(llm):
    base = llm.generate("class Foo:", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]                      # a piece from the middle: may span tokens
    cut = llm.generate("class Foo:", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                    stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]


def test_n_samples_share_prompt_blocks(llm):
    prompt = "def fibonacci(n):\n    " * 4
    hits0 = llm.engine.stats().prefix_cache_hits
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert llm.engine.stats().prefix_cache_hits > hits0          # siblings hit the shared prompt blocks
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks            # and nothing leaked


def test_logprobs(llm):
    out = llm.generate("x = ", SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and lp[tok].rank == 1                  # greedy: the chosen token is the most likely
        assert len(lp) >= 3 and all(v.logprob <= 0 for v in lp.values())


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "Write a function."}],
                   SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert "<|im_start|>user" in prompt and prompt.rstrip().endswith("assistant")
    assert len(out.outputs[0].token_ids) == 6
