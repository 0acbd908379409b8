"""Prometheus metrics with vLLM's names, so existing vLLM dashboards work unchanged.

Contract: ``ServerMetrics(model_name, stats_fn)`` owns its own ``CollectorRegistry`` (several servers can
live in one test process). Request-level series are observed by the AsyncEngine through ``on_first_token``
/ ``on_finish``; engine-level ones (running, waiting, KV usage, prefix-cache queries/hits, preemptions, and the
host KV tier's lookups/hits as vLLM's "external" prefix cache, its bytes copied each way as vLLM's offload
``kv_offload_total_bytes{transfer_type}`` and its usage as ``cpu_cache_usage_perc``) are read from ``stats_fn()``
(the latest ``EngineStats``) at scrape time; once the engine is up, ``info_fn()``
(its ``EngineInfo``) adds vLLM's ``vllm:cache_config_info`` (labels: block_size, cache_dtype, num_gpu_blocks,
...) and ``onecard:kv_cache_capacity_tokens`` / ``onecard:kv_cache_bytes_per_token`` (the KV pool in tokens). ``render()`` returns the text
exposition and its content type. Every series carries ``model_name`` (the first served name) and
``engine="0"``, as vLLM v1 labels them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from onecard.protocol import EngineInfo, EngineStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector(Collector):
    def __init__(self, labels: dict[str, str], stats_fn: Callable[[], EngineStats],
                 info_fn: Callable[[], EngineInfo | None] | None = None):
        self.labels = labels
        self.stats_fn = stats_fn
        self.info_fn = info_fn

    def collect(self) -> Iterable:
        s = self.stats_fn()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, v)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (older vLLM name).", s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                      s.num_preemptions)
        yield counter("vllm:external_prefix_cache_queries",
                      "External (host KV tier) prefix cache queries, in terms of number of queried tokens.",
                      s.external_prefix_cache_queries)
        yield counter("vllm:external_prefix_cache_hits",
                      "External (host KV tier) prefix cache hits, in terms of number of cached tokens.",
                      s.external_prefix_cache_hits)
        offload = CounterMetricFamily("vllm:kv_offload_total_bytes", "Bytes of KV cache copied to/from the host tier.",
                                      labels=names + ["transfer_type"])
        offload.add_metric(values + ["GPU_to_CPU"], s.kv_bytes_to_host)
        offload.add_metric(values + ["CPU_to_GPU"], s.kv_bytes_from_host)
        yield offload
        yield gauge("vllm:cpu_cache_usage_perc", "Host KV tier usage. 1 means 100 percent usage.",
                    s.host_kv_cache_usage)
        info = self.info_fn() if self.info_fn is not None else None
        if info is not None:
            yield from self._cache_info(info, gauge)

    def _cache_info(self, info: EngineInfo, gauge: Callable) -> Iterable:
        cfg = {"block_size": str(info.block_size), "cache_dtype": info.kv_cache_dtype,
               "num_gpu_blocks": str(info.num_gpu_blocks), "gpu_memory_utilization": str(info.gpu_memory_utilization),
               "enable_prefix_caching": str(info.enable_prefix_caching)}
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(cfg) + list(self.labels))
        g.add_metric(list(cfg.values()) + list(self.labels.values()), 1.0)
        yield g
        yield gauge("onecard:kv_cache_capacity_tokens", "Tokens the KV cache holds (usable blocks x block size).",
                    info.kv_capacity_tokens)
        yield gauge("onecard:kv_cache_bytes_per_token", "KV-cache bytes per token (all layers, K and V).",
                    info.kv_bytes_per_token)


class ServerMetrics:
    def __init__(self, model_name: str, stats_fn: Callable[[], EngineStats],
                 info_fn: Callable[[], EngineInfo | None] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": "0"}
        names = list(self.labels)
        self.registry.register(_EngineStatsCollector(self.labels, stats_fn, info_fn))
        self._prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", names,
                               registry=self.registry).labels(**self.labels)
        self._generation = Counter("vllm:generation_tokens", "Number of generation tokens processed.", names,
                                   registry=self.registry).labels(**self.labels)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                names + ["finished_reason"], registry=self.registry)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               names, buckets=_TTFT_BUCKETS, registry=self.registry).labels(**self.labels)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                              names, buckets=_E2E_BUCKETS, registry=self.registry).labels(**self.labels)
        self._prompt_hist = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens per request.",
                                      names, buckets=_len_buckets(), registry=self.registry).labels(**self.labels)
        self._gen_hist = Histogram("vllm:request_generation_tokens", "Number of generation tokens per request.",
                                   names, buckets=_len_buckets(), registry=self.registry).labels(**self.labels)

    def on_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def on_finish(self, *, prompt_tokens: int, output_tokens: int, finish_reason: str,
                  e2e_seconds: float) -> None:
        self._prompt.inc(prompt_tokens)
        self._generation.inc(output_tokens)
        self._prompt_hist.observe(prompt_tokens)
        self._gen_hist.observe(output_tokens)
        self._e2e.observe(e2e_seconds)
        if finish_reason in ("stop", "length", "abort"):
            self._success.labels(**self.labels, finished_reason=finish_reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _len_buckets() -> list[float]:
    out, v = [], 1
    while v <= 1 << 20:
        out.extend([v, 2 * v, 5 * v])
        v *= 10
    return out
