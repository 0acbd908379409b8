"""A linear layer whose weight is float (HF layout [N, K]) or packed GPTQ (kept packed on the device).

Contract: ``Linear(in_features, out_features)``; the loader sets ``weight`` (float [N, K]) or ``gptq``
(GPTQWeight) and optionally ``bias`` [N]; ``forward(x[T, K]) -> [T, N]`` in x.dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecard.kernels import dispatch as ops
from onecard.kernels.types import GPTQWeight


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: torch.Tensor | None = None     # [N, K] float
        self.gptq: GPTQWeight | None = None
        self.bias: torch.Tensor | None = None       # [N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gptq is not None:
            return ops.w4a16_gemm(x, self.gptq, self.bias)
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        n = self.gptq.nbytes() if self.gptq is not None else self.weight.numel() * self.weight.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
