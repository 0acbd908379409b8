"""Triton batch-1 MoE block in ONE launch: post-attention RMSNorm + router + top-k + both expert stages. Same
contract as batch1.norm_moe (MoE output in float32, residual out); used when ``paths.moe_block1()`` is on (off
by default until the full model measures it faster: bench/long_context.py ``--policies fill,moeblock``).

Why: batch1.norm_moe is three dependent launches (norm-route, gate/up, down). At batch 1 each one waits for its
predecessor's grid to drain, and gate/up can only start streaming its 12.6 MB of expert weights once the
routing kernel is complete. Here the three are roles of one grid, chained by flags in memory instead of launch
boundaries, so each expert tile is requested the moment its program sees the routing, and the down stage's
weights stream while gate/up computes.

Roles, in this (logical) order of a 1-D grid:
  route   (E programs): batch1.norm_route_share (every program computes the RMS itself; stores its share of hn,
          residual_out and zeros of out32, and its logit); the last arriver does softmax + top-k, stores the
          routed weights and publishes slot k's expert as active[k] = expert + 1 (released after a barrier).
  gate/up (k slots x S1 K-splits x 2 x T1 column tiles): wait for active[slot] (poll, then an acquire), stream
          its int4 tiles of expert e's gate or up columns, multiply with hn, store the fp32 partial
          part[split, slot, 2I] (plain stores: the reader sums the S1 partials in a fixed order, no atomics),
          then arrive at ready[slot, j] (released after a barrier), j the down split its columns feed.
  down    (k slots x S2 K-splits x T2 column tiles): wait for active[slot], load its first down tile, wait until
          ready[slot, j] counts every gate/up program of its K range, sum the partials into silu(gate) * up,
          times the routed weight, fp32 atomics into out32 [H] (read by the next kernel, after this grid).
Deadlock freedom: a program's role comes from a ticket (an atomic counter taken at entry), not from its
program id, so the logical order is the order in which programs started: each waits only on programs holding
earlier tickets, which are resident or done. Under the interpreter (programs run one after another) every wait
is already satisfied when reached.
PDL (sm90): only route programs wait for the previous kernel; every other program writes only after it has
seen the routing, which the route programs publish after their wait. Every program lets the next kernel launch
at once (it waits for this whole grid).
State, zero between launches (kernels/workspace.py, region "moe_block"): [ticket, router arrivals, active[k],
ready[k*S2], done[k*S2], slot_done[k]]: the last ticket holder resets the ticket, the router's last arriver its
counter, the last down program of (slot, j) ready and done, and the last (slot, j) of a slot its active entry.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from onecard.kernels import workspace
from onecard.kernels.fused_moe import batch1
from onecard.kernels.fused_moe.stages import DECODE_CONFIGS, _decode_tile_load, _split, weight_args
from onecard.kernels.gptq_gemm.int4 import gemv_tile_mac
from onecard.kernels.triton_common import (
    AotConfig,
    last_arrival,
    next_pow2,
    pdl,
    pdl_enter,
    signature,
)
from onecard.kernels.types import GPTQWeight, MoEWeight

CONFIG = "decode1"                    # tiles, warps and the split target of stages.DECODE_CONFIGS


def supported(x: torch.Tensor, gate: torch.Tensor, top_k: int, w_gate: MoEWeight, w_up: MoEWeight,
              w_down: MoEWeight) -> bool:
    """batch1's shapes, GPTQ experts whose K tiles each lie in one group (no g_idx: the served checkpoint)."""
    if not batch1.supported(x, gate, top_k):
        return False
    ws = (w_gate, w_up, w_down)
    if not all(isinstance(w, GPTQWeight) for w in ws):
        return False
    bk8 = DECODE_CONFIGS[CONFIG][2]
    return not any(weight_args(w, bk8)[5] for w in ws)                   # per_row: g_idx or split groups


@triton.jit
def _poll(ptr, at_least):
    """Spin until the int32 at ptr is >= at_least (volatile loads from L2), then read it with acquire semantics:
    what the releasing programs stored before their release is visible after this."""
    v = tl.load(ptr, volatile=True)
    while v < at_least:
        v = tl.load(ptr, volatile=True)
    return tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _expert(ptr, POLL: tl.constexpr):
    """active[slot] (expert + 1): polled until published in this grid (POLL), else written by the launch
    before (complete after the PDL wait; from L2)."""
    if POLL:
        return _poll(ptr, 1)
    return tl.load(ptr, cache_modifier=".cg")


