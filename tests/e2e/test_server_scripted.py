"""The server end to end over HTTP (real uvicorn, official openai client) with a scripted token source
behind the real engine core: exact texts through detokenizer → parsers → SSE/JSON, errors, metrics, aborts."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import metric, scripted_engine_config, start_server
from tests.e2e.scripted import Script, ScriptedCoreClient

REPLY = "Hello there, friend. The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def script(e2e_tokenizer):
    return Script(e2e_tokenizer, default=REPLY)


@pytest.fixture(scope="module")
def server(e2e_tokenizer_dir, e2e_tokenizer, script):
    config = scripted_engine_config(e2e_tokenizer_dir, e2e_tokenizer, max_model_len=256)
    core = ScriptedCoreClient(config, script)
    state = make_state(config, core, settings_from(config), e2e_tokenizer)
    srv = start_server(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_models_list_shows_every_served_name(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["coder", "reasoning"]
    for m in models.data:
        assert m.object == "model"
        assert m.model_extra["root"] == server.state.settings.model_root
        assert m.model_extra["parent"] is None
        assert m.model_extra["max_model_len"] == 256
    assert client.models.retrieve("reasoning").id == "reasoning"


@pytest.mark.parametrize("name", ["coder", "reasoning"])
def test_chat_plain_and_streamed_give_the_scripted_text(client, e2e_tokenizer, name):
    msgs = [{"role": "user", "content": "Say hello"}]
    r = client.chat.completions.create(model=name, messages=msgs, temperature=0, max_tokens=64)
    assert r.model == name
    assert r.choices[0].message.content == REPLY
    assert r.choices[0].finish_reason == "stop"
    n_reply = len(_ids(e2e_tokenizer, REPLY))
    assert r.usage.completion_tokens == n_reply + 1  # + EOS
    prompt = e2e_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(_ids(e2e_tokenizer, prompt))

    stream = client.chat.completions.create(model=name, messages=msgs, temperature=0, max_tokens=64,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(c.model == name for c in chunks)


def test_max_tokens_gives_length(client, e2e_tokenizer):
    r = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    assert r.choices[0].message.content == e2e_tokenizer.decode(_ids(e2e_tokenizer, REPLY)[:3])


def test_n2_gives_two_choices(client):
    r = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "x"}], n=2,
                                       max_tokens=64)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content == REPLY for c in r.choices)
    stream = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "x"}], n=2,
                                            max_tokens=64, stream=True)
    texts = {0: "", 1: ""}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {0: REPLY, 1: REPLY}


def test_stop_string_ends_with_stop(client):
    for stream in (False, True):
        r = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "x"}],
                                           stop=["brown"], max_tokens=64, stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert reason == ["stop"]
        else:
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
            assert reason == "stop"
            assert r.choices[0].model_extra["stop_reason"] == "brown"
        assert text == REPLY[:REPLY.index("brown")]


def test_logprobs(client, e2e_tokenizer):
    r = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    ids = _ids(e2e_tokenizer, REPLY)[:4]
    assert [c.token for c in content] == [e2e_tokenizer.decode([i]) for i in ids]
    assert all(c.logprob == -0.25 and len(c.top_logprobs) == 2 for c in content)
    assert content[0].bytes == list(content[0].token.encode())


def test_completions(client, e2e_tokenizer):
    r = client.completions.create(model="reasoning", prompt="Once upon", max_tokens=5, logprobs=1)
    assert r.model == "reasoning"
    assert r.choices[0].text == e2e_tokenizer.decode(_ids(e2e_tokenizer, REPLY)[:5])
    assert r.choices[0].finish_reason == "length"
    assert len(r.choices[0].logprobs.tokens) == 5
    assert r.usage.prompt_tokens == len(e2e_tokenizer.encode("Once upon"))
    # several prompts, streamed, n=2 → 4 choices
    stream = client.completions.create(model="coder", prompt=["a", "b"], n=2, max_tokens=3, stream=True)
    texts: dict[int, str] = {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert sorted(texts) == [0, 1, 2, 3]
    assert set(texts.values()) == {e2e_tokenizer.decode(_ids(e2e_tokenizer, REPLY)[:3])}


def test_async_client(server):
    async def go():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        rs = await asyncio.gather(*[
            aclient.chat.completions.create(model="coder", messages=[{"role": "user", "content": f"q{i}"}],
                                            max_tokens=64) for i in range(4)])
        stream = await aclient.chat.completions.create(model="reasoning", messages=[{"role": "user",
                                                       "content": "q"}], max_tokens=64, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await aclient.close()
        return rs, text

    rs, text = asyncio.run(go())
    assert all(r.choices[0].message.content == REPLY for r in rs)
    assert text == REPLY


def test_tokenize_detokenize(server, e2e_tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"model": "coder", "prompt": "Hello there"})
    assert r.status_code == 200
    ids = r.json()["tokens"]
    assert ids == e2e_tokenizer.encode("Hello there") and r.json()["count"] == len(ids)
    r = httpx.post(server.url + "/detokenize", json={"model": "coder", "tokens": ids})
    assert r.json() == {"prompt": e2e_tokenizer.decode(ids)}
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    prompt = e2e_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert r.json()["tokens"] == _ids(e2e_tokenizer, prompt)
    assert httpx.get(server.url + "/version").json()["version"]


# ----------------------------------------------------------------------------------------------- errors
def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_unknown_model_is_404(server):
    r = httpx.post(server.base_url + "/chat/completions",
                   json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    assert _error(r) == {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                         "param": "model", "code": 404}
    r = httpx.get(server.base_url + "/models/nope")
    assert r.status_code == 404 and _error(r)["message"] == "The model `nope` does not exist."


def test_invalid_body_is_400_not_422(server):
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "coder"})
    assert r.status_code == 400
    err = _error(r)
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == "messages"
    r = httpx.post(server.base_url + "/chat/completions", content=b"{not json", headers={"content-type":
                                                                                         "application/json"})
    assert r.status_code == 400
    r = httpx.post(server.base_url + "/chat/completions",
                   json={"model": "coder", "messages": [{"role": "user", "content": "x"}], "temperature": -1})
    assert r.status_code == 400 and "temperature" in _error(r)["message"]


def test_prompt_too_long_is_400_with_vllm_text(server, e2e_tokenizer):
    msgs = [{"role": "user", "content": "word " * 300}]
    template = e2e_tokenizer.apply_chat_template
    n = len(_ids(e2e_tokenizer, template(msgs, tokenize=False, add_generation_prompt=True)))
    hi = len(_ids(e2e_tokenizer, template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)))
    for stream in (False, True):
        r = httpx.post(server.base_url + "/chat/completions",
                       json={"model": "coder", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 256 - hi + 1, "stream": stream})
        assert r.status_code == 400
        err = _error(r)
        assert err["type"] == "BadRequestError"
        assert err["message"].startswith("You passed ") and "However, the model's context length is only 256" \
            in err["message"] and f"maximum input length of {hi - 1} tokens" in err["message"]
        # a max_tokens no prompt could fit: vLLM's other wording, never a negative "maximum input length"
        r = httpx.post(server.base_url + "/chat/completions",
                       json={"model": "coder", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000,
                             "stream": stream})
        assert r.status_code == 400
        assert _error(r)["message"] == (f"'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's "
                                        f"maximum context length is 256 tokens and your request has {hi} input "
                                        f"tokens (1000 > 256 - {hi}).")
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "coder", "messages": msgs})
    assert r.status_code == 400
    assert f"(length {n})" in _error(r)["message"] or f"You passed {n} input tokens" in _error(r)["message"]


def test_queue_full_is_503(server):
    sched = server.state.engine.core.engine_core.scheduler
    old = sched.config.max_num_queued_reqs, sched.config.max_num_seqs
    # no free running slot and no queue: every new request finds the queue full (the engine's own check; the
    # API process's bound is tested in test_hostile_input.py)
    sched.config.max_num_queued_reqs, sched.config.max_num_seqs = 0, 0
    try:
        for stream in (False, True):
            r = httpx.post(server.base_url + "/chat/completions",
                           json={"model": "coder", "messages": [{"role": "user", "content": "x"}], "stream": stream})
            assert r.status_code == 503
            err = _error(r)
            assert err["type"] == "ServiceUnavailableError" and err["code"] == 503
            assert "--max-num-queued-reqs=0" in err["message"]
    finally:
        sched.config.max_num_queued_reqs, sched.config.max_num_seqs = old


def test_unknown_response_format_is_refused(server):
    # (json_object / json_schema are served: tests/e2e/test_structured_outputs.py)
    r = httpx.post(server.base_url + "/chat/completions",
                   json={"model": "coder", "messages": [{"role": "user", "content": "x"}],
                         "response_format": {"type": "yaml"}})
    assert r.status_code == 400 and "response_format" in _error(r)["message"]
    assert _error(r)["param"] == "response_format"


def test_auto_tool_choice_without_flag_is_400(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = httpx.post(server.base_url + "/chat/completions",
                   json={"model": "coder", "messages": [{"role": "user", "content": "x"}], "tools": tools})
    assert r.status_code == 400
    assert _error(r)["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                    '--tool-call-parser to be set')


def test_internal_error_is_500_and_server_keeps_serving(server, script, monkeypatch):
    def boom(prompt_ids):
        raise RuntimeError("scripted runner failure")

    monkeypatch.setattr(script, "reply_ids", boom)
    r = httpx.post(server.base_url + "/chat/completions",
                   json={"model": "coder", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4})
    assert r.status_code == 500
    err = _error(r)
    assert err["type"] == "InternalServerError" and "Traceback" not in err["message"]
    monkeypatch.undo()
    r = httpx.post(server.base_url + "/chat/completions",
                   json={"model": "coder", "messages": [{"role": "user", "content": "x"}], "max_tokens": 64})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY


# ----------------------------------------------------------------------------------------------- lifecycle
def test_dropped_stream_aborts_and_frees_kv(server):
    runner = server.state.engine.core.runner
    runner.hold_after, _ = 5, runner.release.clear()
    aborts0 = _aborts(server.url)
    with httpx.stream("POST", server.base_url + "/chat/completions",
                      json={"model": "coder", "messages": [{"role": "user", "content": "long"}], "stream": True,
                            "max_tokens": 200, "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
            if got >= 5:
                break
        assert metric(server.url, "vllm:num_requests_running") == 1
        assert metric(server.url, "vllm:kv_cache_usage_perc") > 0
    # the connection is closed: the server notices, aborts the request and frees its blocks
    assert _wait_for(lambda: server.state.engine.num_in_flight == 0)
    runner.hold_after = None
    runner.release.set()
    assert _wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 0
                     and metric(server.url, "vllm:kv_cache_usage_perc") == 0.0)
    assert _aborts(server.url) == aborts0 + 1


def _aborts(url: str) -> float:
    import re

    text = httpx.get(url + "/metrics").text
    m = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _wait_for(pred, timeout=10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_metrics_move(server, client):
    gen0 = metric(server.url, "vllm:generation_tokens_total")
    prompt0 = metric(server.url, "vllm:prompt_tokens_total")
    ttft0 = metric(server.url, "vllm:time_to_first_token_seconds_count")
    e2e0 = metric(server.url, "vllm:e2e_request_latency_seconds_count")
    r = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "m"}], max_tokens=5)
    assert metric(server.url, "vllm:generation_tokens_total") == gen0 + 5
    assert metric(server.url, "vllm:prompt_tokens_total") == prompt0 + r.usage.prompt_tokens
    assert metric(server.url, "vllm:time_to_first_token_seconds_count") == ttft0 + 1
    assert metric(server.url, "vllm:e2e_request_latency_seconds_count") == e2e0 + 1
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in text
    assert 'model_name="coder"' in text
