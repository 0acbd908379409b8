"""The batch-1 o_proj GEMV that merges the split-KV partials itself (paths.batch1_oproj_merge): contract as
ref.merge_gemv, except that the result is added into an fp32 row that an earlier launch zeroed (the
accumulating attention block's; attn_in/triton.attention_block).

Why: without it a split decode attention is followed by the split-KV reduce, a launch of its own in the batch-1
layer's dependent chain, and then by the o_proj GEMV, whose programs wait for it. Here the GEMV's programs do
the reduce's work for the heads their K tiles cover, after their PDL wait (their weight tiles were requested
before it, as the plain GEMV's are): the (m, l) pairs and partials of every filled segment in one load each
(at most BLOCK_S = SHORT_MERGE_MAX_SEGMENTS segments: no loop, no dependent round trips), the reduce's
arithmetic (attention/triton: max, exp2 weights, the weighted sums, the division; rounded to the model dtype as
the reduce's output is), and then the GEMV tile on those inputs. Every column tile's programs redo the merge of
their heads (32 re-reads of each head's partials at the served shape, from L2): cheap for the short splits this
takes, not for the 86-94 segments of a long bound, which keep the reduce launch.

Tiles: the batch-1 GEMV's (gptq_gemm/triton.small_grid, "gemv": [16 packed rows = 128 inputs, 64 columns]);
inputs 128t .. 128t + 127 of K tile t belong to HPT = max(1, 128 // D) heads of DC = 128 // HPT inputs each.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels import paths
from onecard.kernels.attention.triton import EMPTY_MAX, SUM_FLOOR, SplitPartials, _filled_segments
from onecard.kernels.gptq_gemm.small_m import _small_tile_load, _small_tile_mac
from onecard.kernels.gptq_gemm.triton import _CONFIGS, row_groups, small_grid
from onecard.kernels.triton_common import AotConfig, next_pow2, pdl, pdl_enter, settle_cache_keys, signature
from onecard.kernels.types import GPTQWeight

MERGE_BLOCK_S = next_pow2(paths.SHORT_MERGE_MAX_SEGMENTS)   # every segment's partial in one load


@triton.jit
def _tile_partials(part_ptr, ml_ptr, n_seg, num_segments, t, live, K, D: tl.constexpr, BLOCK_K8: tl.constexpr,
                   HPT: tl.constexpr, BLOCK_S: tl.constexpr):
    """(m, l) [S, HPT] and partials [S, HPT, DC] of the heads that K tile t's inputs belong to (one decode row:
    partials [Hq, segments, D], (m, l) [Hq, segments, 2]); masked (EMPTY_MAX, 0, 0) past n_seg, past K and where
    not ``live`` (a tile of another split: its inputs must be exact zeros)."""
    DC: tl.constexpr = BLOCK_K8 * 8 // HPT
    k0 = t * BLOCK_K8 * 8
    hh = tl.arange(0, HPT)
    offs_s = tl.arange(0, BLOCK_S)
    kk = k0 + hh[:, None] * DC + tl.arange(0, DC)[None, :]               # [HPT, DC] input index
    head = (k0 + hh * DC) // D                                            # [HPT]
    row = head[None, :] * num_segments + offs_s[:, None]                  # [S, HPT] partial row
    ok = (offs_s < n_seg)[:, None] & ((k0 + hh * DC < K) & live)[None, :]
    m = tl.load(ml_ptr + row * 2, mask=ok, other=EMPTY_MAX, cache_modifier=".cg")   # .cg: another launch's, L2
    l = tl.load(ml_ptr + row * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
    p = tl.load(part_ptr + row[:, :, None] * D + (kk % D)[None, :, :], mask=ok[:, :, None] & (kk < K)[None, :, :],
                other=0.0, cache_modifier=".cg")                          # [S, HPT, DC]
    return m, l, p


@triton.jit
def _merge_store(m, l, p, x_ptr, t, live, K, BLOCK_K8: tl.constexpr):
    """The reduce's merge (attention/triton._merge_weights, _merge_apply, the division) of _tile_partials'
    heads, stored as K tile t's inputs x[128t ..] in x's dtype (the model dtype, as the reduce's output)."""
    m_new = tl.maximum(tl.max(m, axis=0), EMPTY_MAX)                      # [HPT]
    w = tl.exp2(m - m_new[None, :])                                       # [S, HPT]
    lw = tl.sum(l * w, axis=0)                                            # [HPT]
    x = tl.sum(p * w[:, :, None], axis=0) / tl.maximum(lw, SUM_FLOOR)[:, None]   # [HPT, DC]
    kk = t * BLOCK_K8 * 8 + tl.arange(0, BLOCK_K8 * 8)
    tl.store(x_ptr + kk, tl.reshape(x, (BLOCK_K8 * 8,)).to(x_ptr.dtype.element_ty), mask=(kk < K) & live)


# runtime-varying ints: one compile serves all
@triton.jit(do_not_specialize=["tiles_per_split", "num_segments", "block_n", "min_seg_tiles"])
def _merge_gemv_kernel(part_ptr, ml_ptr, seqlen_ptr, x_ptr, qw_ptr, qz_ptr, sc_ptr, bias_ptr, out_ptr, N, K,
                       group_size, num_groups, tiles_per_split, num_segments, block_n, min_seg_tiles, has_bias,
                       D: tl.constexpr, HPT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                       BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """out[0, :] += merge(partials) @ dequant(w) (+ bias, added by split 0), fp32 atomics into a zeroed row.
    Grid (column tiles, K splits of tiles_per_split tiles). The sequence length (the step's metadata: how many
    segments hold keys) and the first two weight tiles load before the PDL wait; after it, every tile's
    partials are requested at once, merged and stored into x (the row the reduce would have written; every
    column tile's programs store the same values there), and after a CTA barrier the GEMV's tiles read x as
    the plain GEMV reads its input (small_m._small_tile_mac: the inputs arrive in the layout its MAC uses,
    where merged registers would need a conversion per input column)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN]
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_K8)
    k8 = K // 8
    z_shift = (offs_n % 8) * 4
    acc = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(k8, BLOCK_K8))
    seq_len = tl.load(seqlen_ptr, cache_modifier=".cg")                   # decode row 0's sequence
    n_seg = _filled_segments(tl.cdiv(seq_len, block_n), num_segments, min_seg_tiles)
    q0, s0, z0 = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t_begin, t_end, offs_r, offs_n, n_mask, z_shift, k8, N,
                                  group_size, num_groups, BLOCK_K8)
    q1, s1, z1 = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t_begin + 1, t_end, offs_r, offs_n, n_mask, z_shift, k8,
                                  N, group_size, num_groups, BLOCK_K8)
    pdl_enter(PDL)
    # the first two tiles' partials in flight together (their merges' reductions are CTA barriers)
    live0, live1 = t_begin < t_end, t_begin + 1 < t_end
    m0, l0, p0 = _tile_partials(part_ptr, ml_ptr, n_seg, num_segments, t_begin, live0, K, D, BLOCK_K8, HPT, BLOCK_S)
    m1, l1, p1 = _tile_partials(part_ptr, ml_ptr, n_seg, num_segments, t_begin + 1, live1, K, D, BLOCK_K8, HPT,
                                BLOCK_S)
    _merge_store(m0, l0, p0, x_ptr, t_begin, live0, K, BLOCK_K8)
    _merge_store(m1, l1, p1, x_ptr, t_begin + 1, live1, K, BLOCK_K8)
    for t in range(t_begin + 2, t_end):
        m, l, p = _tile_partials(part_ptr, ml_ptr, n_seg, num_segments, t, True, K, D, BLOCK_K8, HPT, BLOCK_S)
        _merge_store(m, l, p, x_ptr, t, True, K, BLOCK_K8)
    tl.debug_barrier()                                                    # x's stores seen by every thread
    offs_m = tl.arange(0, 1)
    m_mask = offs_m < 1
    DT: tl.constexpr = x_ptr.dtype.element_ty
    acc = _small_tile_mac(acc, q0, s0, z0, t_begin, t_end, x_ptr, sc_ptr, qz_ptr, qw_ptr, offs_r, offs_m, m_mask,
                          offs_n, n_mask, z_shift, k8, N, 0, DT, 1, BLOCK_N, BLOCK_K8, False, False)
    acc = _small_tile_mac(acc, q1, s1, z1, t_begin + 1, t_end, x_ptr, sc_ptr, qz_ptr, qw_ptr, offs_r, offs_m,
                          m_mask, offs_n, n_mask, z_shift, k8, N, 0, DT, 1, BLOCK_N, BLOCK_K8, False, False)
    for t in range(t_begin + 2, t_end):
        q, s_u, z_u = _small_tile_load(qw_ptr, sc_ptr, qz_ptr, t, t_end, offs_r, offs_n, n_mask, z_shift, k8, N,
                                       group_size, num_groups, BLOCK_K8)
        acc = _small_tile_mac(acc, q, s_u, z_u, t, t_end, x_ptr, sc_ptr, qz_ptr, qw_ptr, offs_r, offs_m, m_mask,
                              offs_n, n_mask, z_shift, k8, N, 0, DT, 1, BLOCK_N, BLOCK_K8, False, False)
    res = tl.sum(acc, axis=0)                                             # [BN]
    if has_bias != 0:                                                     # once: split 0 adds the bias
        res += tl.load(bias_ptr + offs_n, mask=n_mask & (pid_k == 0), other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr + offs_n, res, mask=n_mask, sem="relaxed")


def heads_per_tile(d: int, block_k8: int) -> int:
    """HPT: heads of head_dim ``d`` in one K tile of 8 * block_k8 inputs (1 where a head spans tiles)."""
    return max(1, block_k8 * 8 // d)


def merge_supported(w: GPTQWeight, d: int) -> bool:
    """Whether ``merge_gemv`` takes o_proj ``w`` over heads of dim ``d``: the batch-1 GEMV's tiles in one group
    each (no per-row groups), heads and tiles nested (D a power of two)."""
    g = small_grid(1, w.out_features, w.in_features, w.qweight.device)
    return d == next_pow2(d) and not row_groups(w, g.block_k8)[0] and w.in_features % d == 0


def merge_gemv(sp: SplitPartials, w: GPTQWeight, bias: torch.Tensor | None, accumulate: torch.Tensor) -> torch.Tensor:
    """accumulate [1, N] fp32 (zeroed by an earlier launch on this stream) += merge(sp) @ w (+ bias); returned.
    sp: one decode row's split-KV partials (paged_attention(..., merge_later=True)), at most MERGE_BLOCK_S
    segments. Contract of ref.merge_gemv otherwise."""
    t, hq, segs, d = sp.part.shape
    assert t == 1 and segs <= MERGE_BLOCK_S and hq * d == w.in_features, (sp.part.shape, w.in_features)
    assert accumulate.dtype == torch.float32 and accumulate.shape == (1, w.out_features)
    assert accumulate.stride(-1) == 1 and merge_supported(w, d)
    dev = accumulate.device
    g = small_grid(1, w.out_features, w.in_features, dev)
    use_pdl = pdl(dev, 1)
    x = torch.empty(1, w.in_features, dtype=sp.dtype, device=dev)      # the merged row, as the reduce's output
    _merge_gemv_kernel[(g.grid_n, g.splits)](
        sp.part, sp.ml, sp.seq_lens, x, w.qweight, w.qzeros, w.scales, bias if bias is not None else accumulate,
        accumulate, w.out_features, w.in_features, w.group_size, w.num_groups, g.tiles_per_split, segs, sp.block_n,
        sp.min_seg_tiles, int(bias is not None), D=d, HPT=heads_per_tile(d, g.block_k8), BLOCK_N=g.block_n,
        BLOCK_K8=g.block_k8, BLOCK_S=MERGE_BLOCK_S, PDL=use_pdl, num_warps=g.num_warps, num_stages=g.num_stages,
        launch_pdl=use_pdl)
    return accumulate


def aot_configs() -> list[AotConfig]:
    """The served o_proj (32 heads x 128 -> 2048, g128) at the batch-1 GEMV's tiles, fp16 (bf16 on sm80+)."""
    out: list[AotConfig] = []
    _, bn, bk8, _, warps, stages = _CONFIGS["gemv"]                      # the batch-1 GEMV's (small_grid's)
    for act, cc in (("fp16", 70), ("bf16", 80)):
        cx = {"D": 128, "HPT": 1, "BLOCK_N": bn, "BLOCK_K8": bk8, "BLOCK_S": MERGE_BLOCK_S, "PDL": False}
        args = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "seqlen_ptr": "*i32", "x_ptr": f"*{act}", "qw_ptr": "*i32",
                "qz_ptr": "*i32",
                "sc_ptr": f"*{act}", "bias_ptr": f"*{act}", "out_ptr": "*fp32", "N": "i32", "K": "i32",
                "group_size": "i32", "num_groups": "i32", "tiles_per_split": "i32", "num_segments": "i32",
                "block_n": "i32", "min_seg_tiles": "i32", "has_bias": "i32"}
        out.append(AotConfig(_merge_gemv_kernel, signature(args, cx), cx, warps, stages, cc, f"merge_gemv[{act}]"))
    return out


__all__ = ["MERGE_BLOCK_S", "aot_configs", "heads_per_tile", "merge_gemv", "merge_supported"]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
