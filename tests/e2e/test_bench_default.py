"""`onecard bench URL` with nothing else, against a real `onecard serve` of the bundled model: the model comes
from /v1/models, the bundled coding-assistant conversations are fitted to the server's max_model_len and run
turn by turn, and the JSON carries `vllm bench serve`'s result keys with figures that agree with each other."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import free_port, metric, wait_health

ROOT = Path(__file__).resolve().parents[2]
# The keys `vllm bench serve --save-result` writes (percentile keys for its default --metric-percentiles 99).
VLLM_KEYS = ["date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
             "output_lens", "ttfts", "itls", "generated_texts", "errors"] + [
    f"{kind}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for kind in ("mean", "median", "std", "p99")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "onecard.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--device", "cpu", "--max-model-len", "320"], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, 200, timeout=240)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_bench_with_only_a_url(server, tmp_path):
    hits0 = metric(server, "vllm:prefix_cache_hits_total")
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-m", "onecard.cli", "bench", server, "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "Serving Benchmark Result" in run.stdout and "Median TTFT (ms)" in run.stdout
    res = json.loads(out.read_text())
    assert not [k for k in VLLM_KEYS if k not in res], "missing vllm bench serve keys"
    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]
    assert res["model_id"] == model and res["backend"] == "openai-chat" and res["dataset_name"] == "coding"
    workload = json.loads((ROOT / "onecard" / "data" / "bench" / "coding_assistant.json").read_text())
    turns = sum(len(c["turns"]) for c in workload["conversations"])
    n = res["num_prompts"]
    assert n == turns == res["completed"] and res["max_concurrency"] == len(workload["conversations"])
    assert res["errors"] == [""] * n and all(isinstance(t, str) and t for t in res["generated_texts"])
    for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts"):
        assert len(res[key]) == n, key
    assert sum(res["input_lens"]) == res["total_input_tokens"] and sum(res["output_lens"]) == res[
        "total_output_tokens"]
    # Every request fits the server's context, and later turns of a conversation carry the history.
    reqs = res["requests"]
    assert all(r["prompt_tokens"] + r["output_tokens"] <= 320 for r in reqs)
    assert all(r["output_tokens"] == r["output_len"] for r in reqs)           # ignore_eos: lengths as asked
    by_start = sorted(reqs, key=lambda r: r["start_s"])
    assert max(r["prompt_tokens"] for r in by_start[-6:]) > max(r["prompt_tokens"] for r in by_start[:6])
    for kind in ("ttft", "itl", "e2el"):
        assert 0 < res[f"median_{kind}_ms"] <= res[f"p99_{kind}_ms"] and math.isfinite(res[f"p99_{kind}_ms"])
    assert res["mean_ttft_ms"] == pytest.approx(1000 * sum(res["ttfts"]) / n)
    # Long shared prefixes: the system prompt and each conversation's history hit the prefix cache.
    assert metric(server, "vllm:prefix_cache_hits_total") - hits0 > res["total_input_tokens"] / 4
