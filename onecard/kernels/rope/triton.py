"""Triton per-head q/k RMSNorm + neox RoPE (fp32 math), one program per token; contract as ref.py.

Each program normalises all Hq + Hkv heads of its token as a [HEADS, D/2] x 2 pair of halves, so the
rotation needs no data exchange: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin.
``qk_norm_rope_store`` writes k (after norm + RoPE) and v straight into the paged KV cache; an fp8 cache is
written as attention/fp8.py encodes it (value / scale, from the fp32 result).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels.attention.fp8 import fmt_code, kernel_view, kv_store_value
from onecard.kernels.attention.triton import KV_FORMATS
from onecard.kernels.triton_common import AotConfig, next_pow2, pdl, pdl_enter, settle_cache_keys, signature


@triton.jit
def rms_rope(x1, x2, w_ptr, cos, sin, eps, HALF: tl.constexpr):
    """Per-head RMSNorm * weight, then neox RoPE, on fp32 halves x1, x2 [R, D/2] of R head vectors (cos, sin
    [D/2] fp32) -> (out1, out2) [R, D/2] fp32."""
    offs_d = tl.arange(0, HALF)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + offs_d).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)
    x1 = x1 * rstd[:, None] * w1[None, :]
    x2 = x2 * rstd[:, None] * w2[None, :]
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _norm_rope_heads(x_ptr, o_ptr, w_ptr, stride_t, stride_h, tok, o_row, row_ok, cos, sin, eps, H, o_scale,
                     BLOCK_H: tl.constexpr, HALF: tl.constexpr, FMT: tl.constexpr):
    """Heads [H, D] of token tok -> output row o_row of o_ptr (rows of H * D), stored only where row_ok;
    FMT != 0: o_ptr is an fp8 cache's bytes (value / o_scale, fp8.kv_encode)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < H)[:, None]
    base = x_ptr + tok * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)               # [BH, D/2]
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rms_rope(x1, x2, w_ptr, cos, sin, eps, HALF)
    ob = o_ptr + o_row * H * 2 * HALF + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    mask = mask & row_ok
    ty = o_ptr.dtype.element_ty
    tl.store(ob, kv_store_value(o1, o_scale, FMT, ty), mask=mask)
    tl.store(ob + HALF, kv_store_value(o2, o_scale, FMT, ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, qo_ptr, ko_ptr,
                         v_ptr, vc_ptr, slot_ptr, stride_vt,
                         stride_qt, stride_qh, stride_kt, stride_kh, HQ, HKV, eps, k_scale, v_scale,
                         HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                         STORE_KV: tl.constexpr, PDL: tl.constexpr, KV_FMT: tl.constexpr):
    """STORE_KV: ko_ptr is the K cache and k goes to row slot_mapping[tok] of it (skipped when < 0), and v
    [T, HKV, D] is copied to the same row of the V cache: the KV store needs no launch of its own.
    PDL: the step's inputs (position, slot) and the rotation's cos/sin are not the previous kernel's output, so
    their dependent loads (position, then cos/sin) are issued before the wait; q, k, v after it."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok, cache_modifier=".cg").to(tl.int64)      # .cg: rewritten every step
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * 2 * HALF + offs_d)
    sin = tl.load(cs_ptr + pos * 2 * HALF + HALF + offs_d)
    if STORE_KV:
        slot = tl.load(slot_ptr + tok, cache_modifier=".cg").to(tl.int64)
    pdl_enter(PDL)
    _norm_rope_heads(q_ptr, qo_ptr, qw_ptr, stride_qt, stride_qh, tok, tok, True, cos, sin, eps, HQ, 1.0,
                     BLOCK_HQ, HALF, 0)
    if STORE_KV:
        _norm_rope_heads(k_ptr, ko_ptr, kw_ptr, stride_kt, stride_kh, tok, slot, slot >= 0, cos, sin, eps, HKV,
                         k_scale, BLOCK_HKV, HALF, KV_FMT)
        offs = tl.arange(0, BLOCK_HKV * 2 * HALF)
        vm = (offs < HKV * 2 * HALF) & (slot >= 0)
        v = tl.load(v_ptr + tok * stride_vt + offs, mask=vm)
        tl.store(vc_ptr + slot * HKV * 2 * HALF + offs, kv_store_value(v, v_scale, KV_FMT, vc_ptr.dtype.element_ty),
                 mask=vm)
    else:
        _norm_rope_heads(k_ptr, ko_ptr, kw_ptr, stride_kt, stride_kh, tok, tok, True, cos, sin, eps, HKV, 1.0,
                         BLOCK_HKV, HALF, 0)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_out = _launch(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, k_out, None, None, None, 1.0, 1.0)
    return q_out, k_out


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out_dtype``: q_out's (default q's; q, k, v may be fp32 sums: attn_in/triton.attention_block)."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v.stride(2) == 1
    assert v.stride(1) == v.shape[2], "v heads must be contiguous within a token"
    return _launch(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, k_cache, v, v_cache, slot_mapping,
                   k_scale, v_scale, out_dtype)


def _launch(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, k_out, v, v_cache, slot_mapping, k_scale,
            v_scale, out_dtype=None):
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert d == next_pow2(d) and q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.is_contiguous()
    assert cos_sin_cache.dtype == torch.float32
    q_out = torch.empty(t, hq, d, dtype=out_dtype or q.dtype, device=q.device)
    store = v is not None
    fmt = fmt_code(k_out) if store else 0
    if t > 0:
        use_pdl = pdl(q.device, t)
        k_out = kernel_view(k_out)
        _qk_norm_rope_kernel[(t,)](q, k, q_weight, k_weight, positions, cos_sin_cache, q_out, k_out,
                                   v if store else k, kernel_view(v_cache) if store else k_out,
                                   slot_mapping if store else positions, v.stride(0) if store else 0,
                                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), hq, hkv, eps,
                                   float(k_scale), float(v_scale),
                                   HALF=d // 2, BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv), STORE_KV=store,
                                   PDL=use_pdl, KV_FMT=fmt, launch_pdl=use_pdl)
    return q_out


def aot_configs() -> list[AotConfig]:
    """Qwen3-30B-A3B: 32 q heads, 4 kv heads, head_dim 128; with and without the fused KV store, the store
    into each KV format (attention.triton.KV_FORMATS: native, fp8_e5m2 on every target, fp8_e4m3 sm89+)."""
    out = []
    for act, act_cc in (("fp16", 70), ("bf16", 80)):
        # q, k, v as fp32 sums: the batch-1 attention block's (paths.batch1_accumulate), storing into the cache
        for store, src in ((False, act), (True, act), (True, "fp32")):
            for kv_tag, kv_fmt, kv_cc in (KV_FORMATS if store else KV_FORMATS[:1]):
                cache = f"*{act}" if kv_fmt == 0 else "*u8"
                cx = dict(HALF=64, BLOCK_HQ=32, BLOCK_HKV=4, STORE_KV=store, PDL=False, KV_FMT=kv_fmt)
                args = dict(q_ptr=f"*{src}", k_ptr=f"*{src}", qw_ptr=f"*{act}", kw_ptr=f"*{act}", pos_ptr="*i64",
                            cs_ptr="*fp32", qo_ptr=f"*{act}", ko_ptr=cache, v_ptr=f"*{src}", vc_ptr=cache,
                            slot_ptr="*i64", stride_vt="i32", stride_qt="i32", stride_qh="i32", stride_kt="i32",
                            stride_kh="i32", HQ="i32", HKV="i32", eps="fp32", k_scale="fp32", v_scale="fp32")
                tag = ",src=fp32" if src == "fp32" else ""
                out.append(AotConfig(_qk_norm_rope_kernel, signature(args, cx), cx, 4, 1, max(act_cc, kv_cc),
                                     f"qk_norm_rope[store={store}{tag},{act}{kv_tag}]"))
    return out

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
