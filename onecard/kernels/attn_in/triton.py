"""Triton attention block of a decoder layer at batch 1 with accumulating GEMVs (paths.batch1_accumulate):
``attention_block`` composes the launches (contract as ref.attention_block, except that out comes back as fp32
sums; ``accumulate_supported`` says when; kernels/dispatch.py composes ref.attention_block's ops otherwise).

Why: a batch-1 decode layer is a chain of small kernels, each bound by latency rather than bytes (a 5 MB qkv
GEMV takes ~5 µs on the H100 against ~1.5 µs of bandwidth). Here the two GEMVs add their K splits' partial sums
into one zeroed fp32 row with atomics instead of a last-arriving program per column tile that reads the
partials back (two dependent L2 round trips and a fence per GEMV), and the consumers read the fp32 sums.
(A one-launch attention input, the input RMSNorm folded into the qkv GEMV with each head finished by its last
arriver, lived here until 2026-12-06: faster alone, 1.3% slower in the model; BENCHMARKS.md.)
"""
from __future__ import annotations

import torch

from onecard.kernels import paths
from onecard.kernels.attention.fp8 import fmt_code
from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.kernels.attn_in.ref import head_counts
from onecard.kernels.fused_moe.router_fold import FoldedRoute, RouterFold
from onecard.kernels.triton_common import compute_capability
from onecard.kernels.types import GPTQWeight


def accumulate_supported(x: torch.Tensor, residual: torch.Tensor | None, w_qkv: object, w_o: object,
                         k_cache: torch.Tensor) -> bool:
    """Whether ``attention_block`` takes this call: one token, paths.batch1_accumulate, both projections GPTQ,
    q | k | v columns of whole heads."""
    if x.shape[0] != 1 or not (isinstance(w_qkv, GPTQWeight) and isinstance(w_o, GPTQWeight)):
        return False
    hq, hkv, d = head_counts(w_qkv.out_features, k_cache)
    return (paths.batch1_accumulate(1) and hq >= 1 and (hq + 2 * hkv) * d == w_qkv.out_features
            and w_o.in_features == hq * d and w_o.out_features == x.shape[1])


def attention_block(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    w_qkv: GPTQWeight, b_qkv: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, md: AttentionMetadata, scale: float, w_o: GPTQWeight,
                    b_o: torch.Tensor | None, k_scale: float = 1.0, v_scale: float = 1.0,
                    router_fold: RouterFold | None = None) -> tuple:
    """The batch-1 attention block with accumulating GEMVs (paths.batch1_accumulate; only where
    ``accumulate_supported``): contract as ref.attention_block, but out [1, H] comes back as fp32 sums (the next
    rms_norm / norm_moe takes fp32 x). Five launches (four with batch1_attn_qk), each waiting for the one before (PDL on sm90):
      rms_norm      the input norm (+ residual add); it also zeroes acc = fp32 [1, N + H]
      GEMV qkv      K splits add into acc[:, :N] (gptq_gemm/small_m ACCUM: fp32 atomics, no last arriver)
      qk_norm_rope_store  reads the fp32 q | k | v sums, stores q in the model dtype and k, v into the cache
      paged_attention (+ its split-KV reduce); with paths.batch1_attn_qk (decode, model-dtype cache) it takes
                    the raw sums and does qk_norm_rope_store's work itself (attention/triton.RawQK)
      GEMV o_proj   K splits add into acc[:, N:]: two launches after its zeroing, which is complete by then
                    (each launch's wait covers the one before, whose own wait covered its predecessor).
    ``router_fold`` (paths.batch1_router_fold; no o_proj bias): the o_proj launch also adds the MoE router's
    folded sums into acc[:, N + H:][:E] (fused_moe/router_fold.py), and the call returns (out, residual_out,
    FoldedRoute(those sums, the zeroed fp32 row after them for the MoE's output))."""
    from onecard.kernels.attention.triton import RawQK, paged_attention
    from onecard.kernels.gptq_gemm.triton import small_m_gemm
    from onecard.kernels.norm.triton import rms_norm
    from onecard.kernels.rope.triton import qk_norm_rope_store

    assert accumulate_supported(x, residual, w_qkv, w_o, k_cache)
    n, h = w_qkv.out_features, w_o.out_features
    hq, hkv, d = head_counts(n, k_cache)
    e = router_fold.f.shape[0] if router_fold is not None else 0
    extra = e + h if router_fold is not None else 0                       # the router's sums, the MoE's output
    acc = torch.empty(1, n + h + extra, dtype=torch.float32, device=x.device)   # zeroed by the norm's launch
    hn, residual_out = rms_norm(x, norm_weight, eps, residual, zero=acc)
    qkv = small_m_gemm(hn, w_qkv, b_qkv, accumulate=acc[:, :n])           # [1, N] fp32 sums
    q, k, v = (c.reshape(1, -1, d) for c in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    if paths.batch1_attn_qk(compute_capability(x.device)) and fmt_code(k_cache) == 0 and md.num_decode_tokens == 1:
        # the attention launch normalises, rotates and stores q/k itself (one launch fewer)
        raw = RawQK(k, v, q_weight, k_weight, positions, cos_sin_cache, md.slot_mapping, eps)
        o = paged_attention(q, k_cache, v_cache, md, scale, k_scale, v_scale, raw=raw)   # [1, Hq, D]
    else:
        q_out = qk_norm_rope_store(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, k_cache, v_cache,
                                   md.slot_mapping, k_scale, v_scale, out_dtype=hn.dtype)   # [1, Hq, D]
        o = paged_attention(q_out, k_cache, v_cache, md, scale, k_scale, v_scale)    # [1, Hq, D]
    if router_fold is None:
        out = small_m_gemm(o.reshape(1, hq * d), w_o, b_o, accumulate=acc[:, n:])    # [1, H] fp32 sums
        return out, residual_out
    assert b_o is None, "the folded router takes an o_proj without bias"
    folded = FoldedRoute(acc[:, n + h:n + h + e], acc[:, n + h + e:])
    out = small_m_gemm(o.reshape(1, hq * d), w_o, None, accumulate=acc[:, n:n + h],
                       router=(router_fold.m, router_fold.f, residual_out, folded.raw))
    return out, residual_out, folded


__all__ = ["accumulate_supported", "attention_block"]
