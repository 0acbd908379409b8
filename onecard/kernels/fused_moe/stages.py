"""The two expert stages of the decode-sized fused MoE (T <= decode.DECODE_MAX_TOKENS), shared by decode.py
and batch1.py.

One kernel, ``_moe_decode_kernel``, launched twice by ``moe_stages`` after a routing launch wrote the top-k
ids, routed weights and the compact ``active`` list (expert + 1 per slot; 0: the slot idles):
  1. gate/up: grid (2 * I/BN column tiles, split-K, active slot). A program dequantizes one [BK8, BN] int32
     tile per K step (16-byte loads along N, scales/zeros once per group) of ONE expert and multiplies it with
     the rows of every token routed to that expert (tl.dot over a 16-row token block when T > 1, so tokens
     that share an expert share its weight read); fp32 partial sums go to gu [T*k, 2I] with atomic_add.
  2. down: same grid over H; the input tile is silu(gate) * up computed on the fly from gu (the full K sums
     are complete after stage 1), times the routed weight, atomic_add into out32 [T, H]: the top-k sum is
     free. At T > 1 with paths.decode_moe_act_launch, silu(gate) * up is a launch of its own between the
     stages (activation/triton.silu_and_mul, into the model dtype) and stage 2 loads it (PRE_ACT).
With the exact-integer dot (INT_DOT: paths.int_dot, T > 1: both stages, stage 2 on the silu launch's
rows) a tile step is gptq_gemm/int4.int_dot_tile: a tensor-core
dot of the exact n - z with the inputs, the scale once per tile, into a transposed [BN, 16] accumulator.
Below sm80 at T > 1 (ROWS: paths.decode_rows; stage 2 on the silu launch's rows) there is no dot: a program
takes the tokens routed to its expert two at a time, each pass the batch-1 GEMV's tile step on two rows
(_rows_program), where the FMA dot would multiply all 16 rows of the block.
Both accumulators must be zero before stage 1 (the routing launch zeroes them). With PDL (sm90,
triton_common) stage 2 reads the routing and its first weight tile before its wait: the routing was written
two launches earlier. Split-K is chosen on the host from static sizes so that a tuned number of programs per
SM exists (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels import paths
from onecard.kernels.activation.triton import silu_and_mul, silu_mul
from onecard.kernels.gptq_gemm.int4 import (
    INT_DOT_ROWS,
    _dequant_tile_j,
    _group_sz,
    gemv2_tile_mac,
    gemv_tile_mac,
    int_dot_tile,
    magic_zero_scale,
    nibbles,
    row_input,
    rows_input_t,
)
from onecard.kernels.gptq_gemm.triton import row_groups
from onecard.kernels.triton_common import (
    AotConfig,
    compute_capability,
    next_pow2,
    num_sms,
    pdl_enter,
    settle_cache_keys,
    signature,
)
from onecard.kernels.triton_dot import dot
from onecard.kernels.types import GPTQWeight, MoEWeight

# name: (BLOCK_T, BLOCK_N, BLOCK_K8, num_warps, num_stages, programs per SM for the split-K choice).
# BK8 = 16 packed rows = 128 inputs = one g128 group. decode1 has the GEMV's structure and its tuned shape
# (gptq_gemm/triton.py). From bench/tune_decode.py on the H200 (whole MoE, graph replay, weights rotated):
# decode1 2 warps 16/SM: 29.3 -> 27.4 us; decode16 2 warps: 186 -> 169 us (BK8 32 runs out of registers).
# Below sm80 tl.dot is FMA code holding its tiles in registers: decode16 on 2 warps spills there (sm70,
# JIT-aligned compile at the served shape: 160 B of stack per thread in stage 1, 336 B in stage 2); on 4 warps
# it has none (tests/kernels/test_aot.py checks). Not timed on a V100 (none available). decode1 16 -> 8 programs per
# SM on 2026-12-06 (tune_decode on the H100, whole MoE T=1: 23.20 -> 22.25 µs; in the model with the GEMV's 8 -> 4,
# batch 1 at 512 tokens 418.8 -> 429.7 tok/s, BENCHMARKS.md).
DECODE_CONFIGS = {
    "decode1": (1, 64, 16, 2, 2, 8),
    "decode16": (16, 128, 16, 2, 2, 12),
    "decode16-pre-sm80": (16, 128, 16, 4, 2, 12),
}


def choose_decode_config(num_tokens: int, cc: int = 80) -> str:
    """The config for T <= DECODE_MAX_TOKENS tokens: paths.choose_decode_moe (the path table)."""
    return paths.choose_decode_moe(num_tokens, cc)


@triton.jit(do_not_specialize=["T", "tiles_per_split"])  # runtime-varying: one compile serves all
def _moe_decode_kernel(x_ptr, a_ptr, out_ptr, qa_ptr, za_ptr, sa_ptr, ga_ptr, qb_ptr, zb_ptr, sb_ptr, gb_ptr,
                       ids_ptr, topk_w_ptr, active_ptr,
                       T, N, K, group_size, num_groups, g_stride, stride_a, stride_out, n_tiles,
                       tiles_per_split,
                       TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, STAGE: tl.constexpr,
                       FLOAT_W: tl.constexpr, PER_ROW: tl.constexpr, PDL: tl.constexpr,
                       PRE_ACT: tl.constexpr = False, INT_DOT: tl.constexpr = False, ROWS: tl.constexpr = 0):
    """STAGE 1: gu[pair, mat*N + n] += x[t] @ W_mat[e] (mat 0 = gate (qa..), 1 = up (qb..)) over one K split.
    STAGE 2: out[t, n] += topk_w[pair] * (silu(gu[pair, :K]) * gu[pair, K:]) @ Wd[e] (qa.. = qb.. = down);
    PRE_ACT (T > 1): a_ptr holds silu(gate) * up already, [pairs, K] in the model dtype (paths.decode_moe_act_launch).
    INT_DOT (T > 1, fp16, one group per K tile; paths.int_dot): int4.int_dot_tile, the weights entering
    the dot as their exact n - z and the group's scale multiplying each tile's fp32 sum; stage 2 then loads the
    silu launch's rows (PRE_ACT).
    ROWS (T > 1, int4 weights with one group per K tile; paths.decode_rows, below sm80; stage 2 with PRE_ACT): no
    dot; the tokens routed to the expert compacted, ROWS per pass over the program's K tiles, each tile the GEMV's
    step on ROWS rows (_rows_program).
    active_ptr[slot] = expert + 1 (0: no expert in this slot, the program does nothing).
    PDL: stage 1 reads the routing the kernel just before wrote, so it waits first. Stage 2's routing is two
    kernels old (complete before any stage-2 program can start, see triton_common), so it reads the routing
    (from L2: .cg, never a stale L1 line) and its first weight tile before the wait, and only gu after it."""
    tl.static_assert(not INT_DOT or STAGE == 1 or PRE_ACT, "stage 2 of the int dot loads silu * up")
    if STAGE == 1:
        pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    slot = tl.program_id(2)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    e32 = tl.load(active_ptr + slot, cache_modifier=".cg") - 1
    live = e32 >= 0
    e = tl.maximum(e32, 0).to(tl.int64)
    mat = pid_n // n_tiles
    tile = pid_n - mat * n_tiles
    if mat == 0:
        q_ptr, z_ptr, s_ptr, g_ptr = qa_ptr, za_ptr, sa_ptr, ga_ptr
    else:
        q_ptr, z_ptr, s_ptr, g_ptr = qb_ptr, zb_ptr, sb_ptr, gb_ptr
    k8 = K // 8
    if FLOAT_W:
        q_ptr += e * K * N
    else:
        q_ptr += e * k8 * N
        z_ptr += e * num_groups * (N // 8)
        s_ptr += e * num_groups * N
        g_ptr += e * g_stride
    # which tokens use expert e, through which slot, with which routed weight
    offs_t = tl.arange(0, BLOCK_T)
    offs_j = tl.arange(0, BLOCK_TOPK)
    pm = (offs_t < T)[:, None] & (offs_j < TOP_K)[None, :]
    ids = tl.load(ids_ptr + offs_t[:, None] * TOP_K + offs_j[None, :], mask=pm, other=-1,
                  cache_modifier=".cg")                                   # [BT, BTK]
    hit = (ids == e32) & live
    tok_mask = tl.max(hit.to(tl.int32), axis=1) > 0                      # [BT]
    pair = offs_t * TOP_K + tl.sum(tl.where(hit, offs_j[None, :], 0), axis=1)                # [BT]
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)                       # [BN]
    n_mask = offs_n < N
    z_shift = (offs_n % 8) * 4
    offs_r = tl.arange(0, BLOCK_K8)
    pair1 = tl.sum(pair, axis=0).to(tl.int64)                             # T == 1: token 0's pair for e
    if STAGE == 1:
        a_row = pair1 * 0                                                 # (BLOCK_T == 1) token 0
    else:
        a_row = pair1
    t_begin = pid_k * tiles_per_split                                     # every split has >= 1 tile
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(k8, BLOCK_K8))
    if ROWS > 0:
        _rows_program(x_ptr, a_ptr, out_ptr, q_ptr, s_ptr, z_ptr, topk_w_ptr, live, offs_t, tok_mask, pair, offs_r,
                      offs_n, n_mask, z_shift, t_begin, t_end, k8, N, mat, group_size, num_groups, stride_a,
                      stride_out, BLOCK_K8, BLOCK_N, STAGE, PRE_ACT, PDL, ROWS)
    else:
        if BLOCK_T == 1:
            # batch 1: a program has 1-2 tiles; the first one's loads are issued before stage 2's wait. (Issuing
            # both tiles' loads up front measured slower on the H200: fused MoE T=1 26.9 vs 21.5 us.)
            q0, s0, z0 = _decode_tile_load(q_ptr, s_ptr, z_ptr, t_begin, t_end, live, offs_r, offs_n, n_mask, z_shift,
                                           k8, N, group_size, num_groups, BLOCK_K8, BLOCK_N, FLOAT_W)
            t_loop = t_begin + 1
        else:
            # batch > 1: many tiles per program; a plain pipelined loop (peeling its first tile measured slower:
            # T=16 188 vs 172 us)
            t_loop = t_begin
        if INT_DOT:
            acc = tl.zeros((BLOCK_N, INT_DOT_ROWS), dtype=tl.float32)        # transposed (int4.int_dot_tile)
        elif BLOCK_T == 1:
            acc = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)            # row sums deferred past the loop
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        if STAGE == 2:
            pdl_enter(PDL)
        if live:
            if BLOCK_T == 1:
                acc = _decode_tile_mac(acc, q0, s0, z0, t_begin, t_end, x_ptr, a_ptr, a_row, q_ptr, z_ptr, s_ptr,
                                       g_ptr, offs_r, offs_n, n_mask, z_shift, k8, K, N, stride_a, offs_t, tok_mask,
                                       pair, DT, BLOCK_T, BLOCK_N, BLOCK_K8, STAGE, FLOAT_W, PER_ROW, PRE_ACT, INT_DOT)
            for it in range(t_loop, t_end):
                q, s_u, z_u = _decode_tile_load(q_ptr, s_ptr, z_ptr, it, t_end, live, offs_r, offs_n, n_mask, z_shift,
                                                k8, N, group_size, num_groups, BLOCK_K8, BLOCK_N, FLOAT_W)
                acc = _decode_tile_mac(acc, q, s_u, z_u, it, t_end, x_ptr, a_ptr, a_row, q_ptr, z_ptr, s_ptr, g_ptr,
                                       offs_r, offs_n, n_mask, z_shift, k8, K, N, stride_a, offs_t, tok_mask, pair,
                                       DT, BLOCK_T, BLOCK_N, BLOCK_K8, STAGE, FLOAT_W, PER_ROW, PRE_ACT, INT_DOT)
        if live:
            if BLOCK_T == 1:
                res = tl.sum(acc, axis=0)                                     # [BN]
                if STAGE == 1:
                    tl.atomic_add(out_ptr + pair1 * stride_out + mat * N + offs_n, res, mask=n_mask, sem="relaxed")
                else:
                    res *= tl.load(topk_w_ptr + pair1)
                    tl.atomic_add(out_ptr + offs_n, res, mask=n_mask, sem="relaxed")
            else:
                if INT_DOT:
                    res = tl.permute(acc, (1, 0))                             # [BT, BN]
                else:
                    res = acc
                om = tok_mask[:, None] & n_mask[None, :]
                if STAGE == 1:
                    tl.atomic_add(out_ptr + pair.to(tl.int64)[:, None] * stride_out + mat * N + offs_n[None, :], res,
                                  mask=om, sem="relaxed")
                else:
                    rw = tl.load(topk_w_ptr + pair, mask=tok_mask, other=0.0)    # [BT]
                    tl.atomic_add(out_ptr + offs_t[:, None] * stride_out + offs_n[None, :], res * rw[:, None],
                                  mask=om, sem="relaxed")


@triton.jit
def _rows_program(x_ptr, a_ptr, out_ptr, q_ptr, s_ptr, z_ptr, topk_w_ptr, live, offs_t, tok_mask, pair, offs_r, offs_n,
                  n_mask, z_shift, t_begin, t_end, k8, N, mat, group_size, num_groups, stride_a, stride_out,
                  BLOCK_K8: tl.constexpr, BLOCK_N: tl.constexpr, STAGE: tl.constexpr, PRE_ACT: tl.constexpr,
                  PDL: tl.constexpr, ROWS: tl.constexpr):
    """A ROWS program of _moe_decode_kernel (T > 1, int4 weights, one group per K tile): the tokens routed to its
    expert (tok_mask [BT], their pairs) in order, two per pass; a pass runs the program's K tiles with the GEMV's
    step on its two rows (int4.gemv2_tile_mac: two [BK8, BN] accumulators of the GEMV's layout, no 3-D tile) and
    adds each row's [BN] sums as the dot path does."""
    tl.static_assert(ROWS == 2, "the row step is written for two rows a pass")
    tl.static_assert(STAGE == 1 or PRE_ACT, "the row step's stage 2 loads the silu launch's rows")
    if STAGE == 2:
        pdl_enter(PDL)
    if live:
        hits = tok_mask.to(tl.int32)                                      # [BT]
        rank = tl.cumsum(hits, axis=0) - 1                                # [BT] each token's place among them
        for p0 in range(0, tl.sum(hits, axis=0), ROWS):
            sel0 = tok_mask & (rank == p0)                                # [BT]: the pass's first token
            sel1 = tok_mask & (rank == p0 + 1)                            # ... and its second, if any
            ok1 = tl.max(sel1.to(tl.int32), axis=0) > 0
            tok0 = tl.sum(tl.where(sel0, offs_t, 0), axis=0).to(tl.int64)
            tok1 = tl.sum(tl.where(sel1, offs_t, 0), axis=0).to(tl.int64)
            pair0 = tl.sum(tl.where(sel0, pair, 0), axis=0).to(tl.int64)
            pair1 = tl.sum(tl.where(sel1, pair, 0), axis=0).to(tl.int64)
            if STAGE == 1:                                                # x's rows by token
                in0, in1 = x_ptr + tok0 * stride_a, x_ptr + tok1 * stride_a
            else:                                                         # the silu launch's rows by pair
                in0, in1 = a_ptr + pair0 * stride_a, a_ptr + pair1 * stride_a
            acc0 = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)       # row sums deferred past the loop
            acc1 = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)
            for it in range(t_begin, t_end):
                q, s_u, z_u = _decode_tile_load(q_ptr, s_ptr, z_ptr, it, t_end, live, offs_r, offs_n, n_mask,
                                                z_shift, k8, N, group_size, num_groups, BLOCK_K8, BLOCK_N, False)
                r = it * BLOCK_K8 + offs_r                                # [BK8] packed rows
                r_mask = r < k8
                acc0, acc1 = gemv2_tile_mac(acc0, acc1, q, s_u, z_u, in0, in1, r, r_mask, r_mask & ok1, row_input)
            res0 = tl.sum(acc0, axis=0)                                   # [BN]
            res1 = tl.sum(acc1, axis=0)
            if STAGE == 1:
                tl.atomic_add(out_ptr + pair0 * stride_out + mat * N + offs_n, res0, mask=n_mask, sem="relaxed")
                tl.atomic_add(out_ptr + pair1 * stride_out + mat * N + offs_n, res1, mask=n_mask & ok1,
                              sem="relaxed")
            else:
                tl.atomic_add(out_ptr + tok0 * stride_out + offs_n, res0 * tl.load(topk_w_ptr + pair0), mask=n_mask,
                              sem="relaxed")
                tl.atomic_add(out_ptr + tok1 * stride_out + offs_n, res1 * tl.load(topk_w_ptr + pair1),
                              mask=n_mask & ok1, sem="relaxed")


