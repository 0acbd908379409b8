"""Batch-1 attention inputs in one launch: RMSNorm (+ residual add), the fused W4A16 qkv GEMV, per-head q/k
RMSNorm + neox RoPE and the KV-cache store. Contract: ref.norm_qkv_rope_store.

Why: at batch 1 the layer is a chain of small dependent launches and each one costs its latency (~2 us on
the H200 under PDL), not its bytes. This kernel replaces three (rms_norm, the GEMV, qk_norm_rope_store).

How (grid = (N / BLOCK_N column tiles, K splits), the GEMV's shape and tuned config, gptq_gemm/triton.py):
  * the norm is folded into the GEMV: out = rstd * (W^T (r * w_norm)) with r = x + residual (rounded to the
    model dtype, as rms_norm adds) and rstd = rsqrt(mean(r^2) + eps). A program only needs its own K slice
    of r, so it also sums r^2 over that slice; the splits of a column tile cover K once, so their sums give
    the row's statistic. Programs of column tile 0 store residual_out (their slice of r).
  * every program stores its fp32 partial [BLOCK_N] and its r^2 sum, then arrives at its head's counter
    (``last_arrival``, D / BLOCK_N tiles x splits arrivals). The last arriver of a head sums the partials in
    split order (deterministic), scales by rstd, adds the bias, rounds to the model dtype (the composed path
    materialises qkv there) and finishes the head: q heads are normalised, rotated and stored to q_out; k
    heads are normalised, rotated and stored to k_cache[slot]; v heads go to v_cache[slot] (slot < 0: skip).
  * the first two K tiles' weights load before the PDL wait, as in the GEMV.
``supported`` says when this applies (one token, GPTQ without per-row groups, head_dim a multiple of the
column tile); dispatch composes the three ops otherwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels import workspace
from onecard.kernels.gptq_gemm.triton import (_CONFIGS, GEMV_MAX_SPLITS, SMALL_PROGRAMS_PER_SM, _small_tile_load,
                                              nibbles, row_groups)
from onecard.kernels.triton_common import AotConfig, last_arrival, next_pow2, num_sms, pdl, pdl_enter, signature
from onecard.kernels.types import GPTQWeight

_, BLOCK_N, BLOCK_K8, _, NUM_WARPS, NUM_STAGES = _CONFIGS["gemv"]


def supported(x: torch.Tensor, w, num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
              cos_sin_cache: torch.Tensor) -> bool:
    if x.shape[0] != 1 or not isinstance(w, GPTQWeight) or w.qweight.dim() != 2:
        return False
    per_row, _ = row_groups(w, BLOCK_K8)
    return (not per_row and head_dim % BLOCK_N == 0 and head_dim == next_pow2(head_dim)
            and w.out_features == (num_heads + 2 * num_kv_heads) * head_dim and x.shape[1] == w.in_features
            and w.qweight.is_contiguous() and w.scales.is_contiguous() and w.qzeros.is_contiguous()
            and k_cache.is_contiguous() and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous())


@triton.jit
def _norm_tile_mac(acc, sq, q, s_u, z_u, t, t_end, x_ptr, res_ptr, nw_ptr, res_out_ptr, store_res, offs_r, k8,
                   DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, HAS_RES: tl.constexpr):
    """acc [BK8, BN] += (r * w_norm)[rows of tile t] @ dequant(q); sq [BK8] += r^2 (nothing for t >= t_end).
    The GEMV's batch-1 form (gptq_gemm._small_tile_mac): scale and zero once per tile."""
    r = t * BLOCK_K8 + offs_r                                             # [BK8] packed rows
    r_mask = (r < k8) & (t < t_end)
    nx = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)                # sum_j n_j a_j
    xs = tl.zeros((BLOCK_K8,), dtype=tl.float32)                          # sum_j a_j
    for j in tl.static_range(8):
        k = r * 8 + j                                                     # [BK8] input rows
        xv = tl.load(x_ptr + k, mask=r_mask, other=0.0)
        if HAS_RES:
            xv = (xv.to(tl.float32) + tl.load(res_ptr + k, mask=r_mask, other=0.0).to(tl.float32)).to(DT)
            tl.store(res_out_ptr + k, xv, mask=r_mask & store_res)
        xf = xv.to(tl.float32)
        sq += xf * xf
        xf = xf * tl.load(nw_ptr + k, mask=r_mask, other=0.0).to(tl.float32)
        nx += (nibbles(q, j, tl.float32) - 8388608.0) * xf[:, None]
        xs += xf
    return acc + nx * s_u[None, :] - xs[:, None] * (z_u * s_u)[None, :], sq


