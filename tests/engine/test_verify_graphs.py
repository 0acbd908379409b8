"""Verify steps in the CUDA graphs' padded layout (runner/cuda_graphs.py), run eagerly on the CPU.

Off CUDA the graph runner captures nothing and runs each shape eagerly on its static buffers, in exactly the
layout a graph replays: every sequence padded to q = 1 + the step's longest draft (pad rows after the real ones,
slot -1, seq_len counting them), padded sequences up to the graph's batch. Checked here on the tiny GPTQ MoE
checkpoint (reference kernels): a real verify step in that layout gives the unpadded eager step's logits on the
real rows and writes the same KV, and nothing for pad rows; greedy output of an engine whose decode and verify
steps all go through the padded layouts equals plain decoding token for token.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from onecard.config import EngineArgs
from onecard.core.engine_core import EngineCore
from onecard.runner.cuda_graphs import pad_verify, verify_query_len
from onecard.runner.input_batch import build_inputs
from onecard.sampling_params import SamplingParams
from tests.engine.spec_helpers import (
    OracleDrafter,
    eager_and_graphed,
    enable_spec,
    run,
    verify_step_inputs,
)


def _core(path, **kw) -> EngineCore:
    return EngineCore(EngineArgs(model=str(path), device="cpu", max_model_len=96, **kw).create_config())


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in (5, 17, 9)] + [[21, 22, 23] * 5]


def test_pad_verify_layout_invariants():
    rng = np.random.default_rng(0)
    q_lens = np.array([3, 1, 5])
    ctx = np.array([7, 30, 12])                            # tokens before each sequence's first new row
    b, q, max_pos = 4, 5, 34
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, q_lens)])
    ids = rng.integers(3, 100, cu[-1])
    slots = rng.integers(0, 500, cu[-1])
    p = pad_verify(cu, ids, pos, slots, (ctx + q_lens).astype(np.int32), b, q, max_pos)
    assert p.input_ids.shape == p.positions.shape == p.slot_mapping.shape == (b * q,)
    assert (p.input_ids[p.rows] == ids).all() and (p.slot_mapping[p.rows] == slots).all()
    assert (p.positions[p.rows] == pos).all()
    pads = np.setdiff1d(np.arange(b * q), p.rows)
    assert (p.slot_mapping[pads] == -1).all() and pads.size == b * q - cu[-1]
    assert p.positions.max() <= max_pos
    for i in range(b):
        rows = np.arange(i * q, (i + 1) * q)
        real = np.intersect1d(rows, p.rows)
        n = q_lens[i] if i < len(q_lens) else 0
        assert (real == rows[:n]).all()                    # real rows first, pads after
        # the kernels' rule: row j of sequence i sits at seq_len - q + j; it must be the real row's position
        kernel_pos = p.seq_lens[i] - q + np.arange(n)
        assert (kernel_pos == pos[cu[i]:cu[i] + n]).all() if n else p.seq_lens[i] == q
    with pytest.raises(ValueError):
        pad_verify(cu, ids, pos, slots, (ctx + q_lens).astype(np.int32), b, 4, max_pos)   # q below a query


def test_padded_verify_step_equals_eager(tiny_moe_gptq_dir):
    core = _core(tiny_moe_gptq_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    runner = core.runner
    inputs, q = verify_step_inputs(core, _prompts()[:3])        # 3 sequences: the b = 4 graph pads one more
    assert len(inputs.seq_lens) == 3                            # rows (asserted there) and a sequence are padded
    # every slot outside the step's sequences holds a sentinel, so that any write there shows (a pad row's K and
    # V may well be zero: token 0's embedding is)
    bsz = runner.block_size
    live = torch.zeros(runner.num_blocks * bsz, dtype=torch.bool)
    for i, n in enumerate(inputs.seq_lens.tolist()):
        pos = np.arange(n)
        live[torch.from_numpy(inputs.block_table[i, pos // bsz].astype(np.int64) * bsz + pos % bsz)] = True
    for k, v in runner.kv_caches:
        k.flatten(0, 1)[~live] = 0.5
        v.flatten(0, 1)[~live] = -0.5
    graphs = runner.graph_runner()
    graphs.capture()
    eager, padded, snapshot, kv_eager = eager_and_graphed(runner, graphs, inputs, 4, q)
    assert graphs.replays == {(4, q): 1}
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(padded.argmax(-1), eager.argmax(-1))
    written = torch.from_numpy(inputs.slot_mapping)
    for (k, v), (ke, ve), (k0, v0) in zip(runner.kv_caches, kv_eager, snapshot):
        for cache, want, before in ((k, ke, k0), (v, ve, v0)):
            flat, flat_want, flat_before = (c.flatten(0, 1) for c in (cache, want, before))
            torch.testing.assert_close(flat[written], flat_want[written], rtol=1e-4, atol=1e-4)
            keep = torch.ones(flat.shape[0], dtype=torch.bool)
            keep[written] = False
            assert torch.equal(flat[keep], flat_before[keep])   # pad rows wrote nothing


def test_steps_that_are_not_verify_steps_are_left_to_eager(tiny_moe_gptq_dir):
    core = _core(tiny_moe_gptq_dir)
    from onecard.protocol import EngineRequest

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineRequest("a", _prompts()[1], sp, 0.0, []))
    sched = core.scheduler.schedule()                           # a prefill chunk
    inputs = build_inputs(sched, core.runner.block_size, {}, None)
    graphs = core.runner.graph_runner()
    graphs.capture()
    assert verify_query_len(inputs) is None and graphs.try_run(inputs) is None


@pytest.mark.parametrize("k, async_scheduling", [(2, False), (4, False), (4, True)])
def test_greedy_through_padded_layouts_equals_plain(tiny_moe_gptq_dir, k, async_scheduling):
    """(async: the hybrid loop, plain steps pipelined through the decode graphs' placeholder inputs.)"""
    prompts = _prompts()
    reqs = {f"g{i}": (p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))   # batches shrink
            for i, (p, n) in enumerate(zip(prompts, (16, 5, 9, 12)))}
    plain = run(_core(tiny_moe_gptq_dir), reqs)
    ref = {rid: list(reqs[rid][0]) + plain[rid]["tokens"] for rid in reqs}
    core = _core(tiny_moe_gptq_dir, speculative_config={"method": "ngram", "num_speculative_tokens": k},
                 async_scheduling=async_scheduling)
    spec = enable_spec(core, OracleDrafter(ref, int(core.config.model.hf_config["vocab_size"])), k=k)
    graphs = core.runner.graphs = core.runner.graph_runner()
    graphs.capture()
    assert {q for b, q in graphs.shapes if b == 1} == set(range(1, k + 2))
    got = run(core, reqs)
    for rid in reqs:
        assert got[rid]["tokens"] == plain[rid]["tokens"], rid
    verify = {s: n for s, n in graphs.replays.items() if s[1] > 1}
    assert sum(verify.values()) >= 3 and len(verify) >= 2       # verify steps went through padded layouts
    assert any(b > 1 for b, _ in verify)                        # ... with several sequences
    assert spec.stats().num_accepted_tokens > 0