@triton.jit
def _gated_input(src, r, j: tl.constexpr, r_mask):
    """fp32 [BK8] stage-2 inputs 8r + j: silu(gate) * up from gu row a_row of fp32 sums [gate K | up K]; an
    INPUT of gemv_tile_mac. src = (a_ptr, a_row, stride_a, K), the row's parts rather than its pointer: the
    address is formed after k, as the kernel did before the GEMV step was shared (a row pointer formed
    before the loop reordered the PTX)."""
    a_ptr, a_row, stride_a, K = src
    k = r * 8 + j
    gv = tl.load(a_ptr + a_row * stride_a + k, mask=r_mask, other=0.0)
    uv = tl.load(a_ptr + a_row * stride_a + K + k, mask=r_mask, other=0.0)
    return silu_mul(gv, uv)


@triton.jit
def _decode_input_row(x_ptr, a_ptr, a_row, stride_a, r, j: tl.constexpr, r_mask, K, STAGE: tl.constexpr):
    """fp32 [BK8] inputs 8r + j of one pair: x's row (stage 1) or silu(gate) * up from the gu sums (stage 2)."""
    if STAGE == 1:
        return row_input(x_ptr + a_row * stride_a, r, j, r_mask)
    else:
        return _gated_input((a_ptr, a_row, stride_a, K), r, j, r_mask)


