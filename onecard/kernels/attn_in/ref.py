"""Reference attention input of a decoder layer (the spec): the input RMSNorm with its residual add, the fused
qkv projection, per-head q/k RMSNorm + neox RoPE and the K/V store into the paged cache, composed of the ops
that define each step (norm/ref.py, gptq_gemm/ref.py or F.linear, rope/ref.py).

norm_qkv_rope_store(x[T,H], residual[T,H]|None, norm_weight[H], eps, w, bias[N]|None, q_weight[D],
    k_weight[D], positions[T], cos_sin_cache[P,D], k_cache[NB,BS,Hkv,D], v_cache, slot_mapping[T],
    k_scale=1.0, v_scale=1.0) -> (q_out[T,Hq,D], residual_out[T,H])
  w: the fused projection, GPTQWeight [H -> N] or float [N, H]; N = (Hq + 2 Hkv) D, q | k | v columns;
  Hkv and D come from the cache. ``ops``: where the steps come from (dispatch passes itself, so its backend
  choice and GEMM paths apply to each step).

attention_block(x, residual, norm_weight, eps, w_qkv, b_qkv, q_weight, k_weight, positions, cos_sin_cache,
    k_cache, v_cache, md, scale, w_o, b_o, k_scale=1.0, v_scale=1.0) -> (out[T,H], residual_out[T,H])
  A decoder layer's attention block: norm_qkv_rope_store, paged attention over md, the o projection w_o
  (GPTQWeight, or float [H, Hq D]) with bias b_o. out is in the model dtype here (attn_in/triton.py's batch-1
  path returns fp32 sums).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.kernels.attention.ref import paged_attention
from onecard.kernels.gptq_gemm.ref import w4a16_gemm
from onecard.kernels.norm.ref import rms_norm
from onecard.kernels.rope.ref import qk_norm_rope_store
from onecard.kernels.types import GPTQWeight

_REF = SimpleNamespace(rms_norm=rms_norm, w4a16_gemm=w4a16_gemm, qk_norm_rope_store=qk_norm_rope_store,
                       paged_attention=paged_attention)


def head_counts(out_features: int, k_cache: torch.Tensor) -> tuple[int, int, int]:
    """-> (Hq, Hkv, D) of a fused q | k | v projection with ``out_features`` columns writing into k_cache."""
    hkv, d = int(k_cache.shape[2]), int(k_cache.shape[3])
    return out_features // d - 2 * hkv, hkv, d


def norm_qkv_rope_store(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w: GPTQWeight | torch.Tensor, bias: torch.Tensor | None, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: float = 1.0, v_scale: float = 1.0,
                        ops: object = _REF) -> tuple[torch.Tensor, torch.Tensor]:
    t = x.shape[0]
    n = w.out_features if isinstance(w, GPTQWeight) else int(w.shape[0])
    hq, hkv, d = head_counts(n, k_cache)
    h, residual_out = ops.rms_norm(x, norm_weight, eps, residual)                         # [T, H]
    qkv = ops.w4a16_gemm(h, w, bias) if isinstance(w, GPTQWeight) else F.linear(h, w, bias)   # [T, N]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q_out = ops.qk_norm_rope_store(q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d), q_weight,
                                   k_weight, positions, cos_sin_cache, eps, k_cache, v_cache, slot_mapping,
                                   k_scale, v_scale)
    return q_out, residual_out


_REF.norm_qkv_rope_store = norm_qkv_rope_store                          # the composition itself, for attention_block


def attention_block(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    w_qkv: GPTQWeight | torch.Tensor, b_qkv: torch.Tensor | None, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                    w_o: GPTQWeight | torch.Tensor, b_o: torch.Tensor | None, k_scale: float = 1.0,
                    v_scale: float = 1.0, ops: object = _REF) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops``: as norm_qkv_rope_store's (default: these references; dispatch passes itself, and its
    norm_qkv_rope_store then picks its own path)."""
    t = x.shape[0]
    q, residual_out = ops.norm_qkv_rope_store(x, residual, norm_weight, eps, w_qkv, b_qkv, q_weight, k_weight,
                                              positions, cos_sin_cache, k_cache, v_cache, md.slot_mapping,
                                              k_scale, v_scale)
    o = ops.paged_attention(q, k_cache, v_cache, md, scale, k_scale, v_scale).reshape(t, -1)   # [T, Hq D]
    out = ops.w4a16_gemm(o, w_o, b_o) if isinstance(w_o, GPTQWeight) else F.linear(o, w_o, b_o)
    return out, residual_out
