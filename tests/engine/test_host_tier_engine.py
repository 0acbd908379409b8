"""The host KV tier on the real engine (tiny GPTQ MoE checkpoint, CPU): an evicted prefix comes back from host memory.

A long prompt runs cold, two other prompts push its blocks out of a small KV pool (into the host tier), and the
same prompt runs again: its admission must count the host-held blocks as computed (only the tail is prefilled),
its greedy tokens must equal the cold run's and those of an engine with no host tier, and both pools must end with
nothing leaked. Synchronous and async scheduling.
"""
from __future__ import annotations

import time

import pytest
import torch

from onecard.config import ConfigError, EngineArgs
from onecard.core.engine_core import EngineCore
from onecard.core.kv_cache_manager import KVBlock
from onecard.core.request import Request
from onecard.protocol import EngineRequest
from onecard.sampling_params import SamplingParams

BLOCK = 16
PROMPT = 100                                  # 6 full blocks + 4 tokens


def _core(path, **kw) -> EngineCore:
    return EngineCore(EngineArgs(model=str(path), device="cpu", max_model_len=192, block_size=BLOCK,
                                 num_gpu_blocks_override=1 + 13, **kw).create_config())


def _run(core: EngineCore, rid: str, prompt: list[int], schedules: list | None = None) -> tuple[list[int], int]:
    """Run one request to the end; its tokens and num_cached_tokens. Records each step's SchedulerOutput."""
    if schedules is not None:
        schedule = core.scheduler.schedule

        def recording(**kw):
            so = schedule(**kw)
            schedules.append(so)
            return so

        core.scheduler.schedule = recording
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert core.add_request(EngineRequest(rid, prompt, sp, time.monotonic(), [])) is None
    tokens, cached = [], None
    while core.has_unfinished():
        for o in core.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    if schedules is not None:
        core.scheduler.schedule = schedule
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks and all(b.ref_cnt == 0 for b in kv.blocks)
    host = kv.host
    if host is not None:
        assert host.num_used + host.num_free == host.num_slots and host.num_used <= host.num_slots
    return tokens, cached


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_evicted_prefix_served_from_host_tier(tiny_moe_gptq_dir, async_scheduling: bool) -> None:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 200, (PROMPT,), generator=g).tolist() for _ in range(3)]
    ref, _ = _run(_core(tiny_moe_gptq_dir, async_scheduling=async_scheduling), "ref", prompts[0])

    core = _core(tiny_moe_gptq_dir, async_scheduling=async_scheduling, kv_offloading_size=0.01)
    host = core.scheduler.kv_cache_manager.host
    assert core.info.num_host_blocks == host.num_slots >= 12
    assert core.runner.host_pool.bytes_per_slot == core.runner.block_bytes
    cold, cached = _run(core, "a", prompts[0])
    assert cold == ref and cached == 0
    for i in (1, 2):                                          # 2 x 7 blocks of a 13-block pool: a's go to the host
        _run(core, f"x{i}", prompts[i])
    kv = core.scheduler.kv_cache_manager
    hits, n = kv.get_computed_blocks(Request("probe", prompts[0], SamplingParams(), 0.0))
    assert n == 96 and not any(type(h) is KVBlock for h in hits), "the test needs a's prefix off the GPU"

    schedules: list = []
    again, cached = _run(core, "a-again", prompts[0], schedules)
    first = next(so for so in schedules if so.scheduled)
    sr = first.scheduled[0]
    assert (sr.num_computed_tokens, sr.num_new_tokens) == (96, 4)      # the 96 host-held tokens not recomputed
    assert len(first.kv_from_host) == 6 and cached == 96
    assert again == cold == ref
    stats = core.stats()
    block_bytes = core.runner.block_bytes
    assert stats.external_prefix_cache_hits == 96
    assert stats.kv_bytes_from_host == 6 * block_bytes
    assert stats.kv_bytes_to_host >= 6 * block_bytes and 0 < stats.host_kv_cache_usage <= 1


def test_offloading_flags_are_checked(tiny_moe_gptq_dir) -> None:
    path = str(tiny_moe_gptq_dir)
    with pytest.raises(ConfigError, match="--kv-offloading-backend=lmcache"):
        EngineArgs(model=path, kv_offloading_size=1, kv_offloading_backend="lmcache").create_config()
    with pytest.raises(ConfigError, match="must be a positive"):
        EngineArgs(model=path, kv_offloading_size=0).create_config()
    with pytest.raises(ConfigError, match="needs prefix caching"):
        EngineArgs(model=path, kv_offloading_size=1, enable_prefix_caching=False).create_config()
    with pytest.raises(ConfigError, match="available host memory"):     # a PiB: more than any test machine
        EngineArgs(model=path, kv_offloading_size=1 << 20).create_config()
    cfg = EngineArgs(model=path).create_config()
    assert cfg.cache.kv_offloading_size is None                        # off by default


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_waves_of_shared_prefixes_match_an_engine_without_the_tier(tiny_moe_gptq_dir, async_scheduling: bool):
    """Requests over three long shared prefixes arrive in waves into a pool that holds about two of them: blocks
    go down and come back while other requests prefill and decode in the same steps (and get preempted). Every
    greedy token equals an engine without a host tier; nothing leaks."""
    g = torch.Generator().manual_seed(11)
    # 62-64-token prompts: three fit the 13-block pool at admission (4 blocks each), and their decodes need a
    # fifth block each, so the latest is preempted
    prefixes = [torch.randint(3, 200, (56,), generator=g).tolist() for _ in range(3)]
    waves = [[(f"w{w}-{i}", prefixes[(w + i) % 3] + torch.randint(3, 200, (6 + i,), generator=g).tolist())
              for i in range(3)] for w in range(3)]

    def run(core: EngineCore) -> dict[str, list[int]]:
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got: dict[str, list[int]] = {}
        for wave in waves:
            for rid, p in wave:
                assert core.add_request(EngineRequest(rid, p, sp, time.monotonic(), [])) is None
            while core.has_unfinished():
                for o in core.step():
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
        kv = core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks and all(b.ref_cnt == 0 for b in kv.blocks)
        return got

    ref = run(_core(tiny_moe_gptq_dir, async_scheduling=async_scheduling, enable_prefix_caching=False))
    core = _core(tiny_moe_gptq_dir, async_scheduling=async_scheduling, kv_offloading_size=0.01)
    assert run(core) == ref
    kv = core.scheduler.kv_cache_manager
    assert kv.host_hits > 0 and kv.blocks_to_host > 0 and kv.blocks_from_host > 0
    assert core.scheduler.num_preemptions > 0
    assert kv.host.num_used + kv.host.num_free == kv.host.num_slots
