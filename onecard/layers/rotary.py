"""RoPE cos/sin cache as HF computes it (default and yarn), for neox-style rotation.

Contract: ``rope_cache(hf_config, head_dim, max_positions) -> cos_sin [P, D] fp32 = cat(cos, sin)``, with
yarn's attention factor folded into cos and sin as transformers does.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def rope_params(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters)."""
    params = hf_config.get("rope_parameters") or {}
    theta = float(hf_config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = hf_config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _yarn(theta: float, dim: int, scaling: dict[str, Any], max_pos_cfg: int) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    orig = int(scaling.get("original_max_position_embeddings") or max_pos_cfg)
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if (mscale and mscale_all) \
            else get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = inter * (1 - extra_factor) + extra * extra_factor
    return inv_freq, float(attn)


def rope_cache(hf_config: dict[str, Any], head_dim: int, max_positions: int) -> torch.Tensor:
    theta, scaling = rope_params(hf_config)
    scale = 1.0
    if scaling is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    else:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "yarn":
            inv_freq, scale = _yarn(theta, head_dim, scaling,
                                    int(hf_config.get("max_position_embeddings", max_positions)))
        elif kind == "linear":
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim)) / float(scaling["factor"])
        else:
            from onecard.env import ConfigError

            raise ConfigError(f"rope_scaling type {kind!r} is not supported; onecard supports default, linear and yarn.")
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)                                      # [P, D/2]
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)    # [P, D]
