"""FP8 KV-cache formats in the kernels: the reference conversions (torch; the spec) and their Triton twins.

A cache tensor carries its format in its dtype: the model dtype, or ``torch.float8_e5m2`` / ``float8_e4m3fn``
(allocated as uint8 and viewed, onecard/kv_dtype.py has the formats). Triton kernels take an fp8 cache as its
bytes (``kernel_view``: uint8, so no fp8 type reaches a compiler for sm70) and a ``KV_FMT`` constexpr
(``fmt_code``): 0 = native (stored with ``.to``), 1 = e5m2, 2 = e4m3. Both fp8 formats store value / scale
and load stored x scale (per layer; 1.0 when the checkpoint has none).
  e5m2 store: h = fp16(value / scale), rounded to nearest even; the byte is the upper byte of h rounded to
       nearest even: (u + 0x7F + ((u >> 8) & 1)) >> 8 on h's 16 bits u (a NaN stays a NaN; past 57344 it
       rounds to inf), exactly torch's fp16 -> float8_e5m2. Load: the fp16 whose bits are byte << 8.
       Integer shifts only: every GPU runs it.
  e4m3 store: e4m3fn(clamp(value / scale, -448, 448)), nearest even (vLLM's saturating conversion), from the
       fp32 bits with integer ops (normal: round the mantissa to 3 bits and rebias; below 2^-6: the nearest
       multiple of 2^-9): the same bytes on every target, the interpreter included (whose fp8e4nv cast does not
       round to nearest even). Load: Triton's fp8e4nv -> fp16 conversion (exact), which needs sm89+.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels.triton_common import settle_cache_keys

E5M2 = torch.float8_e5m2
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
_CODES = {E5M2: 1, E4M3: 2}


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype in _CODES


def fmt_code(cache: torch.Tensor) -> int:
    """The KV_FMT constexpr for a cache tensor: 0 native, 1 e5m2, 2 e4m3."""
    return _CODES.get(cache.dtype, 0)


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """What a Triton kernel is given: an fp8 cache as its uint8 bytes (same storage), else the cache."""
    return cache.view(torch.uint8) if cache.dtype in _CODES else cache


# ---------------------------------------------------------------- reference (torch): the spec
def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Values -> the cache's dtype (see the module docstring for the fp8 rules)."""
    if cache_dtype == E5M2:
        return (x.float() / scale).to(torch.float16).to(E5M2)
    if cache_dtype == E4M3:
        return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x.to(cache_dtype)


def dequantize(c: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cache entries -> float32 values."""
    return c.float() * scale if c.dtype in _CODES else c.float()


# ---------------------------------------------------------------- Triton twins
@triton.jit
def kv_encode(x, scale, FMT: tl.constexpr):
    """fp32 values -> the bytes an fp8 cache stores (uint8), FMT 1 (e5m2) or 2 (e4m3)."""
    y = x / scale
    if FMT == 1:
        u = y.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        r = (u + 0x7F + ((u >> 8) & 1)) >> 8
        r = tl.where((u & 0x7FFF) > 0x7C00, (u >> 8) | 0x2, r)          # NaN: keep it a (quiet) NaN
        return r.to(tl.uint8)
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        u = y.to(tl.uint32, bitcast=True)
        a = u & 0x7FFFFFFF                                                 # |y| bits
        # normal (|y| >= 2^-6): nearest-even mantissa of 3 bits, exponent rebiased 127 -> 7 (960 = 120 << 3)
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
        # subnormal: |y| * 2^9 rounded to the nearest even integer (adding 2^23 rounds it in fp32), 0..8
        t = tl.abs(y) * 512.0
        sub = ((t + 8388608.0) - 8388608.0).to(tl.uint32)
        mag = tl.where(a >= 0x3C800000, normal, sub)                       # 0x3C800000 = 2^-6
        return (((u >> 24) & 0x80) | mag).to(tl.uint8)


@triton.jit
def kv_decode(raw, FMT: tl.constexpr):
    """Cache bytes (uint8) -> fp16 values (exact; the scale is applied by the caller)."""
    if FMT == 1:
        return (raw.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    else:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def kv_store_value(x, scale, FMT: tl.constexpr, dtype: tl.constexpr):
    """Values (any float type) -> what a cache of element type ``dtype`` stores (FMT 0: a plain cast)."""
    if FMT == 0:
        return x.to(dtype)
    else:
        return kv_encode(x.to(tl.float32), scale, FMT)

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