@triton.jit
def _decode_tile_load(q_ptr, s_ptr, z_ptr, it, t_end, live, offs_r, offs_n, n_mask, z_shift, k8, N, group_size,
                      num_groups, BLOCK_K8: tl.constexpr, BLOCK_N: tl.constexpr, FLOAT_W: tl.constexpr):
    """One expert's K tile ``it``: (q [BK8, BN] int32, scales, true zeros [BN] fp32); q = 0 past t_end or when
    not live. FLOAT_W: nothing here (the MAC loads float weights per row)."""
    q = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.int32)
    s_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    z_u = s_u
    if not FLOAT_W:
        r = it * BLOCK_K8 + offs_r                                        # [BK8] packed rows
        ok = (r < k8) & (it < t_end) & live
        q = tl.load(q_ptr + r[:, None] * N + offs_n[None, :], mask=ok[:, None] & n_mask[None, :], other=0)
        g = tl.minimum((it * BLOCK_K8 * 8) // group_size, num_groups - 1)
        s_u, z_u = _group_sz(s_ptr, z_ptr, g, offs_n, n_mask, z_shift, N)
    return q, s_u, z_u


@triton.jit
def _decode_tile_mac(acc, q, s_u, z_u, it, t_end, x_ptr, a_ptr, a_row, q_ptr, z_ptr, s_ptr, g_ptr, offs_r, offs_n,
                     n_mask, z_shift, k8, K, N, stride_a, offs_t, tok_mask, pair, DT: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, STAGE: tl.constexpr,
                     FLOAT_W: tl.constexpr, PER_ROW: tl.constexpr, PRE_ACT: tl.constexpr, INT_DOT: tl.constexpr):
    """acc += inputs [rows of tile it] @ dequant(tile) for the tokens routed here (nothing past t_end).
    INT_DOT: acc [BN, INT_DOT_ROWS] += int4.int_dot_tile on x's rows by token (stage 1) or the silu launch's rows
    by pair (stage 2, T > 1)."""
    r = it * BLOCK_K8 + offs_r                                            # [BK8] packed rows
    r_mask = (r < k8) & (it < t_end)
    FAST: tl.constexpr = not FLOAT_W and not PER_ROW
    if INT_DOT:
        if STAGE == 1:
            acc += int_dot_tile(q, s_u, z_u, (x_ptr, offs_t, tok_mask, stride_a), r, r_mask, rows_input_t)
        else:
            acc += int_dot_tile(q, s_u, z_u, (a_ptr, pair, tok_mask, stride_a), r, r_mask, rows_input_t)
    else:
        if FAST:
            zb, sc = magic_zero_scale(z_u, s_u, DT)
        if BLOCK_T == 1 and FAST:
            # the GEMV's tile step (scale and zero once per tile), on x's row or on silu(gate) * up
            if STAGE == 1:
                acc = gemv_tile_mac(acc, q, s_u, z_u, x_ptr + a_row * stride_a, r, r_mask, row_input, BLOCK_K8,
                                    BLOCK_N)
            else:
                acc = gemv_tile_mac(acc, q, s_u, z_u, (a_ptr, a_row, stride_a, K), r, r_mask,
                                    _gated_input, BLOCK_K8, BLOCK_N)
        else:
            for j in tl.static_range(8):
                k = r * 8 + j                                                 # [BK8] input rows
                if FLOAT_W:
                    w = tl.load(q_ptr + k[:, None] * N + offs_n[None, :],
                                mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
                elif FAST:
                    w = (nibbles(q, j, DT) - zb[None, :]) * sc[None, :]
                else:
                    w = _dequant_tile_j(q, j, s_u, z_u, s_ptr, z_ptr, g_ptr, k, r_mask, offs_n, n_mask, z_shift,
                                        N, PER_ROW)                           # [BK8, BN] fp32
                if BLOCK_T == 1:
                    av = _decode_input_row(x_ptr, a_ptr, a_row, stride_a, r, j, r_mask, K, STAGE)
                    acc += w.to(tl.float32) * av[:, None]
                else:
                    a = _decode_inputs(x_ptr, a_ptr, k, r_mask, stride_a, offs_t, tok_mask, pair, K, DT, STAGE,
                                       PRE_ACT)
                    acc += dot(a, w.to(DT))                                   # [BT, BN]
    return acc


@triton.jit
def _decode_inputs(x_ptr, a_ptr, k, r_mask, stride_a, offs_t, tok_mask, pair, K, DT: tl.constexpr,
                   STAGE: tl.constexpr, PRE_ACT: tl.constexpr):
    """[BT, len(k)] inputs k of the tokens routed here, model dtype, 0 where masked: x's rows (stage 1), the
    silu launch's rows (PRE_ACT) or silu(gate) * up from the gu sums."""
    am = tok_mask[:, None] & r_mask[None, :]
    if STAGE == 1:
        a = tl.load(x_ptr + offs_t[:, None] * stride_a + k[None, :], mask=am, other=0.0)
    elif PRE_ACT:                                                         # silu(gate) * up, computed once
        a = tl.load(a_ptr + pair.to(tl.int64)[:, None] * stride_a + k[None, :], mask=am, other=0.0)
    else:
        a_off = pair.to(tl.int64)[:, None] * stride_a + k[None, :]
        gv = tl.load(a_ptr + a_off, mask=am, other=0.0)
        uv = tl.load(a_ptr + a_off + K, mask=am, other=0.0)
        a = silu_mul(gv, uv).to(DT)
    return a


def weight_args(w: MoEWeight, block_k8: int):
    """-> (ptrs (w, zeros, scales, g_idx), K, N, group_size, num_groups, per_row, g_stride, float?)."""
    if isinstance(w, GPTQWeight):
        assert w.qweight.is_contiguous() and w.qzeros.is_contiguous() and w.scales.is_contiguous()
        per_row, gidx = row_groups(w, block_k8)
        g_stride = w.in_features if (w.g_idx is not None and w.g_idx.dim() == 2) else 0
        return ((w.qweight, w.qzeros, w.scales, gidx), w.in_features, w.out_features, w.group_size,
                w.num_groups, int(per_row), g_stride, False)
    assert w.is_contiguous()
    return (w, w, w, w), int(w.shape[1]), int(w.shape[2]), 1 << 30, 1, 0, 0, True


def _split(programs: int, k_tiles: int, device: torch.device, per_sm: int) -> tuple[int, int]:
    """-> (splits, tiles_per_split) so that programs * splits ~ per_sm * SMs."""
    want = max(1, min(k_tiles, -(-per_sm * num_sms(device) // max(programs, 1))))
    per = -(-k_tiles // want)
    return -(-k_tiles // per), per


def moe_inter_size(w: MoEWeight) -> int:
    """I: the gate projection's output size."""
    return int(w.out_features) if isinstance(w, GPTQWeight) else int(w.shape[2])


def moe_stages(x: torch.Tensor, gu: torch.Tensor, out32: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight,
               w_down: MoEWeight, topk_ids: torch.Tensor, topk_w: torch.Tensor, active: torch.Tensor,
               top_k: int, use_pdl: bool, tuning: tuple[int, int, int, int, int] | None = None) -> None:
    """Launch stage 1 (gate/up: gu += ...) and stage 2 (down: out32 += ...) over the ``active`` slots; gu
    [T*k, 2I] and out32 [T, H] fp32 must be zero, and the routing (ids, weights, active) written, by earlier
    launches."""
    t = x.shape[0]
    dev = x.device
    slots = active.numel()
    bt, bn, bk8, warps, stages, per_sm = DECODE_CONFIGS[choose_decode_config(t, compute_capability(dev))]
    if tuning is not None:
        bn, bk8, warps, stages, per_sm = tuning
    gate, k1, n1, gs1, ng1, pr1, gst1, float_w = weight_args(w_gate, bk8)
    up, *_, pr_up, gst_up, _ = weight_args(w_up, bk8)
    assert (pr_up, gst_up) == (pr1, gst1), "gate and up must share their group layout (g_idx or not)"
    down, k2, n2, gs2, ng2, pr2, gst2, _ = weight_args(w_down, bk8)
    assert k1 == x.shape[1] and n2 == x.shape[1] and k2 == n1, (x.shape, k1, n1, k2, n2)
    common = dict(TOP_K=top_k, BLOCK_TOPK=next_pow2(top_k), BLOCK_T=bt, BLOCK_N=bn, BLOCK_K8=bk8,
                  FLOAT_W=float_w, PDL=use_pdl, num_warps=warps, num_stages=stages, launch_pdl=use_pdl)
    # the exact-integer dot: T > 1 (a 16-row block), fp16, int4 weights with one group per K tile (paths.int_dot)
    cc = compute_capability(dev)
    int_dot = bt > 1 and not float_w and x.dtype == torch.float16 and paths.int_dot(t, cc)
    # below sm80: the compacted row step instead of the 16-row FMA dot (paths.decode_rows), one group per K tile
    rows = paths.decode_rows(t, cc) if bt > 1 and not float_w else 0
    assert not (rows and int_dot), "the row step and the int dot exclude each other (below / from sm80)"
    tiles1 = triton.cdiv(n1, bn)
    s1, per1 = _split(2 * tiles1 * slots, triton.cdiv(k1 // 8, bk8), dev, per_sm)
    _moe_decode_kernel[(2 * tiles1, s1, slots)](
        x, x, gu, *gate, *up, topk_ids, topk_w, active, t, n1, k1, gs1, ng1, gst1,
        x.stride(0), 2 * n1, tiles1, per1, STAGE=1, PER_ROW=bool(pr1), INT_DOT=int_dot and not pr1,
        ROWS=0 if pr1 else rows, **common)
    tiles2 = triton.cdiv(n2, bn)
    s2, per2 = _split(tiles2 * slots, triton.cdiv(k2 // 8, bk8), dev, per_sm)
    # stage 2 of the exact-integer dot (T > 1) loads silu(gate) * up (computing it there spills: 255 registers
    # on sm90), and so does the row step's (on the gu sums its pass loop was 2,273 sm70 instructions with a
    # 56-byte spill, against 1,355 and none)
    pre_act = bt > 1 and not float_w and (paths.decode_moe_act_launch(t) or int_dot or rows > 0)
    a2 = silu_and_mul(gu, x.dtype) if pre_act else gu                    # [T*k, I] model dtype | [T*k, 2I] fp32
    _moe_decode_kernel[(tiles2, s2, slots)](
        x, a2, out32, *down, *down, topk_ids, topk_w, active, t, n2, k2, gs2, ng2,
        gst2, a2.stride(0), n2, tiles2, per2, STAGE=2, PER_ROW=bool(pr2), PRE_ACT=pre_act,
        INT_DOT=int_dot and not pr2, ROWS=0 if pr2 else rows, **common)


def stages_aot_configs(act: str, min_cc: int) -> list[AotConfig]:
    """Every decode GEMM config x weight kinds x stages, at the served routing shape (k = 8), for the targets
    where paths.choose_decode_moe can pick the config (decode16 is sm80+'s; decode16-pre-sm80 also runs on sm80+
    under ONECARD_EMULATE_CC)."""
    out: list[AotConfig] = []
    for name, (bt, bn, bk8, warps, stages, _) in DECODE_CONFIGS.items():
        cc_from = max(min_cc, paths.TENSOR_CORE_DOT_MIN_CC) if name == "decode16" else min_cc
        for float_w, per_row in ((False, False), (False, True), (True, False)):
            for stage in (1, 2):
                cx = dict(TOP_K=8, BLOCK_TOPK=8, BLOCK_T=bt, BLOCK_N=bn, BLOCK_K8=bk8, STAGE=stage,
                          FLOAT_W=float_w, PER_ROW=per_row, PDL=False, PRE_ACT=False, INT_DOT=False, ROWS=0)
                wt = f"*{act}" if float_w else "*i32"
                args = dict(x_ptr=f"*{act}", a_ptr=f"*{act}" if stage == 1 else "*fp32", out_ptr="*fp32",
                            qa_ptr=wt, za_ptr="*i32", sa_ptr="*fp16", ga_ptr="*i32",
                            qb_ptr=wt, zb_ptr="*i32", sb_ptr="*fp16", gb_ptr="*i32",
                            ids_ptr="*i32", topk_w_ptr="*fp32", active_ptr="*i32", T="i32", N="i32", K="i32",
                            group_size="i32", num_groups="i32",
                            g_stride="i32", stride_a="i32", stride_out="i32", n_tiles="i32",
                            tiles_per_split="i32")
                if float_w:
                    args.update(za_ptr=wt, sa_ptr=wt, ga_ptr=wt, zb_ptr=wt, sb_ptr=wt, gb_ptr=wt)
                out.append(AotConfig(_moe_decode_kernel, signature(args, cx), cx, warps, stages, cc_from,
                                     f"moe_decode[{name},stage={stage},float={float_w},per_row={per_row},{act}]"))
                if stage == 2 and bt > 1 and not float_w:                 # the separate silu launch's input
                    cx = dict(cx, PRE_ACT=True)
                    args = dict(args, a_ptr=f"*{act}")
                    out.append(AotConfig(_moe_decode_kernel, signature(args, cx), cx, warps, stages, cc_from,
                                         f"moe_decode[{name},stage=2,float=False,per_row={per_row},pre_act,{act}]"))
                if not float_w and not per_row and name == "decode16-pre-sm80":
                    # the compacted row step (paths.decode_rows); its stage 2 loads the silu launch's rows
                    cx = dict(cx, PRE_ACT=stage == 2, ROWS=paths.DECODE_ROWS_PRE_AMPERE)
                    args = dict(args, a_ptr=f"*{act}")
                    out.append(AotConfig(_moe_decode_kernel, signature(args, cx), cx, warps, stages, cc_from,
                                         f"moe_decode[{name},stage={stage},rows,{act}]"))
                if not float_w and not per_row and act == "fp16" and name != "decode16-pre-sm80" and bt > 1:
                    # the exact-integer dot (T > 1)
                    cx = dict(cx, PRE_ACT=stage == 2, INT_DOT=True)
                    args = dict(args, a_ptr=f"*{act}")
                    out.append(AotConfig(_moe_decode_kernel, signature(args, cx), cx, warps, stages, max(min_cc, 80),
                                         f"moe_decode[{name},stage={stage},int_dot,{act}]"))
    return out


__all__ = [
    "DECODE_CONFIGS",
    "choose_decode_config",
    "moe_inter_size",
    "moe_stages",
    "stages_aot_configs",
    "weight_args",
]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
