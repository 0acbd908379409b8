"""GPU-only: the paths a card below sm80 takes where tl.dot would be FMA code, on this card with the capability
emulated (paths.set_emulated_capability(70)), at the served shapes:
  * the prefill attention on SDPA's memory-efficient kernel (attention/sdpa.py; 32 query / 4 KV heads, D 128,
    fp16, 16-token blocks): against the float32 reference alone and inside the Triton wrapper (a chunk beside
    decodes the kernel keeps), over fp16 and fp8_e5m2 caches, with its extra memory within paths.prefill_sdpa_workspace;
  * the decode MoE's compacted row step (fused_moe/stages.py ROWS, paths.decode_rows; H 2048, I 768, 128
    experts, top 8, g128): against the reference at T = 2, 9, 16 and with every token on the same experts, and
    the 16-row dot it replaces (switch off) too;
  * the skinny GEMM's row step (gptq_gemm/small_m.py ROWS, paths.dense_rows) at the served qkv and o_proj
    shapes, M = 2, 3, 4, 6, likewise.
The engine's greedy text and the full-size logits under ONECARD_EMULATE_CC=70 (test_emulation_gpu.py) run both
inside the model. Skipped without CUDA."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))


def _batch(seq_lens, q_lens, decodes, cache_dtype, seed=0):
    from kernels_testlib import make_paged_batch

    from onecard.kernels.attention import fp8
    from onecard.kernels.attention.metadata import AttentionMetadata

    kc, vc, md, _, _ = make_paged_batch(seq_lens, q_lens, 4, 128, 16, dtype=torch.float16, seed=seed)
    if cache_dtype == "fp8_e5m2":
        kc, vc = fp8.quantize(kc, fp8.E5M2), fp8.quantize(vc, fp8.E5M2)
    dev = torch.device("cuda")
    md = AttentionMetadata(slot_mapping=md.slot_mapping.to(dev), query_start_loc=md.query_start_loc.to(dev),
                           seq_lens=md.seq_lens.to(dev), block_table=md.block_table.to(dev),
                           max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, num_decode_tokens=decodes,
                           host_query_start_loc=md.query_start_loc.numpy(), host_seq_lens=md.seq_lens.numpy())
    return kc.to(dev), vc.to(dev), md


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("cache_dtype", ["fp16", "fp8_e5m2"])
@pytest.mark.parametrize("lens", [([2048], [2048]), ([8192], [512]), ([5000, 300, 9000, 64], [1, 300, 17, 64])],
                         ids=["prompt2k", "chunk512over8k", "mixed"])
def test_sdpa_efficient_kernel_matches_reference(lens, cache_dtype):
    from onecard.kernels import paths
    from onecard.kernels.attention import ref, sdpa
    from onecard.kernels.attention import triton as tk

    seq_lens, q_lens = lens
    decodes = 1 if q_lens[0] == 1 else 0
    kc, vc, md = _batch(seq_lens, q_lens, decodes, cache_dtype)
    q = torch.randn(sum(q_lens), 32, 128, dtype=torch.float16, device="cuda")
    scale = 1 / math.sqrt(128)
    want = ref.paged_attention(q.float(), kc, vc, md, scale)
    assert sdpa.available(q.device)
    alone = sdpa.paged_attention(q, kc, vc, md, scale)                     # the memory-efficient backend only
    paths.set_emulated_capability(70)
    try:
        assert sdpa.long_sequences(md, 70) == [i for i, n in enumerate(q_lens) if n > paths.SPLIT_MAX_QUERY]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        split = tk.paged_attention(q, kc, vc, md, scale)                    # SDPA + the kernel for the others
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - split.numel() * split.element_size()
    finally:
        paths.set_emulated_capability(None, clear=True)
    assert _rel(alone, want) < 1e-2 and _rel(split, want) < 1e-2
    bound = paths.prefill_sdpa_workspace(max(seq_lens), max(q_lens), 32, 4, 128, 2, kc.dtype.itemsize)
    assert extra <= bound + (4 << 20), (extra, bound)                       # + the kernel half's small buffers


@pytest.mark.parametrize("t, skew", [(2, False), (9, False), (16, False), (16, True)])
def test_decode_moe_row_step_matches_reference(t, skew):
    from kernels_testlib import random_gptq

    from onecard.kernels import paths
    from onecard.kernels.fused_moe import ref
    from onecard.kernels.fused_moe import triton as tk

    h, i, e, k = 2048, 768, 128, 8
    g = torch.Generator().manual_seed(t)
    ws = [random_gptq(h, i, 128, experts=e, seed=1)[0], random_gptq(h, i, 128, experts=e, seed=2)[0],
          random_gptq(i, h, 128, experts=e, seed=3)[0]]
    ws = [w.to("cuda") for w in ws]
    x = torch.randn(t, h, generator=g).half().cuda()
    logits = torch.randn(t, e, generator=g).cuda()
    if skew:                                                              # every token on experts 0..7: 8 passes
        logits[:, :k] += 20.0
    want = ref.fused_moe(x.float(), logits, *ws, k, True)
    paths.set_emulated_capability(70)
    try:
        assert paths.decode_rows(t, paths.capability()) > 0
        rows = tk.fused_moe(x, logits, *ws, k, True)
        paths.set_switch("pre_ampere_decode_rows", False)
        dot = tk.fused_moe(x, logits, *ws, k, True)
    finally:
        paths.set_switch("pre_ampere_decode_rows", None)
        paths.set_emulated_capability(None, clear=True)
    assert _rel(rows, want) < 2e-3 and _rel(dot, want) < 2e-3, (_rel(rows, want), _rel(dot, want))


@pytest.mark.parametrize("m", [2, 3, 4, 6])
@pytest.mark.parametrize("k, n", [(2048, 5120), (4096, 2048)], ids=["qkv", "o_proj"])
def test_skinny_gemm_row_step_matches_reference(m, k, n):
    from kernels_testlib import random_gptq

    from onecard.kernels import paths
    from onecard.kernels.gptq_gemm import ref
    from onecard.kernels.gptq_gemm import triton as tk

    w = random_gptq(k, n, 128, seed=m)[0].to("cuda")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().cuda()
    bias = torch.randn(n).half().cuda()
    want = ref.w4a16_gemm(x.float(), w, bias.float())
    paths.set_emulated_capability(70)
    try:
        assert paths.dense_rows(m, paths.capability()) > 0
        rows = tk.w4a16_gemm(x, w, bias)
        paths.set_switch("pre_ampere_decode_rows", False)
        dot = tk.w4a16_gemm(x, w, bias)
    finally:
        paths.set_switch("pre_ampere_decode_rows", None)
        paths.set_emulated_capability(None, clear=True)
    assert _rel(rows, want) < 2e-3 and _rel(dot, want) < 2e-3, (_rel(rows, want), _rel(dot, want))
