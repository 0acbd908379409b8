"""Triton batch-1 MoE block: post-attention RMSNorm + router + top-k in one launch, then stages.py's two
expert stages; same contract as ref.norm_moe, except that the MoE output comes back in float32.

Why: at batch 1 a decode step is ~12 small kernels per layer and each launch boundary costs ~1-2 us on the
H200 even with PDL; the MoE block alone was six (RMSNorm, router GEMV, routing, gate/up, down, finish).
Here it is three:
  1. ``_norm_route_kernel``, one program per expert: every program loads the token's row and residual, adds
     them and computes the RMS statistics itself (2-3 rows of 4 KB, from L2); it stores its share of the
     normalised row and of the new residual, its router logit (the normalised row rounded to the model dtype,
     as the model's F.linear sees it, times the expert's row of the router weight), and zeroes its share of
     the two fp32 accumulators of the stages. The program that arrives last (``last_arrival``: plain stores,
     then a released counter) does softmax, top-k and renormalisation and writes the routing for the stages:
     ids, routed weights and the active list (expert + 1 per slot; a token's k experts are distinct).
  2, 3. stages.moe_stages: gate/up into gu, down (times the routed weight, top-k summed) into out32. With
     paths.batch1_moe_slices (where slices.supported): slices.moe_slices, both stages in ONE launch (no gu);
     and with paths.batch1_slices_route the slices find the top-k themselves from the logits (no last arriver).
Given the attention block's ``folded`` hand-over (paths.batch1_router_fold, router_fold.py) there is no launch 1:
the slices normalise the input and route from the router's sums that the o_proj launch added up; ONE launch.
The finish kernel (cast to the model dtype) is gone: out32 is returned and the next RMSNorm reads fp32
(norm/ref.py: its outputs follow the residual's dtype). Nothing persists between calls but the arrival
counter, which its last arriver resets (kernels/workspace.py). Under PDL the stages' rule holds as in
stages.py: stage 1 reads the routing after its wait, stage 2 (two launches later) before it.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from onecard.kernels import paths, workspace
from onecard.kernels.fused_moe import slices
from onecard.kernels.fused_moe.decode import topk_of
from onecard.kernels.fused_moe.router_fold import FoldedRoute
from onecard.kernels.fused_moe.stages import moe_inter_size, moe_stages
from onecard.kernels.norm.triton import inv_rms, residual_add
from onecard.kernels.triton_common import (
    AotConfig,
    last_arrival,
    next_pow2,
    pdl,
    pdl_enter,
    settle_cache_keys,
    signature,
)
from onecard.kernels.types import MoEWeight

MAX_HIDDEN = 8192                     # one program holds the whole row (BLOCK_H fp32 values, 4 warps)
MAX_EXPERTS = 1024                    # the last arriver's top-k holds every logit
NORM_ROUTE_WARPS = 4


def supported(x: torch.Tensor, gate: torch.Tensor, top_k: int, residual: torch.Tensor | None = None) -> bool:
    """x may be fp32 with a residual (the model dtype is the residual's then)."""
    e, h = gate.shape
    dt = residual.dtype if residual is not None else x.dtype
    return (x.shape[0] == 1 and h == x.shape[1] and h <= MAX_HIDDEN and top_k <= e <= MAX_EXPERTS
            and gate.is_contiguous() and gate.dtype == dt)


@triton.jit
def _zero_share(ptr, n, part, parts, BLOCK: tl.constexpr):
    """Zero part ``part`` of ``parts`` equal slices of fp32 ptr[0:n]."""
    chunk = tl.cdiv(n, parts)
    offs = tl.arange(0, BLOCK)
    for z in range(0, chunk, BLOCK):
        o = part * chunk + z + offs
        tl.store(ptr + o, tl.zeros((BLOCK,), dtype=tl.float32), mask=(z + offs < chunk) & (o < n))


@triton.jit
def _norm_route_kernel(x_ptr, res_ptr, nw_ptr, gate_ptr, h_ptr, res_out_ptr, logits_ptr, topk_w_ptr, ids_ptr,
                       active_ptr, gu_ptr, out32_ptr, cnt_ptr, H, E, GU_N, eps,
                       TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                       RENORM: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr, ROUTE: tl.constexpr = True):
    """not ROUTE (paths.batch1_slices_route): no last arriver, no routing written; the slices route from the logits."""
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    g = tl.load(gate_ptr + e.to(tl.int64) * H + offs, mask=m, other=0.0).to(tl.float32)   # weights: before
    nw = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)                         # the wait
    pdl_enter(PDL)
    r = residual_add(x_ptr, res_ptr, 0, H, H, offs, m, res_out_ptr.dtype.element_ty, HAS_RES)  # [1, H]: row 0
    hf = r.to(tl.float32)
    rstd = inv_rms(hf, H, eps)
    hn = (hf * rstd * nw).to(h_ptr.dtype.element_ty)                      # [BH] as rms_norm returns it
    chunk = tl.cdiv(H, E)
    mine = m & (offs >= e * chunk) & (offs < e * chunk + chunk)
    tl.store(h_ptr + offs, hn, mask=mine)
    if HAS_RES:
        tl.store(res_out_ptr + offs, r, mask=mine)
    logit = tl.sum(hn.to(tl.float32) * g, axis=0)
    tl.store(logits_ptr + e, logit.to(logits_ptr.dtype.element_ty))
    _zero_share(gu_ptr, GU_N, e, E, BLOCK_H)
    _zero_share(out32_ptr, H, e, E, BLOCK_H)
    if ROUTE:  # noqa: SIM102 -- a constexpr; an `and` would still emit last_arrival's barrier and atomic
        if last_arrival(cnt_ptr, E):
            offs_e = tl.arange(0, BLOCK_E)
            lg = tl.load(logits_ptr + offs_e, mask=offs_e < E, other=-float("inf"), cache_modifier=".cg")
            vals, ids, offs_k = topk_of(lg.to(tl.float32), offs_e, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)
            k_mask = offs_k < TOP_K
            tl.store(topk_w_ptr + offs_k, vals, mask=k_mask)
            tl.store(ids_ptr + offs_k, ids, mask=k_mask)
            tl.store(active_ptr + offs_k, ids + 1, mask=k_mask)


