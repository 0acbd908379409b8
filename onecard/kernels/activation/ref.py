"""Reference SiLU·mul: x [T, 2I] -> silu(x[:, :I]) * x[:, I:] [T, I] (float32 math, output in x.dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)                                  # [T, I] each
    return (F.silu(gate) * up).to(x.dtype)
