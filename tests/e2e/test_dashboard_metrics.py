"""deploy/grafana/onecard-dashboard.json against a real server: after real traffic (streamed and not, a repeated
prompt, a rejected request), every series a dashboard query selects is in /metrics with the labels the query
filters on, so a renamed metric or label fails here and not on an operator's screen."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from onecard.config import EngineArgs
from onecard.frontend.core_client import make_core_client
from onecard.server.launch import make_state, settings_from
from tests.e2e.harness import start_server

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "onecard-dashboard.json"
# Labels a scrape adds (Prometheus Operator target labels), not the server.
SCRAPE_LABELS = {"namespace", "pod", "job", "instance", "container", "service", "endpoint"}
PROMQL_WORDS = {"sum", "rate", "by", "le", "histogram_quantile", "max", "label_values", "without", "avg"}


def dashboard_selectors() -> dict[str, set[str]]:
    """metric name -> label names its selectors filter on, over every query of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    out: dict[str, set[str]] = {}
    for e in exprs:
        for name, body in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", e):
            out.setdefault(name, set()).update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*[=!]~?", body))
        bare = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[\[)]", e)) - PROMQL_WORDS
        assert not {b for b in bare if ":" in b or b.endswith("_total")}, f"selector without braces in {e}"
    return out


def test_dashboard_covers_the_operator_panels():
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for want in ("requests per second", "http", "time to first token", "inter-token", "end-to-end",
                 "tokens per second", "running and waiting", "kv-cache", "prefix-cache hit", "preemption"):
        assert want in titles, (want, titles)
    names = set(dashboard_selectors())
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket", "vllm:num_preemptions_total"} <= names


@pytest.fixture(scope="module")
def server(tiny_moe_gptq_dir):
    config = EngineArgs(model=str(tiny_moe_gptq_dir), served_model_name=["coder"], max_model_len=256,
                        device="cpu", seed=0).create_config()
    srv = start_server(make_state(config, make_core_client(config, single_process=True), settings_from(config)))
    yield srv
    srv.stop()


def test_every_dashboard_series_is_in_metrics_after_traffic(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    prompt = "def fibonacci(n):\n    " * 6                 # > one KV block, sent twice: a prefix-cache hit
    for _ in range(2):
        client.completions.create(model="coder", prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, stream=True, extra_body={"ignore_eos": True})
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 2
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)

    text = httpx.get(server.url + "/metrics").text
    samples: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s.labels)
    missing = []
    for name, labels in sorted(dashboard_selectors().items()):
        if name not in samples:
            missing.append(name)
            continue
        have = set().union(*(set(lab) for lab in samples[name]))
        lacking = labels - SCRAPE_LABELS - have
        assert not lacking, f"{name}: the dashboard filters on {sorted(lacking)}, /metrics has {sorted(have)}"
    assert not missing, f"queried by the dashboard but not in /metrics: {missing}"
    # The traffic really reached the series the latency panels read.
    counts = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert counts["vllm:inter_token_latency_seconds_count"] >= 5 + 5
    assert counts["vllm:prefix_cache_hits_total"] > 0
    statuses = {lab["status"] for lab in samples["http_requests_total"] if lab["handler"] == "/v1/completions"}
    assert {"2xx", "4xx"} <= statuses
