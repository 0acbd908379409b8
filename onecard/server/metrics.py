"""Prometheus metrics with vLLM's names, so existing vLLM dashboards work unchanged.

Contract: ``ServerMetrics(model_name, stats_fn)`` owns its own ``CollectorRegistry`` (several servers can
live in one test process). Request-level series are observed by the AsyncEngine through ``on_first_token``
/ ``on_tokens`` / ``on_finish`` (TTFT, inter-token latency, queue / prefill / decode / inference / e2e time,
token counts); ``on_http`` counts responses for the app's middleware (``http_requests_total{method,status,
handler}``, as vLLM's instrumentator names it); ``on_step(stats)`` observes ``vllm:iteration_tokens_total`` once per engine step; engine-level
gauges (running, waiting, KV usage, prefix-cache queries/hits, preemptions, and the host KV tier's
lookups/hits as vLLM's "external" prefix cache, its bytes copied each way as vLLM's offload
``kv_offload_total_bytes{transfer_type}`` and its usage as ``cpu_cache_usage_perc``; with speculative decoding
vLLM's ``spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`` and
``spec_decode_num_accepted_tokens_per_pos_total{position}``) are read from
``stats_fn()`` (the latest ``EngineStats``) at scrape time; once the engine is up, ``info_fn()`` (its
``EngineInfo``) adds vLLM's ``vllm:cache_config_info`` (labels: block_size, cache_dtype, num_gpu_blocks, ...)
and ``onecard:kv_cache_capacity_tokens`` / ``onecard:kv_cache_bytes_per_token`` (the KV pool in tokens). ``render()`` returns the text exposition and its
content type. ``throughput_line()`` is the periodic log line (vLLM's "Avg prompt throughput ..."), None when
idle. Every series carries ``model_name`` (the first served name) and ``engine="0"``, as vLLM v1 labels them.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from onecard.protocol import EngineInfo, EngineStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_ITERATION_TOKEN_BUCKETS = tuple(2**i for i in range(15))     # 1 .. 16384 tokens per step
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
        if s.spec_accepted_per_pos is not None:           # speculative decoding on: vLLM's spec-decode series
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_num_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          s.spec_num_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", labels=names + ["position"])
            for pos, v in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric(values + [str(pos)], v)
            yield per_pos
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
        # prometheus-fastapi-instrumentator's series (vLLM's server has it): status grouped as 2xx/4xx/5xx.
        self._http = Counter("http_requests", "Total number of requests by method, status and handler.",
                             ["method", "status", "handler"], registry=self.registry)
        # structured outputs (no vLLM names for these): grammar compilations (cache misses) and requests
        self._grammar_compile = Histogram(
            "onecard:structured_output_compile_seconds", "Grammar compile time of structured-output requests "
            "(cache misses) in seconds.", names, buckets=_COMPILE_BUCKETS,
            registry=self.registry).labels(**self.labels)
        self._structured = Counter("onecard:structured_output_requests", "Number of requests with an output "
                                   "constraint (response_format, structured_outputs, guided_*, forced tool calls).",
                                   names, registry=self.registry).labels(**self.labels)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**self.labels)

        self._itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                         _ITL_BUCKETS)
        # vLLM 0.10/0.11 observe this one per token too (deprecated alias of inter_token_latency).
        self._tpot = hist("vllm:time_per_output_token_seconds",
                          "Histogram of time per output token in seconds.", _ITL_BUCKETS)
        self._req_tpot = hist("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS)
        self._queue = hist("vllm:request_queue_time_seconds",
                           "Histogram of time spent in WAITING phase for request.", _E2E_BUCKETS)
        self._prefill = hist("vllm:request_prefill_time_seconds",
                             "Histogram of time spent in PREFILL phase for request.", _E2E_BUCKETS)
        self._decode = hist("vllm:request_decode_time_seconds",
                            "Histogram of time spent in DECODE phase for request.", _E2E_BUCKETS)
        self._inference = hist("vllm:request_inference_time_seconds",
                               "Histogram of time spent in RUNNING phase for request.", _E2E_BUCKETS)
        self._iteration = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                               _ITERATION_TOKEN_BUCKETS)
        # plain totals for the periodic throughput line (prompt tokens counted at their first token)
        self._lock = threading.Lock()
        self._steps_seen = 0
        self._totals = [0, 0]                     # prompt tokens prefilled, tokens generated
        self._last_log = (time.monotonic(), 0, 0)
        self._idle_logged = False
        self._stats_fn = stats_fn

    def on_http(self, method: str, status: int, handler: str) -> None:
        self._http.labels(method=method, status=f"{status // 100}xx", handler=handler).inc()
    def on_grammar_compile(self, seconds: float) -> None:
        self._grammar_compile.observe(seconds)

    def on_structured_request(self) -> None:
        self._structured.inc()

    def on_first_token(self, seconds: float, prompt_tokens: int = 0) -> None:
        self._ttft.observe(seconds)
        with self._lock:
            self._totals[0] += prompt_tokens
            self._totals[1] += 1

    def on_tokens(self, count: int, gap_seconds: float) -> None:
        with self._lock:
            self._totals[1] += count
        for _ in range(count):
            self._itl.observe(gap_seconds / count)
            self._tpot.observe(gap_seconds / count)

    def on_step(self, stats: EngineStats) -> None:
        """Called with each EngineStats B sends; observes the tokens of each new step once."""
        if stats.num_steps > self._steps_seen:
            self._steps_seen = stats.num_steps
            self._iteration.observe(stats.last_step_tokens)

    def on_finish(self, *, prompt_tokens: int, output_tokens: int, finish_reason: str,
                  e2e_seconds: float, timing=None) -> None:
        self._prompt.inc(prompt_tokens)
        self._generation.inc(output_tokens)
        self._prompt_hist.observe(prompt_tokens)
        self._gen_hist.observe(output_tokens)
        self._e2e.observe(e2e_seconds)
        if finish_reason in ("stop", "length", "abort"):
            self._success.labels(**self.labels, finished_reason=finish_reason).inc()
        if timing is None or timing.scheduled is None:
            return
        self._queue.observe(max(0.0, timing.scheduled - timing.arrival))
        if timing.first_token is not None and timing.last_token is not None:
            self._prefill.observe(max(0.0, timing.first_token - timing.scheduled))
            decode = timing.last_token - timing.first_token
            self._decode.observe(decode)
            self._inference.observe(max(0.0, timing.last_token - timing.scheduled))
            if output_tokens > 1:
                self._req_tpot.observe(decode / (output_tokens - 1))

    def throughput_line(self) -> str | None:
        """vLLM's periodic line: token rates since the last call; None when idle twice in a row."""
        now = time.monotonic()
        with self._lock:
            prompt, gen = self._totals
        t0, p0, g0 = self._last_log
        self._last_log = (now, prompt, gen)
        s = self._stats_fn()
        idle = prompt == p0 and gen == g0 and s.num_running == 0 and s.num_waiting == 0
        if idle and self._idle_logged:
            return None
        self._idle_logged = idle
        dt = max(now - t0, 1e-9)
        hit = 100.0 * s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        return (f"Engine 000: Avg prompt throughput: {(prompt - p0) / dt:.1f} tokens/s, Avg generation "
                f"throughput: {(gen - g0) / dt:.1f} tokens/s, Running: {s.num_running} reqs, Waiting: "
                f"{s.num_waiting} reqs, GPU KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, Prefix cache hit "
                f"rate: {hit:.1f}%")

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_COMPILE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


def _len_buckets() -> list[float]:
    out, v = [], 1
    while v <= 1 << 20:
        out.extend([v, 2 * v, 5 * v])
        v *= 10
    return out
