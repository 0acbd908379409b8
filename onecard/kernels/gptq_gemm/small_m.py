"""Device code (@triton.jit) of the decode GEMM, M <= 16: ``_w4a16_small_kernel`` and its per-tile helpers.

One launch per GEMM (plus a reduce kernel when 1 < M with split-K); the host side, the config table and the
split-K choice are in triton.py (``small_m_gemm``), which also says why the two split-K reductions differ.
A program streams one or two [BK8, BN] int32 tiles of its K split (16-byte loads along N, scales/zeros once
per tile: a tile lies in one group unless PER_ROW). M == 1 keeps a [BK8, BN] fp32 accumulator and reduces
it once after the K loop; M > 1 uses tl.dot on a 16-row block, or below sm80 for few rows (ROWS:
paths.dense_rows) the M == 1 step on two rows a program (_small_rows; tl.dot is FMA code there). With the
exact-integer dot (INT_DOT, M > 1, fp16, one group per tile: paths.int_dot) it takes int4.int_dot_tile, a
tensor-core dot on 16 input rows into a transposed [BN, 16] accumulator.
"""
from __future__ import annotations

import triton
import triton.language as tl

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
from onecard.kernels.triton_common import last_arrival, pdl_enter, settle_cache_keys
from onecard.kernels.triton_dot import dot


@triton.jit
def _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t, t_end, offs_r, offs_n, n_mask, z_shift, k8, N, group_size,
                     num_groups, BLOCK_K8: tl.constexpr):
    """K tile t's weights: (q [BK8, BN] int32 (16-byte loads along N), scales, true zeros [BN] fp32); q is 0
    for t >= t_end (another split's tile)."""
    r = t * BLOCK_K8 + offs_r                                             # [BK8] packed rows
    q = tl.load(qw_ptr + r[:, None] * N + offs_n[None, :], mask=((r < k8) & (t < t_end))[:, None] & n_mask[None, :],
                other=0)
    g = tl.minimum((t * BLOCK_K8 * 8) // group_size, num_groups - 1)
    s_u, z_u = _group_sz(sc_ptr, qz_ptr, g, offs_n, n_mask, z_shift, N)
    return q, s_u, z_u


@triton.jit
def _small_tile_mac(acc, q, s_u, z_u, t, t_end, x_ptr, sc_ptr, qz_ptr, gidx_ptr, offs_r, offs_m, m_mask, offs_n, n_mask,
                    z_shift, k8, N, stride_xm, DT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K8: tl.constexpr, PER_ROW: tl.constexpr, INT_DOT: tl.constexpr):
    """acc += x[:, rows of tile t] @ dequant(q) (nothing for t >= t_end); see _w4a16_small_kernel for the three
    accumulator forms."""
    r = t * BLOCK_K8 + offs_r                                             # [BK8] packed rows
    r_mask = (r < k8) & (t < t_end)                                       # x rows masked: exact zero
    if INT_DOT:
        acc += int_dot_tile(q, s_u, z_u, (x_ptr, offs_m, m_mask, stride_xm), r, r_mask, rows_input_t)
    elif BLOCK_M == 1 and not PER_ROW:
        acc = gemv_tile_mac(acc, q, s_u, z_u, x_ptr, r, r_mask, row_input, BLOCK_K8, BLOCK_N)
    else:
        zb, sc = magic_zero_scale(z_u, s_u, DT)
        for j in tl.static_range(8):
            k = r * 8 + j                                                 # [BK8] input rows
            if PER_ROW:
                w = _dequant_tile_j(q, j, s_u, z_u, sc_ptr, qz_ptr, gidx_ptr, k, r_mask, offs_n, n_mask,
                                    z_shift, N, PER_ROW)
            else:
                w = (nibbles(q, j, DT) - zb[None, :]) * sc[None, :]
            if BLOCK_M == 1:
                xv = tl.load(x_ptr + k, mask=r_mask, other=0.0).to(tl.float32)
                acc += w.to(tl.float32) * xv[:, None]
            else:
                xj = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                             mask=m_mask[:, None] & r_mask[None, :], other=0.0)   # [BM, BK8]
                acc += dot(xj, w.to(DT))
    return acc


