"""Async scheduling (``--async-scheduling``) gives the same outputs as the synchronous engine loop.

With one step in flight, the runner reads a request's newest token from the previous step's samples on the
device: as its input id, and in the output counts of penalties; min_tokens counts it too. Every sampling
feature whose result depends on the tokens so far is run in both modes on the tiny GPTQ MoE checkpoint (the
real quantized path) and must agree: greedy, seeded random, penalties, min_tokens with stop ids, stop ids,
logprobs. The synchronous loop is itself checked against HF transformers in test_engine_vs_hf.py.
"""
from __future__ import annotations

import time

import pytest

from onecard.config import EngineArgs
from onecard.core.engine_core import EngineCore
from onecard.protocol import EngineRequest
from onecard.sampling_params import SamplingParams
from tests.engine.spec_helpers import assert_same_outputs


def _core(path, async_scheduling: bool, **kw) -> EngineCore:
    return EngineCore(EngineArgs(model=str(path), device="cpu", max_model_len=192,
                                 async_scheduling=async_scheduling, **kw).create_config())


def _run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, sp) in requests.items():
        assert core.add_request(EngineRequest(rid, prompt, sp, time.monotonic(), [])) is None
    got: dict[str, dict] = {rid: {"tokens": [], "logprobs": [], "finish": None} for rid in requests}
    while core.has_unfinished():
        for o in core.step():
            g = got[o.request_id]
            g["tokens"] += o.new_token_ids
            g["logprobs"] += [(lp.token_id, lp.rank, lp.logprob, sorted(lp.top))
                              for lp in (o.new_logprobs or [])]
            if o.finish_reason is not None:
                g["finish"] = (o.finish_reason, o.stop_reason)
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks          # nothing leaked, in either mode
    return got


def _prompts(n: int, vocab: int = 200) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(99)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in (5, 12, 30, 47, 64, 9)[:n]]


@pytest.fixture(scope="module")
def greedy_tokens(tiny_moe_gptq_dir) -> list[list[int]]:
    """What plain greedy decoding writes for each prompt (to pick stop ids that really occur)."""
    core = _core(tiny_moe_gptq_dir, False)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = _run(core, {f"g{i}": (p, sp) for i, p in enumerate(_prompts(6))})
    return [got[f"g{i}"]["tokens"] for i in range(6)]


@pytest.mark.parametrize("extra", [{}, {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
                                   {"num_gpu_blocks_override": 14}])
def test_async_matches_sync_for_every_sampling_feature(tiny_moe_gptq_dir, greedy_tokens, extra):
    p = _prompts(6)
    sync_core = _core(tiny_moe_gptq_dir, False, **extra)
    vocab = int(sync_core.config.model.hf_config["vocab_size"])
    requests = {
        "greedy_lp": (p[0], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2)),
        "seeded": (p[1], SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=11, max_tokens=14,
                                        ignore_eos=True)),
        "penalties": (p[2], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                           presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.8)),
        # every id but 0-2 stops it, and is banned until min_tokens outputs exist: it stops right after them
        "min_tokens": (p[3], SamplingParams(temperature=0.0, max_tokens=14, min_tokens=6,
                                            stop_token_ids=list(range(3, vocab)))),
        "stop_id": (p[4], SamplingParams(temperature=0.0, max_tokens=14,
                                         stop_token_ids=[greedy_tokens[4][4]])),
        "seeded_pen": (p[5], SamplingParams(temperature=0.8, seed=5, max_tokens=14, ignore_eos=True,
                                            frequency_penalty=2.0)),
    }
    sync = _run(sync_core, requests)
    core = _core(tiny_moe_gptq_dir, True, **extra)
    assert core.async_scheduling
    got = _run(core, requests)
    assert_same_outputs(got, sync)
    # the stops really cut the outputs short, and min_tokens held its stop id back
    assert len(sync["stop_id"]["tokens"]) == 5 and sync["stop_id"]["finish"][1] == greedy_tokens[4][4]
    assert len(sync["min_tokens"]["tokens"]) == 7 and len(sync["greedy_lp"]["logprobs"]) == 14
    if "num_gpu_blocks_override" in extra:
        assert core.stats().num_preemptions > 0
