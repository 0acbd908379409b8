"""Hostile and broken input against a real server (uvicorn on 127.0.0.1, the real engine core with a scripted
runner): every bad value is a 400 (or 413) in OpenAI's error shape while good streams running at the same
time finish unharmed; non-streaming requests whose client left are aborted; the queue bound answers 503 with
Retry-After without waiting for an engine step; the API key is checked on the first Authorization header."""
from __future__ import annotations

import asyncio
import logging
import time

import httpx
import openai
import pytest

from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import metric, scripted_engine_config, start_server
from tests.e2e.scripted import Script, ScriptedCoreClient

REPLY = "Hello there, friend. The quick brown fox jumps over the lazy dog."
MSG = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def server(e2e_tokenizer_dir, e2e_tokenizer):
    # --max-num-seqs 4 + --max-num-queued-reqs 4: the in-flight cap is 8
    config = scripted_engine_config(e2e_tokenizer_dir, e2e_tokenizer, max_model_len=256, max_num_seqs=4,
                                    max_num_queued_reqs=4)
    core = ScriptedCoreClient(config, Script(e2e_tokenizer, default=REPLY))
    settings = settings_from(config, api_key="sekret")
    srv = start_server(make_state(config, core, settings, e2e_tokenizer))
    yield srv
    srv.stop()


AUTH = {"Authorization": "Bearer sekret"}


def _post(server, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={**AUTH, **kw.pop("headers", {})}, timeout=60, **kw)


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


BAD_CHAT = [
    ({"n": 2**40, "max_tokens": 1}, "n"),
    ({"n": 0}, "n"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"top_logprobs": 10**6, "logprobs": True}, "top_logprobs"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"1": 1.0}}, None),
]
BAD_RAW = [     # JSON that Python's parser accepts but no number field may hold
    ('{"model":"coder","messages":[{"role":"user","content":"x"}],"temperature":NaN}', "temperature"),
    ('{"model":"coder","messages":[{"role":"user","content":"x"}],"top_p":Infinity}', "top_p"),
    ('{"model":"coder","messages":[{"role":"user","content":"x"}],"presence_penalty":-Infinity}',
     "presence_penalty"),
]
BAD_COMPLETION = [
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [[1, True]]}, "prompt"),
    ({"prompt": [1.0, 2.0]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x", "best_of": 10**9}, "best_of"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
]


def test_bad_inputs_are_400_and_concurrent_streams_are_unharmed(server):
    async def good(client: openai.AsyncOpenAI) -> str:
        stream = await client.chat.completions.create(model="coder", messages=MSG, stream=True, max_tokens=64)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def bad(http: httpx.AsyncClient) -> list[tuple[str, httpx.Response]]:
        out = []
        for fields, param in BAD_CHAT:
            r = await http.post("/v1/chat/completions", json={"model": "coder", "messages": MSG, **fields})
            out.append((f"chat {fields} -> {param}", r, param))
        for raw, param in BAD_RAW:
            r = await http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            out.append((f"raw {raw[-30:]}", r, param))
        for fields, param in BAD_COMPLETION:
            r = await http.post("/v1/completions", json={"model": "coder", **fields})
            out.append((f"completion {fields}", r, param))
        r = await http.post("/detokenize", json={"tokens": [True]})
        out.append(("detokenize bools", r, "tokens"))
        return out

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="sekret", max_retries=0)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            results = await asyncio.gather(*[good(client) for _ in range(3)], bad(http),
                                           *[good(client) for _ in range(3)])
        await client.close()
        return results

    results = asyncio.run(main())
    goods = results[:3] + results[4:]
    assert goods == [REPLY] * 6
    for what, r, param in results[3]:
        assert r.status_code == 400, (what, r.status_code, r.text)
        err = _error(r)
        assert err["type"] == "BadRequestError", what
        if param is not None:
            assert err["param"] == param or param in err["message"], (what, err)
    # nothing leaked: no request left in the engine, no KV block held
    assert server.state.engine.num_in_flight == 0
    assert _wait_for(lambda: metric(server.url, "vllm:kv_cache_usage_perc") == 0.0)