@triton.jit
def _norm_rope_half(y1, y2, w_ptr, cos, sin, eps, offs_d, HALF: tl.constexpr):
    """One head (halves y1, y2 [HALF] fp32) -> RMSNorm(weight) then neox RoPE: (o1, o2)."""
    rstd = 1.0 / tl.sqrt((tl.sum(y1 * y1, axis=0) + tl.sum(y2 * y2, axis=0)) / (2 * HALF) + eps)
    y1 = y1 * rstd * tl.load(w_ptr + offs_d).to(tl.float32)
    y2 = y2 * rstd * tl.load(w_ptr + HALF + offs_d).to(tl.float32)
    return y1 * cos - y2 * sin, y2 * cos + y1 * sin


@triton.jit
def _norm_qkv_kernel(x_ptr, res_ptr, nw_ptr, qw_ptr, qz_ptr, sc_ptr, bias_ptr, part_ptr, sq_ptr, cnt_ptr,
                     res_out_ptr, qn_ptr, kn_ptr, pos_ptr, cs_ptr, q_out_ptr, kc_ptr, vc_ptr, slot_ptr,
                     N, K, group_size, num_groups, tiles_per_split, eps, has_bias,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K8: tl.constexpr, BLOCK_S: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN]
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_K8)
    k8 = K // 8
    z_shift = (offs_n % 8) * 4
    DT: tl.constexpr = q_out_ptr.dtype.element_ty
    t_begin = pid_k * tiles_per_split                                     # every split has >= 1 tile
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(k8, BLOCK_K8))
    q0, s0, z0 = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t_begin, t_end, offs_r, offs_n, n_mask, z_shift, k8, N,
                                  group_size, num_groups, BLOCK_K8)
    q1, s1, z1 = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t_begin + 1, t_end, offs_r, offs_n, n_mask, z_shift, k8,
                                  N, group_size, num_groups, BLOCK_K8)
    pdl_enter(PDL)
    store_res = pid_n == 0
    acc = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K8,), dtype=tl.float32)
    acc, sq = _norm_tile_mac(acc, sq, q0, s0, z0, t_begin, t_end, x_ptr, res_ptr, nw_ptr, res_out_ptr, store_res,
                             offs_r, k8, DT, BLOCK_N, BLOCK_K8, HAS_RES)
    acc, sq = _norm_tile_mac(acc, sq, q1, s1, z1, t_begin + 1, t_end, x_ptr, res_ptr, nw_ptr, res_out_ptr,
                             store_res, offs_r, k8, DT, BLOCK_N, BLOCK_K8, HAS_RES)
    for t in range(t_begin + 2, t_end):
        q, s_u, z_u = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t, t_end, offs_r, offs_n, n_mask, z_shift, k8, N,
                                       group_size, num_groups, BLOCK_K8)
        acc, sq = _norm_tile_mac(acc, sq, q, s_u, z_u, t, t_end, x_ptr, res_ptr, nw_ptr, res_out_ptr, store_res,
                                 offs_r, k8, DT, BLOCK_N, BLOCK_K8, HAS_RES)
    tl.store(part_ptr + pid_k * N + offs_n, tl.sum(acc, axis=0), mask=n_mask)
    tl.store(sq_ptr + pid_n * splits + pid_k, tl.sum(sq, axis=0))
    TILES: tl.constexpr = D // BLOCK_N
    head = pid_n // TILES
    if last_arrival(cnt_ptr + head, TILES * splits):
        HALF: tl.constexpr = D // 2
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < splits
        sqs = tl.load(sq_ptr + head * TILES * splits + offs_s, mask=s_ok, other=0.0, cache_modifier=".cg")
        rstd = 1.0 / tl.sqrt(tl.sum(sqs, axis=0) / K + eps)
        offs_d = tl.arange(0, HALF)
        col = head * D + offs_d                                           # [HALF]: the head's first half
        pm = s_ok[:, None]
        y1 = tl.sum(tl.load(part_ptr + offs_s[:, None] * N + col[None, :], mask=pm, other=0.0,
                            cache_modifier=".cg"), axis=0) * rstd
        y2 = tl.sum(tl.load(part_ptr + offs_s[:, None] * N + HALF + col[None, :], mask=pm, other=0.0,
                            cache_modifier=".cg"), axis=0) * rstd
        if has_bias != 0:
            y1 += tl.load(bias_ptr + col).to(tl.float32)
            y2 += tl.load(bias_ptr + HALF + col).to(tl.float32)
        y1 = y1.to(DT).to(tl.float32)                                     # qkv in the model dtype, as composed
        y2 = y2.to(DT).to(tl.float32)
        pos = tl.load(pos_ptr).to(tl.int64)
        slot = tl.load(slot_ptr).to(tl.int64)
        if head < HQ + HKV:
            cos = tl.load(cs_ptr + pos * D + offs_d)
            sin = tl.load(cs_ptr + pos * D + HALF + offs_d)
            if head < HQ:
                o1, o2 = _norm_rope_half(y1, y2, qn_ptr, cos, sin, eps, offs_d, HALF)
                tl.store(q_out_ptr + head * D + offs_d, o1.to(DT))
                tl.store(q_out_ptr + head * D + HALF + offs_d, o2.to(DT))
            elif slot >= 0:
                o1, o2 = _norm_rope_half(y1, y2, kn_ptr, cos, sin, eps, offs_d, HALF)
                kb = kc_ptr + slot * HKV * D + (head - HQ) * D
                tl.store(kb + offs_d, o1.to(kc_ptr.dtype.element_ty))
                tl.store(kb + HALF + offs_d, o2.to(kc_ptr.dtype.element_ty))
        elif slot >= 0:
            vb = vc_ptr + slot * HKV * D + (head - HQ - HKV) * D
            tl.store(vb + offs_d, y1.to(vc_ptr.dtype.element_ty))
            tl.store(vb + HALF + offs_d, y2.to(vc_ptr.dtype.element_ty))


