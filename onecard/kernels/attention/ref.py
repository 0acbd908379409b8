"""Reference KV-cache store and paged attention (plain PyTorch, float32 math; the spec).

Caches are [num_blocks, block_size, Hkv, D]; slot s = block * block_size + offset. Sequence i owns query
rows query_start_loc[i]:query_start_loc[i+1]; its keys are positions 0..seq_lens[i]-1 read through
block_table[i]; query row j sits at position seq_lens[i] - query_len + j and attends to keys <= it.
Query head h uses KV head h // (Hq // Hkv). Rows outside every sequence (padding) come back as zeros.
An fp8 cache (dtype float8_e5m2 / float8_e4m3fn) stores value / scale and is read as stored x scale, with
k_scale for K and v_scale for V (fp8.quantize / fp8.dequantize); other caches ignore the scales.
"""
from __future__ import annotations

import torch

from onecard.kernels.attention.fp8 import dequantize, quantize
from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.kernels.paths import KV_PREFETCH_CHUNK


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping[T] (entries < 0 are skipped), in place."""
    nb, bs, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(nb * bs, hkv, d)[slots] = quantize(k[keep], k_cache.dtype, k_scale)
    v_cache.view(nb * bs, hkv, d)[slots] = quantize(v[keep], v_cache.dtype, v_scale)


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, scale: float = 1.0) -> torch.Tensor:
    """cache [NB, BS, Hkv, D] -> the first seq_len tokens of one sequence, float32 [L, Hkv, D]."""
    bs = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_row.long()[pos // bs]
    return dequantize(cache[blocks, pos % bs], scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q.dtype: causal GQA attention over each sequence's paged context."""
    _, hq, _d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = md.query_start_loc.tolist()
    for i, seq_len in enumerate(md.seq_lens.tolist()):
        q0, q1 = starts[i], starts[i + 1]
        if q1 == q0:
            continue
        k = gather_kv(k_cache, md.block_table[i], seq_len, k_scale).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = gather_kv(v_cache, md.block_table[i], seq_len, v_scale).repeat_interleave(group, dim=1)  # [L, Hq, D]
        qs = q[q0:q1].float()                                                               # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale                                # [Hq, n, L]
        q_pos = seq_len - (q1 - q0) + torch.arange(q1 - q0, device=q.device)                 # [n]
        k_pos = torch.arange(seq_len, device=q.device)                                      # [L]
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)


def kv_touch(k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, max_positions: int,
             out: torch.Tensor | None = None, evict_last: bool = True) -> torch.Tensor:
    """The read that puts a batch-1 step's next layer's KV in L2 (paths.batch1_kv_prefetch): the K and V rows of
    positions below min(seq_lens[0], max_positions) of sequence 0, model-dtype caches. -> fp32
    [ceil(max_positions / paths.KV_PREFETCH_CHUNK)]: each chunk's sum of those rows (0 past the end), what keeps
    the reads in the kernel and what a test compares; ``out``: written instead of a new tensor; ``evict_last``:
    the kernel's L2 priority for the rows (no value here)."""
    chunk = KV_PREFETCH_CHUNK
    n = min(int(md.seq_lens[0]), max_positions)
    rows = (gather_kv(k_cache, md.block_table[0], n) + gather_kv(v_cache, md.block_table[0], n)).sum(dim=(1, 2))
    sums = torch.zeros(-(-max_positions // chunk), dtype=torch.float32, device=k_cache.device)
    sums.index_add_(0, torch.arange(n, device=k_cache.device) // chunk, rows)
    if out is None:
        return sums
    out.copy_(sums)
    return out