def test_extreme_but_valid_values_are_served(server):
    r = _post(server, "/v1/chat/completions", {"model": "coder", "messages": MSG, "seed": 2**63 - 1, "n": 2,
                                               "top_k": 2**63 - 1, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    r = _post(server, "/v1/chat/completions", {"model": "coder", "messages": MSG, "seed": -(2**63), "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_oversized_body_is_413_and_health_stays_responsive(server):
    huge = b'{"model": "coder", "prompt": "' + b"a" * (20 << 20) + b'"}'
    for path in ("/v1/completions", "/tokenize"):
        r = httpx.post(server.url + path, content=huge, headers={**AUTH, "content-type": "application/json"},
                       timeout=120)
        assert r.status_code == 413, (path, r.status_code)
        assert _error(r)["type"] == "RequestTooLargeError"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_prompt_surely_too_long_is_refused_before_tokenizing(server):
    text = "word " * 200_000       # 1 MB: under the body limit, far over the context
    for path, body in (("/v1/completions", {"model": "coder", "prompt": text}),
                       ("/v1/chat/completions", {"model": "coder", "messages": [{"role": "user", "content": text}]})):
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        assert "longer than the maximum model length of 256" in _error(r)["message"]


def test_api_key_first_authorization_header_counts(server):
    body = {"model": "coder", "messages": MSG, "max_tokens": 2}
    two = [("authorization", "Bearer wrong"), ("authorization", "Bearer sekret")]
    r = httpx.post(server.base_url + "/chat/completions", json=body, headers=two)
    assert r.status_code == 401
    r = httpx.post(server.base_url + "/chat/completions", json=body, headers=list(reversed(two)))
    assert r.status_code == 200
    for bad in ("sekret", "Basic sekret", "Bearer sekret2", "Bearer  sekret", "bearer sekret"):
        r = httpx.post(server.base_url + "/chat/completions", json=body, headers={"Authorization": bad})
        assert r.status_code == (200 if bad == "bearer sekret" else 401), bad   # the scheme is case-blind
    # vLLM's rule: only /v1/* needs the key
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).status_code == 200


def test_non_streaming_disconnect_aborts(server):
    runner = server.state.engine.core.runner
    aborts0 = _aborts(server.url)
    runner.hold_after, _ = 3, runner.release.clear()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/chat/completions", headers=AUTH, timeout=httpx.Timeout(60, read=1.0),
                       json={"model": "coder", "messages": MSG, "max_tokens": 200, "ignore_eos": True})
        # the client is gone: the route is cancelled and its engine request aborted while steps are held
        assert _wait_for(lambda: server.state.engine.num_in_flight == 0)
    finally:
        runner.hold_after = None
        runner.release.set()
    assert _wait_for(lambda: _aborts(server.url) == aborts0 + 1)
    assert _wait_for(lambda: metric(server.url, "vllm:kv_cache_usage_perc") == 0.0)


def test_queue_bound_is_503_with_retry_after_at_once(server):
    runner = server.state.engine.core.runner
    runner.hold_after, _ = 1, runner.release.clear()      # every step after the first token waits: no progress

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            body = {"model": "coder", "messages": MSG, "max_tokens": 8}
            held = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(8)]
            while server.state.engine.num_in_flight < 8:
                await asyncio.sleep(0.01)
            # the cap (4 running + 4 queued) is reached while no engine step can run: the answer cannot
            # have waited for one
            over = await http.post("/v1/chat/completions", json=body)
            too_many = await http.post("/v1/chat/completions", json={**body, "n": 9})
            runner.hold_after = None
            runner.release.set()
            return over, too_many, await asyncio.gather(*held)

    try:
        over, too_many, held = asyncio.run(main())
    finally:
        runner.hold_after = None
        runner.release.set()
    assert over.status_code == 503 and over.headers["retry-after"] == "1"
    err = _error(over)
    assert err["type"] == "ServiceUnavailableError" and "--max-num-queued-reqs=4" in err["message"]
    assert too_many.status_code == 400 and "n times the number of prompts" in _error(too_many)["message"]
    assert all(r.status_code == 200 for r in held)


def test_new_metrics_and_access_log(server, caplog):
    caplog.set_level(logging.INFO, logger="onecard.access")
    names = ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
             "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
             "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
             "vllm:request_time_per_output_token_seconds_count", "vllm:iteration_tokens_total_count")
    before = {n: metric(server.url, n) for n in names}
    itl_sum0 = metric(server.url, "vllm:inter_token_latency_seconds_sum")
    r = _post(server, "/v1/chat/completions", {"model": "coder", "messages": MSG, "max_tokens": 5})
    assert r.status_code == 200
    after = {n: metric(server.url, n) for n in names}
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 4
    assert after["vllm:time_per_output_token_seconds_count"] == before["vllm:time_per_output_token_seconds_count"] + 4
    for n in names[2:7]:
        assert after[n] == before[n] + 1, n
    assert after["vllm:iteration_tokens_total_count"] >= before["vllm:iteration_tokens_total_count"] + 5
    assert metric(server.url, "vllm:inter_token_latency_seconds_sum") > itl_sum0
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "onecard.access"]
    assert any('"POST /v1/chat/completions HTTP/1.1" 200' in line for line in lines), lines


def _aborts(url: str) -> float:
    import re

    text = httpx.get(url + "/metrics").text
    m = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _wait_for(pred, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False