def _splits(k: int, n: int, device: torch.device) -> tuple[int, int]:
    """-> (splits, tiles per split): the GEMV's split-K choice (gptq_gemm.small_m_gemm)."""
    k_tiles = triton.cdiv(k // 8, BLOCK_K8)
    want = max(1, min(k_tiles, -(-SMALL_PROGRAMS_PER_SM["gemv"] * num_sms(device) // triton.cdiv(n, BLOCK_N)),
                      GEMV_MAX_SPLITS))
    per = triton.cdiv(k_tiles, want)
    return triton.cdiv(k_tiles, per), per


def norm_qkv_rope_store(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w: GPTQWeight, bias: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, H] (model dtype, or fp32 with a residual) -> (q_out [1, Hq, D], residual_out [1, H])."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    assert supported(x, w, num_heads, hkv, d, k_cache, cos_sin_cache), (x.shape, w.out_features, num_heads, d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    dev, k, n = x.device, w.in_features, w.out_features
    dt = residual.dtype if residual is not None else x.dtype
    splits, per = _splits(k, n, dev)
    grid_n = triton.cdiv(n, BLOCK_N)
    part = torch.empty(splits, n, dtype=torch.float32, device=dev)
    sq = torch.empty(grid_n, splits, dtype=torch.float32, device=dev)
    res_out = torch.empty(1, k, dtype=dt, device=dev) if residual is not None else x
    q_out = torch.empty(1, num_heads, d, dtype=dt, device=dev)
    use_pdl = pdl(dev, 1)
    _norm_qkv_kernel[(grid_n, splits)](
        x, residual if residual is not None else x, norm_weight, w.qweight, w.qzeros, w.scales,
        bias if bias is not None else norm_weight, part, sq, workspace.counters(dev, "gemm", n // d), res_out,
        q_weight, k_weight, positions, cos_sin_cache, q_out, k_cache, v_cache, slot_mapping,
        n, k, w.group_size, w.num_groups, per, eps, int(bias is not None),
        HQ=num_heads, HKV=hkv, D=d, BLOCK_N=BLOCK_N, BLOCK_K8=BLOCK_K8, BLOCK_S=GEMV_MAX_SPLITS,
        HAS_RES=residual is not None, PDL=use_pdl, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        launch_pdl=use_pdl)
    return q_out, res_out


def aot_configs(act: str, min_cc: int) -> list[AotConfig]:
    """Qwen3-30B-A3B (32 / 4 heads, D 128): layer 0 (no residual), later layers with x in fp32 (after a
    batch-1 MoE) or in the model dtype (after a dense MLP)."""
    out: list[AotConfig] = []
    for has_res, x_t in ((False, act), (True, "fp32"), (True, act)):
        cx = dict(HQ=32, HKV=4, D=128, BLOCK_N=BLOCK_N, BLOCK_K8=BLOCK_K8, BLOCK_S=GEMV_MAX_SPLITS,
                  HAS_RES=has_res, PDL=False)
        args = dict(x_ptr=f"*{x_t}", res_ptr=f"*{act}", nw_ptr=f"*{act}", qw_ptr="*i32", qz_ptr="*i32",
                    sc_ptr="*fp16", bias_ptr=f"*{act}", part_ptr="*fp32", sq_ptr="*fp32", cnt_ptr="*i32",
                    res_out_ptr=f"*{act}", qn_ptr=f"*{act}", kn_ptr=f"*{act}", pos_ptr="*i64", cs_ptr="*fp32",
                    q_out_ptr=f"*{act}", kc_ptr=f"*{act}", vc_ptr=f"*{act}", slot_ptr="*i64", N="i32", K="i32",
                    group_size="i32", num_groups="i32", tiles_per_split="i32", eps="fp32", has_bias="i32")
        out.append(AotConfig(_norm_qkv_kernel, signature(args, cx), cx, NUM_WARPS, NUM_STAGES, min_cc,
                             f"norm_qkv[res={has_res},x={x_t},{act}]"))
    return out


__all__ = ["norm_qkv_rope_store", "supported", "aot_configs"]
