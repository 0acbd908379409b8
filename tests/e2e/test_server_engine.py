"""The server on the real engine (tiny 4-bit GPTQ Qwen3-MoE, CPU, engine core in a thread): greedy text over
HTTP, for both served names, streamed and not, equals ``LLM.generate`` on the same prompt token ids; with the
synchronous engine loop and with ``--async-scheduling`` (the reference ``LLM`` runs synchronously)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from onecard import LLM, SamplingParams
from onecard.config import EngineArgs
from onecard.frontend.core_client import make_core_client
from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import metric, start_server

ARGS = dict(served_model_name=["coder", "reasoning"], max_model_len=256, device="cpu", seed=0)
MSGS = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def config(tiny_moe_gptq_dir, request):
    return EngineArgs(model=str(tiny_moe_gptq_dir), async_scheduling=request.param, **ARGS).create_config()


@pytest.fixture(scope="module")
def server(config):
    state = make_state(config, make_core_client(config, single_process=True), settings_from(config))
    srv = start_server(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm(tiny_moe_gptq_dir):
    return LLM(str(tiny_moe_gptq_dir), **ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def _chat_prompt_ids(tokenizer, msgs):
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _reference(llm, prompt_ids, **kw):
    out = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, **kw))[0].outputs[0]
    return out


def test_models_list_has_root(client, config):
    data = client.models.list().data
    assert [m.id for m in data] == ["coder", "reasoning"]
    assert {m.model_extra["root"] for m in data} == {config.model.model}


@pytest.mark.parametrize("name", ["coder", "reasoning"])
def test_greedy_chat_equals_llm_generate(client, llm, server, name):
    ref = _reference(llm, _chat_prompt_ids(server.state.tokenizer, MSGS), max_tokens=12)
    r = client.chat.completions.create(model=name, messages=MSGS, temperature=0, max_tokens=12)
    assert r.model == name
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.chat.completions.create(model=name, messages=MSGS, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_completions_equal_llm_generate_with_logprobs(client, llm, server):
    ids = server.state.tokenizer.encode("import json\n")
    ref = _reference(llm, ids, max_tokens=8, logprobs=2)
    r = client.completions.create(model="coder", prompt="import json\n", temperature=0, max_tokens=8, logprobs=2)
    assert r.choices[0].text == ref.text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids)
    assert lp.token_logprobs == pytest.approx([d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)], abs=1e-4)


def test_n2_and_stop(client, llm, server):
    ids = _chat_prompt_ids(server.state.tokenizer, MSGS)
    ref = _reference(llm, ids, max_tokens=12)
    r = client.chat.completions.create(model="coder", messages=MSGS, temperature=0, max_tokens=12, n=2)
    assert [c.message.content for c in r.choices] == [ref.text, ref.text]
    stop = ref.text[3:6]
    if stop.strip():
        r = client.chat.completions.create(model="coder", messages=MSGS, temperature=0, max_tokens=12, stop=[stop])
        assert r.choices[0].message.content == ref.text[:ref.text.index(stop)]
        assert r.choices[0].finish_reason == "stop"


def test_async_streams_concurrently(server, llm):
    ids = _chat_prompt_ids(server.state.tokenizer, MSGS)
    ref = _reference(llm, ids, max_tokens=10)

    async def one(ac, name):
        s = await ac.chat.completions.create(model=name, messages=MSGS, temperature=0, max_tokens=10, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

    async def go():
        ac = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        try:
            return await asyncio.gather(*[one(ac, n) for n in ("coder", "reasoning", "coder")])
        finally:
            await ac.close()

    assert asyncio.run(go()) == [ref.text] * 3


def test_metrics_and_kv_back_to_zero(server, client):
    gen0 = metric(server.url, "vllm:generation_tokens_total")
    client.completions.create(model="coder", prompt="x = 1", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert metric(server.url, "vllm:generation_tokens_total") == gen0 + 4
    assert metric(server.url, "vllm:num_requests_running") == 0
    assert metric(server.url, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(server.url, "vllm:prefix_cache_queries_total") > 0
    assert httpx.get(server.url + "/health").status_code == 200


def _parity_cases(llm, prompt):
    """Requests for the LLM-vs-server parity test: greedy with logprobs; a stop string the output reaches at
    its second token, without and with ``min_tokens`` (which must let it run past); n=2 seeded sampling."""
    tok = llm.get_tokenizer()
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    first = tok.decode(base.token_ids[:1])
    stop = tok.decode(base.token_ids[:2])[len(first):]
    assert stop.strip(), "the second token must print something for the stop case to mean anything"
    return base, stop, [
        dict(temperature=0, max_tokens=10, logprobs=2),
        dict(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
        dict(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], min_tokens=4, logprobs=1),
        dict(temperature=0.8, seed=7, n=2, max_tokens=8, ignore_eos=True, logprobs=1),
    ]


def test_llm_and_server_give_identical_outputs(client, llm):
    """One output processor (issue 26): text, finish reason, stop reason and logprob strings/values agree."""
    prompt = "def parse(data):\n"
    base, stop, cases = _parity_cases(llm, prompt)
    results = {}
    for kw in cases:
        ref = llm.generate(prompt, SamplingParams(**kw))[0].outputs
        extra = {k: kw[k] for k in ("ignore_eos", "min_tokens") if k in kw}
        std = {k: v for k, v in kw.items() if k not in extra}
        r = client.completions.create(model="coder", prompt=prompt, extra_body=extra, **std)
        assert len(r.choices) == len(ref)
        for choice, out in zip(sorted(r.choices, key=lambda c: c.index), ref):
            assert choice.text == out.text
            assert choice.finish_reason == out.finish_reason
            assert choice.model_extra["stop_reason"] == out.stop_reason
            if kw.get("logprobs"):
                lp = choice.logprobs
                assert lp.tokens == [d[t].decoded_token for d, t in zip(out.logprobs, out.token_ids)]
                assert lp.token_logprobs == pytest.approx(
                    [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)], abs=1e-4)
                for top, d in zip(lp.top_logprobs, out.logprobs):
                    ref_top = {v.decoded_token: v.logprob for v in d.values() if v.rank <= kw["logprobs"]}
                    assert top == pytest.approx(ref_top, abs=1e-4)
        results[len(results)] = ref[0]
    # the stop cases mean something: without min_tokens the stop ends the text at once, with it the output
    # runs past the first match
    assert results[1].finish_reason == "stop" and results[1].stop_reason == stop
    assert results[1].text == base.text[:base.text.index(stop)]
    assert len(results[2].token_ids) > 4 and results[2].text.startswith(base.text[:base.text.index(stop) + 1])


def test_responses_and_messages_equal_llm_generate(client, llm, server):
    """The real tiny model's plain text through /v1/responses and /v1/messages (official clients)."""
    import anthropic

    ref = _reference(llm, _chat_prompt_ids(server.state.tokenizer, MSGS), max_tokens=12)
    r = client.responses.create(model="coder", input=MSGS[0]["content"], temperature=0, max_output_tokens=12)
    assert r.output_text == ref.text and r.usage.output_tokens == len(ref.token_ids)
    assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    ac = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    greedy = {"temperature": 0}       # (this anthropic release has no temperature argument)
    m = ac.messages.create(model="reasoning", max_tokens=12, messages=MSGS, extra_body=greedy)
    assert "".join(b.text for b in m.content) == ref.text and m.usage.output_tokens == len(ref.token_ids)
    assert m.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn")
    with ac.messages.stream(model="coder", max_tokens=12, messages=MSGS, extra_body=greedy) as s:
        assert s.get_final_text() == ref.text
