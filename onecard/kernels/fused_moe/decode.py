"""Triton fused MoE for decode-sized batches (T <= DECODE_MAX_TOKENS), same contract as ref.fused_moe.

Built for bandwidth at batch 1..16 (the weights are read once per step; everything else is tiny), in four
launches (every launch is a CUDA-graph node; nothing else runs in between), after the router GEMV
(``router_logits``, one program per expert: cuBLAS took 5 us for this 0.5 MB at batch 1):
  1. routing, one program per token: zero the token's rows of the fp32 accumulators, fp32 softmax, top-k,
     renormalise; then the token claims its experts with atomics on persistent zeroed counters
     (kernels/workspace.py) and the first claimant of an expert appends it (as expert + 1) to a compact
     ``active`` list in the same zeroed workspace (no sort, no host sync; a program whose slot holds 0 idles).
  2. gate/up: grid (2 * I/BN column tiles, split-K, active slot). A program dequantizes one [BK8, BN] int32
     tile per K step (16-byte loads along N, scales/zeros once per group) of ONE expert and multiplies it with
     the rows of every token routed to that expert (tl.dot over a 16-row token block when T > 1, so tokens
     that share an expert share its weight read); fp32 partial sums go to gu [T*k, 2I] with atomic_add.
  3. down: same grid over H; the input tile is silu(gate) * up computed on the fly from gu (the full K sums
     are complete after kernel 2), times the routed weight, atomic_add into out32 [T, H]: the top-k sum is free.
  4. finish: cast out32 to x.dtype; zero the counters and the active list for the next call. (A "last
     arriver" of step 3 cannot do this: other CTAs' fp32 atomics are not ordered before its arrival counter.)
With PDL (sm90, triton_common) step 3 reads the routing and its first weight tile before its wait: the
routing was written two launches earlier.
Split-K is chosen on the host from static sizes so that a tuned number of programs per SM exists
(CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels.gptq_gemm.triton import _dequant_tile_j, _group_sz, magic_zero_scale, nibbles, row_groups
from onecard.kernels.triton_dot import dot
from onecard.kernels import workspace
from onecard.kernels.triton_common import AotConfig, next_pow2, num_sms, pdl, pdl_enter, signature
from onecard.kernels.types import GPTQWeight, MoEWeight

DECODE_MAX_TOKENS = 16
# name: (BLOCK_T, BLOCK_N, BLOCK_K8, num_warps, num_stages, programs per SM for the split-K choice).
# BK8 = 16 packed rows = 128 inputs = one g128 group. decode1 has the GEMV's structure and its tuned shape
# (gptq_gemm/triton.py). From bench/tune_decode.py on the H200 (whole MoE, graph replay, weights rotated):
# decode1 2 warps 16/SM: 29.3 -> 27.4 us; decode16 2 warps: 186 -> 169 us (BK8 32 runs out of registers).
DECODE_CONFIGS = {
    "decode1": (1, 64, 16, 2, 2, 16),
    "decode16": (16, 128, 16, 2, 2, 12),
}
ROUTE_WARPS = 1                       # the top-k chain is 8 dependent reductions: shuffles only, no smem
_ZERO_BLOCK = 1024
_FINISH_BLOCK = 1024


def choose_decode_config(num_tokens: int) -> str:
    return "decode1" if num_tokens == 1 else "decode16"



@triton.jit(do_not_specialize=["T"])  # runtime-varying: one compile serves all
def _router_kernel(x_ptr, w_ptr, out_ptr, T, H, E, stride_x,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[t, e] = x[t] . w[e] for program e's expert and all T <= BLOCK_T tokens (fp32 sums, cast to out's
    dtype, as F.linear). w [E, H] row-major: an expert's row is contiguous (16-byte loads); its first chunk
    (all of it at T == 1) loads before the PDL wait."""
    e = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    t_mask = offs_t < T
    w = tl.load(w_ptr + e * H + offs_h, mask=offs_h < H, other=0.0)      # [BH]
    pdl_enter(PDL)
    acc = _router_chunk(tl.zeros((BLOCK_T,), dtype=tl.float32), x_ptr, w, 0, offs_t, t_mask, offs_h, H, stride_x)
    for h0 in range(BLOCK_H, H, BLOCK_H):
        w = tl.load(w_ptr + e * H + h0 + offs_h, mask=h0 + offs_h < H, other=0.0)
        acc = _router_chunk(acc, x_ptr, w, h0, offs_t, t_mask, offs_h, H, stride_x)
    tl.store(out_ptr + offs_t * E + e, acc.to(out_ptr.dtype.element_ty), mask=t_mask)


