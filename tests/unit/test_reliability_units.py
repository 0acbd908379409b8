"""Reliability pieces that need no server: request bounds in SamplingParams, thread and queue defaults, the
thread client's watchdog, the periodic throughput line."""
from __future__ import annotations

import asyncio
import math
import threading

import pytest

from onecard.config import (
    ConfigError,
    Env,
    default_api_threads,
    default_engine_threads,
    default_max_num_queued_reqs,
)
from onecard.protocol import EngineInfo, EngineStats
from onecard.sampling_params import SEED_MAX, SEED_MIN, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("min_p", math.inf),
    ("presence_penalty", math.nan), ("repetition_penalty", math.inf),
    ("seed", SEED_MAX + 1), ("seed", SEED_MIN - 1), ("top_k", 2**63), ("n", 129), ("n", 0),
    ("stop_token_ids", [True]), ("stop_token_ids", [-1]), ("stop_token_ids", [2**63]),
])
def test_sampling_params_refuse_what_the_runner_cannot_hold(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_edges_are_accepted():
    SamplingParams(seed=SEED_MIN)
    SamplingParams(seed=SEED_MAX)
    SamplingParams(top_k=2**63 - 1, n=128, stop_token_ids=[0, 2**63 - 1])


def test_thread_and_queue_defaults():
    assert default_engine_threads("cuda", 64) == 1
    assert default_engine_threads("cpu", 2) == 1 and default_engine_threads("cpu", 16) == 8
    assert default_engine_threads("cpu", 1) == 1
    assert default_api_threads(2) == 2 and default_api_threads(64) == 4
    assert default_max_num_queued_reqs(256) == 1024 and default_max_num_queued_reqs(4) == 64


def test_env_thread_counts(monkeypatch):
    monkeypatch.setenv("ONECARD_ENGINE_THREADS", "3")
    monkeypatch.setenv("ONECARD_API_THREADS", "2")
    env = Env.read()
    assert (env.engine_threads, env.api_threads) == (3, 2)
    monkeypatch.setenv("ONECARD_ENGINE_THREADS", "zero")
    with pytest.raises(ConfigError, match="ONECARD_ENGINE_THREADS"):
        Env.read()


def test_engine_args_thread_and_queue_defaults(monkeypatch):
    from onecard.config import EngineArgs

    monkeypatch.delenv("ONECARD_ENGINE_THREADS", raising=False)
    cfg = EngineArgs(device="cpu", max_num_seqs=8).create_config()
    assert cfg.scheduler.max_num_queued_reqs == 64
    assert cfg.engine_threads == default_engine_threads("cpu", cfg.env.cpu_count)
    cfg = EngineArgs(device="cpu", engine_threads=3, max_num_queued_reqs=0).create_config()
    assert cfg.engine_threads == 3 and cfg.scheduler.max_num_queued_reqs == 0
    with pytest.raises(ConfigError, match="--max-num-queued-reqs"):
        EngineArgs(device="cpu", max_num_queued_reqs=-1).create_config()


def test_serve_rejects_bad_thread_flags(capsys):
    from onecard.cli import main

    assert main(["serve", "--engine-threads=0", "--device=cpu"]) == 2
    assert "--engine-threads=0" in capsys.readouterr().err


class _DyingCore:
    """An engine core whose loop breaks on the first step (a fault outside the runner)."""

    info = EngineInfo(num_gpu_blocks=1, block_size=16, kv_capacity_tokens=16, max_concurrency_at_max_len=1.0,
                      weights_bytes=0, kv_cache_bytes=0, dtype="float32", quantization=None, device="cpu",
                      load_seconds=0.0)

    def __init__(self, _config):
        self.pending = False

    def add_request(self, request):
        self.pending = True

    def abort(self, ids):
        return []

    def has_unfinished(self):
        return self.pending

    def stats(self):
        return EngineStats()

    def step(self):
        raise RuntimeError("scheduler state corrupted")


def test_thread_client_reports_the_engine_thread_death():
    from onecard.frontend.core_client import EngineDiedError, ThreadCoreClient

    class Client(ThreadCoreClient):
        _core_factory = staticmethod(_DyingCore)

    client = Client(config=None)
    seen = []
    noticed = threading.Event()
    client.on_dead.append(lambda why: (seen.append(why), noticed.set()))
    client.start()
    client.wait_ready(timeout=10)

    async def main():
        task = asyncio.ensure_future(client.get_outputs())
        await asyncio.sleep(0)
        client.add_request(object())
        with pytest.raises(EngineDiedError, match="scheduler state corrupted"):
            await asyncio.wait_for(task, 10)
        with pytest.raises(EngineDiedError):             # every later call raises too
            await asyncio.wait_for(client.get_outputs(), 10)

    asyncio.run(main())
    assert noticed.wait(10) and "engine thread died" in seen[0]
    assert client.dead is not None
    client.shutdown()


def test_throughput_line():
    from onecard.server.metrics import ServerMetrics

    stats = EngineStats(num_running=1, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
                        prefix_cache_hits=40)
    m = ServerMetrics("coder", lambda: stats)
    m.on_first_token(0.1, prompt_tokens=50)
    m.on_tokens(9, 0.09)
    line = m.throughput_line()
    assert line.startswith("Engine 000: Avg prompt throughput: ") and "Running: 1 reqs, Waiting: 2 reqs" in line
    assert "GPU KV cache usage: 25.0%" in line and "Prefix cache hit rate: 40.0%" in line
    assert "Avg generation throughput: 0.0" not in line
    stats = EngineStats()
    assert m.throughput_line() is not None     # the first idle interval is logged once...
    assert m.throughput_line() is None         # ...then silence while idle