def norm_moe(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
             gate: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight, w_down: MoEWeight, top_k: int,
             renormalize: bool, folded: FoldedRoute | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, H] (model dtype or fp32), residual [1, H] | None -> (moe out [1, H] fp32, residual_out [1, H]).
    ``folded`` (the attention block's, paths.batch1_router_fold; x fp32, a residual): where the slices route
    themselves, no norm-route launch: the slices normalise x and route from folded.raw, adding into folded.out32
    (router_fold.py); elsewhere it is not used."""
    assert supported(x, gate, top_k, residual), (x.shape, gate.shape, top_k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    dev, h = x.device, x.shape[1]
    e = gate.shape[0]
    dt = residual.dtype if residual is not None else x.dtype
    if (folded is not None and residual is not None and x.dtype == torch.float32 and paths.batch1_moe_slices()
            and paths.batch1_slices_route() and slices.supported(w_gate, w_up, w_down)):
        res_out = torch.empty(1, h, dtype=dt, device=dev)
        slices.moe_slices(x, folded.out32, w_gate, w_up, w_down, folded.raw, folded.raw, top_k, pdl(dev, 1),
                          logits=folded.raw, renormalize=renormalize, norm=(residual, norm_weight, eps, res_out))
        return folded.out32, res_out
    hn = torch.empty(1, h, dtype=dt, device=dev)
    res_out = torch.empty(1, h, dtype=dt, device=dev) if residual is not None else x
    logits = torch.empty(1, e, dtype=gate.dtype, device=dev)
    topk_w = torch.empty(1, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(1, top_k, dtype=torch.int32, device=dev)
    active = torch.empty(top_k, dtype=torch.int32, device=dev)
    out32 = torch.empty(1, h, dtype=torch.float32, device=dev)
    one_launch = paths.batch1_moe_slices() and slices.supported(w_gate, w_up, w_down)
    route_in_slices = one_launch and paths.batch1_slices_route()
    # gu [k, 2I]: stages.py's gate/up sums (the slices keep theirs in registers: nothing to zero)
    gu = out32[:, :0] if one_launch else torch.empty(top_k, 2 * moe_inter_size(w_gate), dtype=torch.float32,
                                                     device=dev)
    use_pdl = pdl(dev, 1)
    _norm_route_kernel[(e,)](x, residual if residual is not None else x, norm_weight, gate, hn, res_out, logits,
                             topk_w, ids, active, gu, out32, workspace.counters(dev, "router", 1), h, e,
                             gu.numel(), eps, TOP_K=top_k, BLOCK_K=next_pow2(top_k), BLOCK_H=next_pow2(h),
                             BLOCK_E=next_pow2(e), RENORM=renormalize, HAS_RES=residual is not None,
                             PDL=use_pdl, ROUTE=not route_in_slices,
                             num_warps=NORM_ROUTE_WARPS, launch_pdl=use_pdl)
    if one_launch:
        slices.moe_slices(hn, out32, w_gate, w_up, w_down, ids, topk_w, top_k, use_pdl,
                          logits=logits if route_in_slices else None, renormalize=renormalize)
    else:
        moe_stages(hn, gu, out32, w_gate, w_up, w_down, ids, topk_w, active, top_k, use_pdl)
    return out32, res_out


def aot_configs(act: str, min_cc: int) -> list[AotConfig]:
    """The served shape (H 2048, E 128, k 8) with the residual (the model always has one here)."""
    out: list[AotConfig] = []
    # x fp32: after attention_block's accumulating GEMVs; not ROUTE (paths.batch1_slices_route, on: the slices
    # route themselves): on that path, renormalised, only
    for renorm, x_t, route in itertools.product((True, False), (act, "fp32"), (True, False)):
        if not route and (x_t != "fp32" or not renorm):
            continue
        cx = dict(TOP_K=8, BLOCK_K=8, BLOCK_H=2048, BLOCK_E=128, RENORM=renorm, HAS_RES=True, PDL=False,
                  ROUTE=route)                                            # (an AOT compile takes no defaults)
        args = dict(x_ptr=f"*{x_t}", res_ptr=f"*{act}", nw_ptr=f"*{act}", gate_ptr=f"*{act}", h_ptr=f"*{act}",
                    res_out_ptr=f"*{act}", logits_ptr=f"*{act}", topk_w_ptr="*fp32", ids_ptr="*i32",
                    active_ptr="*i32", gu_ptr="*fp32", out32_ptr="*fp32", cnt_ptr="*i32", H="i32", E="i32",
                    GU_N="i32", eps="fp32")
        out.append(AotConfig(_norm_route_kernel, signature(args, cx), cx, NORM_ROUTE_WARPS, 1, min_cc,
                             f"norm_route[renorm={renorm}{',x=fp32' if x_t == 'fp32' else ''}"
                             f"{'' if route else ',noroute'},{act}]"))
    return out


__all__ = ["aot_configs", "norm_moe", "supported"]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
