"""The batch-1 MoE's two expert stages in ONE launch, by slices of the intermediate size (paths.batch1_moe_slices).

Same contract as stages.moe_stages at T = 1, given the routing of batch1.py's norm-route launch (ids and routed
weights of the token's k experts; out32 [1, H] fp32 zeroed by that launch): out32 += sum over the k experts of
w_e * (silu(x @ Wg[e]) * (x @ Wu[e])) @ Wd[e]. Nothing else is read or written (no gu, no active list). With
ROUTE (paths.batch1_slices_route) each program routes the token itself from that launch's router logits, as its
last program would have (decode.topk_slot_of: topk_of's choice, its own slot only), and the ids and weights are
neither written nor read. With NORM (paths.batch1_router_fold) there is no norm-route launch: x is the norm's fp32
input, each program normalises it itself and routes from the folded router's sums (router_fold.py).

Why: at batch 1 stages.py is two launches, gate/up into gu (fp32 atomics), then down (which needs every K
split of gu complete, so it waits for the whole first launch). That boundary is one more dependent step on the
decode chain. Here a program owns BLOCK_I rows of the intermediate size of ONE expert, ``(slice, slot)``:
  1. gate/up for its BLOCK_I columns over the whole input (K = H): nobody else contributes to them, so silu
     and the product follow at once, in registers: h [BLOCK_I] fp32;
  2. down for those BLOCK_I rows of Wd[e] (BLOCK_I / 8 packed rows, one quantization group: the host picks
     BLOCK_I to divide the group size), over all H outputs in chunks of BLOCK_H, times w_e, added to out32
     with fp32 atomics (the top-k sum and the sum over slices; order differs from stages.py only in fp32).
Grid: (ceil(I / BLOCK_I), k). Weight bytes are those of stages.py plus the down projection's scales and zeros,
read once per slice instead of once per expert; atomics: H per program.
The tile step is the batch-1 GEMV's (gptq_gemm/int4.gemv_tile_mac: scale and zero once per tile) where a K
tile lies in one group; a tile of several whole groups (g128 at the shipped BLOCK_K8) applies each group's scale
and zero once per packed row (int4.unit_sums / unit_combine on the tile's rows reshaped by group). int4 GPTQ
weights without act order (g_idx) only: ``supported``.
With fp16 inputs both dots run in packed fp16 (HALF2, paths.batch1_slices_half2, shipped on: int4.half2_dot8, two
weights an instruction, four fp16 products to a sum, the halves and the group's scale in fp32; h rounded to fp16
for the down), since the gate/up loop is bound by instructions where two programs share an SM.
The gate/up loop streams its tiles through Triton's software pipeline (cp.async into shared memory, STAGES deep)
on sm80+, and one tile ahead in registers below (``config(cc)``: one config per side of sm80).
Under PDL the program waits before its first load: the routing (or the logits) is the previous launch's output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels import paths
from onecard.kernels.activation.triton import silu_mul
from onecard.kernels.fused_moe.decode import topk_slot_of
from onecard.kernels.gptq_gemm.int4 import (
    gemv_tile_mac,
    half2_dot8,
    half2_zeros,
    input_pairs,
    row_input,
    row_words,
    unit_combine,
    unit_sums,
)
from onecard.kernels.norm.triton import inv_rms, residual_add
from onecard.kernels.triton_common import (
    AotConfig,
    next_pow2,
    pdl_enter,
    settle_cache_keys,
    signature,
    stamp,
    stamp_where,
)
from onecard.kernels.types import GPTQWeight, MoEWeight

# (BLOCK_I, BLOCK_K8, BLOCK_H, num_warps, stages) on sm80+ (SLICES_CONFIG) and below (SLICES_CONFIG_PRE_AMPERE;
# ``config(cc)`` picks, paths.pipelined_loads); stages: the gate/up loop's depth (kernel STAGES: 1, the next tile
# in registers; >= 2, Triton's cp.async pipeline, sm80+ only). BLOCK_I 32: 128-byte rows of gate/up tiles, 24
# slices x 8 experts = 192 programs at the served shape; BLOCK_K8 32 (pre-Ampere): a program's gate/up is 8 K
# tiles of 2 g128 groups, 8 KB a tile for gate and up together, the next one loading while one is multiplied
# (sm80+: 64, 4 tiles of 16 KB); its down 2 chunks of 16 KB, likewise. sm90 (JIT-aligned compile): 128 registers
# at 8 warps, so two programs per SM and the 192 in one wave; at BLOCK_H 1,024 the down tile's layout (outputs
# first, 8 warps along them) keeps a column's 4 packed rows in one thread: no CTA barrier in the down loop and
# 16-byte atomics (BLOCK_H 512: 9 barriers a chunk, 8-byte atomics). BLOCK_K8 64 in registers (stages 1) needs 254
# registers; through Triton's pipeline 128. Timed (H100, 2026-12-07, bench/run_h200.sh decode10; the figures are
# in paths.BATCH1_MOE_SLICES's comment and BENCHMARKS.md): BLOCK_I 16 on 4 warps ("slices16": 384 programs, twice
# the atomics) lost in the full model; of the other configs the "norm_moe T=1 slices" rows of bench/kernels_gpu.py
# try, only (16, 64, 1024, 8, 1) was faster alone (23.4 against 24.5 µs), and it lost in the model ("slices1664":
# batch 1 at 512 tokens 457.1 -> 440.3 tok/s, at 32k 307.7 -> 299.2; H100, 2026-12-07). The rows alone replay 20
# copies of one layer, whose 19 MB of routed experts then sit in the 50 MB L2: not the model's cold reads.
# sm80+ since 2026-12-07: the gate/up loop pipelined 3 deep (stages 3: sm90 98 registers, 17.5 KB shared), the
# down's first chunk loaded after it. Measured (H100, bench/run_h200.sh decode12, one engine, alternating, medians
# of 3; BENCHMARKS.md), batch 1 at 512 / 32k tokens: stages 1 456.5 / 306.2 tok/s; stages 3 472.9 / 314.6 (+3.6% /
# +2.8%; the down's first chunk before the loop: 467.8 / 313.1; with an L2 prefetch 458.2 / 308.6; both removed);
# BLOCK_I 16 on 4 warps (384 programs, 3 an SM: the busiest SM issues ~20% fewer instructions by the SASS counts)
# 466.4 / 303.3, with BLOCK_K8 64 467.0 / 308.8: balance did not pay. The same greedy tokens throughout.
# BLOCK_K8 64 on sm80+ since 2026-12-07 (after the router fold): 4 gate/up steps of 16 KB, two in flight through
# shared memory (sm90 128 registers, 37 KB shared: still two programs an SM). bench/run_h200.sh decode14 (H100, one
# engine, alternating, medians of 3), batch 1 at 512 / 32k tokens: BLOCK_K8 32 476.9 / 314.9 tok/s, 64 481.9 /
# 316.8 (+1.1% / +0.6%); in the other order 479.7 / 315.6 against 482.4 / 316.9; the shipped tile 4 deep 476.3 /
# 314.0, BLOCK_K8 64 4 deep 474.2 / 314.0. The same greedy tokens.
SLICES_CONFIG = (32, 64, 1024, 8, 3)
SLICES_CONFIG_PRE_AMPERE = (32, 32, 1024, 8, 1)      # no cp.async: stages 1 (sm70: 128 registers, no spill)
# The TRACE variant's stamps (bench/slices_trace.py): a program's row of TRACE_SLOTS int64, fields in this order:
# %clock64 at each phase boundary, then (%globaltimer, SM) after the wait and at the end
TRACE_SLOTS = 12
TRACE_FIELDS = ("start", "waited", "routed", "gate_up", "h", "down0", "end", "t_waited_ns", "sm", "t_end_ns", "sm_end")
_TRACE_ROW = tl.constexpr(TRACE_SLOTS)
# Measured and removed (H100, 2026-12-07; BENCHMARKS.md): an L2 prefetch of the next gate/up tiles and of the whole
# down projection (prefetch.global.L2, 3 tiles ahead: 458.2 against 472.9 tok/s at batch 1, 512 tokens), and the
# down's first chunk loaded before the pipelined gate/up loop (467.8).


@triton.jit
def _slice_input(hj, r, j: tl.constexpr, r_mask):
    """Column j of inputs already in registers (_columns_of), an INPUT of gemv_tile_mac: the down projection's
    fp32 [BI8] inputs 8r + j (the program's own h; rows past I are zeros already), or a pipelined gate/up tile's
    [BK8] (_x_columns; rows past H zeros)."""
    return hj[j]


@triton.jit
def _columns_of(h, BI8: tl.constexpr):
    """h [8 * BI8] -> its 8 columns as a tuple of [BI8] (column j: h[8p + j]), by three halvings of the reshaped
    row (register moves, no reduction)."""
    a0, a1 = tl.split(tl.reshape(h, (BI8, 4, 2)))                        # j % 2 = 0, 1: [BI8, 4]
    b00, b01 = tl.split(tl.reshape(a0, (BI8, 2, 2)))                      # j = 0, 2 | 4, 6 by j // 2 % 2
    b10, b11 = tl.split(tl.reshape(a1, (BI8, 2, 2)))                      # j = 1, 3 | 5, 7
    c000, c001 = tl.split(b00)                                            # j = 0, 4
    c010, c011 = tl.split(b01)                                            # j = 2, 6
    c100, c101 = tl.split(b10)                                            # j = 1, 5
    c110, c111 = tl.split(b11)                                            # j = 3, 7
    return c000, c100, c010, c110, c001, c101, c011, c111


@triton.jit
def _gate_up_load(q_ptr, s_ptr, z_ptr, r0, k8, offs_r, offs_i, i_mask, I, num_groups, GROUP_K8: tl.constexpr,
                  TILE_GROUPS: tl.constexpr):
    """One expert's gate or up K tile at packed rows r0 + [0, BK8) (pointers at the expert; rows past k8 are 0):
    (q [BK8, BI] int32, scales, packed zeros of its TILE_GROUPS groups: [BI] for one, else [TILE_GROUPS, BI])."""
    r = r0 + offs_r
    q_ptrs = q_ptr + r[:, None] * I + offs_i[None, :]
    q = tl.load(q_ptrs, mask=(r < k8)[:, None] & i_mask[None, :], other=0)
    if TILE_GROUPS == 1:
        g = tl.minimum(r0 // GROUP_K8, num_groups - 1)
        s = tl.load(s_ptr + g * I + offs_i, mask=i_mask, other=0.0)
        zp = tl.load(z_ptr + g * (I // 8) + offs_i // 8, mask=i_mask, other=0)
    else:
        g = r0 // GROUP_K8 + tl.arange(0, TILE_GROUPS)                    # [TG]
        m = (g < num_groups)[:, None] & i_mask[None, :]
        s = tl.load(s_ptr + g[:, None] * I + offs_i[None, :], mask=m, other=0.0)
        zp = tl.load(z_ptr + g[:, None] * (I // 8) + (offs_i // 8)[None, :], mask=m, other=0)
    return q, s, zp


@triton.jit
def _gate_up_mac(acc, q, s, zp, src, INPUT: tl.constexpr, r0, k8, offs_r, z_shift, BLOCK_K8: tl.constexpr,
                 BLOCK_I: tl.constexpr, GROUP_K8: tl.constexpr, TILE_GROUPS: tl.constexpr):
    """acc += x rows 8r + j times a tile of _gate_up_load (r = r0 + [0, BK8)): acc [BK8, BI] (one group a tile) or
    [TILE_GROUPS, GROUP_K8, BI] (the tile's rows by group, each group's scale and zero applied once per row). The
    inputs: INPUT(src, r, j, r_mask) (int4.row_input on x's pointer, or _slice_input on _x_columns')."""
    r = r0 + offs_r
    r_mask = r < k8
    if TILE_GROUPS == 1:
        z = ((zp >> z_shift) & 0xF).to(tl.float32)
        acc = gemv_tile_mac(acc, q, s.to(tl.float32), z, src, r, r_mask, INPUT, BLOCK_K8, BLOCK_I)
    else:
        z = ((zp >> z_shift[None, :]) & 0xF).to(tl.float32)              # [TG, BI]
        ux, xs = unit_sums(q, src, r, r_mask, INPUT, BLOCK_K8, BLOCK_I)
        acc += unit_combine(tl.reshape(ux, (TILE_GROUPS, GROUP_K8, BLOCK_I)),
                            tl.reshape(xs, (TILE_GROUPS, GROUP_K8))[:, :, None],
                            s.to(tl.float32)[:, None, :], z[:, None, :])
    return acc


@triton.jit
def _x_columns(x_ptr, r0, k8, offs_r, BLOCK_K8: tl.constexpr):
    """The tile's inputs x[8r + j], r = r0 + [0, BK8), as 8 fp32 columns [BK8] (_columns_of; rows past k8 are
    zeros) from ONE load of its 16-byte rows (int4.row_words: streamed with the weights in a pipelined loop, where
    row_input's eight 2-byte loads a column each wait on L1/L2 inside the loop)."""
    r = r0 + offs_r
    DT: tl.constexpr = x_ptr.dtype.element_ty
    if DT.primitive_bitwidth == 16:
        pairs = row_words(x_ptr, r, r < k8)                               # [BK8, 4]: x[8r + 2c], x[8r + 2c + 1]
        lo = (pairs & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
        hi = (pairs >> 16).to(tl.int16).to(DT, bitcast=True)
        xt = tl.join(lo, hi)                                              # [BK8, 4, 2]: x[8r + 2c + h]
    else:                                                                 # fp32 x (tests): 4 bytes an element
        xt = tl.load(x_ptr + r[:, None] * 8 + tl.arange(0, 8)[None, :], mask=(r < k8)[:, None], other=0.0)
    return _columns_of(tl.reshape(xt.to(tl.float32), (BLOCK_K8 * 8,)), BLOCK_K8)


@triton.jit
def _h_pairs(h, BI8: tl.constexpr):
    """h fp32 [8 * BI8] (the slice's rows; zeros past I) rounded to fp16 -> the down's inputs as half2_dot8's pairs
    (h[8p + k], h[8p + k + 4]), k = 0..3, int32 [BI8] each."""
    b = h.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF   # [8 BI8]: the fp16 bits
    lo, hi = tl.split(tl.permute(tl.reshape(b, (BI8, 2, 4)), (0, 2, 1)))   # [BI8, 4] each: 8p + k, 8p + k + 4
    even, odd = tl.split(tl.reshape(lo | (hi << 16), (BI8, 2, 2)))        # k = 0, 2 | k = 1, 3
    p0, p2 = tl.split(even)
    p1, p3 = tl.split(odd)
    return p0, p1, p2, p3


@triton.jit
def _gate_up_h2(acc, q, s, zp, xp, z_shift, BLOCK_K8: tl.constexpr, BLOCK_I: tl.constexpr, GROUP_K8: tl.constexpr,
                TILE_GROUPS: tl.constexpr):
    """_gate_up_mac in packed fp16 (kernel HALF2): acc (its shapes) += s * sum_j (n_j - z) x_j per packed row and
    column, the sum by int4.half2_dot8 (four products a half in fp16, exact n - z), the scale once per packed row
    in fp32; xp: int4.input_pairs of the tile's rows."""
    if TILE_GROUPS == 1:
        zz = half2_zeros((zp >> z_shift) & 0xF)                           # [BI]
        d = half2_dot8(q, xp[0][:, None], xp[1][:, None], xp[2][:, None], xp[3][:, None], zz[None, :])
        acc += d * s.to(tl.float32)[None, :]                              # [BK8, BI]
    else:
        zz = half2_zeros((zp >> z_shift[None, :]) & 0xF)                  # [TG, BI]
        q3 = tl.reshape(q, (TILE_GROUPS, GROUP_K8, BLOCK_I))
        G3: tl.constexpr = (TILE_GROUPS, GROUP_K8)                       # the tile's rows by group
        d = half2_dot8(q3, tl.reshape(xp[0], G3)[:, :, None], tl.reshape(xp[1], G3)[:, :, None],
                       tl.reshape(xp[2], G3)[:, :, None], tl.reshape(xp[3], G3)[:, :, None], zz[:, None, :])
        acc += d * s.to(tl.float32)[:, None, :]                           # [TG, GROUP_K8, BI]
    return acc


@triton.jit
def _down_load(q_ptr, s_ptr, z_ptr, g, n0, offs_p, p_mask, H, live, BLOCK_H: tl.constexpr):
    """The slice's down chunk at output columns n0 + [0, BH) (nothing past H, nothing at all unless live): (q [BI8,
    BH] int32, scales [BH], packed zeros [BH] of group g)."""
    offs_n = n0 + tl.arange(0, BLOCK_H)
    n_mask = (offs_n < H) & live
    # loaded as [BH, BI8] (outputs first): a thread's 16-byte vectors run along the outputs and it holds every
    # packed row of its columns, so the sum over the rows stays in the thread
    q = tl.trans(tl.load(q_ptr + offs_p[None, :] * H + offs_n[:, None], mask=p_mask[None, :] & n_mask[:, None],
                         other=0))
    s = tl.load(s_ptr + g * H + offs_n, mask=n_mask, other=0.0)
    zp = tl.load(z_ptr + g * (H // 8) + offs_n // 8, mask=n_mask, other=0)
    return q, s, zp


@triton.jit
def _moe_slices_kernel(x_ptr, out_ptr, qg_ptr, zg_ptr, sg_ptr, qu_ptr, zu_ptr, su_ptr, qd_ptr, zd_ptr, sd_ptr,
                       ids_ptr, topk_w_ptr, logits_ptr, trace_ptr, H, I, ng1, gs2, ng2, E,
                       res_ptr, nw_ptr, xs_ptr, res_out_ptr, eps,
                       BLOCK_I: tl.constexpr, BLOCK_K8: tl.constexpr, BLOCK_H: tl.constexpr,
                       GROUP_K8: tl.constexpr, PDL: tl.constexpr, ROUTE: tl.constexpr = False,
                       TOP_K: tl.constexpr = 8, BLOCK_E: tl.constexpr = 128,
                       RENORM: tl.constexpr = True, TRACE: tl.constexpr = False, NUM_WARPS: tl.constexpr = 8,
                       STAGES: tl.constexpr = 1,
                       NORM: tl.constexpr = False, BLOCK_HN: tl.constexpr = 1, HALF2: tl.constexpr = False):
    """Program (slice, slot): out[n] += w * sum_i h[i] Wd[e][i, n] over the slice's rows i, h = silu(x @ Wg[e][:, i])
    * (x @ Wu[e][:, i]), e = ids[slot], w = topk_w[slot]. x [1, H] model dtype; out [1, H] fp32. GROUP_K8: packed
    rows per gate/up group (a power of two; the input size or more: one group). ROUTE (paths.batch1_slices_route):
    e and w come from the router's logits [E] (the previous launch's), by the program's own softmax and top-k
    (decode.topk_slot_of: topk_of's keys, its own slot only, NUM_WARPS = the launch's warps, one row of logits
    each), instead of ids / topk_w.
    STAGES: the gate/up loop's depth. 1: each step loads the next tile into registers before it multiplies the
    current one (one tile in flight; Triton pipelines a loop without tl.dot only when asked). >= 2 (sm80+,
    paths.pipelined_loads): the loop asks (tl.range num_stages), so Triton's software pipeline streams the tiles by
    cp.async into a ring of STAGES - 1 tiles in shared memory (8.75 KB each at the served shape), STAGES - 1 in
    flight, and holds none in registers (sm90: 98 registers against 124); the tile's inputs come with it
    (_x_columns). The down loop (2 chunks at the served shape) keeps its one chunk ahead in registers.
    TRACE (bench/slices_trace.py only): the program's phase boundaries into trace_ptr [programs, TRACE_SLOTS] int64
    (TRACE_FIELDS: %clock64 cycles, then %globaltimer ns and the SM after the wait and at the end).
    NORM (with ROUTE; paths.batch1_router_fold, router_fold.py): x_ptr holds the post-attention norm's input sums
    (fp32 [H]) and logits_ptr the folded router's sums (fp32 [E]); each program adds the residual (res_ptr),
    normalises (nw_ptr, eps) into its own row of xs_ptr [programs, H] (model dtype) that its gate/up then read,
    stores its share of the new residual (res_out_ptr) and routes from rstd * those sums rounded to the model
    dtype (the logits the norm-route launch would have stored).
    HALF2 (paths.batch1_slices_half2; fp16 inputs): the gate/up tiles' and the down's dots in packed fp16
    (int4.half2_dot8: _gate_up_h2 in either loop on int4.input_pairs' inputs; the down on h rounded to fp16,
    _h_pairs)."""
    pid_i = tl.program_id(0)
    slot = tl.program_id(1)
    BI8: tl.constexpr = BLOCK_I // 8
    TG: tl.constexpr = BLOCK_K8 // GROUP_K8 if BLOCK_K8 > GROUP_K8 else 1  # groups per gate/up K tile
    if TRACE:
        tr = trace_ptr + (slot * tl.num_programs(0) + pid_i) * _TRACE_ROW
        stamp(tr, pid_i)                                                  # 0: started (before the PDL wait)
    if NORM:
        tl.static_assert(ROUTE, "NORM routes from the folded sums")
        offs_hn = tl.arange(0, BLOCK_HN)
        m_hn = offs_hn < H
        nw = tl.load(nw_ptr + offs_hn, mask=m_hn, other=0.0).to(tl.float32)   # a weight: before the wait
    pdl_enter(PDL)
    if TRACE:
        stamp(tr + 1, pid_i)                                              # 1: the previous launch complete
        stamp_where(tr + 7, pid_i)
    if ROUTE:
        # the logits once per warp (topk_slot_of: every reduction inside a warp), loaded first: with NORM their L2
        # round trip overlaps the norm's
        offs_e = tl.arange(0, BLOCK_E)
        reps = tl.arange(0, NUM_WARPS)
        lg = tl.load(logits_ptr + reps[:, None] * 0 + offs_e[None, :], mask=(offs_e < E)[None, :],
                     other=-float("inf"), cache_modifier=".cg")            # [NUM_WARPS, BE]
    if NORM:
        # the norm of the token's row (every program: 2 rows of 4-8 KB from L2), into this program's own x row
        RDT: tl.constexpr = res_out_ptr.dtype.element_ty
        r = residual_add(x_ptr, res_ptr, 0, H, H, offs_hn, m_hn, RDT, True)   # [BHN] model dtype
        hf = r.to(tl.float32)
        rstd = inv_rms(hf, H, eps)
        prog = slot * tl.num_programs(0) + pid_i
        x_in = xs_ptr + prog.to(tl.int64) * H
        tl.store(x_in + offs_hn, (hf * rstd * nw).to(RDT), mask=m_hn)
        share = tl.cdiv(H, tl.num_programs(0) * tl.num_programs(1))
        tl.store(res_out_ptr + offs_hn, r, mask=m_hn & (offs_hn >= prog * share) & (offs_hn < prog * share + share))
        tl.debug_barrier()                                                # the row, stored, before any load of it
    else:
        x_in = x_ptr
    if ROUTE:                                                             # this slot's expert and weight
        if NORM:                                                          # the logits as norm-route stores them
            lg = (lg * rstd).to(res_out_ptr.dtype.element_ty)
        e, w_e = topk_slot_of(lg.to(tl.float32), offs_e, E, slot, TOP_K, BLOCK_E, RENORM)
        e = e.to(tl.int64)
    else:
        e = tl.load(ids_ptr + slot, cache_modifier=".cg").to(tl.int64)
        w_e = tl.load(topk_w_ptr + slot, cache_modifier=".cg")
    if TRACE:
        stamp(tr + 2, e)                                                  # 2: routed (this slot's expert known)
    k8 = H // 8
    i8 = I // 8
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)                      # [BI] gate/up columns
    i_mask = offs_i < I
    zs_i = (offs_i % 8) * 4
    offs_r = tl.arange(0, BLOCK_K8)
    qg, qu = qg_ptr + e * k8 * I, qu_ptr + e * k8 * I
    sg, su = sg_ptr + e * ng1 * I, su_ptr + e * ng1 * I
    zg, zu = zg_ptr + e * ng1 * i8, zu_ptr + e * ng1 * i8
    offs_p = pid_i * BI8 + tl.arange(0, BI8)                              # [BI8] the slice's packed down rows
    p_mask = offs_p < i8
    g2 = tl.minimum((pid_i * BLOCK_I) // gs2, ng2 - 1)                    # their one group
    qd = qd_ptr + e * i8 * H
    sd = sd_ptr + e * ng2 * H
    zd = zd_ptr + e * ng2 * (H // 8)
    if STAGES == 1:
        q_g, s_g, z_g = _gate_up_load(qg, sg, zg, 0, k8, offs_r, offs_i, i_mask, I, ng1, GROUP_K8, TG)
        q_u, s_u, z_u = _gate_up_load(qu, su, zu, 0, k8, offs_r, offs_i, i_mask, I, ng1, GROUP_K8, TG)
    # 1. gate and up for the slice's BI columns over every input: the sums are complete in this program
    if TG == 1:                                                           # row sums deferred past the loop
        acc_g = tl.zeros((BLOCK_K8, BLOCK_I), dtype=tl.float32)
    else:
        acc_g = tl.zeros((TG, GROUP_K8, BLOCK_I), dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    # 0 for every real shape, but not to the compiler: with the rows r0 + offs_r (r0 counting up from 0) it proves
    # them non-negative and folds unit_bits' 1.0 into an immediate, so unit_nibble's and-or becomes two LOP3s a
    # weight instead of one (sm90 SASS of the gate/up loop: 506 -> 441 instructions for 64 weights a thread)
    hide = k8 >> 31
    # programs start their down on different chunks (the slice and the slot pick it), so that the 192 programs'
    # fp32 atomics spread over all of out's lines at once rather than all hitting the first chunk's
    n_ch = tl.cdiv(H, BLOCK_H)
    c0 = (pid_i + slot) % n_ch
    if STAGES > 1:                                                        # Triton's cp.async ring (sm80+)
        for r0 in tl.range(0, k8, BLOCK_K8, num_stages=STAGES):
            q_g, s_g, z_g = _gate_up_load(qg, sg, zg, r0, k8, offs_r, offs_i, i_mask, I, ng1, GROUP_K8, TG)
            q_u, s_u, z_u = _gate_up_load(qu, su, zu, r0, k8, offs_r, offs_i, i_mask, I, ng1, GROUP_K8, TG)
            if HALF2:
                xp = input_pairs(x_in, r0 + offs_r, r0 + offs_r < k8)     # 4 x [BK8] int32: the tile's inputs
                acc_g = _gate_up_h2(acc_g, q_g, s_g, z_g, xp, zs_i, BLOCK_K8, BLOCK_I, GROUP_K8, TG)
                acc_u = _gate_up_h2(acc_u, q_u, s_u, z_u, xp, zs_i, BLOCK_K8, BLOCK_I, GROUP_K8, TG)
            else:
                xj = _x_columns(x_in, r0, k8, offs_r, BLOCK_K8)           # 8 x [BK8]: gate's and up's inputs
                acc_g = _gate_up_mac(acc_g, q_g, s_g, z_g, xj, _slice_input, r0 + hide, k8, offs_r, zs_i, BLOCK_K8,
                                     BLOCK_I, GROUP_K8, TG)
                acc_u = _gate_up_mac(acc_u, q_u, s_u, z_u, xj, _slice_input, r0 + hide, k8, offs_r, zs_i, BLOCK_K8,
                                     BLOCK_I, GROUP_K8, TG)
    else:                                                                 # the next tile in registers
        for r0 in range(0, k8, BLOCK_K8):
            nq_g, ns_g, nz_g = _gate_up_load(qg, sg, zg, r0 + BLOCK_K8, k8, offs_r, offs_i, i_mask, I, ng1, GROUP_K8,
                                             TG)
            nq_u, ns_u, nz_u = _gate_up_load(qu, su, zu, r0 + BLOCK_K8, k8, offs_r, offs_i, i_mask, I, ng1, GROUP_K8,
                                             TG)
            if HALF2:
                xp = input_pairs(x_in, r0 + offs_r, r0 + offs_r < k8)
                acc_g = _gate_up_h2(acc_g, q_g, s_g, z_g, xp, zs_i, BLOCK_K8, BLOCK_I, GROUP_K8, TG)
                acc_u = _gate_up_h2(acc_u, q_u, s_u, z_u, xp, zs_i, BLOCK_K8, BLOCK_I, GROUP_K8, TG)
            else:
                acc_g = _gate_up_mac(acc_g, q_g, s_g, z_g, x_in, row_input, r0 + hide, k8, offs_r, zs_i, BLOCK_K8,
                                     BLOCK_I, GROUP_K8, TG)
                acc_u = _gate_up_mac(acc_u, q_u, s_u, z_u, x_in, row_input, r0 + hide, k8, offs_r, zs_i, BLOCK_K8,
                                     BLOCK_I, GROUP_K8, TG)
            q_g, s_g, z_g, q_u, s_u, z_u = nq_g, ns_g, nz_g, nq_u, ns_u, nz_u
    if TRACE:                                                             # 3: the gate/up loop done
        stamp(tr + 3, tl.max(tl.reshape(acc_u, (BLOCK_K8 * BLOCK_I,)), axis=0).to(tl.int32))
    # the down's first chunk, requested before the sums are reduced and h is laid out for the down (~40 CTA
    # barriers on sm90). Requested before the one-ahead loop, it is sunk here by the compiler anyway (sm90 SASS).
    q_d, s_d, z_d = _down_load(qd, sd, zd, g2, c0 * BLOCK_H, offs_p, p_mask, H, True, BLOCK_H)
    # the column sums of gate and up in one cross-warp reduction: [BK8, BI, 2] -> [BI, 2]
    gate, up = tl.split(tl.sum(tl.join(tl.reshape(acc_g, (BLOCK_K8, BLOCK_I)), tl.reshape(acc_u, (BLOCK_K8, BLOCK_I))),
                               axis=0))
    h = silu_mul(gate, up)                                                # [BI] fp32
    if HALF2:
        hj = _h_pairs(tl.where(i_mask, h, 0.0), BI8)                      # 4 x [BI8] int32: fp16 input pairs
    else:
        hj = _columns_of(tl.where(i_mask, h, 0.0), BI8)                   # 8 x [BI8]: input 8p + j of the down
    if TRACE:                                                             # 4: h in the down's layout
        stamp(tr + 4, tl.max(hj[0], axis=0).to(tl.int32))
    # 2. down: the slice's BI8 packed rows of Wd[e], every output column, times w_e, into out (fp32 atomics)
    for c in range(n_ch):
        n0 = ((c0 + c) % n_ch) * BLOCK_H
        nq_d, ns_d, nz_d = _down_load(qd, sd, zd, g2, ((c0 + c + 1) % n_ch) * BLOCK_H, offs_p, p_mask, H,
                                      c + 1 < n_ch, BLOCK_H)
        offs_n = n0 + tl.arange(0, BLOCK_H)
        z = (z_d >> ((offs_n % 8) * 4)) & 0xF                             # [BH] the true zeros
        if HALF2:                                                         # [BI8, BH] of sum_j (n_j - z) h_j
            d = half2_dot8(q_d, hj[0][:, None], hj[1][:, None], hj[2][:, None], hj[3][:, None],
                           half2_zeros(z)[None, :])
            part = tl.sum(d, axis=0) * (s_d.to(tl.float32) * w_e)
        else:
            acc = gemv_tile_mac(tl.zeros((BI8, BLOCK_H), dtype=tl.float32), q_d, s_d.to(tl.float32),
                                z.to(tl.float32), hj, offs_p, p_mask, _slice_input, BI8, BLOCK_H)
            part = tl.sum(acc, axis=0) * w_e
        tl.atomic_add(out_ptr + offs_n, part, mask=offs_n < H, sem="relaxed")
        q_d, s_d, z_d = nq_d, ns_d, nz_d
        if TRACE:  # noqa: SIM102  (a compile-time branch around a runtime one)
            if c == 0:                                                    # 5: the first down chunk issued
                stamp(tr + 5, tl.max(part, axis=0).to(tl.int32))
    if TRACE:                                                             # 6: the last chunk's atomics issued
        last = stamp(tr + 6, pid_i)
        stamp_where(tr + 9, last.to(tl.int32))


def slice_rows(w_down: GPTQWeight, block_i: int) -> int:
    """BLOCK_I for this down projection: at most ``block_i``, a power of two >= 8 that divides its group size
    (a slice's rows must lie in one group); 0 when none does."""
    bi = block_i
    while bi >= 8 and w_down.group_size % bi != 0 and w_down.group_size < w_down.in_features:
        bi //= 2
    return bi if bi >= 8 else 0


def group_k8(w: GPTQWeight) -> int:
    """GROUP_K8: packed rows per group of a gate/up weight (the whole input when it is one group); 0 when that is
    not a power of two (the kernel's K tiles hold whole groups or lie in one)."""
    g8 = min(w.group_size, w.in_features) // 8
    return g8 if g8 > 0 and g8 & (g8 - 1) == 0 and min(w.group_size, w.in_features) % 8 == 0 else 0


def config(cc: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_I, BLOCK_K8, BLOCK_H, num_warps, stages) on compute capability cc: SLICES_CONFIG where Triton can
    pipeline loads through shared memory (paths.pipelined_loads), else SLICES_CONFIG_PRE_AMPERE (read at the call:
    benchmarks and tests replace them here)."""
    return SLICES_CONFIG if paths.pipelined_loads(cc) else SLICES_CONFIG_PRE_AMPERE


def supported(w_gate: MoEWeight, w_up: MoEWeight, w_down: MoEWeight) -> bool:
    """int4 GPTQ experts without act order, gate/up groups of a power of two packed rows (or one group), a down
    projection that slice_rows can cut (at either config's BLOCK_I)."""
    ws = (w_gate, w_up, w_down)
    return (all(isinstance(w, GPTQWeight) and w.g_idx is None for w in ws)
            and w_gate.group_size == w_up.group_size and group_k8(w_gate) > 0
            and min(slice_rows(w_down, c[0]) for c in (SLICES_CONFIG, SLICES_CONFIG_PRE_AMPERE)) > 0)


def moe_slices(x: torch.Tensor, out32: torch.Tensor, w_gate: GPTQWeight, w_up: GPTQWeight, w_down: GPTQWeight,
               topk_ids: torch.Tensor, topk_w: torch.Tensor, top_k: int, use_pdl: bool,
               logits: torch.Tensor | None = None, renormalize: bool = True,
               trace: torch.Tensor | None = None,
               norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None) -> None:
    """out32 [1, H] fp32 += the k experts' outputs; x [1, H] model dtype; topk_ids int32 / topk_w fp32 [1, k] (or
    [k]) written by the previous launch, or, given ``logits`` [1, E] (the router's, written by the previous
    launch; ``renormalize`` as the model's), the kernel routes itself and the two are not read. The config is
    ``config``'s at the call. ``trace``: int64 [programs, TRACE_SLOTS] (``grid``), filled with the kernel's TRACE
    stamps (bench/slices_trace.py). ``norm`` = (residual [1, H], norm weight [H], eps, residual_out [1, H]), with
    ``logits`` (the kernel's NORM; paths.batch1_router_fold): x is the norm's fp32 input sums and ``logits`` the
    folded router's fp32 sums (router_fold.FoldedRoute.raw); the programs add the residual, store the new one
    into residual_out and normalise x themselves."""
    assert supported(w_gate, w_up, w_down) and x.shape[0] == 1, x.shape
    cc = paths.capability(x.device)
    bi, bk8, bh, warps, stages = config(cc)
    assert stages == 1 or paths.pipelined_loads(cc), (cc, stages)   # below, Triton would load each tile in place
    bi = slice_rows(w_down, bi)
    h, inter = w_gate.in_features, w_gate.out_features
    assert w_down.in_features == inter and w_down.out_features == h == x.shape[1], (x.shape, inter)
    for w in (w_gate, w_up, w_down):
        assert w.qweight.is_contiguous() and w.qzeros.is_contiguous() and w.scales.is_contiguous()
    e = int(w_gate.qweight.shape[0])
    route = dict(ROUTE=True, TOP_K=top_k, BLOCK_E=next_pow2(e), RENORM=renormalize) \
        if logits is not None else {}
    if trace is not None:
        assert trace.dtype == torch.int64 and trace.shape == (grid(w_gate, w_down, top_k, cc), TRACE_SLOTS)
    n_slices = triton.cdiv(inter, bi)
    if norm is not None:
        residual, nw, eps, res_out = norm
        assert logits is not None and logits.dtype == torch.float32 and x.dtype == torch.float32, (logits, x.dtype)
        assert residual.is_contiguous() and res_out.is_contiguous() and res_out.dtype == residual.dtype
        xs = torch.empty(n_slices * top_k, h, dtype=residual.dtype, device=x.device)   # each program's own row
        nargs = (residual, nw, xs, res_out, float(eps))
        route.update(NORM=True, BLOCK_HN=next_pow2(h))
    else:
        nargs = (out32, out32, out32, out32, 0.0)                         # unused without NORM
    # the gate/up dot in packed fp16 needs fp16 inputs: x, or with NORM the rows the programs normalise into
    half2 = paths.batch1_slices_half2() and (norm[0] if norm is not None else x).dtype == torch.float16
    _moe_slices_kernel[(n_slices, top_k)](
        x, out32, w_gate.qweight, w_gate.qzeros, w_gate.scales, w_up.qweight, w_up.qzeros, w_up.scales,
        w_down.qweight, w_down.qzeros, w_down.scales, topk_ids, topk_w, logits if logits is not None else topk_w,
        trace if trace is not None else topk_w, h, inter, w_gate.num_groups, w_down.group_size,
        w_down.num_groups, e, *nargs, BLOCK_I=bi, BLOCK_K8=bk8, BLOCK_H=bh, GROUP_K8=group_k8(w_gate), PDL=use_pdl,
        TRACE=trace is not None, NUM_WARPS=warps, STAGES=stages, num_warps=warps, num_stages=stages,
        HALF2=half2, launch_pdl=use_pdl, **route)


def grid(w_gate: GPTQWeight, w_down: GPTQWeight, top_k: int, cc: int) -> int:
    """Programs of a moe_slices launch on compute capability cc (slices x k)."""
    return triton.cdiv(w_gate.out_features, slice_rows(w_down, config(cc)[0])) * top_k


def slices_aot_configs(act: str, min_cc: int) -> list[AotConfig]:
    """The pre-Ampere config (every target) with the served g128 weights (GROUP_K8 16) and with groups of 32
    (GROUP_K8 4), g128 routing itself from the logits (paths.batch1_slices_route; E 128, k 8, renormalised); the
    sm80+ config (named "sm80+", from sm80) routing itself; both configs routing from the folded router's sums and
    normalising their input (NORM, paths.batch1_router_fold; H 2048), also with the dots in packed fp16 (HALF2,
    paths.batch1_slices_half2; fp16 only)."""
    out: list[AotConfig] = []
    pre, amp = SLICES_CONFIG_PRE_AMPERE, SLICES_CONFIG
    for cfg, g8, route, norm, h2 in (
            (pre, 16, False, False, False), (pre, 4, False, False, False), (pre, 16, True, False, False),
            (amp, 16, True, False, False), (pre, 16, True, True, False), (amp, 16, True, True, False),
            (pre, 16, True, True, True), (amp, 16, True, True, True)):
        if h2 and act != "fp16":
            continue
        bi, bk8, bh, warps, st = cfg
        cx = dict(BLOCK_I=bi, BLOCK_K8=bk8, BLOCK_H=bh, GROUP_K8=g8, PDL=False, ROUTE=route, TOP_K=8, BLOCK_E=128,
                  RENORM=True, TRACE=False, NUM_WARPS=warps, STAGES=st, NORM=norm, BLOCK_HN=2048 if norm else 1,
                  HALF2=h2)
        args = dict(x_ptr="*fp32" if norm else f"*{act}", out_ptr="*fp32", qg_ptr="*i32", zg_ptr="*i32",
                    sg_ptr="*fp16", qu_ptr="*i32",
                    zu_ptr="*i32", su_ptr="*fp16", qd_ptr="*i32", zd_ptr="*i32", sd_ptr="*fp16", ids_ptr="*i32",
                    topk_w_ptr="*fp32", logits_ptr=f"*{act}" if route and not norm else "*fp32",
                    trace_ptr="*fp32", H="i32", I="i32", ng1="i32", gs2="i32", ng2="i32", E="i32",
                    res_ptr=f"*{act}", nw_ptr=f"*{act}",
                    xs_ptr=f"*{act}", res_out_ptr=f"*{act}", eps="fp32")
        cc0 = max(min_cc, paths.PIPELINED_LOADS_MIN_CC) if cfg is amp else min_cc
        out.append(AotConfig(_moe_slices_kernel, signature(args, cx), cx, warps, st, cc0,
                             f"moe_slices[g{8 * g8},{'route,' if route else ''}{'norm,' if norm else ''}"
                             f"{'half2,' if h2 else ''}"
                             f"{'sm80+,' if cfg is amp else ''}{f'stages{st},' if st > 1 else ''}{act}]"))
    return out


__all__ = ["SLICES_CONFIG", "SLICES_CONFIG_PRE_AMPERE", "TRACE_FIELDS", "TRACE_SLOTS", "config", "grid", "moe_slices",
           "slice_rows", "slices_aot_configs", "supported"]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
