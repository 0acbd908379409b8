"""The host KV tier behind the HTTP server (tiny GPTQ MoE, CPU, engine in a thread), seen by a client.

A long prompt, two others that push it out of a small KV pool, then the first again: the official ``openai``
client gets the same greedy text both times, and /metrics (vLLM's names) shows the host tier at work: external
prefix-cache hits of the evicted prefix, bytes copied each way, the tier's usage.
"""
from __future__ import annotations

import openai
import pytest
import torch

from onecard.config import EngineArgs
from onecard.frontend.core_client import make_core_client
from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import metric, start_server


@pytest.fixture(scope="module")
def server(tiny_moe_gptq_dir):
    config = EngineArgs(model=str(tiny_moe_gptq_dir), served_model_name=["coder"], max_model_len=192, device="cpu",
                        num_gpu_blocks_override=1 + 13, kv_offloading_size=0.01).create_config()
    state = make_state(config, make_core_client(config, single_process=True), settings_from(config))
    srv = start_server(state)
    yield srv
    srv.stop()


def test_evicted_prefix_comes_back_from_host_memory(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (100,), generator=g).tolist() for _ in range(3)]   # 6 full blocks + 4

    def complete(p):
        return client.completions.create(model="coder", prompt=p, max_tokens=8, temperature=0).choices[0].text

    def m(name, **labels):
        return metric(server.url, name) if not labels else _labelled(server.url, name, labels)

    hits0, queries0 = m("vllm:external_prefix_cache_hits_total"), m("vllm:external_prefix_cache_queries_total")
    cold = complete(prompts[0])
    complete(prompts[1])
    complete(prompts[2])                    # the pool (13 blocks) now holds none of the first prompt's blocks
    assert m("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") > 0
    assert m("vllm:external_prefix_cache_hits_total") == hits0
    down = m("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU")
    assert complete(prompts[0]) == cold
    assert m("vllm:external_prefix_cache_hits_total") - hits0 == 96
    assert m("vllm:external_prefix_cache_queries_total") - queries0 == 4 * 100
    up = m("vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU")
    block = up / 6                          # the 6 full blocks of the prompt came back
    assert block > 0 and down >= 6 * block and down % block == 0
    assert 0 < m("vllm:cpu_cache_usage_perc") <= 1


def _labelled(url: str, name: str, labels: dict[str, str]) -> float:
    import re

    import httpx

    text = httpx.get(url + "/metrics").text
    for line in text.splitlines():
        mt = re.match(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", line)
        if mt and all(f'{k}="{v}"' in mt.group(1) for k, v in labels.items()):
            return float(mt.group(2))
    raise AssertionError(f"{name} {labels} not in /metrics")
