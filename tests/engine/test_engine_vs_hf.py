"""The engine (scheduler + runner + model, reference kernels on the CPU) against HF transformers' generate().

Greedy output must be token-for-token identical in every scheduling mode: batched or not, tiny chunked
prefill budgets, a prefix-cache second pass, and a KV pool so small that requests get preempted.
"""
from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from onecard.config import EngineArgs
from onecard.core.engine_core import EngineCore
from onecard.protocol import EngineRequest
from onecard.sampling_params import SamplingParams

LENGTHS = (1, 3, 17, 40, 77, 120, 160, 200)
NEW = 10


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module", params=["dense", "moe"])
def model_and_refs(request, tiny_dense_dir, tiny_moe_dir):
    path = tiny_dense_dir if request.param == "dense" else tiny_moe_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return path, prompts, refs


def _run(core: EngineCore, prompts, tag: str, max_tokens: int = NEW) -> tuple[list[list[int]], int]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert core.add_request(EngineRequest(f"{tag}-{i}", p, sp, time.monotonic(), [])) is None
    got: dict[str, list[int]] = {}
    cached = 0
    while core.has_unfinished():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            cached = max(cached, o.num_cached_tokens)
    return [got[f"{tag}-{i}"] for i in range(len(prompts))], cached


def _core(path, **kw) -> EngineCore:
    kw.setdefault("max_model_len", 256)
    return EngineCore(EngineArgs(model=str(path), device="cpu", **kw).create_config())


MODES = {
    "batched": {},
    "one_at_a_time": {"max_num_seqs": 1},
    "tiny_chunks": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "async": {"async_scheduling": True},
    "async_tiny_chunks": {"async_scheduling": True, "max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(model_and_refs, mode):
    path, prompts, refs = model_and_refs
    core = _core(path, **MODES[mode])
    got, _ = _run(core, prompts, "a")
    assert got == refs
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.scheduler.kv_cache_manager.num_usable_blocks


def test_prefix_cache_second_pass(model_and_refs):
    path, prompts, refs = model_and_refs
    core = _core(path)
    first, cached_first = _run(core, prompts, "a")
    second, cached_second = _run(core, prompts, "b")
    assert first == refs and second == refs
    assert cached_first == 0 and cached_second > 0
    assert core.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_gives_identical_output(model_and_refs, async_scheduling):
    path, prompts, refs = model_and_refs
    # 16 blocks of 16 = 240 usable tokens: the 200-token prompt fits alone, the batch does not.
    core = _core(path, num_gpu_blocks_override=16, max_num_batched_tokens=64, long_prefill_token_threshold=32,
                 max_model_len=224, async_scheduling=async_scheduling)
    got, _ = _run(core, prompts, "a")
    assert got == refs
    assert core.stats().num_preemptions > 0
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_seeded_sampling_independent_of_batch(tiny_moe_dir):
    core = _core(tiny_moe_dir)
    prompts = _prompts(200)[:8]
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    core.add_request(EngineRequest("alone", prompts[3], sp, time.monotonic(), []))
    alone: list[int] = []
    while core.has_unfinished():
        for o in core.step():
            alone += o.new_token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"b{i}", p, sp if i == 3 else other, time.monotonic(), []))
    got: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got["b3"] == alone
    assert len(set(map(tuple, got.values()))) > 1   # the sampler really samples


def test_too_long_prompt_rejected_with_vllm_text(tiny_dense_dir):
    core = _core(tiny_dense_dir)
    err = core.add_request(EngineRequest("x", list(range(3, 253)), SamplingParams(max_tokens=10), 0.0, []))
    assert err is not None and err.error_status == 400
    assert err.error.startswith("You passed 250 input tokens and requested 10 output tokens. However, the "
                                "model's context length is only 256 tokens")
