"""Triton SiLU·mul: x [T, 2I] -> silu(x[:, :I]) * x[:, I:] (fp32 math); contract as ref.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from onecard.kernels.triton_common import NATIVE, AotConfig, settle_cache_keys, signature

BLOCK = 1024


@triton.jit
def silu_mul(g, u, FAST: tl.constexpr = False):
    """silu(g) * u on fp32 values: the one SiLU formula of the Triton kernels (this launch, the decode MoE's down
    stage, the sorted MoE's gate/up epilogue).

    FAST (on a GPU: triton_common.NATIVE; paths.DECODE_FAST_SILU says where it pays): exp and the division as
    libdevice's fast forms (ex2.approx.ftz and a reciprocal approximation, ~2 ulp), 6 instructions a value.
    Triton's own exp and division are the non-ftz forms, each scaling its operand around the approximation to
    keep denormals: 13. The flush cannot move a result beyond fp32 rounding: exp(-g) below 2^-126 (g > 87) is
    lost next to 1.0; where 1 + exp(-g) passes 2^126 the quotient is 0, silu's limit."""
    if FAST and NATIVE:
        return libdevice.fast_dividef(g, 1.0 + libdevice.fast_expf(-g)) * u
    else:
        return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, BLOCK: tl.constexpr, FAST: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + offs, silu_mul(g, u, FAST).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out_dtype: torch.dtype | None = None, fast: bool = False) -> torch.Tensor:
    """``out_dtype``: the result's dtype (default x's; the decode MoE rounds its fp32 sums to the model dtype);
    ``fast``: silu_mul's FAST form (the decode MoE passes paths.decode_fast_silu, so that its stages and this
    launch compute one formula)."""
    t, two_i = x.shape
    i = two_i // 2
    assert x.stride(1) == 1
    out = torch.empty(t, i, dtype=out_dtype or x.dtype, device=x.device)
    if t > 0:
        _silu_and_mul_kernel[(t, triton.cdiv(i, BLOCK))](x, out, i, x.stride(0), BLOCK=BLOCK, FAST=fast)
    return out


def aot_configs() -> list[AotConfig]:
    out = []
    for act, min_cc in (("fp16", 70), ("bf16", 80)):
        for x_t in (act, "fp32"):                 # fp32: the decode MoE's gate/up sums (fused_moe/stages.py)
            for fast in ((False, True) if x_t == "fp32" else (False,)):
                cx = dict(BLOCK=BLOCK, FAST=fast)
                args = dict(x_ptr=f"*{x_t}", out_ptr=f"*{act}", I="i32", stride_x="i32")
                out.append(AotConfig(_silu_and_mul_kernel, signature(args, cx), cx, 4, 1, min_cc,
                                     f"silu_and_mul[{act}{'' if x_t == act else ',x=fp32'}{',fast' if fast else ''}]"))
    return out

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
