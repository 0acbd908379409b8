"""Reference KV-cache store and paged attention (plain PyTorch, float32 math; the spec).

Caches are [num_blocks, block_size, Hkv, D]; slot s = block * block_size + offset. Sequence i owns query
rows query_start_loc[i]:query_start_loc[i+1]; its keys are positions 0..seq_lens[i]-1 read through
block_table[i]; query row j sits at position seq_lens[i] - query_len + j and attends to keys <= it.
Query head h uses KV head h // (Hq // Hkv). Rows outside every sequence (padding) come back as zeros.
"""
from __future__ import annotations

import torch

from onecard.runner.attn_metadata import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping[T] (entries < 0 are skipped), in place."""
    nb, bs, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(nb * bs, hkv, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, hkv, d)[slots] = v[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [NB, BS, Hkv, D] -> the first seq_len tokens of one sequence, float32 [L, Hkv, D]."""
    bs = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_row.long()[pos // bs]
    return cache[blocks, pos % bs].float()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q.dtype: causal GQA attention over each sequence's paged context."""
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = md.query_start_loc.tolist()
    for i, seq_len in enumerate(md.seq_lens.tolist()):
        q0, q1 = starts[i], starts[i + 1]
        if q1 == q0:
            continue
        k = gather_kv(k_cache, md.block_table[i], seq_len).repeat_interleave(group, dim=1)   # [L, Hq, D]
        v = gather_kv(v_cache, md.block_table[i], seq_len).repeat_interleave(group, dim=1)   # [L, Hq, D]
        qs = q[q0:q1].float()                                                               # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale                                # [Hq, n, L]
        q_pos = seq_len - (q1 - q0) + torch.arange(q1 - q0, device=q.device)                 # [n]
        k_pos = torch.arange(seq_len, device=q.device)                                      # [L]
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)


def compose_norm_qkv(ops, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     w, bias: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_qkv_rope_store from the ops of ``ops`` (this module's ref ops, or kernels.dispatch's)."""
    h, residual_out = ops.rms_norm(x, norm_weight, eps, residual)
    if isinstance(w, torch.Tensor):
        qkv = torch.nn.functional.linear(h, w, bias)                       # float weight [N, K]
    else:
        qkv = ops.w4a16_gemm(h, w, bias)                                   # GPTQWeight
    t, hkv, d = h.shape[0], k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split([num_heads * d, hkv * d, hkv * d], dim=-1)
    q_out = ops.qk_norm_rope_store(q.reshape(t, num_heads, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d),
                                   q_weight, k_weight, positions, cos_sin_cache, eps, k_cache, v_cache,
                                   slot_mapping)
    return q_out, residual_out


def norm_qkv_rope_store(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w, bias: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention inputs from the layer's input: rms_norm(x, norm_weight, eps, residual) -> qkv = h @ w
    (+ bias; w a GPTQWeight or float [N, K]) -> split into q [T, Hq, D], k, v [T, Hkv, D] -> qk_norm_rope_store
    (eps for the q/k norms too). -> (q_out [T, Hq, D], residual_out [T, H]); the caches are written in place."""
    import types

    from onecard.kernels.gptq_gemm.ref import w4a16_gemm
    from onecard.kernels.norm.ref import rms_norm
    from onecard.kernels.rope.ref import qk_norm_rope_store

    ops = types.SimpleNamespace(rms_norm=rms_norm, w4a16_gemm=w4a16_gemm, qk_norm_rope_store=qk_norm_rope_store)
    return compose_norm_qkv(ops, x, residual, norm_weight, eps, w, bias, q_weight, k_weight, positions,
                            cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads)
