"""Shared helpers for kernel tests: random GPTQ weights with an independently computed dense matrix (packed by
``gptq_gemm.format``, whose bit layout tests/unit/test_pack.py checks nibble by nibble) and paged-cache
builders (not the code under test)."""
from __future__ import annotations

import numpy as np
import torch

from onecard.kernels.gptq_gemm.format import pack_cols, pack_rows
from onecard.kernels.types import GPTQWeight
from onecard.runner.attn_metadata import AttentionMetadata


def random_gptq(k: int, n: int, group_size: int, experts: int | None = None, desc_act: bool = False,
                seed: int = 0, scale_dtype=torch.float16):
    """-> (GPTQWeight, dense float32 [(E,) K, N]) built from random ints with an independent formula."""
    rng = np.random.default_rng(seed)
    lead = () if experts is None else (experts,)
    groups = -(-k // group_size)
    q = rng.integers(0, 16, size=lead + (k, n))
    z = rng.integers(0, 16, size=lead + (groups, n))
    s = (rng.random(size=lead + (groups, n)) * 0.02 + 0.005).astype(np.float32)
    g = np.arange(k) // group_size
    if desc_act:
        g = np.stack([rng.permutation(g) for _ in range(experts or 1)])
        if experts is None:
            g = g[0]
    else:
        g = np.broadcast_to(g, lead + (k,))
    s_t = torch.from_numpy(s).to(scale_dtype)
    s_used = s_t.float().numpy()
    dense = np.empty(lead + (k, n), dtype=np.float32)
    for idx in np.ndindex(*lead):
        for row in range(k):
            gi = g[idx + (row,)]
            dense[idx + (row,)] = (q[idx + (row,)] - z[idx + (gi,)]) * s_used[idx + (gi,)]
    w = GPTQWeight(qweight=pack_rows(torch.from_numpy(q)), qzeros=pack_cols(torch.from_numpy(z)), scales=s_t,
                   g_idx=torch.from_numpy(np.ascontiguousarray(g).astype(np.int32)) if desc_act else None,
                   group_size=group_size, in_features=k, out_features=n)
    return w, torch.from_numpy(dense)


def make_paged_batch(seq_lens: list[int], query_lens: list[int], hkv: int, d: int, block_size: int,
                     dtype=torch.float32, seed: int = 0, extra_blocks: int = 3, pad_rows: int = 0):
    """Random contiguous K/V per sequence, scattered into a paged cache through shuffled block tables.

    -> (k_cache, v_cache, md, [k_seq [L, Hkv, D]], [v_seq]) with the new tokens' slots in md.slot_mapping.
    """
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(nblk) + 1
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)  # garbage outside contexts
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    ks, vs, slots = [], [], []
    used = 0
    for i, (L, n) in enumerate(zip(seq_lens, query_lens)):
        ids = perm[used:used + nblk[i]]
        used += nblk[i]
        table[i, : nblk[i]] = ids.to(torch.int32)
        k = torch.randn(L, hkv, d, generator=g).to(dtype)
        v = torch.randn(L, hkv, d, generator=g).to(dtype)
        pos = torch.arange(L)
        flat = ids[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, hkv, d)[flat] = k
        v_cache.view(-1, hkv, d)[flat] = v
        ks.append(k)
        vs.append(v)
        slots.append(flat[L - n:])
    qsl = torch.tensor([0] + list(np.cumsum(query_lens)), dtype=torch.int32)
    slot_mapping = torch.cat(slots + [torch.full((pad_rows,), -1, dtype=torch.long)]).long()
    md = AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=qsl,
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
                           max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                           num_decode_tokens=0)
    return k_cache, v_cache, md, ks, vs
