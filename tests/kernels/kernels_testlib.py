"""Shared helpers for kernel tests: random GPTQ weights with an independently computed dense matrix (packed by
``gptq_gemm.format``, whose bit layout tests/unit/test_pack.py checks nibble by nibble) and paged-cache
builders (not the code under test)."""
from __future__ import annotations

import numpy as np
import torch

from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.kernels.gptq_gemm.format import pack_cols, pack_rows
from onecard.kernels.types import GPTQWeight


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The kernel tests' error measure: ||out - ref|| / ||ref|| in float64 (0 / 0 counts as 0)."""
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def route_gap(logits: torch.Tensor, top_k: int) -> float:
    """The smallest relative gap, over the rows of router logits [T, E], between a token's k-th and (k+1)-th expert
    probability (1.0 when k = E): under ROUTE_MARGIN-like bounds two paths that round the logits differently may
    route to different experts (tests that compare such paths draw data clear of it)."""
    p = torch.sort(torch.softmax(logits.float(), dim=-1), dim=-1, descending=True).values    # [T, E]
    return float(((p[:, top_k - 1] - p[:, top_k]) / p[:, top_k - 1]).min()) if top_k < p.shape[1] else 1.0


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


# ---------------------------------------------------------------- fp8 KV: independent references
# (mantissa bits, half the smallest subnormal step) of each fp8 format, from its definition
FP8_PRECISION = {"e5m2": (2, 2.0 ** -17), "e4m3": (3, 2.0 ** -10)}


def e5m2_bits_np(h: np.ndarray) -> np.ndarray:
    """fp16 array -> e5m2 bytes, in numpy from the definition: the upper byte of the fp16 bits, rounded to nearest
    even on the lower byte (ties to the even upper byte); NaNs stay NaNs (0x7E / 0xFE), overflow goes to inf."""
    u = h.astype(np.float16).view(np.uint16).astype(np.uint32)
    hi, lo = u >> 8, u & 0xFF
    up = (lo > 0x80) | ((lo == 0x80) & ((hi & 1) == 1))
    out = hi + up.astype(np.uint32)
    nan = (u & 0x7FFF) > 0x7C00
    out = np.where(nan, (u >> 8) | 0x2, out)
    return out.astype(np.uint8)


def fp8_attention_bound(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], query_lens: list[int],
                        fmt: str, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                        sigmas: float = 6.0) -> torch.Tensor:
    """Per output element [T, Hq, D], a bound on |attention(fp8 KV) - attention(exact KV)| derived from the
    format's precision. Each stored element x/s rounds to nearest with |error| <= u|x| + a (u = 2^-(m+1), a = half
    a subnormal step, times the scale) and, being a rounding of an unrelated value, has variance <= that^2 / 3.
    To first order o_d changes by sum_j p_j dv_jd + sum_j p_j (ds_j - sum_i p_i ds_i) v_jd with
    ds_j = scale * q . dk_j; its standard deviation is at most sqrt(sum_j p_j^2 (var dv_jd + var(ds_j) (v_jd - o_d)^2))
    (the softmax-centring only shrinks it); the bound is ``sigmas`` of those, plus a quadratic term
    (sum_j p_j |ds_j|)^2 max|v| for what first order leaves out."""
    m, a = FP8_PRECISION[fmt]
    u = 2.0 ** -(m + 1)
    t, hq, d = q.shape
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    start = 0
    for k, v, n in zip(ks, vs, query_lens):
        hkv = k.shape[1]
        g = hq // hkv
        k64 = k.double().repeat_interleave(g, dim=1)                          # [L, Hq, D]
        v64 = v.double().repeat_interleave(g, dim=1)
        qs = q[start:start + n].double()                                      # [n, Hq, D]
        L = k.shape[0]
        s = torch.einsum("nhd,lhd->hnl", qs, k64) * scale                     # [Hq, n, L]
        q_pos = L - n + torch.arange(n)
        s = s.masked_fill(torch.arange(L)[None, None, :] > q_pos[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)                                          # [Hq, n, L]
        o = torch.einsum("hnl,lhd->nhd", p, v64)                              # [n, Hq, D]
        err_k = u * k64.abs() + a * k_scale                                   # [L, Hq, D]
        err_v = u * v64.abs() + a * v_scale
        var_s = torch.einsum("nhd,lhd->hnl", qs ** 2, err_k ** 2 / 3) * scale ** 2        # [Hq, n, L]
        max_ds = torch.einsum("nhd,lhd->hnl", qs.abs(), err_k) * scale
        centred = (v64[None] - o[:, None]) ** 2                               # [n, L, Hq, D]
        var_o = torch.einsum("hnl,lhd->nhd", p ** 2, err_v ** 2 / 3) \
            + torch.einsum("hnl,nlhd->nhd", p ** 2 * var_s, centred)
        quad = torch.einsum("hnl,hnl->hn", p, max_ds) ** 2                     # [Hq, n]
        vmax = v64.abs().amax(dim=0)                                          # [Hq, D]
        out[start:start + n] = sigmas * var_o.sqrt() + quad.T[:, :, None] * vmax[None]
        start += n
    return out