@triton.jit
def _router_chunk(acc, x_ptr, w, h0, offs_t, t_mask, offs_h, H, stride_x):
    """acc [BT] += x[:, h0:h0+BH] @ w [BH] (fp32)."""
    h_ok = h0 + offs_h < H
    x = tl.load(x_ptr + offs_t[:, None] * stride_x + h0 + offs_h[None, :], mask=t_mask[:, None] & h_ok[None, :],
                other=0.0).to(tl.float32)                                 # [BT, BH]
    return acc + tl.sum(x * w.to(tl.float32)[None, :], axis=1)


ROUTER_WARPS = 4
ROUTER_ELEMS = 4096                   # BLOCK_T * BLOCK_H: x chunk elements per program (32 per thread)


def router_block_h(num_tokens: int, hidden: int) -> int:
    return min(next_pow2(hidden), max(64, ROUTER_ELEMS // next_pow2(num_tokens)))


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, E] = x [T, H] @ weight [E, H]^T in x.dtype, T <= DECODE_MAX_TOKENS: one program per expert."""
    t, h = x.shape
    e = weight.shape[0]
    assert 1 <= t <= DECODE_MAX_TOKENS and weight.shape[1] == h and weight.is_contiguous(), (x.shape, weight.shape)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(t, e, dtype=x.dtype, device=x.device)
    use_pdl = pdl(x.device, t)
    _router_kernel[(e,)](x, weight, out, t, h, e, x.stride(0), BLOCK_T=next_pow2(t), BLOCK_H=router_block_h(t, h),
                         PDL=use_pdl, num_warps=ROUTER_WARPS, launch_pdl=use_pdl)
    return out


@triton.jit
def softmax_topk(logits_ptr, t, stride_t, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 RENORM: tl.constexpr):
    """Token t's router: fp32 softmax over E logits -> top-k (lowest index among ties) -> renormalise.
    Returns (weights [BLOCK_K] fp32, expert ids [BLOCK_K] int32, offsets [BLOCK_K]); lanes >= TOP_K unused."""
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_t + offs, mask=offs < E, other=-float("inf"))
    return topk_of(x.to(tl.float32), offs, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)


@triton.jit
def topk_of(x, offs, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """softmax_topk on logits already loaded: x [BLOCK_E] fp32 (-inf past E), offs = arange(BLOCK_E)."""
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)                                             # [BE] fp32 softmax
    # one int64 key per expert: the probability's bits (p >= 0: ordered as integers) above the reversed index,
    # so a single max per round yields the value and the lowest index among ties (one reduction, not two)
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(offs < E, (bits << 32) | (BLOCK_E - 1 - offs).to(tl.int64), -1)   # [BE]
    offs_k = tl.arange(0, BLOCK_K)
    vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        idx = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        val = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        vals = tl.where(offs_k == i, val, vals)
        ids = tl.where(offs_k == i, idx, ids)
        key = tl.where(key == best, -1, key)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)
    return vals, ids, offs_k


@triton.jit
def _route_claim_kernel(logits_ptr, w_ptr, ids_ptr, count_ptr, active_ptr, num_active_ptr, gu_ptr, out32_ptr,
                        E, stride_t, GU_ROW, H,
                        TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                        RENORM: tl.constexpr, ZERO_BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    # zero this token's rows of the atomic accumulators: gu [T*k, GU_ROW] and out32 [T, H]
    offs_z = tl.arange(0, ZERO_BLOCK)
    zeros = tl.zeros((ZERO_BLOCK,), dtype=tl.float32)
    for z in range(0, TOP_K * GU_ROW, ZERO_BLOCK):
        tl.store(gu_ptr + t * TOP_K * GU_ROW + z + offs_z, zeros, mask=z + offs_z < TOP_K * GU_ROW)
    for z in range(0, H, ZERO_BLOCK):
        tl.store(out32_ptr + t * H + z + offs_z, zeros, mask=z + offs_z < H)
    vals, ids, offs_k = softmax_topk(logits_ptr, t, stride_t, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)
    k_mask = offs_k < TOP_K
    tl.store(w_ptr + t * TOP_K + offs_k, vals, mask=k_mask)
    tl.store(ids_ptr + t * TOP_K + offs_k, ids, mask=k_mask)
    # a token's k experts are distinct, so one vector atomic has no intra-token conflicts
    old = tl.atomic_add(count_ptr + ids, tl.full((BLOCK_K,), 1, tl.int32), mask=k_mask)
    first = (old == 0) & k_mask
    n_new = tl.sum(first.to(tl.int32), axis=0)
    base = tl.atomic_add(num_active_ptr, n_new)
    slot = base + tl.cumsum(first.to(tl.int32), axis=0) - 1
    tl.store(active_ptr + slot, ids + 1, mask=first)                     # expert + 1: 0 means an empty slot


@triton.jit(do_not_specialize=["T", "tiles_per_split"])  # runtime-varying: one compile serves all
def _moe_decode_kernel(x_ptr, a_ptr, out_ptr, qa_ptr, za_ptr, sa_ptr, ga_ptr, qb_ptr, zb_ptr, sb_ptr, gb_ptr,
                       ids_ptr, topk_w_ptr, active_ptr,
                       T, N, K, group_size, num_groups, g_stride, stride_a, stride_out, n_tiles,
                       tiles_per_split,
                       TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, STAGE: tl.constexpr,
                       FLOAT_W: tl.constexpr, PER_ROW: tl.constexpr, PDL: tl.constexpr):
    """STAGE 1: gu[pair, mat*N + n] += x[t] @ W_mat[e] (mat 0 = gate (qa..), 1 = up (qb..)) over one K split.
    STAGE 2: out[t, n] += topk_w[pair] * (silu(gu[pair, :K]) * gu[pair, K:]) @ Wd[e] (qa.. = qb.. = down).
    active_ptr[slot] = expert + 1 (0: no expert in this slot, the program does nothing).
    PDL: stage 1 reads the routing the kernel just before wrote, so it waits first. Stage 2's routing is two
    kernels old (complete before any stage-2 program can start, see triton_common), so it reads the routing
    (from L2: .cg, never a stale L1 line) and its first weight tile before the wait, and only gu after it."""
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
    if BLOCK_T == 1:
        # batch 1: a program has 1-2 tiles; the first one's loads are issued before stage 2's wait. (Issuing
        # both tiles' loads up front measured slower on the H200: fused MoE T=1 26.9 vs 21.5 us.)
        q0, s0, z0 = _decode_tile_load(q_ptr, s_ptr, z_ptr, t_begin, t_end, live, offs_r, offs_n, n_mask, z_shift,
                                       k8, N, group_size, num_groups, BLOCK_K8, BLOCK_N, FLOAT_W)
        acc = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)            # row sums deferred past the loop
        t_loop = t_begin + 1
    else:
        # batch > 1: many tiles per program; a plain pipelined loop (peeling its first tile measured slower:
        # T=16 188 vs 172 us)
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        t_loop = t_begin
    if STAGE == 2:
        pdl_enter(PDL)
    if live:
        if BLOCK_T == 1:
            acc = _decode_tile_mac(acc, q0, s0, z0, t_begin, t_end, x_ptr, a_ptr, a_row, q_ptr, z_ptr, s_ptr,
                                   g_ptr, offs_r, offs_n, n_mask, z_shift, k8, K, N, stride_a, offs_t, tok_mask,
                                   pair, DT, BLOCK_T, BLOCK_N, BLOCK_K8, STAGE, FLOAT_W, PER_ROW)
        for it in range(t_loop, t_end):
            q, s_u, z_u = _decode_tile_load(q_ptr, s_ptr, z_ptr, it, t_end, live, offs_r, offs_n, n_mask, z_shift,
                                            k8, N, group_size, num_groups, BLOCK_K8, BLOCK_N, FLOAT_W)
            acc = _decode_tile_mac(acc, q, s_u, z_u, it, t_end, x_ptr, a_ptr, a_row, q_ptr, z_ptr, s_ptr, g_ptr,
                                   offs_r, offs_n, n_mask, z_shift, k8, K, N, stride_a, offs_t, tok_mask, pair,
                                   DT, BLOCK_T, BLOCK_N, BLOCK_K8, STAGE, FLOAT_W, PER_ROW)
    if live:
        if BLOCK_T == 1:
            res = tl.sum(acc, axis=0)                                     # [BN]
            if STAGE == 1:
                tl.atomic_add(out_ptr + pair1 * stride_out + mat * N + offs_n, res, mask=n_mask, sem="relaxed")
            else:
                res *= tl.load(topk_w_ptr + pair1)
                tl.atomic_add(out_ptr + offs_n, res, mask=n_mask, sem="relaxed")
        else:
            om = tok_mask[:, None] & n_mask[None, :]
            if STAGE == 1:
                tl.atomic_add(out_ptr + pair.to(tl.int64)[:, None] * stride_out + mat * N + offs_n[None, :], acc,
                              mask=om, sem="relaxed")
            else:
                rw = tl.load(topk_w_ptr + pair, mask=tok_mask, other=0.0)    # [BT]
                tl.atomic_add(out_ptr + offs_t[:, None] * stride_out + offs_n[None, :], acc * rw[:, None],
                              mask=om, sem="relaxed")


@triton.jit
def _decode_input_row(x_ptr, a_ptr, a_row, stride_a, k, r_mask, K, STAGE: tl.constexpr):
    """fp32 [BK8] inputs k of one pair: x's row (stage 1) or silu(gate) * up from the gu sums (stage 2)."""
    if STAGE == 1:
        return tl.load(x_ptr + a_row * stride_a + k, mask=r_mask, other=0.0).to(tl.float32)
    else:
        gv = tl.load(a_ptr + a_row * stride_a + k, mask=r_mask, other=0.0)
        uv = tl.load(a_ptr + a_row * stride_a + K + k, mask=r_mask, other=0.0)
        return gv / (1.0 + tl.exp(-gv)) * uv


@triton.jit(do_not_specialize=["TH"])  # runtime-varying: one compile serves all
def _finish_kernel(out32_ptr, out_ptr, state_ptr, TH, NZ, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = out32 cast to out's dtype; program 0 zeroes the NZ words of routing state (expert counters,
    num_active, the active list) for the next call."""
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(out32_ptr + offs, mask=offs < TH, other=0.0)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=offs < TH)
    if tl.program_id(0) == 0:
        for i in range(0, NZ, BLOCK):
            tl.store(state_ptr + i + tl.arange(0, BLOCK), tl.zeros((BLOCK,), dtype=tl.int32),
                     mask=i + tl.arange(0, BLOCK) < NZ)


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
                     FLOAT_W: tl.constexpr, PER_ROW: tl.constexpr):
    """acc += inputs [rows of tile it] @ dequant(tile) for the tokens routed here (nothing past t_end)."""
    r = it * BLOCK_K8 + offs_r                                            # [BK8] packed rows
    r_mask = (r < k8) & (it < t_end)
    FAST: tl.constexpr = not FLOAT_W and not PER_ROW
    if FAST:
        zb, sc = magic_zero_scale(z_u, s_u, DT)
    if BLOCK_T == 1 and FAST:
        # scale and zero once per tile: sum_j (q_j - z) s x_j = s * (sum_j q_j x_j - z * sum_j x_j)
        nx = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((BLOCK_K8,), dtype=tl.float32)
        for j in tl.static_range(8):
            av = _decode_input_row(x_ptr, a_ptr, a_row, stride_a, r * 8 + j, r_mask, K, STAGE)
            nx += (nibbles(q, j, tl.float32) - 8388608.0) * av[:, None]
            xs += av
        acc += nx * s_u[None, :] - xs[:, None] * (z_u * s_u)[None, :]
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
                av = _decode_input_row(x_ptr, a_ptr, a_row, stride_a, k, r_mask, K, STAGE)
                acc += w.to(tl.float32) * av[:, None]
            else:
                am = tok_mask[:, None] & r_mask[None, :]
                if STAGE == 1:
                    a = tl.load(x_ptr + offs_t[:, None] * stride_a + k[None, :], mask=am, other=0.0)
                else:
                    a_off = pair.to(tl.int64)[:, None] * stride_a + k[None, :]
                    gv = tl.load(a_ptr + a_off, mask=am, other=0.0)
                    uv = tl.load(a_ptr + a_off + K, mask=am, other=0.0)
                    a = (gv / (1.0 + tl.exp(-gv)) * uv).to(DT)
                acc += dot(a, w.to(DT))                                   # [BT, BN]
    return acc


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


def fused_moe_decode(x: torch.Tensor, router_logits: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight,
                     w_down: MoEWeight, top_k: int, renormalize: bool,
                     tuning: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``tuning`` (BLOCK_N, BLOCK_K8, num_warps, num_stages, programs per SM) overrides the table (bench)."""
    t, h = x.shape
    assert 1 <= t <= DECODE_MAX_TOKENS, t
    if x.stride(-1) != 1:
        x = x.contiguous()
    dev = x.device
    num_experts = int(router_logits.shape[1])
    p = t * top_k
    slots = min(num_experts, p)
    # zeros between calls: expert counters [E], num_active [1], active list [slots] (expert + 1 per slot)
    state = workspace.counters(dev, "moe", num_experts + 1 + slots)
    counts, num_active = state[:num_experts], state[num_experts:num_experts + 1]
    active = state[num_experts + 1:]
    n1 = moe_inter_size(w_gate)
    gu = torch.empty(p, 2 * n1, dtype=torch.float32, device=dev)          # [T*k, 2I] gate | up sums
    out32 = torch.empty(t, h, dtype=torch.float32, device=dev)            # [T, H]
    out = torch.empty(t, h, dtype=x.dtype, device=dev)
    topk_w = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    topk_ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    use_pdl = pdl(dev, t)
    _route_claim_kernel[(t,)](router_logits, topk_w, topk_ids, counts, active, num_active, gu, out32,
                              num_experts,
                              router_logits.stride(0), 2 * n1, h, TOP_K=top_k, BLOCK_K=next_pow2(top_k),
                              BLOCK_E=next_pow2(num_experts), RENORM=renormalize, ZERO_BLOCK=_ZERO_BLOCK,
                              PDL=use_pdl, num_warps=ROUTE_WARPS, launch_pdl=use_pdl)
    moe_stages(x, gu, out32, w_gate, w_up, w_down, topk_ids, topk_w, active, top_k, use_pdl, tuning)
    _finish_kernel[(triton.cdiv(t * h, _FINISH_BLOCK),)](out32, out, state, t * h, state.numel(),
                                                         BLOCK=_FINISH_BLOCK, PDL=use_pdl, launch_pdl=use_pdl)
    return out


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
    bt, bn, bk8, warps, stages, per_sm = DECODE_CONFIGS[choose_decode_config(t)]
    if tuning is not None:
        bn, bk8, warps, stages, per_sm = tuning
    gate, k1, n1, gs1, ng1, pr1, gst1, float_w = weight_args(w_gate, bk8)
    up, *_, pr_up, gst_up, _ = weight_args(w_up, bk8)
    assert (pr_up, gst_up) == (pr1, gst1), "gate and up must share their group layout (g_idx or not)"
    down, k2, n2, gs2, ng2, pr2, gst2, _ = weight_args(w_down, bk8)
    assert k1 == x.shape[1] and n2 == x.shape[1] and k2 == n1, (x.shape, k1, n1, k2, n2)
    common = dict(TOP_K=top_k, BLOCK_TOPK=next_pow2(top_k), BLOCK_T=bt, BLOCK_N=bn, BLOCK_K8=bk8,
                  FLOAT_W=float_w, PDL=use_pdl, num_warps=warps, num_stages=stages, launch_pdl=use_pdl)
    tiles1 = triton.cdiv(n1, bn)
    s1, per1 = _split(2 * tiles1 * slots, triton.cdiv(k1 // 8, bk8), dev, per_sm)
    _moe_decode_kernel[(2 * tiles1, s1, slots)](
        x, x, gu, *gate, *up, topk_ids, topk_w, active, t, n1, k1, gs1, ng1, gst1,
        x.stride(0), 2 * n1, tiles1, per1, STAGE=1, PER_ROW=bool(pr1), **common)
    tiles2 = triton.cdiv(n2, bn)
    s2, per2 = _split(tiles2 * slots, triton.cdiv(k2 // 8, bk8), dev, per_sm)
    _moe_decode_kernel[(tiles2, s2, slots)](
        x, gu, out32, *down, *down, topk_ids, topk_w, active, t, n2, k2, gs2, ng2,
        gst2, 2 * n1, n2, tiles2, per2, STAGE=2, PER_ROW=bool(pr2), **common)


def decode_aot_configs(act: str, min_cc: int) -> list[AotConfig]:
    """Router GEMV at H=2048 per token block, claiming router at E=128, k=8 and both decode GEMM configs x stages
    x weight kinds."""
    out: list[AotConfig] = []
    for bt in sorted({next_pow2(t) for t in range(1, DECODE_MAX_TOKENS + 1)}):
        cx = dict(BLOCK_T=bt, BLOCK_H=router_block_h(bt, 2048), PDL=False)
        args = dict(x_ptr=f"*{act}", w_ptr=f"*{act}", out_ptr=f"*{act}", T="i32", H="i32", E="i32",
                    stride_x="i32")
        out.append(AotConfig(_router_kernel, signature(args, cx), cx, ROUTER_WARPS, 1, min_cc,
                             f"router[bt={bt},{act}]"))
    for renorm in (True, False):
        cx = dict(TOP_K=8, BLOCK_K=8, BLOCK_E=128, RENORM=renorm, ZERO_BLOCK=_ZERO_BLOCK, PDL=False)
        args = dict(logits_ptr=f"*{act}", w_ptr="*fp32", ids_ptr="*i32", count_ptr="*i32", active_ptr="*i32",
                    num_active_ptr="*i32", gu_ptr="*fp32", out32_ptr="*fp32", E="i32", stride_t="i32",
                    GU_ROW="i32", H="i32")
        out.append(AotConfig(_route_claim_kernel, signature(args, cx), cx, ROUTE_WARPS, 1, min_cc,
                             f"route_claim[{renorm},{act}]"))
    cx = dict(BLOCK=_FINISH_BLOCK, PDL=False)
    args = dict(out32_ptr="*fp32", out_ptr=f"*{act}", state_ptr="*i32", TH="i32", NZ="i32")
    out.append(AotConfig(_finish_kernel, signature(args, cx), cx, 4, 1, min_cc, f"moe_finish[{act}]"))
    for name, (bt, bn, bk8, warps, stages, _) in DECODE_CONFIGS.items():
        for float_w, per_row in ((False, False), (False, True), (True, False)):
            for stage in (1, 2):
                cx = dict(TOP_K=8, BLOCK_TOPK=8, BLOCK_T=bt, BLOCK_N=bn, BLOCK_K8=bk8, STAGE=stage,
                          FLOAT_W=float_w, PER_ROW=per_row, PDL=False)
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
                out.append(AotConfig(_moe_decode_kernel, signature(args, cx), cx, warps, stages, min_cc,
                                     f"moe_decode[{name},stage={stage},float={float_w},per_row={per_row},{act}]"))
    return out


__all__ = ["fused_moe_decode", "moe_stages", "moe_inter_size", "router_logits", "decode_aot_configs",
           "choose_decode_config", "weight_args", "softmax_topk", "topk_of", "DECODE_MAX_TOKENS", "DECODE_CONFIGS"]
