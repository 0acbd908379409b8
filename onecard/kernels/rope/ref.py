"""Reference per-head q/k RMSNorm + neox RoPE (float32 math; the spec).

For each head vector v [D]: v = v * rsqrt(mean(v^2) + eps) * weight; then with c, s = cos_sin_cache[pos]
split in halves (cos [D/2], sin [D/2]) and v = (v1, v2) halves: out = (v1*c - v2*s, v2*c + v1*s).
"""
from __future__ import annotations

import torch


def _norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               eps: float) -> torch.Tensor:
    h = x.float()                                                          # [T, H, D]
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    h1, h2 = h.chunk(2, dim=-1)                                            # [T, H, D/2] each
    c, s = cos[:, None, :], sin[:, None, :]                                # [T, 1, D/2]
    return torch.cat([h1 * c - h2 * s, h2 * c + h1 * s], dim=-1).to(x.dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    cs = cos_sin_cache[positions.long()].float()                           # [T, D]
    cos, sin = cs.chunk(2, dim=-1)                                         # [T, D/2]
    return _norm_rope(q, q_weight, cos, sin, eps), _norm_rope(k, k_weight, cos, sin, eps)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """qk_norm_rope, then store_kv of (k_out, v): -> q_out [T, Hq, D]; the caches are written in place."""
    from onecard.kernels.attention.ref import store_kv

    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin_cache, eps)
    store_kv(k_out, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q_out
