"""Weight containers shared by kernels, layers and the loader.

Contract for GPTQ 4-bit (as on disk in GPTQModel/AutoGPTQ, kept packed on the device):
  W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n],   q[k, n] = (qweight[k // 8, n] >> 4 * (k % 8)) & 0xF,
  z[g, n] = (qzeros[g, n // 8] >> 4 * (n % 8)) & 0xF  (TRUE zeros: the loader adds 1 to v1 checkpoints),
  g(k) = g_idx[k] if g_idx is not None else k // group_size.
A leading expert dimension E is allowed on every tensor (stacked MoE experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class GPTQWeight:
    qweight: torch.Tensor            # int32 [(E,) K/8, N]
    qzeros: torch.Tensor             # int32 [(E,) G, N/8]  true zeros
    scales: torch.Tensor             # fp16/fp32 [(E,) G, N]
    g_idx: torch.Tensor | None       # int32 [(E,) K]; None when trivial (k // group_size)
    group_size: int                  # K when the checkpoint says -1
    in_features: int                 # K
    out_features: int                # N

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[-2])

    def to(self, device: torch.device | str) -> GPTQWeight:
        return GPTQWeight(self.qweight.to(device), self.qzeros.to(device), self.scales.to(device),
                          None if self.g_idx is None else self.g_idx.to(device), self.group_size,
                          self.in_features, self.out_features)

    def nbytes(self) -> int:
        t = [self.qweight, self.qzeros, self.scales] + ([self.g_idx] if self.g_idx is not None else [])
        return sum(x.numel() * x.element_size() for x in t)


# An MoE weight is either a float tensor [E, K, N] (y = x @ W[e]) or a stacked GPTQWeight.
MoEWeight = torch.Tensor | GPTQWeight
