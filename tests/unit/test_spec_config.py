"""``--speculative-config`` / ``LLM(speculative_config=...)``: vLLM's keys, clear refusals, the /metrics series
and ``onecard bench``'s acceptance figures read back from them."""
from __future__ import annotations

import asyncio

import pytest

from onecard.cli import build_serve_parser, engine_args_from_namespace
from onecard.config import ConfigError, EngineArgs, SpeculativeConfig
from onecard.protocol import EngineStats
from onecard.server.metrics import ServerMetrics
from onecard.tools.bench_spec import read_spec_counters, spec_summary


def test_parse_vllm_keys():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
                                '"prompt_lookup_min": 2}')
    assert (c.method, c.num_speculative_tokens, c.params) == ("ngram", 5, {"prompt_lookup_min": 2,
                                                                           "prompt_lookup_max": 4})
    c = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8,
                                 "suffix_decoding_max_tree_depth": 24})
    assert c.params == {"suffix_decoding_max_tree_depth": 24}
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24   # vLLM: the tree depth
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None


@pytest.mark.parametrize("value, words", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', ["'eagle' is not supported", "draft model", "ngram"]),
    ({"method": "mtp", "num_speculative_tokens": 1}, ["'mtp' is not supported"]),
    ({"method": "ngram"}, ["num_speculative_tokens"]),
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens=0"]),
    ({"num_speculative_tokens": 2}, ['needs "method"']),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, ["unknown", "model"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     ["--speculative-config", "prompt_lookup"]),
    ({"method": "suffix", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, ["do not apply", "suffix"]),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, ["num_speculative_tokens=0"]),
    ("{not json", ["not valid JSON"]),
])
def test_refusals_name_the_problem(value, words):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.parse(value)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_cli_flag_with_and_without_async_scheduling():
    flag = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--device", "cpu"]
    cfg = engine_args_from_namespace(build_serve_parser().parse_args(flag)).create_config()
    assert cfg.speculative.method == "ngram" and cfg.speculative.num_speculative_tokens == 3
    assert cfg.scheduler.async_scheduling is False                                 # the CPU path's default
    assert EngineArgs(device="cpu").create_config().speculative is None           # off by default
    # the pair is allowed (the hybrid loop, core/engine_core.py), from the CLI and from EngineArgs
    cfg = engine_args_from_namespace(build_serve_parser().parse_args([*flag, "--async-scheduling"])).create_config()
    assert cfg.scheduler.async_scheduling is True and cfg.speculative.method == "ngram"
    cfg = EngineArgs(device="cpu", async_scheduling=True,
                     speculative_config={"method": "suffix", "num_speculative_tokens": 3}).create_config()
    assert cfg.scheduler.async_scheduling is True and cfg.speculative.method == "suffix"


class _Resp:
    def __init__(self, text: str) -> None:
        self.status_code, self.text = 200, text


class _Client:
    """Serves a ServerMetrics exposition as GET /metrics would."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def get(self, path: str) -> _Resp:
        assert path == "/metrics"
        return _Resp(self.metrics.render()[0].decode())


def test_metrics_series_and_bench_acceptance_length():
    stats = EngineStats(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=25,
                        spec_accepted_per_pos=[9, 8, 5, 3])
    m = ServerMetrics("coder", lambda: stats)
    text = m.render()[0].decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert f'{name}{{engine="0",model_name="coder"}}' in text, name
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="coder",position="2"} 5.0' in text
    before = asyncio.run(read_spec_counters(_Client(m)))
    stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens = 20, 80, 55
    stats.spec_accepted_per_pos = [19, 16, 12, 8]
    s = spec_summary(before, asyncio.run(read_spec_counters(_Client(m))))
    assert s["spec_decode_acceptance_length"] == pytest.approx(1 + 30 / 10)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(100 * 30 / 40)
    assert s["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 0.8, 0.7, 0.5])
    # no speculation: no series, no figures
    plain = ServerMetrics("coder", EngineStats)
    assert "spec_decode" not in plain.render()[0].decode()
    assert asyncio.run(read_spec_counters(_Client(plain))) is None and spec_summary(None, None) == {}
