"""Triton SiLU·mul: x [T, 2I] -> silu(x[:, :I]) * x[:, I:] (fp32 math); contract as ref.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels.triton_common import AotConfig, settle_cache_keys, signature

BLOCK = 1024


@triton.jit
def silu_mul(g, u):
    """silu(g) * u on fp32 values: the one SiLU formula of the Triton kernels (this launch, the decode MoE's down
    stage, the batch-1 MoE slices, the sorted MoE's gate/up epilogue). (libdevice's fast exp and division, 6
    instructions a value against 13, were measured in the decode MoE and removed: paths.py, "Not kept".)"""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + offs, silu_mul(g, u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out_dtype``: the result's dtype (default x's; the decode MoE rounds its fp32 sums to the model dtype)."""
    t, two_i = x.shape
    i = two_i // 2
    assert x.stride(1) == 1
    out = torch.empty(t, i, dtype=out_dtype or x.dtype, device=x.device)
    if t > 0:
        _silu_and_mul_kernel[(t, triton.cdiv(i, BLOCK))](x, out, i, x.stride(0), BLOCK=BLOCK)
    return out


def aot_configs() -> list[AotConfig]:
    out = []
    for act, min_cc in (("fp16", 70), ("bf16", 80)):
        for x_t in (act, "fp32"):                 # fp32: the decode MoE's gate/up sums (fused_moe/stages.py)
            cx = dict(BLOCK=BLOCK)
            args = dict(x_ptr=f"*{x_t}", out_ptr=f"*{act}", I="i32", stride_x="i32")
            out.append(AotConfig(_silu_and_mul_kernel, signature(args, cx), cx, 4, 1, min_cc,
                                 f"silu_and_mul[{act}{'' if x_t == act else ',x=fp32'}]"))
    return out

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
