"""The server with --kv-cache-dtype fp8_e5m2 (tiny GPTQ MoE, CPU, engine in a thread): /metrics names the format
(vLLM's vllm:cache_config_info) and counts the pool in tokens, twice a float16 pool of the same bytes; the
start-up log says it; the official openai client gets the greedy text LLM.generate gives on the same cache."""
from __future__ import annotations

import logging
import re

import httpx
import openai
import pytest

from onecard import LLM, SamplingParams
from onecard.config import EngineArgs
from onecard.frontend.core_client import make_core_client
from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import metric, start_server

ARGS = {"served_model_name": ["coder"], "max_model_len": 256, "device": "cpu", "seed": 0,
        "kv_cache_memory_bytes": 4 << 20}


def _server(path, kv: str):
    config = EngineArgs(model=str(path), kv_cache_dtype=kv, **ARGS).create_config()
    state = make_state(config, make_core_client(config, single_process=True), settings_from(config))
    return start_server(state)


@pytest.fixture(scope="module")
def servers(tiny_moe_gptq_dir):
    fp8, fp16 = _server(tiny_moe_gptq_dir, "fp8_e5m2"), _server(tiny_moe_gptq_dir, "float16")
    yield fp8, fp16
    fp8.stop()
    fp16.stop()


def test_metrics_count_twice_the_tokens(servers):
    fp8, fp16 = servers
    text = httpx.get(fp8.url + "/metrics").text
    info = re.search(r"^vllm:cache_config_info\{([^}]*)\} 1\.0$", text, re.MULTILINE)
    assert info and 'cache_dtype="fp8_e5m2"' in info.group(1) and 'block_size="16"' in info.group(1)
    tokens8 = metric(fp8.url, "onecard:kv_cache_capacity_tokens")
    tokens16 = metric(fp16.url, "onecard:kv_cache_capacity_tokens")
    assert tokens8 >= 2 * tokens16 > 0
    assert 2 * metric(fp8.url, "onecard:kv_cache_bytes_per_token") == metric(fp16.url, "onecard:kv_cache_bytes_per_token")


def test_startup_log_names_the_format(servers, caplog):
    from onecard.server.app import log_engine_info

    with caplog.at_level(logging.INFO, logger="onecard.server.app"):
        log_engine_info(servers[0].state)
    assert re.search(r"KV cache fp8_e5m2 \(\d+ B/token\)", caplog.text), caplog.text


def test_completion_matches_llm_on_the_same_cache(servers, tiny_moe_gptq_dir):
    fp8, _ = servers
    client = openai.OpenAI(base_url=fp8.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model="coder", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    llm = LLM(str(tiny_moe_gptq_dir), kv_cache_dtype="fp8_e5m2", **ARGS)
    ref = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert r.choices[0].text == ref.outputs[0].text
    assert metric(fp8.url, "vllm:kv_cache_usage_perc") == 0.0
