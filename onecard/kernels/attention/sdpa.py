"""Paged attention on PyTorch's SDPA, for prefill chunks below sm80 (paths.prefill_sdpa); ref.py's contract.

Why: below sm80 Triton's tl.dot is FMA code, and a chunk's causal attention is compute (4 * n * L * Hq * D FLOPs
for n new tokens over L positions; 137 GFLOP a layer for a 4,096-token prompt, ~8.8 ms on a V100's 15.7 TFLOP/s of
FMA, half of that prefill in bench/v100_estimate.py). PyTorch's memory-efficient SDPA kernel (CUTLASS) runs both
products on tensor cores from sm70.

How, per sequence i of ``seqs`` (lengths from md's host copies: no device sync): its first L = seq_lens[i]
positions of K and V gathered through its block-table row (whole blocks, index_select; fp8 caches converted to
q's dtype, exact for e5m2, with k_scale folded into the softmax scale and v_scale into the output, as the Triton
kernel does); q's rows [n, Hq, D] viewed as [Hkv, G, n, D] and K/V as [Hkv, G, L, D] with a zero stride over the
G = Hq / Hkv query heads of a KV head (GQA as a broadcast, no copy: SDPA's own GQA flag is not taken by the
memory-efficient kernel); a lower-right causal bias (query j sits at position L - n + j). On CUDA only the
memory-efficient backend may run (a V100 has no flash attention; an emulated-sm70 run on a newer card then takes
the same kernel family), and ``available`` probes it once at start-up: where it is missing the Triton kernel keeps
every sequence. Memory: the gathered K and V of one sequence at a time (paths.prefill_sdpa_workspace).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from onecard.kernels import paths
from onecard.kernels.attention.fp8 import is_fp8, kernel_view
from onecard.kernels.attention.metadata import AttentionMetadata


def long_sequences(md: AttentionMetadata, cc: int) -> list[int]:
    """The sequences of md that take this path on capability ``cc`` (paths.prefill_sdpa of their query length);
    none without md's host copies (CUDA graphs: every sequence stays on the Triton kernel)."""
    if not md.has_host_lens or not paths.prefill_sdpa(md.max_query_len, cc):   # no sequence can (sm80+: never)
        return []
    qsl = md.host_query_start_loc
    return [i for i in range(md.num_seqs) if paths.prefill_sdpa(int(qsl[i + 1] - qsl[i]), cc)]


def _gather(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """cache [NB, BS, Hkv, D] -> the first seq_len positions of one sequence [L, Hkv, D] in ``dtype`` (unscaled)."""
    bs = cache.shape[1]
    blocks = block_row[: -(-seq_len // bs)].long()
    kv = kernel_view(cache).index_select(0, blocks).view(cache.dtype).flatten(0, 1)[:seq_len]   # fp8: as bytes
    return kv.to(dtype) if kv.dtype != dtype else kv


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [L, Hkv, D] (n <= L, the chunk at the end) -> [n, Hq, D]: lower-right causal GQA."""
    n, hq, d = q.shape
    seq_len, hkv, _ = k.shape
    g = hq // hkv
    q4 = q.reshape(n, hkv, g, d).permute(1, 2, 0, 3)                         # [Hkv, G, n, D]
    k4 = k.permute(1, 0, 2)[:, None].expand(hkv, g, seq_len, d)             # [Hkv, G, L, D], stride 0 over G
    v4 = v.permute(1, 0, 2)[:, None].expand(hkv, g, seq_len, d)
    o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=causal_lower_right(n, seq_len), scale=scale)
    return o.permute(2, 0, 1, 3).reshape(n, hq, d)                          # [n, Hq, D]


def _backends(device: torch.device):
    """The SDPA backends this path may use: the memory-efficient kernel alone on CUDA (see the docstring)."""
    if device.type == "cuda":
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])
    return contextlib.nullcontext()                                         # the CPU's own (tests)


def attend_into(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, k_scale: float, v_scale: float, seqs: Sequence[int]) -> None:
    """out[rows of each sequence in ``seqs``] = its attention (ref.paged_attention's values), in place."""
    qsl, lens = md.host_query_start_loc, md.host_seq_lens
    fp8 = is_fp8(k_cache)
    s = scale * (k_scale if fp8 else 1.0)
    with _backends(q.device):
        for i in seqs:
            q0, q1, seq_len = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
            if q1 == q0:
                continue
            k = _gather(k_cache, md.block_table[i], seq_len, q.dtype)
            v = _gather(v_cache, md.block_table[i], seq_len, q.dtype)
            o = _attend(q[q0:q1], k, v, s)
            if fp8 and v_scale != 1.0:
                o.mul_(v_scale)
            out[q0:q1] = o


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """ref.paged_attention's contract for every sequence of md (host copies needed), in q.dtype."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    attend_into(out, q, k_cache, v_cache, md, scale, k_scale, v_scale, range(md.num_seqs))
    return out


@functools.cache
def available(device: torch.device, head_dim: int = 128) -> bool:
    """Does this path run on ``device`` at ``head_dim``: a tiny lower-right causal GQA call in the layout above,
    once (the runner asks at start-up, through dispatch.init_paths and its memory profile, so serving never
    learns it from a failing prefill)."""
    if device.type != "cuda":
        return True
    try:
        q = torch.ones(3, 4, head_dim, dtype=torch.float16, device=device)
        kv = torch.ones(5, 2, head_dim, dtype=torch.float16, device=device)
        with _backends(device):
            o = _attend(q, kv, kv, 0.125)
        return bool(((o.float() - 1).abs() < 1e-3).all())                  # start-up: a sync is fine here
    except RuntimeError:
        return False
