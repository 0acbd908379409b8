"""Triton fused MoE (W4A16 GPTQ or float expert weights), same contract as ref.py.

Steps (no host syncs, static sizes: CUDA-graph capturable):
  1. routing: one program per token: fp32 softmax over experts, top-k by repeated argmax, renormalise.
  2. GEMM1 (gate and up, two fp32 accumulators, SiLU·mul in the epilogue) -> inter [T*k, I] in x.dtype.
  3. GEMM2 (down, times the routed weight) -> [T*k, H]; then the top-k sum (torch, fp32 accumulation).
Two ways to walk the (token, slot) pairs, chosen by T from a fixed table:
  * decode (T <= DECODE_MAX_TOKENS): decode.py (routing) and stages.py (expert GEMMs), split-K over the
    active experts with fp32 atomics (one weight read per distinct expert, thousands of programs in flight);
    see those modules.
  * "sorted" (larger T): ``moe_align_block_size`` sorts pairs by expert, padding each expert's run to BLOCK_M
    (sentinel = T*k; static size T*k + E*(BM-1)); each program takes one block, reads A rows pair // k and
    the expert's weights, dequantizes int4 in the K loop and uses tl.dot.
The int4 walk is the one of gptq_gemm (int4.py): nibble j of packed row r is input row 8r + j.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels import paths
from onecard.kernels.activation.triton import silu_mul
from onecard.kernels.fused_moe import batch1, slices
from onecard.kernels.fused_moe.decode import (
    DECODE_MAX_TOKENS,
    decode_aot_configs,
    fused_moe_decode,
    router_logits,
    softmax_topk,
)
from onecard.kernels.fused_moe.router_fold import FoldedRoute
from onecard.kernels.fused_moe.stages import DECODE_CONFIGS, weight_args
from onecard.kernels.gptq_gemm.int4 import _dequant_tile_j, _group_sz
from onecard.kernels.triton_common import (
    AotConfig,
    compute_capability,
    next_pow2,
    settle_cache_keys,
    signature,
)
from onecard.kernels.triton_dot import dot
from onecard.kernels.types import MoEWeight


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_t, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0)
    vals, ids, offs_k = softmax_topk(logits_ptr, t, stride_t, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)
    tl.store(w_ptr + t * TOP_K + offs_k, vals, mask=offs_k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_k, ids, mask=offs_k < TOP_K)


@triton.jit
def _w_tile_j(w_ptr, z_ptr, s_ptr, g_ptr, q, j: tl.constexpr, s_u, z_u, r, r_mask, offs_n, n_mask, z_shift,
              N, per_row, FLOAT_W: tl.constexpr):
    """fp32 [BK8, BN] weights of rows 8r + j for one expert (pointers already offset to it)."""
    k = r * 8 + j
    if FLOAT_W:
        w = tl.load(w_ptr + k[:, None] * N + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :],
                    other=0.0).to(tl.float32)
    else:
        w = _dequant_tile_j(q, j, s_u, z_u, s_ptr, z_ptr, g_ptr, k, r_mask, offs_n, n_mask, z_shift, N,
                            per_row)
    return w


@triton.jit(do_not_specialize=["num_pairs"])  # runtime-varying: one compile serves all
def _moe_gemm_kernel(a_ptr, out_ptr, w1_ptr, z1_ptr, s1_ptr, g1_ptr, w2_ptr, z2_ptr, s2_ptr, g2_ptr,
                     rows_ptr, experts_ptr, ntpp_ptr, topk_w_ptr,
                     N, K, group_size, num_groups, a_div, num_pairs, stride_am, per_row, g_stride,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                     SORTED: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED: tl.constexpr,
                     FLOAT_W: tl.constexpr):
    """out[pair, :N] = act(a[pair // a_div] @ W[expert]) for the pairs of one program.

    GATED: W = (w1 gate, w2 up), act = silu(gate) * up. MUL_ROUTED: times topk_w[pair].
    SORTED: program = one BLOCK_M block of sorted pairs (tl.dot); else one pair (GEMV, BLOCK_M == 1).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if SORTED:  # noqa: SIM102 - a constexpr branch: the load below must not exist in the unsorted kernel
        if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
            return
    e = tl.load(experts_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    k8 = K // 8
    if FLOAT_W:
        w1_ptr += e * K * N
        w2_ptr += e * K * N
    else:
        w1_ptr += e * k8 * N
        w2_ptr += e * k8 * N
        z1_ptr += e * num_groups * (N // 8)
        z2_ptr += e * num_groups * (N // 8)
        s1_ptr += e * num_groups * N
        s2_ptr += e * num_groups * N
        g1_ptr += e * g_stride
        g2_ptr += e * g_stride
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    z_shift = (offs_n % 8) * 4
    offs_r = tl.arange(0, BLOCK_K8)
    if SORTED:
        pair = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))            # [BM]
        p_mask = pair < num_pairs
        a_rows = tl.where(p_mask, pair // a_div, 0).to(tl.int64)
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        pair = pid_m
        a_row = (pair // a_div).to(tl.int64)
        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in range(tl.cdiv(k8, BLOCK_K8)):
        r = t * BLOCK_K8 + offs_r
        r_mask = r < k8
        q1 = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.int32)
        q2 = q1
        s1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        z1 = s1
        s2 = s1
        z2 = s1
        if not FLOAT_W:
            qm = r_mask[:, None] & n_mask[None, :]
            g = tl.minimum((t * BLOCK_K8 * 8) // group_size, num_groups - 1)
            q1 = tl.load(w1_ptr + r[:, None] * N + offs_n[None, :], mask=qm, other=0)
            s1, z1 = _group_sz(s1_ptr, z1_ptr, g, offs_n, n_mask, z_shift, N)
            if GATED:
                q2 = tl.load(w2_ptr + r[:, None] * N + offs_n[None, :], mask=qm, other=0)
                s2, z2 = _group_sz(s2_ptr, z2_ptr, g, offs_n, n_mask, z_shift, N)
        for j in tl.static_range(8):
            k = r * 8 + j
            wa = _w_tile_j(w1_ptr, z1_ptr, s1_ptr, g1_ptr, q1, j, s1, z1, r, r_mask, offs_n, n_mask, z_shift,
                           N, per_row, FLOAT_W)
            if SORTED:
                aj = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :],
                             mask=p_mask[:, None] & r_mask[None, :], other=0.0)           # [BM, BK8]
                acc1 += dot(aj, wa.to(aj.dtype))
            else:
                av = tl.load(a_ptr + a_row * stride_am + k, mask=r_mask, other=0.0).to(tl.float32)
                acc1 += tl.sum(wa * av[:, None], axis=0)
            if GATED:
                wb = _w_tile_j(w2_ptr, z2_ptr, s2_ptr, g2_ptr, q2, j, s2, z2, r, r_mask, offs_n, n_mask,
                               z_shift, N, per_row, FLOAT_W)
                if SORTED:
                    acc2 += dot(aj, wb.to(aj.dtype))
                else:
                    acc2 += tl.sum(wb * av[:, None], axis=0)
    if GATED:
        acc1 = silu_mul(acc1, acc2)                                       # silu(gate) * up, fp32
    if SORTED:
        if MUL_ROUTED:
            acc1 *= tl.load(topk_w_ptr + pair, mask=p_mask, other=0.0)[:, None]
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * N + offs_n[None, :],
                 acc1.to(out_ptr.dtype.element_ty), mask=p_mask[:, None] & n_mask[None, :])
    else:
        if MUL_ROUTED:
            acc1 *= tl.load(topk_w_ptr + pair)
        tl.store(out_ptr + pair * N + offs_n, acc1.to(out_ptr.dtype.element_ty), mask=n_mask)


# name: (BLOCK_M, BLOCK_N for GEMM1, BLOCK_N for GEMM2, BLOCK_K8, num_warps, num_stages); the decode names
# (T <= DECODE_MAX_TOKENS) live in stages.DECODE_CONFIGS.
_CONFIGS = {
    "sorted16": (16, 64, 64, 16, 4, 3),
    "sorted64": (64, 128, 128, 16, 8, 3),
}


def choose_config(num_tokens: int, cc: int = 80) -> str:
    """The config for T tokens: paths.triton_moe_config (the path table)."""
    return paths.triton_moe_config(num_tokens, cc)


def moe_router(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Decode-sized T: decode.router_logits (one launch, PDL); larger T is compute-bound: cuBLAS."""
    if 1 <= x.shape[0] <= DECODE_MAX_TOKENS and weight.is_contiguous():
        return router_logits(x, weight)
    return torch.nn.functional.linear(x, weight)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_weights fp32 [T, k], topk_ids int32 [T, k])."""
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    # zeros, not empty: a dry forward (kernels/precompile.py) skips the kernel and then indexes with these
    ids = torch.zeros(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t > 0:
        _route_kernel[(t,)](router_logits, weights, ids, e, router_logits.stride(0), TOP_K=top_k,
                            BLOCK_K=next_pow2(top_k), BLOCK_E=next_pow2(e), RENORM=renormalize)
    return weights, ids


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert, each expert's run padded to block_m; torch ops, static sizes.

    -> (sorted_pair_ids [P + E*(BM-1)] int32 (sentinel P), block_expert [that / BM] int32 (-1 past the end),
        num_tokens_post_padded [1] int32).
    """
    flat = topk_ids.reshape(-1).long()                                    # [P]
    p = flat.numel()
    dev = flat.device
    cap = p + num_experts * (block_m - 1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m                   # [E]
    pad_end = torch.cumsum(padded, 0)
    order = torch.sort(flat, stable=True).indices                         # pairs grouped by expert
    sorted_e = flat[order]
    rank = torch.arange(p, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    sorted_ids = torch.full((cap,), p, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pad_end[sorted_e] - padded[sorted_e] + rank, order.to(torch.int32))
    block_start = torch.arange(0, cap, block_m, device=dev)
    block_e = torch.searchsorted(pad_end, block_start, right=True)        # E past the last block
    block_e = torch.where(block_e < num_experts, block_e, -1).to(torch.int32)
    return sorted_ids, block_e, pad_end[-1:].to(torch.int32)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight,
              w_down: MoEWeight, top_k: int, renormalize: bool) -> torch.Tensor:
    t, _h = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if 1 <= t <= DECODE_MAX_TOKENS:
        return fused_moe_decode(x, router_logits, w_gate, w_up, w_down, top_k, renormalize)
    topk_w, topk_ids = route(router_logits, top_k, renormalize)         # [T, k]
    p = t * top_k
    name = choose_config(t, compute_capability(x.device))
    bm, bn1, bn2, bk8, warps, stages = _CONFIGS[name]
    sorted_mode = True
    gate, k1, n1, gs1, ng1, pr1, gst1, float_w = weight_args(w_gate, bk8)
    up, *_, pr_up, gst_up, _ = weight_args(w_up, bk8)
    assert (pr_up, gst_up) == (pr1, gst1), "gate and up must share their group layout (g_idx or not)"
    down, k2, n2, gs2, ng2, pr2, gst2, _ = weight_args(w_down, bk8)
    num_experts = int(router_logits.shape[1])
    if sorted_mode:
        rows, experts, ntpp = moe_align_block_size(topk_ids, num_experts, bm)
        grid_m = rows.numel() // bm
    else:
        rows, experts, ntpp = topk_ids, topk_ids.reshape(-1), topk_ids     # rows/ntpp unused
        grid_m = p
    inter = torch.empty(p, n1, dtype=x.dtype, device=x.device)            # [T*k, I]
    y = torch.empty(p, n2, dtype=x.dtype, device=x.device)                # [T*k, H]
    if p == 0:
        return y.view(t, top_k, n2).sum(1)
    common = dict(BLOCK_M=bm, BLOCK_K8=bk8, SORTED=sorted_mode, FLOAT_W=float_w, num_warps=warps,
                  num_stages=stages)
    _moe_gemm_kernel[(grid_m, triton.cdiv(n1, bn1))](
        x, inter, *gate, *up, rows, experts, ntpp, topk_w, n1, k1, gs1, ng1, top_k, p, x.stride(0), pr1, gst1,
        BLOCK_N=bn1, GATED=True, MUL_ROUTED=False, **common)
    _moe_gemm_kernel[(grid_m, triton.cdiv(n2, bn2))](
        inter, y, *down, *down, rows, experts, ntpp, topk_w, n2, k2, gs2, ng2, 1, p, inter.stride(0), pr2, gst2,
        BLOCK_N=bn2, GATED=False, MUL_ROUTED=True, **common)
    return y.view(t, top_k, n2).sum(dim=1)


def norm_moe(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
             gate: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight, w_down: MoEWeight, top_k: int,
             renormalize: bool, folded: FoldedRoute | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 1: batch1.norm_moe (three launches, fp32 out; one with ``folded``); otherwise RMSNorm, router and
    fused_moe here (``folded`` unused)."""
    if batch1.supported(x, gate, top_k, residual):
        return batch1.norm_moe(x, residual, norm_weight, eps, gate, w_gate, w_up, w_down, top_k, renormalize,
                               folded)
    from onecard.kernels.norm.triton import rms_norm

    h, residual_out = rms_norm(x, norm_weight, eps, residual)
    return fused_moe(h, moe_router(h, gate), w_gate, w_up, w_down, top_k, renormalize), residual_out


def aot_configs() -> list[AotConfig]:
    """Routing at the served shapes (E=128, k=8, and any power-of-two E) and every GEMM config/flag combination
    for GPTQ (fp16 / bf16 activations) and float weights."""
    out: list[AotConfig] = []
    for act, min_cc in (("fp16", 70), ("bf16", 80)):
        for renorm in (True, False):
            cx = dict(TOP_K=8, BLOCK_K=8, BLOCK_E=128, RENORM=renorm)
            args = dict(logits_ptr=f"*{act}", w_ptr="*fp32", ids_ptr="*i32", E="i32", stride_t="i32")
            out.append(AotConfig(_route_kernel, signature(args, cx), cx, 4, 1, min_cc, f"route[{renorm},{act}]"))
        out += decode_aot_configs(act, min_cc) + batch1.aot_configs(act, min_cc) + slices.slices_aot_configs(act, min_cc)
        for name, (bm, bn1, bn2, bk8, warps, stages) in _CONFIGS.items():
            for float_w in (False, True):
                for gated, bn in ((True, bn1), (False, bn2)):
                    cx = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K8=bk8, SORTED=True, GATED=gated,
                              MUL_ROUTED=not gated, FLOAT_W=float_w)
                    wt = f"*{act}" if float_w else "*i32"
                    args = dict(a_ptr=f"*{act}", out_ptr=f"*{act}", w1_ptr=wt, z1_ptr="*i32", s1_ptr="*fp16",
                                g1_ptr="*i32", w2_ptr=wt, z2_ptr="*i32", s2_ptr="*fp16", g2_ptr="*i32",
                                rows_ptr="*i32", experts_ptr="*i32", ntpp_ptr="*i32", topk_w_ptr="*fp32",
                                N="i32", K="i32", group_size="i32", num_groups="i32", a_div="i32",
                                num_pairs="i32", stride_am="i32", per_row="i32", g_stride="i32")
                    if float_w:
                        args.update(z1_ptr=wt, s1_ptr=wt, g1_ptr=wt, z2_ptr=wt, s2_ptr=wt, g2_ptr=wt)
                    out.append(AotConfig(_moe_gemm_kernel, signature(args, cx), cx, warps, stages, min_cc,
                                         f"moe[{name},gated={gated},float={float_w},{act}]"))
    return out


__all__ = [
    "DECODE_CONFIGS",
    "aot_configs",
    "choose_config",
    "fused_moe",
    "moe_align_block_size",
    "moe_router",
    "norm_moe",
    "route",
]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
