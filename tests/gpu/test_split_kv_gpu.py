"""Split-KV decode attention on the GPU at the served shape (32 query / 4 KV heads, D 128, 16-token blocks):
one CUDA graph captured with the runner's bound (md.max_seq_len = max_model_len, so the segment count is the
bound's) and replayed over other contexts (1 key to 40k, batch 1 and 16) must equal the float32 reference, for
both split-KV policies, "fill" with the kernel's prefetch levels and other tiles (the knobs bench/attn_sweep.py
sweeps through paths.set_decode_attention_override), and the fp16 and fp8_e5m2 caches. Skipped without CUDA."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))

BOUND = 65536 + 1024                       # bench/long_context.py's max_model_len
KNOBS = {"": {}, "prefetch1": {"prefetch": 1}, "prefetch2": {"prefetch": 2},
         "bn128w8st3": {"block_n": 128, "num_warps": 8, "num_stages": 3, "reduce_block_s": 128}}


def _batch(ctx: list[int], cache_dtype, seed: int):
    from kernels_testlib import make_paged_batch

    from onecard.kernels.attention import fp8

    kc, vc, md, _, _ = make_paged_batch(ctx, [1] * len(ctx), 4, 128, 16, dtype=torch.float16, seed=seed)
    if cache_dtype == "fp8_e5m2":
        kc, vc = fp8.quantize(kc, fp8.E5M2, 1.0), fp8.quantize(vc, fp8.E5M2, 1.0)
    return kc.cuda(), vc.cuda(), md


@pytest.mark.parametrize("cache_dtype", ["fp16", "fp8_e5m2"])
@pytest.mark.parametrize("policy", ["fill", "legacy", "fill+prefetch1", "fill+prefetch2", "fill+bn128w8st3"])
@pytest.mark.parametrize("contexts", [[[40000], [1], [700], [32768]],
                                      [[8192] * 16, [1 + 577 * i for i in range(16)], [5000, 1] * 8]],
                         ids=["bs1", "bs16"])
def test_graph_replay_over_contexts_matches_reference(policy, cache_dtype, contexts):
    from onecard.kernels import paths
    from onecard.kernels.attention import ref
    from onecard.kernels.attention import triton as tk
    from onecard.kernels.attention.metadata import AttentionMetadata

    name, _, knobs = policy.partition("+")
    paths.set_split_kv_policy(name)
    paths.set_decode_attention_override(**KNOBS[knobs])                  # bench/attn_sweep.py's knobs
    try:
        b = len(contexts[0])
        width = -(-max(max(c) for c in contexts) // 16) + 1
        dev = torch.device("cuda")
        # the graph's inputs: fixed buffers, refilled before each replay (as runner/cuda_graphs.py does)
        q = torch.zeros(b, 32, 128, dtype=torch.float16, device=dev)
        seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        table = torch.zeros(b, width, dtype=torch.int32, device=dev)
        kmax = _batch(max(contexts, key=lambda c: sum(c)), cache_dtype, 0)[0]
        nblocks = kmax.shape[0] + 64
        kc = torch.zeros((nblocks,) + kmax.shape[1:], dtype=kmax.dtype, device=dev)
        vc = torch.zeros_like(kc)
        md = AttentionMetadata(slot_mapping=torch.full((b,), -1, dtype=torch.long, device=dev),
                               query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
                               seq_lens=seq_lens, block_table=table, max_query_len=1, max_seq_len=BOUND,
                               num_decode_tokens=b)
        scale = 1 / math.sqrt(128)
        segs = tk.split_plan(md, 4, dev)[0]
        assert segs > 1, "the bound must split"
        tk.paged_attention(q, kc, vc, md, scale)                          # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = tk.paged_attention(q, kc, vc, md, scale)
        for i, ctx in enumerate(contexts):
            k1, v1, m1 = _batch(ctx, cache_dtype, seed=10 + i)
            kc.zero_(), vc.zero_(), table.zero_()
            kc[:k1.shape[0]], vc[:v1.shape[0]] = k1, v1
            table[:, :m1.block_table.shape[1]] = m1.block_table.cuda()
            seq_lens.copy_(m1.seq_lens.cuda())
            q.copy_(torch.randn(b, 32, 128, generator=torch.Generator().manual_seed(i)).half())
            g.replay()
            m1.max_seq_len = max(ctx)
            want = ref.paged_attention(q.float(), kc, vc, AttentionMetadata(
                slot_mapping=md.slot_mapping, query_start_loc=md.query_start_loc, seq_lens=seq_lens,
                block_table=table, max_query_len=1, max_seq_len=max(ctx), num_decode_tokens=b), scale)
            err = float((out.double() - want.double()).norm() / want.double().norm())
            assert err < 1e-2, f"{policy} {cache_dtype} contexts {ctx[:4]}: relative error {err:.3g} ({segs} segs)"
    finally:
        paths.set_split_kv_policy(None)
        paths.set_decode_attention_override()
