"""Reference W4A16 GPTQ GEMM (plain PyTorch, float32 math; the spec).

The format and its dequantization live in ``format.py`` (W = (q - z[g]) * s[g], true zeros); this file is
the GEMM the Triton kernels are checked against.
"""
from __future__ import annotations

import torch

from onecard.kernels.gptq_gemm.format import dequantize_gptq
from onecard.kernels.types import GPTQWeight


def w4a16_gemm(x: torch.Tensor, w: GPTQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w) [K, N] (+ bias) -> [M, N] in x.dtype; fp32 accumulation."""
    y = x.float() @ dequantize_gptq(w)                                     # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
