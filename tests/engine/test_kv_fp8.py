"""The engine with an fp8 KV cache (--kv-cache-dtype fp8_e5m2 / fp8_e4m3) on the tiny GPTQ MoE checkpoint (CPU).

- The runner allocates fp8 caches, one byte per element: half the bytes per block of fp16.
- Async scheduling gives the same tokens as the synchronous loop (also with chunked prefill and with
  preemption), and no KV block leaks.
- Prefix caching: a prompt served from cached fp8 blocks gives the tokens of a cold run and of a run with
  prefix caching off (the cached blocks are the bytes the cold run wrote).
- k_scale / v_scale tensors in the checkpoint reach the attention layers (vLLM's names); without them an
  fp8_e4m3 cache warns and uses 1.0.
"""
from __future__ import annotations

import json
import logging
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from onecard.config import EngineArgs
from onecard.core.engine_core import EngineCore
from onecard.protocol import EngineRequest
from onecard.sampling_params import SamplingParams

FP8 = ["fp8_e5m2", "fp8_e4m3"]


def _core(path, kv: str, **kw) -> EngineCore:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)         # a small pool: quick to build
    return EngineCore(EngineArgs(model=str(path), device="cpu", max_model_len=192, kv_cache_dtype=kv,
                                 **kw).create_config())


def _run(core: EngineCore, prompts: list[list[int]], max_tokens: int = 12, tag: str = "r") -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert core.add_request(EngineRequest(f"{tag}{i}", p, sp, time.monotonic(), [])) is None
    got: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for o in core.step():
            got[o.request_id] += o.new_token_ids
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    return [got[f"{tag}{i}"] for i in range(len(prompts))]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in (6, 33, 50, 17)]


def test_fp8_cache_allocation(tiny_moe_gptq_dir):
    fp16 = _core(tiny_moe_gptq_dir, "float16")
    for kv, dt in (("fp8_e5m2", torch.float8_e5m2), ("fp8_e4m3", torch.float8_e4m3fn)):
        fp8 = _core(tiny_moe_gptq_dir, kv)
        k_cache, v_cache = fp8.runner.kv_caches[0]
        assert k_cache.dtype == v_cache.dtype == dt and k_cache.element_size() == 1
        assert 2 * fp8.runner.block_bytes == fp16.runner.block_bytes
        assert fp8.info.kv_cache_dtype == kv and 2 * fp8.info.kv_bytes_per_token == fp16.info.kv_bytes_per_token
        # the same pool (--kv-cache-memory-bytes) holds twice the tokens
        assert fp8.info.kv_capacity_tokens >= 2 * fp16.info.kv_capacity_tokens


@pytest.mark.parametrize("kv,extra", [
    ("fp8_e5m2", {}), ("fp8_e5m2", {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8}),
    ("fp8_e5m2", {"num_gpu_blocks_override": 14}), ("fp8_e4m3", {"num_gpu_blocks_override": 14})])
def test_async_scheduling_matches_sync(tiny_moe_gptq_dir, kv, extra):
    sync = _run(_core(tiny_moe_gptq_dir, kv, **extra), _prompts())
    asyn = _run(_core(tiny_moe_gptq_dir, kv, async_scheduling=True, **extra), _prompts())
    assert sync == asyn


@pytest.mark.parametrize("kv", FP8)
def test_prefix_cache_hit_matches_cold_run(tiny_moe_gptq_dir, kv):
    shared = _prompts()[2][:48]                            # three full 16-token blocks
    prompts = [shared + [5, 6, 7], shared + [9]]
    core = _core(tiny_moe_gptq_dir, kv)
    first = _run(core, prompts[:1], tag="a")
    hits0 = core.scheduler.kv_cache_manager.prefix_cache_hits
    second = _run(core, prompts, tag="b")
    assert core.scheduler.kv_cache_manager.prefix_cache_hits >= hits0 + 2 * 48      # both found the prefix
    cold = _run(_core(tiny_moe_gptq_dir, kv, enable_prefix_caching=False), prompts, tag="c")
    assert second == cold and second[0] == first[0]


def _with_scales(src, dst, k: float, v: float):
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    tensors = load_file(str(files[0]))
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_proj.output_scale"] = torch.tensor(k)   # compressed-tensors name
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    if (dst / "model.safetensors.index.json").exists():
        idx = json.loads((dst / "model.safetensors.index.json").read_text())
        for name in tensors:
            idx["weight_map"].setdefault(name, files[0].name)
        (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    return dst


def test_checkpoint_scales_reach_the_layers(tiny_moe_gptq_dir, tmp_path, caplog):
    path = _with_scales(tiny_moe_gptq_dir, tmp_path / "scaled", 0.25, 3.0)
    with caplog.at_level(logging.WARNING):
        core = _core(path, "fp8")
    attn = [layer.self_attn for layer in core.runner.model.layers]
    assert all((a.k_scale, a.v_scale) == (0.25, 3.0) for a in attn)
    assert "scaling factor 1.0" not in caplog.text
    out = _run(core, _prompts()[:2])
    assert all(len(t) == 12 for t in out)
    # the same checkpoint on an fp16 cache: scales are not applied (a native cache takes none)
    plain = _core(path, "float16")
    assert all((layer.self_attn.k_scale, layer.self_attn.v_scale) == (1.0, 1.0) for layer in plain.runner.model.layers)


def test_e4m3_without_scales_warns(tiny_moe_gptq_dir, caplog):
    with caplog.at_level(logging.WARNING):
        _core(tiny_moe_gptq_dir, "fp8_e4m3")
    assert "Using KV cache scaling factor 1.0 for fp8_e4m3" in caplog.text