@triton.jit
def _cg_row(row_ptr, r, j: tl.constexpr, r_mask):
    """gemv_tile_mac INPUT: inputs 8r + j of hn, read from L2 (written by other programs of this grid)."""
    return tl.load(row_ptr + r * 8 + j, mask=r_mask, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _gated_partials(src, r, j: tl.constexpr, r_mask):
    """gemv_tile_mac INPUT: silu(gate) * up for inputs 8r + j, gate and up each the sum of the S1 gate/up
    partials [S1, 2I] (split stride ``split_stride``; up at +I), in split order. src = (partials of the slot,
    split_stride, I, S1, offs_s = arange(BLOCK_S1))."""
    p_ptr, split_stride, inter, s1, offs_s = src
    k = r * 8 + j                                                         # [BK8]
    ptrs = p_ptr + offs_s[:, None] * split_stride + k[None, :]            # [BS1, BK8]
    m = (offs_s < s1)[:, None] & r_mask[None, :]
    gv = tl.sum(tl.load(ptrs, mask=m, other=0.0, cache_modifier=".cg"), axis=0)
    uv = tl.sum(tl.load(ptrs + inter, mask=m, other=0.0, cache_modifier=".cg"), axis=0)
    return gv / (1.0 + tl.exp(-gv)) * uv


@triton.jit(do_not_specialize=["s1", "per1", "s2", "per2"])
def _moe_block_kernel(x_ptr, res_ptr, nw_ptr, gate_ptr, h_ptr, res_out_ptr, logits_ptr, topk_w_ptr,
                      qg_ptr, zg_ptr, sg_ptr, qu_ptr, zu_ptr, su_ptr, qd_ptr, zd_ptr, sd_ptr,
                      part_ptr, out32_ptr, state_ptr, active_ptr,
                      H, E, I, group1, groups1, group2, groups2, eps, tiles1, s1, per1, tiles2, s2, per2,
                      TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_S1: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                      RENORM: tl.constexpr, HAS_RES: tl.constexpr, ROUTE_IN: tl.constexpr, TICKET: tl.constexpr,
                      PDL: tl.constexpr):
    """ROUTE_IN: the route role is in this grid (its first E programs), active_ptr in the state, polled; else
    batch1's norm-route launch just before wrote hn, the routing and active (read after the PDL wait).
    TICKET: roles from an atomic ticket (deadlock-free in any dispatch order), else from the program id."""
    n_route = E if ROUTE_IN else 0
    p1 = TOP_K * s1 * 2 * tiles1                                          # gate/up programs
    if TICKET:
        total = n_route + p1 + TOP_K * s2 * tiles2
        tid = tl.atomic_add(state_ptr, 1, sem="relaxed")                  # the ticket: this program's role
        if tid == total - 1:
            tl.atomic_xchg(state_ptr, 0, sem="relaxed")                   # every other ticket is taken
    else:
        tid = tl.program_id(0)
    cnt_ptr = state_ptr + 1
    ready_ptr = state_ptr + 2 + TOP_K
    done_ptr = ready_ptr + TOP_K * s2
    slot_done_ptr = done_ptr + TOP_K * s2
    if tid < n_route:
        # ---- route: batch1's norm-route share, then the last arriver publishes the routing
        offs = tl.arange(0, BLOCK_H)
        m = offs < H
        g = tl.load(gate_ptr + tid.to(tl.int64) * H + offs, mask=m, other=0.0)   # model dtype: half the
        nw = tl.load(nw_ptr + offs, mask=m, other=0.0)                              # registers of fp32
        pdl_enter(PDL)
        batch1.norm_route_share(x_ptr, res_ptr, nw, g, h_ptr, res_out_ptr, logits_ptr, out32_ptr, tid, H, E, eps,
                                offs, m, BLOCK_H, HAS_RES)
        if last_arrival(cnt_ptr, E):
            vals, ids, offs_k = batch1.route_of_logits(logits_ptr, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)
            k_mask = offs_k < TOP_K
            tl.store(topk_w_ptr + offs_k, vals, mask=k_mask)
            tl.debug_barrier()
            tl.atomic_xchg(active_ptr + offs_k, ids + 1, mask=k_mask, sem="release")
    else:
        if ROUTE_IN:
            if PDL:
                gdc_launch_dependents()
        else:
            pdl_enter(PDL)
        offs_r = tl.arange(0, BLOCK_K8)
        if tid < n_route + p1:
            # ---- gate/up: (slot, split, mat, column tile) -> partial sums of hn @ W_mat[e][:, tile]
            q = tid - n_route
            per_slot = s1 * 2 * tiles1
            slot = q // per_slot
            rem = q - slot * per_slot
            split = rem // (2 * tiles1)
            nt = rem - split * 2 * tiles1
            mat = nt // tiles1
            tile = nt - mat * tiles1
            e = (_expert(active_ptr + slot, ROUTE_IN) - 1).to(tl.int64)
            if mat == 0:
                q_ptr, z_ptr, s_ptr = qg_ptr, zg_ptr, sg_ptr
            else:
                q_ptr, z_ptr, s_ptr = qu_ptr, zu_ptr, su_ptr
            k8 = H // 8
            q_ptr += e * k8 * I
            z_ptr += e * groups1 * (I // 8)
            s_ptr += e * groups1 * I
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < I
            z_shift = (offs_n % 8) * 4
            t_begin = split * per1
            t_end = tl.minimum(t_begin + per1, tl.cdiv(k8, BLOCK_K8))
            acc = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)
            qt, st, zt = _decode_tile_load(q_ptr, s_ptr, z_ptr, t_begin, t_end, e >= 0, offs_r, offs_n, n_mask,
                                           z_shift, k8, I, group1, groups1, BLOCK_K8, BLOCK_N, False)
            for it in range(t_begin, t_end):
                # the next tile's loads go out before this one's multiply (masked off past t_end)
                qn, sn, zn = _decode_tile_load(q_ptr, s_ptr, z_ptr, it + 1, t_end, e >= 0, offs_r, offs_n, n_mask,
                                               z_shift, k8, I, group1, groups1, BLOCK_K8, BLOCK_N, False)
                r = it * BLOCK_K8 + offs_r
                acc = gemv_tile_mac(acc, qt, st, zt, h_ptr, r, r < k8, _cg_row, BLOCK_K8, BLOCK_N)
                qt, st, zt = qn, sn, zn
            tl.store(part_ptr + (split * TOP_K + slot) * 2 * I + mat * I + offs_n, tl.sum(acc, axis=0),
                     mask=n_mask)
            j2 = (tile * BLOCK_N) // (per2 * BLOCK_K8 * 8)                # the down split these columns feed
            tl.debug_barrier()
            tl.atomic_add(ready_ptr + slot * s2 + j2, 1, sem="release")
        else:
            # ---- down: (slot, split, column tile) -> out32[tile] += w_slot * (silu(g) * u) @ Wd[e][K split, tile]
            q = tid - n_route - p1
            per_slot = s2 * tiles2
            slot = q // per_slot
            rem = q - slot * per_slot
            split = rem // tiles2
            tile = rem - split * tiles2
            e = (_expert(active_ptr + slot, ROUTE_IN) - 1).to(tl.int64)
            k8 = I // 8
            q_ptr = qd_ptr + e * k8 * H
            z_ptr = zd_ptr + e * groups2 * (H // 8)
            s_ptr = sd_ptr + e * groups2 * H
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < H
            z_shift = (offs_n % 8) * 4
            t_begin = split * per2
            t_end = tl.minimum(t_begin + per2, tl.cdiv(k8, BLOCK_K8))
            qt, st, zt = _decode_tile_load(q_ptr, s_ptr, z_ptr, t_begin, t_end, e >= 0, offs_r, offs_n, n_mask,
                                           z_shift, k8, H, group2, groups2, BLOCK_K8, BLOCK_N, False)
            # every gate/up program whose column tile starts in this split's K range [lo, hi) has arrived
            lo = split * per2 * BLOCK_K8 * 8
            hi = tl.minimum(lo + per2 * BLOCK_K8 * 8, I)
            _poll(ready_ptr + slot * s2 + split, 2 * s1 * (tl.cdiv(hi, BLOCK_N) - lo // BLOCK_N))
            w_slot = tl.load(topk_w_ptr + slot, cache_modifier=".cg")
            src = (part_ptr + slot * 2 * I, TOP_K * 2 * I, I, s1, tl.arange(0, BLOCK_S1))
            acc = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)
            for it in range(t_begin, t_end):
                qn, sn, zn = _decode_tile_load(q_ptr, s_ptr, z_ptr, it + 1, t_end, e >= 0, offs_r, offs_n, n_mask,
                                               z_shift, k8, H, group2, groups2, BLOCK_K8, BLOCK_N, False)
                r = it * BLOCK_K8 + offs_r
                acc = gemv_tile_mac(acc, qt, st, zt, src, r, r < k8, _gated_partials, BLOCK_K8, BLOCK_N)
                qt, st, zt = qn, sn, zn
            tl.atomic_add(out32_ptr + offs_n, tl.sum(acc, axis=0) * w_slot, mask=n_mask, sem="relaxed")
            # bookkeeping: the last down program of (slot, split) resets its counters, the last split the slot
            if last_arrival(done_ptr + slot * s2 + split, tiles2):
                tl.atomic_xchg(ready_ptr + slot * s2 + split, 0, sem="relaxed")
                if ROUTE_IN:  # noqa: SIM102  (a constexpr: the inner if is a launch-time branch)
                    if last_arrival(slot_done_ptr + slot, s2):
                        tl.atomic_xchg(active_ptr + slot, 0, sem="relaxed")


class _Variant:
    """The design knobs (benchmarks A/B them: ``set_variant``): route in the grid (else batch1's norm-route launch
    first), roles from tickets (else program ids), programs per SM the splits aim at (None: decode1's)."""

    route_in = True
    ticket = True
    per_sm: int | None = None


def set_variant(route_in: bool = True, ticket: bool = True, per_sm: int | None = None) -> None:
    """For benchmarks: the knobs of every later launch (no argument: the defaults)."""
    _Variant.route_in, _Variant.ticket, _Variant.per_sm = route_in, ticket, per_sm


def _geometry(h: int, inter: int, top_k: int, device: torch.device) -> tuple[int, int, int, int, int, int]:
    """-> (tiles1, s1, per1, tiles2, s2, per2): column tiles and K splits of the two stages, as stages.moe_stages
    chooses them (the decode1 split target unless the variant sets one)."""
    _, bn, bk8, _, _, per_sm = DECODE_CONFIGS[CONFIG]
    per_sm = _Variant.per_sm or per_sm
    tiles1 = triton.cdiv(inter, bn)
    s1, per1 = _split(2 * tiles1 * top_k, triton.cdiv(h // 8, bk8), device, per_sm)
    tiles2 = triton.cdiv(h, bn)
    s2, per2 = _split(tiles2 * top_k, triton.cdiv(inter // 8, bk8), device, per_sm)
    assert (per2 * bk8 * 8) % bn == 0, "a gate/up column tile must feed one down split"
    return tiles1, s1, per1, tiles2, s2, per2


def state_words(top_k: int, s2: int) -> int:
    """int32 words of zeroed state one launch uses (see the module docstring)."""
    return 2 + top_k + 2 * top_k * s2 + top_k


def norm_moe(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
             gate: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight, w_down: MoEWeight, top_k: int,
             renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, H] (model dtype or fp32), residual [1, H] | None -> (moe out [1, H] fp32, residual_out [1, H])."""
    assert supported(x, gate, top_k, w_gate, w_up, w_down), (x.shape, gate.shape, top_k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    dev, h = x.device, x.shape[1]
    e = gate.shape[0]
    _, bn, bk8, warps, stages, _ = DECODE_CONFIGS[CONFIG]
    (qg, zg, sg, _), k1, n1, gs1, ng1, *_ = weight_args(w_gate, bk8)
    (qu, zu, su, _), *_ = weight_args(w_up, bk8)
    (qd, zd, sd, _), k2, n2, gs2, ng2, *_ = weight_args(w_down, bk8)
    assert k1 == h and n2 == h and k2 == n1, (x.shape, k1, n1, k2, n2)
    tiles1, s1, per1, tiles2, s2, per2 = _geometry(h, n1, top_k, dev)
    dt = residual.dtype if residual is not None else x.dtype
    hn = torch.empty(1, h, dtype=dt, device=dev)
    res_out = torch.empty(1, h, dtype=dt, device=dev) if residual is not None else x
    logits = torch.empty(1, e, dtype=gate.dtype, device=dev)
    topk_w = torch.empty(top_k, dtype=torch.float32, device=dev)
    part = torch.empty(s1, top_k, 2 * n1, dtype=torch.float32, device=dev)   # [S1, k, 2I] gate | up partials
    out32 = torch.empty(1, h, dtype=torch.float32, device=dev)
    state = workspace.counters(dev, "moe_block", state_words(top_k, s2))
    route_in, ticket = _Variant.route_in, _Variant.ticket
    use_pdl = pdl(dev, 1)
    if route_in:
        active = state[2:2 + top_k]
    else:                                       # batch1's norm-route launch: hn, residual_out, routing, out32 zeros
        active = torch.empty(top_k, dtype=torch.int32, device=dev)
        ids = torch.empty(top_k, dtype=torch.int32, device=dev)
        batch1._norm_route_kernel[(e,)](
            x, residual if residual is not None else x, norm_weight, gate, hn, res_out, logits, topk_w, ids, active,
            out32, out32, workspace.counters(dev, "router", 1), h, e, 0, eps, TOP_K=top_k,
            BLOCK_K=next_pow2(top_k), BLOCK_H=next_pow2(h), BLOCK_E=next_pow2(e), RENORM=renormalize,
            HAS_RES=residual is not None, PDL=use_pdl, num_warps=batch1.NORM_ROUTE_WARPS, launch_pdl=use_pdl)
    grid = (e if route_in else 0) + top_k * (s1 * 2 * tiles1 + s2 * tiles2)
    _moe_block_kernel[(grid,)](
        x, residual if residual is not None else x, norm_weight, gate, hn, res_out, logits, topk_w,
        qg, zg, sg, qu, zu, su, qd, zd, sd, part, out32, state, active,
        h, e, n1, gs1, ng1, gs2, ng2, eps, tiles1, s1, per1, tiles2, s2, per2,
        TOP_K=top_k, BLOCK_K=next_pow2(top_k), BLOCK_H=next_pow2(h), BLOCK_E=next_pow2(e),
        BLOCK_S1=next_pow2(s1), BLOCK_N=bn, BLOCK_K8=bk8, RENORM=renormalize, HAS_RES=residual is not None,
        ROUTE_IN=route_in, TICKET=ticket, PDL=use_pdl, num_warps=warps, num_stages=stages, launch_pdl=use_pdl)
    return out32, res_out


def aot_configs(act: str, min_cc: int, block_s1: int = 8) -> list[AotConfig]:
    """The served shape (H 2048, E 128, k 8, the residual) at the split count of 132 SMs (S1 = 8)."""
    _, bn, bk8, warps, stages, _ = DECODE_CONFIGS[CONFIG]
    out: list[AotConfig] = []
    for renorm in (True, False):
        cx = dict(TOP_K=8, BLOCK_K=8, BLOCK_H=2048, BLOCK_E=128, BLOCK_S1=block_s1, BLOCK_N=bn, BLOCK_K8=bk8,
                  RENORM=renorm, HAS_RES=True, ROUTE_IN=True, TICKET=True, PDL=False)
        args = dict(x_ptr=f"*{act}", res_ptr=f"*{act}", nw_ptr=f"*{act}", gate_ptr=f"*{act}", h_ptr=f"*{act}",
                    res_out_ptr=f"*{act}", logits_ptr=f"*{act}", topk_w_ptr="*fp32",
                    qg_ptr="*i32", zg_ptr="*i32", sg_ptr="*fp16", qu_ptr="*i32", zu_ptr="*i32", su_ptr="*fp16",
                    qd_ptr="*i32", zd_ptr="*i32", sd_ptr="*fp16", part_ptr="*fp32", out32_ptr="*fp32",
                    state_ptr="*i32", active_ptr="*i32", H="i32", E="i32", I="i32", group1="i32", groups1="i32", group2="i32",
                    groups2="i32", eps="fp32", tiles1="i32", s1="i32", per1="i32", tiles2="i32", s2="i32",
                    per2="i32")
        out.append(AotConfig(_moe_block_kernel, signature(args, cx), cx, warps, stages, min_cc,
                             f"moe_block1[renorm={renorm},{act}]"))
    return out


__all__ = ["aot_configs", "norm_moe", "set_variant", "state_words", "supported"]
