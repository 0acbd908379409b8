"""Checks on the H200: the skinny (1 < M <= 16) split-K path (repeated calls, raw atomics per split count and
warps) and the prefill grouped-GEMM MoE against the fp32 reference at real shapes."""
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.kernels_gpu import rand_gptq
from onecard.kernels import workspace
from onecard.kernels.gptq_gemm import triton as g_t

DEV = torch.device("cuda")
for name, k, n in (("qkv", 2048, 5120), ("o_proj", 4096, 2048)):
    w = rand_gptq(k, n)
    for m in (2, 16):
        x = torch.randn(m, k, device=DEV, dtype=torch.float16) / math.sqrt(k)
        ref = torch.matmul(x.float(), g_t.dequantize(w, torch.float32))
        err = lambda y, ref=ref: float((y.float() - ref).norm() / ref.norm())
        es = []
        for _ in range(4):
            y = g_t.w4a16_gemm(x, w)
            es.append(err(y))
        print(f"{name} M={m} w4a16_gemm, 4 calls: errs {[f'{e:.1e}' for e in es]}")
        # raw atomics into fresh zeros: is every split's contribution there exactly once?
        bm, bn, bk8, _, warps, stages = g_t._CONFIGS["skinny"]
        k_tiles = triton.cdiv(k // 8, bk8)
        for splits_want in (1, 2, 4, 16):
            tps = triton.cdiv(k_tiles, splits_want)
            splits = triton.cdiv(k_tiles, tps)
            outs = []
            for _ in range(3):
                part = torch.zeros(m, n, dtype=torch.float32, device=DEV)
                out = torch.empty(m, n, dtype=torch.float16, device=DEV)
                g_t._w4a16_small_kernel[(triton.cdiv(n, bn), splits)](
                    x, w.qweight, w.qzeros, w.scales, w.qweight, out, out, part,
                    workspace.counters(DEV, "gemm", n // bn), m, n, k, w.group_size, w.num_groups, tps,
                    x.stride(0), 0, out, out, out, part, 0, 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K8=bk8, PER_ROW=False, BLOCK_S=16, PDL=False,
                    num_warps=warps, num_stages=stages)
                outs.append(err(out if splits == 1 else part))
            print(f"  raw splits={splits}: errs {[f'{e:.1e}' for e in outs]}")
        for warps in (1, 2, 8):
            part = torch.zeros(m, n, dtype=torch.float32, device=DEV)
            out = torch.empty(m, n, dtype=torch.float16, device=DEV)
            g_t._w4a16_small_kernel[(triton.cdiv(n, bn), k_tiles)](
                x, w.qweight, w.qzeros, w.scales, w.qweight, out, out, part,
                workspace.counters(DEV, "gemm", n // bn), m, n, k, w.group_size, w.num_groups, 1,
                x.stride(0), 0, out, out, out, part, 0, 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K8=bk8, PER_ROW=False, BLOCK_S=16, PDL=False,
                num_warps=warps, num_stages=stages)
            print(f"  raw splits={k_tiles} warps={warps}: err {err(part):.1e}")

from bench.kernels_gpu import TOPK, E, H, I
from onecard.kernels.fused_moe import grouped
from onecard.kernels.fused_moe import ref as moe_r

for t in (512, 4096):
    ws = tuple(rand_gptq(k, n, E) for k, n in ((H, I), (H, I), (I, H)))
    x = torch.randn(t, H, device=DEV, dtype=torch.float16)
    logits = torch.randn(t, E, device=DEV, dtype=torch.float16)
    y = grouped.fused_moe(x, logits, *ws, TOPK, True)
    r = moe_r.fused_moe(x, logits, *ws, TOPK, True)
    print(f"grouped fused_moe T={t}: rel err vs ref {float((y.float() - r.float()).norm() / r.float().norm()):.2e}")
