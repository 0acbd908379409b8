"""Reference W4A16 GPTQ GEMM and dequantization (plain PyTorch, float32 math; the spec).

Layout per ``onecard.kernels.types``: nibble ``k % 8`` (shift 4*(k%8)) of ``qweight[k // 8, n]`` is q[k, n];
nibble ``n % 8`` of ``qzeros[g, n // 8]`` is the TRUE zero z[g, n]; W[k, n] = (q - z[g(k), n]) * s[g(k), n]
with g(k) = g_idx[k] or k // group_size. A leading expert dimension is allowed everywhere.
"""
from __future__ import annotations

import torch

from onecard.kernels.types import GPTQWeight

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)    # [8] nibble j sits at bit 4j


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., R, C] packed along rows -> int32 [..., 8R, C] of nibbles (row 8r + j = nibble j)."""
    shifts = _SHIFTS.to(packed.device)
    nib = (packed.unsqueeze(-2) >> shifts.view(8, 1)) & 0xF              # [..., R, 8, C]
    return nib.reshape(*packed.shape[:-2], packed.shape[-2] * 8, packed.shape[-1])


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., R, C] packed along columns -> int32 [..., R, 8C] (column 8c + j = nibble j)."""
    shifts = _SHIFTS.to(packed.device)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF                          # [..., R, C, 8]
    return nib.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def group_index(w: GPTQWeight) -> torch.Tensor:
    """int64 [(E,) K]: the quantization group of every input row."""
    if w.g_idx is not None:
        return w.g_idx.long()
    k = torch.arange(w.in_features, device=w.qweight.device)
    g = torch.div(k, w.group_size, rounding_mode="floor")
    if w.qweight.dim() == 3:
        g = g.expand(w.qweight.shape[0], -1)
    return g


def dequantize_gptq(w: GPTQWeight) -> torch.Tensor:
    """float32 [(E,) K, N] dense weights such that y = x @ W."""
    q = unpack_rows(w.qweight)[..., : w.in_features, :].float()           # [(E,) K, N]
    z = unpack_cols(w.qzeros)[..., : w.out_features].float()              # [(E,) G, N]
    s = w.scales.float()                                                  # [(E,) G, N]
    g = group_index(w)                                                    # [(E,) K]
    idx = g.unsqueeze(-1).expand(*g.shape, w.out_features)                # [(E,) K, N]
    return (q - torch.gather(z, -2, idx)) * torch.gather(s, -2, idx)


def w4a16_gemm(x: torch.Tensor, w: GPTQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w) [K, N] (+ bias) -> [M, N] in x.dtype; fp32 accumulation."""
    y = x.float() @ dequantize_gptq(w)                                     # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def expert_slice(w: GPTQWeight, e: int) -> GPTQWeight:
    """The 2-D GPTQWeight of expert ``e`` from a stacked one."""
    return GPTQWeight(w.qweight[e], w.qzeros[e], w.scales[e], None if w.g_idx is None else w.g_idx[e],
                      w.group_size, w.in_features, w.out_features)
