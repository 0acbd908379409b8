"""Triton RMSNorm with the fused residual add (one program per row, fp32 statistics); contract as ref.py.

``residual_add`` and ``inv_rms`` (a row's add and statistics) also serve fused_moe/batch1.py's RMSNorm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels.triton_common import AotConfig, next_pow2, pdl, pdl_enter, settle_cache_keys, signature


@triton.jit
def residual_add(x_ptr, res_ptr, row, stride_x, stride_r, offs, mask, RES_DT: tl.constexpr,
                 HAS_RES: tl.constexpr):
    """residual_out [BLOCK] of row ``row``: HAS_RES: x + residual added in fp32 and rounded to RES_DT, the
    residual's dtype (x may be fp32); else x as loaded."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(RES_DT)                                                  # the model adds in its dtype
    return x


@triton.jit
def inv_rms(h, H, eps):
    """1 / sqrt(mean(h^2) + eps) over the H values of fp32 h [BLOCK] (zeros past H)."""
    return 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, eps, stride_x, stride_r, zero_ptr, zero_n,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr, ZERO: tl.constexpr = False):
    """ZERO: program 0 also sets fp32 zero_ptr[0:zero_n] to 0 (after the wait: the memory may be an earlier
    launch's), for GEMVs after it that accumulate there (paths.batch1_accumulate)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)       # a weight: may load before the wait
    pdl_enter(PDL)
    if ZERO:                                                              # program 0 stores the zeros
        for z in range(0, zero_n, BLOCK):
            tl.store(zero_ptr + z + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=(z + offs < zero_n) & (row == 0))
    x = residual_add(x_ptr, res_ptr, row, stride_x, stride_r, offs, mask, res_out_ptr.dtype.element_ty,
                     HAS_RES)
    if HAS_RES:
        tl.store(res_out_ptr + row * H + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = inv_rms(h, H, eps)
    tl.store(out_ptr + row * H + offs, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``zero``: a contiguous fp32 tensor the launch also sets to 0 (for accumulating GEMVs after it)."""
    t, h = x.shape
    assert zero is None or (zero.dtype == torch.float32 and zero.is_contiguous() and t > 0)
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    dt = x.dtype if residual is None else residual.dtype                 # x may be fp32 (ref.py)
    out = torch.empty(t, h, dtype=dt, device=x.device)
    res_out = x if residual is None else torch.empty(t, h, dtype=dt, device=x.device)
    if t > 0:
        res = residual if residual is not None else x
        use_pdl = pdl(x.device, t)
        _rms_norm_kernel[(t,)](x, res, weight, out, res_out, h, eps, x.stride(0), res.stride(0),
                               zero if zero is not None else out, zero.numel() if zero is not None else 0,
                               BLOCK=next_pow2(h), HAS_RES=residual is not None, PDL=use_pdl, ZERO=zero is not None,
                               num_warps=4 if h <= 4096 else 8, launch_pdl=use_pdl)
    return out, res_out


def aot_configs() -> list[AotConfig]:
    """Hidden 2048 (layers), with and without the residual, x in the model dtype or (with the residual) fp32."""
    out = []
    for act, min_cc in (("fp16", 70), ("bf16", 80)):
        for h in (2048,):
            # x in fp32 with a residual: the layer after a batch-1 MoE (fused_moe/batch1.py)
            # ZERO: the batch-1 attention block's input norm (paths.batch1_accumulate; x fp32 after a MoE layer)
            for has_res, x_t, zero in ((False, act, False), (True, act, False), (True, "fp32", False),
                                       (False, act, True), (True, act, True), (True, "fp32", True)):
                cx = dict(BLOCK=h, HAS_RES=has_res, PDL=False, ZERO=zero)  # the AOT test sets PDL per target
                args = dict(x_ptr=f"*{x_t}", res_ptr=f"*{act}", w_ptr=f"*{act}", out_ptr=f"*{act}",
                            res_out_ptr=f"*{act}", H="i32", eps="fp32", stride_x="i32", stride_r="i32",
                            zero_ptr="*fp32" if zero else f"*{act}", zero_n="i32")
                out.append(AotConfig(_rms_norm_kernel, signature(args, cx), cx, 4, 1, min_cc,
                                     f"rms_norm[{h},res={has_res},x={x_t}{',zero' if zero else ''},{act}]"))
    return out

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
