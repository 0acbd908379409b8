"""GPU-only: split-KV of small-q launches (speculative verify steps; paths switch "small_q_split", on by default).
(1) At the served shape (32 query / 4 KV heads, D 128, 16-token blocks), one CUDA graph of a verify step in the
padded (b, q) layout (runner/cuda_graphs.pad_verify), captured with the switch on at the runner's bound, replayed
over other contexts (1 to 40k keys, ragged real rows) equals the unsplit launch on the same buffers and the float32
reference, fp16 and fp8_e5m2 caches. (2) On the tiny GPTQ MoE checkpoint, a verify step replayed from the engine's
verify graphs captured with the switch on (the split threshold lowered to the tiny model's 512 positions) gives the
eager unsplit step's logits and greedy tokens. Skipped without CUDA."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))

BOUND = 65536 + 1024                       # bench/long_context.py's max_model_len


@pytest.mark.parametrize("cache_dtype", ["fp16", "fp8_e5m2"])
@pytest.mark.parametrize("b,q,steps", [
    (1, 9, [([40000], [9]), ([700], [3]), ([32768], [9]), ([20], [1])]),
    (4, 5, [([8192, 30, 5000, 16000], [5, 1, 3, 5]), ([1000, 9, 40000, 300], [2, 5, 5, 4]), ([64], [5])])],
    ids=["bs1q9", "bs4q5"])
def test_graphed_split_verify_equals_unsplit(cache_dtype, b, q, steps):
    from kernels_testlib import make_paged_batch, rel_err
    from splitq_cases import padded_verify

    from onecard.kernels import paths
    from onecard.kernels.attention import fp8, ref
    from onecard.kernels.attention import triton as tk
    from onecard.kernels.attention.metadata import AttentionMetadata

    dev = torch.device("cuda")
    batches = []
    for i, (ctx, qlens) in enumerate(steps):
        kc, vc, md, _, _ = make_paged_batch(ctx, qlens, 4, 128, 16, dtype=torch.float16, seed=10 + i)
        if cache_dtype == "fp8_e5m2":
            kc, vc = fp8.quantize(kc, fp8.E5M2, 1.0), fp8.quantize(vc, fp8.E5M2, 1.0)
        padded, rows = padded_verify(md, ctx, qlens, b, q, 16, BOUND + q - 1)
        batches.append((kc, vc, md, padded, rows))
    nblocks = max(x[0].shape[0] for x in batches)
    width = max(x[3].block_table.shape[1] for x in batches)
    # the graph's inputs: fixed buffers, refilled before each replay (as runner/cuda_graphs.py does)
    kc = torch.zeros((nblocks,) + batches[0][0].shape[1:], dtype=batches[0][0].dtype, device=dev)
    vc = torch.zeros_like(kc)
    x = torch.zeros(b * q, 32, 128, dtype=torch.float16, device=dev)
    seq_lens = torch.full((b,), q, dtype=torch.int32, device=dev)
    table = torch.zeros(b, width, dtype=torch.int32, device=dev)
    md = AttentionMetadata(slot_mapping=torch.full((b * q,), -1, dtype=torch.long, device=dev),
                           query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev) * q,
                           seq_lens=seq_lens, block_table=table, max_query_len=q, max_seq_len=BOUND + q - 1)
    scale = 1 / math.sqrt(128)
    paths.set_switch("small_q_split", True)
    try:
        plan = tk.launch_plan(md, 32, 4, dev)
        assert plan.segments > 1 and plan.row_reduce, plan
        tk.paged_attention(x, kc, vc, md, scale)                          # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = tk.paged_attention(x, kc, vc, md, scale)
    finally:
        paths.set_switch("small_q_split", False)                                   # the reference: unsplit
    try:
        assert tk.launch_plan(md, 32, 4, dev).segments == 1                  # off: the unsplit launch
        for i, (k1, v1, m1, p1, rows) in enumerate(batches):
            kc.zero_(), vc.zero_(), table.zero_()
            kc[:k1.shape[0]], vc[:v1.shape[0]] = k1.to(dev), v1.to(dev)
            table[:, :p1.block_table.shape[1]] = p1.block_table.to(dev)
            seq_lens.copy_(p1.seq_lens.to(dev))
            x.copy_(torch.randn(b * q, 32, 128, generator=torch.Generator().manual_seed(i)).half())
            g.replay()
            split = out[rows.to(dev)].clone()
            unsplit = tk.paged_attention(x, kc, vc, md, scale)[rows.to(dev)]
            m1.max_seq_len = int(m1.seq_lens.max())
            want = ref.paged_attention(x[rows.to(dev)].float(), k1.to(dev), v1.to(dev), _on(m1, dev), scale)
            e_unsplit, e_ref = rel_err(split, unsplit), rel_err(split, want)
            assert e_unsplit < 1e-2 and e_ref < 1e-2, f"step {i} ({cache_dtype}): vs unsplit {e_unsplit:.3g}, " \
                                                       f"vs ref {e_ref:.3g} ({plan.segments} segments)"
    finally:
        paths.set_switch("small_q_split", None)


def _on(md, dev):
    from onecard.kernels.attention.metadata import AttentionMetadata

    return AttentionMetadata(slot_mapping=md.slot_mapping.to(dev), query_start_loc=md.query_start_loc.to(dev),
                             seq_lens=md.seq_lens.to(dev), block_table=md.block_table.to(dev),
                             max_query_len=md.max_query_len, max_seq_len=md.max_seq_len)


def test_engine_verify_graph_split_equals_eager_unsplit(tiny_moe_gptq_dir, monkeypatch):
    from onecard.config import EngineArgs
    from onecard.core.engine_core import EngineCore
    from onecard.kernels import paths
    from tests.engine.spec_helpers import (
        eager_and_graphed,
        verify_step_inputs,
    )

    monkeypatch.setattr(paths, "SPLIT_MIN_SEQ_LEN", 64)                 # the tiny model's bound (256) splits
    paths.set_switch("small_q_split", True)
    try:
        core = EngineCore(EngineArgs(model=str(tiny_moe_gptq_dir), device="cuda", dtype="float16",
                                     max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=16,
                                     speculative_config={"method": "ngram", "num_speculative_tokens": 4}
                                     ).create_config())                    # verify graphs captured split
    finally:
        paths.set_switch("small_q_split", None)
    runner = core.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.capture_stats["verify_graphs"] > 0
    cfg = core.config.model.hf_config
    hq, hkv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in (70, 17, 90)]
    inputs, q = verify_step_inputs(core, prompts)
    from onecard.kernels.attention import triton as tk
    from onecard.kernels.attention.metadata import AttentionMetadata
    graph_md = AttentionMetadata(slot_mapping=torch.zeros(4 * q, dtype=torch.long),
                                 query_start_loc=torch.arange(5, dtype=torch.int32) * q,
                                 seq_lens=torch.ones(4, dtype=torch.int32), block_table=torch.zeros(4, 1, dtype=torch.int32),
                                 max_query_len=q, max_seq_len=256 + q - 1)
    paths.set_switch("small_q_split", True)
    try:
        assert tk.launch_plan(graph_md, hq, hkv, torch.device("cuda")).row_reduce   # what the capture launched
    finally:
        paths.set_switch("small_q_split", None)
    paths.set_switch("small_q_split", False)                                      # eager: the unsplit launch
    try:
        eager, graphed, _, _ = eager_and_graphed(runner, graphs, inputs, 4, q)
    finally:
        paths.set_switch("small_q_split", None)
    torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
    assert torch.equal(graphed.argmax(-1), eager.argmax(-1))