@triton.jit(do_not_specialize=["M"])  # runtime-varying: one compile serves all
def _w4a16_small_kernel(x_ptr, qw_ptr, qz_ptr, sc_ptr, gidx_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
                        M, N, K, group_size, num_groups, tiles_per_split, stride_xm, has_bias,
                        rm_ptr, rf_ptr, rr_ptr, raw_ptr, E, rn_chunk,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                        PER_ROW: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
                        INT_DOT: tl.constexpr = False, ACCUM: tl.constexpr = False, ROUTER: tl.constexpr = False,
                        BLOCK_RE: tl.constexpr = 1, BLOCK_R: tl.constexpr = 1, ROWS: tl.constexpr = 0):
    """Decode GEMM, M <= 16, one launch. BLOCK_M == 1: GEMV with a [BK8, BN] fp32 accumulator whose row sum is
    deferred past the K loop; the scale and zero are applied once per tile (int4.gemv_tile_mac), so the inner
    loop is a shift, a LOP3 and an FMA per weight. Else tl.dot on a 16-row block with
    weights dequantized in x's dtype (exact (q - z), one rounding of (q - z) * s, as in fp32-then-cast).
    Split-K (grid dim 1 > 1), BLOCK_M == 1: each split stores fp32 partials [S, 1, N]; the last split of a
    column tile to arrive at cnt_ptr[pid_n] sums them in split order (deterministic), adds the bias and casts.
    BLOCK_M > 1: fp32 atomic_add into part_ptr [M, N] (zeroed by the caller); the reduce kernel finishes.
    M == 1: the first two K tiles' weights load before the PDL wait (they overlap the previous kernel's tail).
    INT_DOT (BLOCK_M 16, fp16, not PER_ROW; paths.int_dot): each tile through int4.int_dot_tile (exact n - z in a
    tensor-core dot, the scale once per tile) into a transposed [BN, 16] accumulator of the 16 input rows.
    ACCUM (M == 1; paths.batch1_accumulate): out_ptr is an fp32 row that an earlier launch zeroed; every split
    adds its partial sums (and split 0 the bias) with fp32 atomics: no partials, no counter, no last arriver.
    ROUTER (with ACCUM, no bias; paths.batch1_router_fold, fused_moe/router_fold.py): the program also adds into
    the zeroed fp32 raw_ptr [E] its share of the folded router, rows pid_n * BLOCK_RE + [0, BLOCK_RE): M[rows, its
    split's K range] @ x[that range] + F[rows, pid_k's rn_chunk of N] @ residual[that chunk] (rm_ptr M [E, K],
    rf_ptr F [E, N], rr_ptr the residual [N]; M and F load before the PDL wait: weights), both as [BLOCK_RE,
    BLOCK_R] tiles (BLOCK_R covers either range), so that one reduction sums them.
    ROWS (1 < M, not PER_ROW; paths.dense_rows, below sm80): no dot; grid dim 2 takes the rows two at a time,
    each tile the GEMV's step on both (_small_rows)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN]
    offs_m = tl.arange(0, BLOCK_M)                                        # [BM]
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_r = tl.arange(0, BLOCK_K8)
    k8 = K // 8
    z_shift = (offs_n % 8) * 4
    DT: tl.constexpr = x_ptr.dtype.element_ty
    if ROWS > 0:
        _small_rows(x_ptr, qw_ptr, qz_ptr, sc_ptr, bias_ptr, out_ptr, part_ptr, M, N, group_size, num_groups,
                    tiles_per_split, stride_xm, has_bias, pid_k, offs_r, offs_n, n_mask, z_shift, k8, BLOCK_K8, PDL,
                    ROWS)
    else:
        tl.static_assert(not INT_DOT or BLOCK_M == INT_DOT_ROWS)
        if INT_DOT:
            acc = tl.zeros((BLOCK_N, INT_DOT_ROWS), dtype=tl.float32)             # transposed (int_dot_tile)
        elif BLOCK_M == 1:
            acc = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        t_begin = pid_k * tiles_per_split                                     # every split has >= 1 tile
        t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(k8, BLOCK_K8))
        if BLOCK_M == 1:
            # the first two tiles' weights (all of them at the tuned splits) stream before the PDL wait
            q0, s0, z0 = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t_begin, t_end, offs_r, offs_n, n_mask, z_shift, k8,
                                          N, group_size, num_groups, BLOCK_K8)
            q1, s1, z1 = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t_begin + 1, t_end, offs_r, offs_n, n_mask, z_shift,
                                          k8, N, group_size, num_groups, BLOCK_K8)
            if ROUTER:
                m_t, f_t, rk, rk_mask, rn, rn_mask, re, re_mask = _router_load(
                    rm_ptr, rf_ptr, pid_n, pid_k, t_begin, t_end, E, N, K, rn_chunk, BLOCK_K8, BLOCK_RE, BLOCK_R)
            pdl_enter(PDL)
            if ROUTER:                      # the router's inputs now: their round trips overlap the K loop's
                # loaded in the tiles' shape (each row its copy, from L1) so that no layout conversion goes through
                # shared memory: [BRE, BR] this split's inputs, [BRE, BR] the residual's chunk
                av = tl.load(x_ptr + re[:, None] * 0 + rk[None, :], mask=rk_mask[None, :], other=0.0).to(tl.float32)
                rv = tl.load(rr_ptr + re[:, None] * 0 + rn[None, :], mask=rn_mask[None, :], other=0.0).to(tl.float32)
            acc = _small_tile_mac(acc, q0, s0, z0, t_begin, t_end, x_ptr, sc_ptr, qz_ptr, gidx_ptr, offs_r, offs_m,
                                  m_mask, offs_n, n_mask, z_shift, k8, N, stride_xm, DT, BLOCK_M, BLOCK_N, BLOCK_K8,
                                  PER_ROW, INT_DOT)
            acc = _small_tile_mac(acc, q1, s1, z1, t_begin + 1, t_end, x_ptr, sc_ptr, qz_ptr, gidx_ptr, offs_r,
                                  offs_m, m_mask, offs_n, n_mask, z_shift, k8, N, stride_xm, DT, BLOCK_M, BLOCK_N,
                                  BLOCK_K8, PER_ROW, INT_DOT)
            t_loop = t_begin + 2
        else:
            # M > 1: a plain pipelined loop (peeling the first tiles measured slower for tl.dot)
            pdl_enter(PDL)
            t_loop = t_begin
        for t in range(t_loop, t_end):
            q, s_u, z_u = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t, t_end, offs_r, offs_n, n_mask, z_shift, k8, N,
                                           group_size, num_groups, BLOCK_K8)
            acc = _small_tile_mac(acc, q, s_u, z_u, t, t_end, x_ptr, sc_ptr, qz_ptr, gidx_ptr, offs_r, offs_m,
                                  m_mask, offs_n, n_mask, z_shift, k8, N, stride_xm, DT, BLOCK_M, BLOCK_N, BLOCK_K8,
                                  PER_ROW, INT_DOT)
        if INT_DOT:
            res = tl.permute(acc, (1, 0))                                     # [BM, BN]
        elif BLOCK_M == 1:
            res = tl.sum(acc, axis=0)[None, :]                                # [1, BN]
        else:
            res = acc
        o_off = offs_m[:, None] * N + offs_n[None, :]
        o_mask = m_mask[:, None] & n_mask[None, :]
        splits = tl.num_programs(1)
        if ACCUM:
            tl.static_assert(BLOCK_M == 1, "ACCUM: batch 1 only")
            if has_bias != 0:                                                 # once: split 0 adds the bias
                res += tl.load(bias_ptr + offs_n, mask=n_mask & (pid_k == 0), other=0.0).to(tl.float32)[None, :]
            tl.atomic_add(out_ptr + o_off, res, mask=o_mask, sem="relaxed")
            if ROUTER:
                raw = tl.sum(m_t.to(tl.float32) * av + f_t.to(tl.float32) * rv, axis=1)   # [BRE]
                tl.atomic_add(raw_ptr + re, raw, mask=re_mask, sem="relaxed")
        elif splits > 1 and BLOCK_M == 1:
            tl.store(part_ptr + pid_k * N + o_off, res, mask=o_mask)
            if last_arrival(cnt_ptr + pid_n, splits):
                offs_s = tl.arange(0, BLOCK_S)                                # every split's row at once
                p = tl.load(part_ptr + offs_s[:, None] * N + offs_n[None, :],
                            mask=(offs_s < splits)[:, None] & n_mask[None, :], other=0.0, cache_modifier=".cg")
                _store_out(out_ptr, o_off, o_mask, tl.sum(p, axis=0)[None, :], bias_ptr, offs_n, n_mask, has_bias)
        elif splits > 1:
            tl.atomic_add(part_ptr + o_off, res, mask=o_mask, sem="relaxed")
        else:
            _store_out(out_ptr, o_off, o_mask, res, bias_ptr, offs_n, n_mask, has_bias)


@triton.jit
def _small_rows(x_ptr, qw_ptr, qz_ptr, sc_ptr, bias_ptr, out_ptr, part_ptr, M, N, group_size, num_groups,
                tiles_per_split, stride_xm, has_bias, pid_k, offs_r, offs_n, n_mask, z_shift, k8,
                BLOCK_K8: tl.constexpr, PDL: tl.constexpr, ROWS: tl.constexpr):
    """A ROWS program of _w4a16_small_kernel: rows m0 = ROWS * program_id(2) and m0 + 1 (if < M) over its K split,
    int4.gemv2_tile_mac a tile; split-K: fp32 atomics into part_ptr [M, N] (the reduce finishes), else stored."""
    tl.static_assert(ROWS == 2, "the row step is written for two rows a pass")
    m0 = tl.program_id(2) * ROWS
    ok1 = m0 + 1 < M
    t_begin = pid_k * tiles_per_split                                     # every split has >= 1 tile
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(k8, BLOCK_K8))
    acc0 = tl.zeros((BLOCK_K8, offs_n.shape[0]), dtype=tl.float32)       # row sums deferred past the loop
    acc1 = tl.zeros((BLOCK_K8, offs_n.shape[0]), dtype=tl.float32)
    pdl_enter(PDL)
    for t in range(t_begin, t_end):
        q, s_u, z_u = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t, t_end, offs_r, offs_n, n_mask, z_shift, k8, N,
                                       group_size, num_groups, BLOCK_K8)
        r = t * BLOCK_K8 + offs_r                                         # [BK8] packed rows
        r_mask = r < k8
        acc0, acc1 = gemv2_tile_mac(acc0, acc1, q, s_u, z_u, x_ptr + m0 * stride_xm, x_ptr + (m0 + 1) * stride_xm,
                                    r, r_mask, r_mask & ok1, row_input)
    res0 = tl.sum(acc0, axis=0)                                           # [BN]
    res1 = tl.sum(acc1, axis=0)
    if tl.num_programs(1) > 1:
        tl.atomic_add(part_ptr + m0 * N + offs_n, res0, mask=n_mask, sem="relaxed")
        tl.atomic_add(part_ptr + (m0 + 1) * N + offs_n, res1, mask=n_mask & ok1, sem="relaxed")
    else:
        _store_out(out_ptr, (m0 * N + offs_n)[None, :], n_mask[None, :], res0[None, :], bias_ptr, offs_n, n_mask,
                   has_bias)
        _store_out(out_ptr, ((m0 + 1) * N + offs_n)[None, :], (n_mask & ok1)[None, :], res1[None, :], bias_ptr,
                   offs_n, n_mask, has_bias)


@triton.jit
def _router_load(rm_ptr, rf_ptr, pid_n, pid_k, t_begin, t_end, E, N, K, rn_chunk, BLOCK_K8: tl.constexpr,
                 BLOCK_RE: tl.constexpr, BLOCK_R: tl.constexpr):
    """The ROUTER share of program (pid_n, pid_k): (M tile [BRE, BR], F tile [BRE, BR], their input offsets and
    masks (K: the split's tiles t_begin..t_end; N: chunk pid_k of rn_chunk), their rows and row mask)."""
    re = pid_n * BLOCK_RE + tl.arange(0, BLOCK_RE)                        # [BRE] router rows (experts)
    re_mask = re < E
    rk = t_begin * BLOCK_K8 * 8 + tl.arange(0, BLOCK_R)                   # [BR] this split's inputs
    rk_mask = rk < tl.minimum(t_end * BLOCK_K8 * 8, K)
    rn = pid_k * rn_chunk + tl.arange(0, BLOCK_R)                         # [BR] a chunk of the residual
    rn_mask = (rn < (pid_k + 1) * rn_chunk) & (rn < N)
    m_t = tl.load(rm_ptr + re[:, None] * K + rk[None, :], mask=re_mask[:, None] & rk_mask[None, :], other=0.0)
    f_t = tl.load(rf_ptr + re[:, None] * N + rn[None, :], mask=re_mask[:, None] & rn_mask[None, :], other=0.0)
    return m_t, f_t, rk, rk_mask, rn, rn_mask, re, re_mask


@triton.jit
def _store_out(out_ptr, o_off, o_mask, res, bias_ptr, offs_n, n_mask, has_bias):
    if has_bias != 0:
        res += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + o_off, res.to(out_ptr.dtype.element_ty), mask=o_mask)

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
