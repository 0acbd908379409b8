"""Reference RMSNorm with the fused residual add (float32 statistics; the spec).

residual None: residual_out = x; else residual_out = x + residual (rounded to residual's dtype, as the model
adds it: x may be float32, the batch-1 MoE's output); out = residual_out * rsqrt(mean(residual_out^2) + eps)
* weight, returned in residual_out's dtype.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        residual_out = x
    else:
        residual_out = (x.float() + residual.float()).to(residual.dtype)   # [T, H]
    h = residual_out.float()
    var = h.pow(2).mean(dim=-1, keepdim=True)                            # [T, 1]
    out = h * torch.rsqrt(var + eps) * weight.float()
    return out.to(residual_out.dtype), residual_out
