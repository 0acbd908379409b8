"""Triton attention input at batch 1: the input RMSNorm (+ residual add), the fused qkv GEMV on GPTQ int4
weights, per-head q/k RMSNorm + neox RoPE and the K/V store into the paged cache in ONE launch; contract as
ref.py (``supported`` says when; kernels/dispatch.py composes the three ops otherwise).

Why: a batch-1 decode layer is a chain of small kernels, and each launch costs a few µs that its bytes do not
explain (a 5 MB qkv GEMV takes ~6 µs on the H100 against ~2 µs of bandwidth; an empty kernel is 0.8 µs per
graph node). This removes two of a layer's launches (rms_norm, qk_norm_rope_store).

How. The grid is the batch-1 GEMV's (gptq_gemm/triton.small_grid: column tiles of BN x K splits), and the K
loop is its (int4.gemv_tile_mac, the first two tiles' weights loaded before the PDL wait):
  * RMSNorm folded in. rstd is one number per row, so y = rstd * sum_k W_k (h_k nw_k) with h = x + residual
    rounded to the residual's dtype (what rms_norm stores). After the PDL wait a program computes its K range
    of u = h * nw once, into a scratch row of its own (then the K loop loads one fp32 per input, as the GEMV
    does; computing u inside the loop, per packed row and nibble, made the kernel as slow as the three launches
    it replaces: H100, 10.1 vs 10.3 µs), and sums h^2 over that range. The K splits of a column tile cover all
    of K, so the program that finishes a head has every split's partial sums of squares: rstd needs no pass of
    its own. Programs of column tile 0 store their K range of the new residual.
  * A head's epilogue. Each program stores its fp32 partial row [BN] and its sum of squares; the program that
    arrives last among the (D / BN column tiles x S splits) of a head (kernels/workspace.py counters, region
    "attn_in") sums the [S, D] partials, scales them by rstd and rounds them to the model dtype (the GEMV's
    output). Then: a q head is normalised and rotated into q_out; a k head likewise into the K cache row
    slot_mapping[0]; a v head goes to the V cache as it is (fp8 caches: value / scale, attention/fp8.py).
Numerics differ from the composed ops in one rounding: the normalised row is not rounded to the model dtype
before the GEMV (its products are fp32 here).
With the exact-integer dot (INT_DOT: paths.int_dot at batch 1, fp16) the K loop is the int-dot GEMV's
(int4.int_dot_tile on the grid of gptq_gemm/triton.INT_DOT_GEMV): the scratch row u holds h * nw rounded to fp16
(the dot's operand: one rounding of the input, as the composed ops' normalised row has), the rows' partial sums
come from its [BN, 16] accumulator (15 rows masked).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels import paths, workspace
from onecard.kernels.attention.fp8 import fmt_code, kernel_view, kv_store_value
from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.kernels.attention.triton import KV_FORMATS
from onecard.kernels.attn_in.ref import head_counts
from onecard.kernels.gptq_gemm.int4 import INT_DOT_ROWS, gemv_tile_mac, int_dot_tile, row_input, rows_input_t
from onecard.kernels.gptq_gemm.small_m import _small_tile_load
from onecard.kernels.gptq_gemm.triton import GEMV_MAX_SPLITS, INT_DOT_GEMV, SmallGrid, row_groups, small_grid
from onecard.kernels.rope.triton import rms_rope
from onecard.kernels.triton_common import (
    AotConfig,
    compute_capability,
    last_arrival,
    pdl,
    pdl_enter,
    settle_cache_keys,
    signature,
)
from onecard.kernels.types import GPTQWeight


def _int_dot(dt: torch.dtype, device: torch.device) -> bool:
    """Does the K loop take the exact-integer dot (paths.int_dot at batch 1, an fp16 model)?"""
    return dt == torch.float16 and paths.int_dot(1, compute_capability(device))


def _grid(x: torch.Tensor, w: object, bias: torch.Tensor | None, k_cache: torch.Tensor,
          int_dot: bool = False) -> SmallGrid | None:
    """The launch shape (the batch-1 GEMV's, or its int-dot config's) where the kernel applies, else None: one
    token, GPTQ weights whose K tiles each lie in one group (no g_idx), no bias, whole heads per column tile (D a
    power of two, a multiple of the GEMV's BN), q | k | v columns."""
    if x.shape[0] != 1 or bias is not None or not isinstance(w, GPTQWeight) or x.stride(-1) != 1:
        return None
    hq, hkv, d = head_counts(w.out_features, k_cache)
    g = small_grid(1, w.out_features, w.in_features, x.device, config=INT_DOT_GEMV if int_dot else None)
    ok = (w.g_idx is None and not row_groups(w, g.block_k8)[0] and d & (d - 1) == 0 and d % g.block_n == 0
          and hq >= 1 and (hq + 2 * hkv) * d == w.out_features and k_cache.is_contiguous()
          and w.in_features % 8 == 0)
    return g if ok else None


def supported(x: torch.Tensor, w: object, bias: torch.Tensor | None, k_cache: torch.Tensor) -> bool:
    """Whether the one-launch kernel takes this call (``_grid``)."""
    return _grid(x, w, bias, k_cache) is not None


@triton.jit
def _row_h(x_ptr, res_ptr, k, k_mask, HAS_RES: tl.constexpr):
    """fp32 h at inputs k: x + residual rounded to the residual's dtype (HAS_RES), else x."""
    h = tl.load(x_ptr + k, mask=k_mask, other=0.0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(res_ptr + k, mask=k_mask, other=0.0).to(tl.float32))
        h = h.to(res_ptr.dtype.element_ty)
    return h.to(tl.float32)


@triton.jit
def _mac(acc, q, s_u, z_u, t, t_begin, t_end, u_ptr, offs_r, k8, BLOCK_K8: tl.constexpr, BLOCK_N: tl.constexpr,
         INT_DOT: tl.constexpr):
    """The GEMV's tile step on this program's scratch row u (h * nw of its K range, from the prologue)."""
    r = t * BLOCK_K8 + offs_r                                             # [BK8] packed rows
    r_mask = (r < k8) & (t < t_end)                                       # inputs masked: exact zeros
    if INT_DOT:
        one = tl.arange(0, INT_DOT_ROWS)                                  # u is row 0; rows 1-15 masked
        return acc + int_dot_tile(q, s_u, z_u, (u_ptr, one, one < 1, 0), (t - t_begin) * BLOCK_K8 + offs_r, r_mask,
                                  rows_input_t)
    else:
        return gemv_tile_mac(acc, q, s_u, z_u, u_ptr, (t - t_begin) * BLOCK_K8 + offs_r, r_mask, row_input,
                             BLOCK_K8, BLOCK_N)


@triton.jit
def _norm_qkv_kernel(x_ptr, res_ptr, nw_ptr, res_out_ptr, qw_ptr, qz_ptr, sc_ptr, u_ptr, part_ptr, ssq_ptr, cnt_ptr,
                     q_out_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, cs_ptr, qn_ptr, kn_ptr,
                     N, K, group_size, num_groups, tiles_per_split, HQ, HKV, eps, k_scale, v_scale,
                     BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, BLOCK_S: tl.constexpr, HALF: tl.constexpr,
                     HAS_RES: tl.constexpr, KV_FMT: tl.constexpr, PDL: tl.constexpr, INT_DOT: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.num_programs(0)
    splits = tl.num_programs(1)
    D: tl.constexpr = 2 * HALF
    DT: tl.constexpr = q_out_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN]
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_K8)
    k8 = K // 8
    z_shift = (offs_n % 8) * 4
    t_begin = pid_k * tiles_per_split                                     # every split has >= 1 tile
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(k8, BLOCK_K8))
    # the first two tiles' weights stream before the PDL wait (as the GEMV's)
    q0, s0, z0 = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t_begin, t_end, offs_r, offs_n, n_mask, z_shift, k8, N,
                                  group_size, num_groups, BLOCK_K8)
    q1, s1, z1 = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t_begin + 1, t_end, offs_r, offs_n, n_mask, z_shift, k8,
                                  N, group_size, num_groups, BLOCK_K8)
    pdl_enter(PDL)
    # prologue: this split's inputs u = h * nw into the program's scratch row (so the K loop loads one fp32 per
    # input, as the GEMV does: computing them per (row, nibble) there tripled its instructions), the sum of h^2 and,
    # in column tile 0, the split's range of the new residual
    TILE_K: tl.constexpr = BLOCK_K8 * 8
    u_ptr = u_ptr + (pid_k * grid_n + pid_n).to(tl.int64) * tiles_per_split * TILE_K
    offs_k = tl.arange(0, TILE_K)
    sq = tl.zeros((TILE_K,), dtype=tl.float32)
    for t in range(t_begin, t_end):
        k = t * TILE_K + offs_k
        k_mask = k < K
        h = _row_h(x_ptr, res_ptr, k, k_mask, HAS_RES)
        sq += h * h
        u = h * tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        tl.store(u_ptr + (t - t_begin) * TILE_K + offs_k, u.to(u_ptr.dtype.element_ty))   # fp16 with INT_DOT
        if HAS_RES and pid_n == 0:
            tl.store(res_out_ptr + k, h.to(res_out_ptr.dtype.element_ty), mask=k_mask)
    tl.debug_barrier()                                                    # the scratch row, written by every thread
    if INT_DOT:
        acc = tl.zeros((BLOCK_N, INT_DOT_ROWS), dtype=tl.float32)        # transposed (int4.int_dot_tile)
    else:
        acc = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)
    acc = _mac(acc, q0, s0, z0, t_begin, t_begin, t_end, u_ptr, offs_r, k8, BLOCK_K8, BLOCK_N, INT_DOT)
    acc = _mac(acc, q1, s1, z1, t_begin + 1, t_begin, t_end, u_ptr, offs_r, k8, BLOCK_K8, BLOCK_N, INT_DOT)
    for t in range(t_begin + 2, t_end):
        q, s_u, z_u = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t, t_end, offs_r, offs_n, n_mask, z_shift, k8, N,
                                       group_size, num_groups, BLOCK_K8)
        acc = _mac(acc, q, s_u, z_u, t, t_begin, t_end, u_ptr, offs_r, k8, BLOCK_K8, BLOCK_N, INT_DOT)
    tl.store(part_ptr + pid_k * N + offs_n, tl.sum(acc, axis=1 if INT_DOT else 0), mask=n_mask)
    tl.store(ssq_ptr + pid_k * grid_n + pid_n, tl.sum(sq, axis=0))
    head = (pid_n * BLOCK_N) // D
    if last_arrival(cnt_ptr + head, splits * (D // BLOCK_N)):
        offs_s = tl.arange(0, BLOCK_S)
        s_mask = offs_s < splits
        ssq = tl.load(ssq_ptr + offs_s * grid_n + pid_n, mask=s_mask, other=0.0, cache_modifier=".cg")
        rstd = 1.0 / tl.sqrt(tl.sum(ssq, axis=0) / K + eps)
        offs_d = tl.arange(0, HALF)
        p = part_ptr + offs_s[:, None] * N + head * D + offs_d[None, :]   # [BS, D/2]: the head's halves
        y1 = tl.sum(tl.load(p, mask=s_mask[:, None], other=0.0, cache_modifier=".cg"), axis=0)
        y2 = tl.sum(tl.load(p + HALF, mask=s_mask[:, None], other=0.0, cache_modifier=".cg"), axis=0)
        y1 = (y1 * rstd).to(DT).to(tl.float32)[None, :]                   # [1, D/2]: the GEMV's output
        y2 = (y2 * rstd).to(DT).to(tl.float32)[None, :]
        slot = tl.load(slot_ptr).to(tl.int64)
        if head < HQ + HKV:
            pos = tl.load(pos_ptr).to(tl.int64)
            cos = tl.load(cs_ptr + pos * D + offs_d)
            sin = tl.load(cs_ptr + pos * D + HALF + offs_d)
            if head < HQ:
                o1, o2 = rms_rope(y1, y2, qn_ptr, cos, sin, eps, HALF)
                o = q_out_ptr + head * D + offs_d[None, :]
                tl.store(o, o1.to(DT))
                tl.store(o + HALF, o2.to(DT))
            elif slot >= 0:
                o1, o2 = rms_rope(y1, y2, kn_ptr, cos, sin, eps, HALF)
                o = kc_ptr + slot * HKV * D + (head - HQ) * D + offs_d[None, :]
                tl.store(o, kv_store_value(o1, k_scale, KV_FMT, kc_ptr.dtype.element_ty))
                tl.store(o + HALF, kv_store_value(o2, k_scale, KV_FMT, kc_ptr.dtype.element_ty))
        elif slot >= 0:
            o = vc_ptr + slot * HKV * D + (head - HQ - HKV) * D + offs_d[None, :]
            tl.store(o, kv_store_value(y1, v_scale, KV_FMT, vc_ptr.dtype.element_ty))
            tl.store(o + HALF, kv_store_value(y2, v_scale, KV_FMT, vc_ptr.dtype.element_ty))


def norm_qkv_rope_store(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w: GPTQWeight, bias: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, H] (the model dtype, or fp32 with a residual), residual [1, H] | None -> (q_out [1, Hq, D],
    residual_out [1, H]); the caches are written in place. Only where ``supported``."""
    dt = residual.dtype if residual is not None else x.dtype
    int_dot = _int_dot(dt, x.device)
    g = _grid(x, w, bias, k_cache, int_dot)
    assert g is not None, (x.shape, type(w), bias is None)
    assert v_cache.is_contiguous() and cos_sin_cache.is_contiguous() and cos_sin_cache.dtype == torch.float32
    dev, h = x.device, x.shape[1]
    n = w.out_features
    hq, hkv, d = head_counts(n, k_cache)
    q_out = torch.empty(1, hq, d, dtype=dt, device=dev)
    res_out = torch.empty(1, h, dtype=dt, device=dev) if residual is not None else x
    part = torch.empty(g.splits, n, dtype=torch.float32, device=dev)      # [S, N] partial rows
    ssq = torch.empty(g.splits, g.grid_n, dtype=torch.float32, device=dev)
    u = torch.empty(g.splits * g.grid_n * g.tiles_per_split * g.block_k8 * 8,
                    dtype=torch.float16 if int_dot else torch.float32, device=dev)
    use_pdl = pdl(dev, 1)
    _norm_qkv_kernel[(g.grid_n, g.splits)](
        x, residual if residual is not None else x, norm_weight, res_out, w.qweight, w.qzeros, w.scales, u, part, ssq,
        workspace.counters(dev, "attn_in", n // d), q_out, kernel_view(k_cache), kernel_view(v_cache),
        slot_mapping, positions, cos_sin_cache, q_weight, k_weight,
        n, h, w.group_size, w.num_groups, g.tiles_per_split, hq, hkv, eps, float(k_scale), float(v_scale),
        BLOCK_N=g.block_n, BLOCK_K8=g.block_k8, BLOCK_S=GEMV_MAX_SPLITS, HALF=d // 2,
        HAS_RES=residual is not None, KV_FMT=fmt_code(k_cache), PDL=use_pdl, INT_DOT=int_dot,
        num_warps=g.num_warps, num_stages=g.num_stages, launch_pdl=use_pdl)
    return q_out, res_out


def accumulate_supported(x: torch.Tensor, residual: torch.Tensor | None, w_qkv: object, w_o: object,
                         k_cache: torch.Tensor) -> bool:
    """Whether ``attention_block`` takes this call: one token, paths.batch1_accumulate, both projections GPTQ,
    q | k | v columns of whole heads."""
    if x.shape[0] != 1 or not (isinstance(w_qkv, GPTQWeight) and isinstance(w_o, GPTQWeight)):
        return False
    hq, hkv, d = head_counts(w_qkv.out_features, k_cache)
    return (paths.batch1_accumulate(1) and hq >= 1 and (hq + 2 * hkv) * d == w_qkv.out_features
            and w_o.in_features == hq * d and w_o.out_features == x.shape[1])


def attention_block(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    w_qkv: GPTQWeight, b_qkv: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, md: AttentionMetadata, scale: float, w_o: GPTQWeight,
                    b_o: torch.Tensor | None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch-1 attention block with accumulating GEMVs (paths.batch1_accumulate; only where
    ``accumulate_supported``): contract as ref.attention_block, but out [1, H] comes back as fp32 sums (the next
    rms_norm / norm_moe takes fp32 x). Five launches (four with batch1_attn_qk), each waiting for the one before (PDL on sm90):
      rms_norm      the input norm (+ residual add); it also zeroes acc = fp32 [1, N + H]
      GEMV qkv      K splits add into acc[:, :N] (gptq_gemm/small_m ACCUM: fp32 atomics, no last arriver)
      qk_norm_rope_store  reads the fp32 q | k | v sums, stores q in the model dtype and k, v into the cache
      paged_attention (+ its split-KV reduce); with paths.batch1_attn_qk (decode, model-dtype cache) it takes
                    the raw sums and does qk_norm_rope_store's work itself (attention/triton.RawQK)
      GEMV o_proj   K splits add into acc[:, N:]: two launches after its zeroing, which is complete by then
                    (each launch's wait covers the one before, whose own wait covered its predecessor)."""
    from onecard.kernels.attention.triton import RawQK, paged_attention
    from onecard.kernels.gptq_gemm.triton import small_m_gemm
    from onecard.kernels.norm.triton import rms_norm
    from onecard.kernels.rope.triton import qk_norm_rope_store

    assert accumulate_supported(x, residual, w_qkv, w_o, k_cache)
    n, h = w_qkv.out_features, w_o.out_features
    hq, hkv, d = head_counts(n, k_cache)
    acc = torch.empty(1, n + h, dtype=torch.float32, device=x.device)    # zeroed by the norm's launch
    hn, residual_out = rms_norm(x, norm_weight, eps, residual, zero=acc)
    qkv = small_m_gemm(hn, w_qkv, b_qkv, accumulate=acc[:, :n])           # [1, N] fp32 sums
    q, k, v = (c.reshape(1, -1, d) for c in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    if paths.batch1_attn_qk(compute_capability(x.device)) and fmt_code(k_cache) == 0 and md.num_decode_tokens == 1:
        # the attention launch normalises, rotates and stores q/k itself (one launch fewer)
        raw = RawQK(k, v, q_weight, k_weight, positions, cos_sin_cache, md.slot_mapping, eps)
        o = paged_attention(q, k_cache, v_cache, md, scale, k_scale, v_scale, raw=raw)   # [1, Hq, D]
    else:
        q_out = qk_norm_rope_store(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, k_cache, v_cache,
                                   md.slot_mapping, k_scale, v_scale, out_dtype=hn.dtype)   # [1, Hq, D]
        o = paged_attention(q_out, k_cache, v_cache, md, scale, k_scale, v_scale)    # [1, Hq, D]
    out = small_m_gemm(o.reshape(1, hq * d), w_o, b_o, accumulate=acc[:, n:])    # [1, H] fp32 sums
    return out, residual_out


def aot_configs() -> list[AotConfig]:
    """The served shape (H 2048, 32 q / 4 kv heads of 128, the GEMV's block config) with and without the
    residual (x in fp32 after a batch-1 MoE), into each KV format (attention.triton.KV_FORMATS)."""
    out = []
    g = small_grid(1, 5120, 2048, torch.device("cpu"))
    gi = small_grid(1, 5120, 2048, torch.device("cpu"), config=INT_DOT_GEMV)
    for act, act_cc in (("fp16", 70), ("bf16", 80)):
        for has_res, x_t in ((False, act), (True, "fp32")):
            for kv_tag, kv_fmt, kv_cc in KV_FORMATS:
                cache = f"*{act}" if kv_fmt == 0 else "*u8"
                cx = dict(BLOCK_N=g.block_n, BLOCK_K8=g.block_k8, BLOCK_S=GEMV_MAX_SPLITS, HALF=64,
                          HAS_RES=has_res, KV_FMT=kv_fmt, PDL=False, INT_DOT=False)
                args = dict(x_ptr=f"*{x_t}", res_ptr=f"*{act}", nw_ptr=f"*{act}", res_out_ptr=f"*{act}",
                            qw_ptr="*i32", qz_ptr="*i32", sc_ptr="*fp16", u_ptr="*fp32", part_ptr="*fp32",
                            ssq_ptr="*fp32",
                            cnt_ptr="*i32", q_out_ptr=f"*{act}", kc_ptr=cache, vc_ptr=cache, slot_ptr="*i64",
                            pos_ptr="*i64", cs_ptr="*fp32", qn_ptr=f"*{act}", kn_ptr=f"*{act}", N="i32", K="i32",
                            group_size="i32", num_groups="i32", tiles_per_split="i32", HQ="i32", HKV="i32",
                            eps="fp32", k_scale="fp32", v_scale="fp32")
                out.append(AotConfig(_norm_qkv_kernel, signature(args, cx), cx, g.num_warps, g.num_stages,
                                     max(act_cc, kv_cc), f"norm_qkv[res={has_res},{act}{kv_tag}]"))
                if act == "fp16":                                         # the exact-integer dot's K loop
                    cx_i = dict(cx, INT_DOT=True)
                    out.append(AotConfig(_norm_qkv_kernel, signature(dict(args, u_ptr="*fp16"), cx_i), cx_i,
                                         gi.num_warps, gi.num_stages, max(80, kv_cc),
                                         f"norm_qkv[res={has_res},int_dot,{act}{kv_tag}]"))
    return out


__all__ = ["aot_configs", "norm_qkv_rope_store", "supported"]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
