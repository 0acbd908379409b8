"""Triton W4A16 GPTQ GEMM: y[M, N] = x[M, K] @ dequant(w) (+ bias), fp32 accumulation, same contract as ref.py.

Paths (chosen by shape from the fixed table ``_CONFIGS``; no host syncs, so CUDA-graph capturable):
  * M == 1 (gemv) and M <= 16 (skinny): ``_w4a16_small_kernel`` (small_m.py), split-K to ~12 programs per
    SM (one or two [16, 128] int32 tiles each: 16-byte loads along N, scales/zeros once per g128 group);
    nibble j of packed row r is input row 8r + j, so the K sum is 8 strided sums — no reshapes, no repeated
    loads. The GEMV keeps a [BK8, BN] fp32 accumulator and reduces it once after the loop; skinny uses
    ``tl.dot``. The group mode (PER_ROW) is a constexpr there, so the common path carries no g_idx code (half
    the registers). With the exact-integer dot (paths.int_dot: 1 < M, fp16, one group per
    tile) skinny takes int4.int_dot_tile.
  * larger M: tiled ``tl.dot``; on compute capability < 8.0 (no tensor cores for tl.dot) it dequantizes to
    fp16 with a Triton kernel and uses cuBLAS instead.
Split-K reductions:
  * M == 1: fp32 partials [S, 1, N]; the last split of each column tile to arrive (a persistent counter,
    kernels/workspace.py) sums them, adds the bias and casts: one launch per GEMV.
  * 1 < M <= 16: fp32 atomics into a zeroed [M, N] temporary (partials would be S x M x N, as large as the
    weights), then the reduce kernel adds the bias and casts. (Not a last arriver: other CTAs' fp32 atomics
    are not ordered before its arrival counter; and not a persistent accumulator that the reduce re-zeroes:
    both measured on the H200 as wrong sums, bench/diag_skinny.py.)
  * tiled: partials and the reduce kernel.
Scales/zeros: when a K tile lies inside one group (no g_idx, group_size % BK == 0 or one group) they are
loaded once per tile; otherwise per row through g_idx or k // group_size (act-order checkpoints).
Here: the config table, the host launchers, the tiled, reduce and dequantize kernels and ``aot_configs``;
the int4 unpacking helpers (shared with fused_moe) are in int4.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from onecard.kernels import paths, workspace

# magic_zero_scale, nibbles: re-exported (importable from here since before int4.py)
from onecard.kernels.gptq_gemm.int4 import _dequant_tile_j, _group_sz, magic_zero_scale, nibbles  # noqa: F401
from onecard.kernels.gptq_gemm.small_m import _w4a16_small_kernel
from onecard.kernels.triton_common import (
    AotConfig,
    compute_capability,
    next_pow2,
    num_sms,
    pdl,
    pdl_enter,
    settle_cache_keys,
    signature,
)
from onecard.kernels.triton_dot import dot
from onecard.kernels.types import GPTQWeight


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split"])  # runtime-varying: one compile serves all
def _w4a16_kernel(x_ptr, qw_ptr, qz_ptr, sc_ptr, gidx_ptr, bias_ptr, out_ptr, part_ptr,
                  M, N, K, group_size, num_groups, tiles_per_split, stride_xm, per_row, has_bias, split,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, USE_DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                      # [BM]
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_r = tl.arange(0, BLOCK_K8)                                       # packed rows in a tile
    k8 = K // 8
    z_shift = (offs_n % 8) * 4                                            # [BN] nibble of qzeros
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(k8, BLOCK_K8))
    for t in range(t_begin, t_end):
        r = t * BLOCK_K8 + offs_r                                         # [BK8]
        r_mask = r < k8
        q = tl.load(qw_ptr + r[:, None] * N + offs_n[None, :],
                    mask=r_mask[:, None] & n_mask[None, :], other=0)      # [BK8, BN] int32
        g = tl.minimum((t * BLOCK_K8 * 8) // group_size, num_groups - 1)
        s_u, z_u = _group_sz(sc_ptr, qz_ptr, g, offs_n, n_mask, z_shift, N)
        for j in tl.static_range(8):
            k = r * 8 + j                                                 # [BK8] input rows
            w = _dequant_tile_j(q, j, s_u, z_u, sc_ptr, qz_ptr, gidx_ptr, k, r_mask, offs_n, n_mask, z_shift,
                                N, per_row)
            if USE_DOT:
                xj = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                             mask=m_mask[:, None] & r_mask[None, :], other=0.0)   # [BM, BK8]
                acc += dot(xj, w.to(xj.dtype))
            else:
                xv = tl.load(x_ptr + pid_m * stride_xm + k, mask=r_mask, other=0.0).to(tl.float32)
                acc1 += tl.sum(w * xv[:, None], axis=0)
    if not USE_DOT:
        acc = acc1[None, :] + acc                                         # BLOCK_M == 1
    o_mask = m_mask[:, None] & n_mask[None, :]
    if split != 0:
        tl.store(part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=o_mask)
    else:
        if has_bias != 0:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=o_mask)


@triton.jit(do_not_specialize=["MN", "num_splits"])  # runtime-varying: one compile serves all
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, num_splits,
                          BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """out[MN] = sum of num_splits fp32 partials [S, MN] (+ bias), cast."""
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(qw_ptr, qz_ptr, sc_ptr, gidx_ptr, out_ptr, N, K, group_size,
                    BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, HAS_GIDX: tl.constexpr):
    """out[K, N] = dequant(w) in out's dtype (the cuBLAS path on pre-Ampere GPUs)."""
    offs_r = tl.program_id(0) * BLOCK_K8 + tl.arange(0, BLOCK_K8)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_r < K // 8)[:, None] & (offs_n < N)[None, :]
    q = tl.load(qw_ptr + offs_r[:, None] * N + offs_n[None, :], mask=mask, other=0)
    z_shift = (offs_n % 8) * 4
    for j in tl.static_range(8):
        k = offs_r * 8 + j
        if HAS_GIDX:
            g = tl.load(gidx_ptr + k, mask=offs_r < K // 8, other=0)
        else:
            g = k // group_size
        s = tl.load(sc_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        zp = tl.load(qz_ptr + g[:, None] * (N // 8) + (offs_n // 8)[None, :], mask=mask, other=0)
        w = (((q >> (4 * j)) & 0xF) - ((zp >> z_shift[None, :]) & 0xF)).to(tl.float32) * s
        tl.store(out_ptr + k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


# name: (BLOCK_M, BLOCK_N, BLOCK_K8, USE_DOT, num_warps, num_stages); gemv/skinny run _w4a16_small_kernel
# (USE_DOT is implied by BLOCK_M > 1 there), tiled runs _w4a16_kernel. BK8 16 = 128 inputs = one g128 group.
# gemv/skinny from bench/tune_decode.py on the H200 (weights rotated out of L2, graph replay): gemv BN 64 with
# 4 warps at 8 programs/SM: qkv 15.3 -> 7.3 us, o_proj 9.8 -> 6.7 us against BN 128, 8 warps, 12/SM.
_CONFIGS = {
    "gemv": (1, 64, 16, False, 4, 2),
    "skinny": (16, 128, 16, True, 4, 2),
    "tiled": (64, 128, 16, True, 8, 3),
}
SMALL_M_MAX = paths.SMALL_M_MAX
# split-K target: enough [BK8, BN] tiles in flight per SM to cover HBM latency. gemv 8 -> 4 on 2026-12-06: the GEMV
# has 128 registers at 4 warps, so 4 programs fit an SM and 8 per SM made the qkv GEMV two waves (tune_decode on
# the H100: 6.25 -> 5.83 µs; with decode1 at 8 per SM, batch 1 at 512 tokens 418.8 -> 429.7 tok/s, switchab).
SMALL_PROGRAMS_PER_SM = {"gemv": 4, "skinny": 12}
GEMV_MAX_SPLITS = 16                  # M == 1: the last split reads all partials as one [16, BN] tile
SKINNY_MAX_SPLITS = 32                # M > 1: atomics, so only a bound on the grid
_REDUCE_BLOCK = 1024
_DEQUANT_BLOCK = (128, 16)            # (BLOCK_N, BLOCK_K8)
_GIDX_CACHE: dict[tuple, torch.Tensor] = {}


choose_config = paths.triton_gemm_config   # the block config for M rows (the path table owns the thresholds)


def row_groups(w: GPTQWeight, block_k8: int) -> tuple[bool, torch.Tensor]:
    """-> (per_row, g_idx [(E,) K] int32). per_row False: every K tile of 8*block_k8 rows is in one group.

    A trivial g_idx (k // group_size) for group sizes that split a tile is built once per shape and cached.
    """
    if w.g_idx is not None:
        return True, w.g_idx
    if w.group_size % (block_k8 * 8) == 0 or w.group_size >= w.in_features:
        return False, w.qweight                                          # any valid pointer: unused
    key = (w.qweight.device, w.in_features, w.group_size)
    if key not in _GIDX_CACHE:
        k = torch.arange(w.in_features, device=w.qweight.device, dtype=torch.int32)
        _GIDX_CACHE[key] = torch.div(k, w.group_size, rounding_mode="floor")
    return True, _GIDX_CACHE[key]


def _split_k(programs: int, k_tiles: int, device: torch.device) -> int:
    target = 2 * num_sms(device)
    if programs >= target or k_tiles <= 1:
        return 1
    return min(16, next_pow2(-(-target // programs)), k_tiles)


def max_splits(m: int) -> int:
    return GEMV_MAX_SPLITS if m == 1 else SKINNY_MAX_SPLITS


@dataclass(frozen=True, slots=True)
class SmallGrid:
    """The launch shape of _w4a16_small_kernel for one GEMM: block config, column tiles x K splits of
    ``tiles_per_split`` [BK8, BN] tiles each."""
    block_m: int
    block_n: int
    block_k8: int
    num_warps: int
    num_stages: int
    grid_n: int
    splits: int
    tiles_per_split: int


def small_grid(m: int, n: int, k: int, device: torch.device,
               tuning: tuple[int, int, int, int, int] | None = None) -> SmallGrid:
    """M <= SMALL_M_MAX rows: split-K so that ~SMALL_PROGRAMS_PER_SM programs per SM each stream few tiles.
    ``tuning`` (BLOCK_N, BLOCK_K8, num_warps, num_stages, programs per SM) overrides the table (bench only)."""
    name = choose_config(m)
    bm, bn, bk8, _, warps, stages = _CONFIGS[name]
    pps = SMALL_PROGRAMS_PER_SM[name]
    if tuning is not None:
        bn, bk8, warps, stages, pps = tuning
    k_tiles = triton.cdiv(k // 8, bk8)
    grid_n = triton.cdiv(n, bn)
    want = max(1, min(k_tiles, -(-pps * num_sms(device) // grid_n), max_splits(m)))
    tiles_per_split = triton.cdiv(k_tiles, want)
    return SmallGrid(bm, bn, bk8, warps, stages, grid_n, triton.cdiv(k_tiles, tiles_per_split), tiles_per_split)


def small_m_gemm(x: torch.Tensor, w: GPTQWeight, bias: torch.Tensor | None = None,
                 tuning: tuple[int, int, int, int, int] | None = None,
                 accumulate: torch.Tensor | None = None,
                 router: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """M <= SMALL_M_MAX (``small_grid``). M == 1: one launch (the last split finishes); M > 1: memset,
    atomics, reduce. CUDA-graph safe (the arrival counters are persistent, kernels/workspace.py).
    ``tuning``: see small_grid. ``accumulate`` (M == 1): an fp32 [1, N] row (unit stride) that an earlier
    launch on this stream zeroed; the splits add into it with atomics (no counter, no last arriver) and it is
    returned. ``router`` (with ``accumulate``, no bias; paths.batch1_router_fold): (M [E, K], F [E, N], residual
    [1, N], raw fp32 [1, E] zeroed like ``accumulate``): the programs also add M @ x + F @ residual into raw
    (the kernel's ROUTER; fused_moe/router_fold.py says why)."""
    m, k = x.shape
    n = w.out_features
    dev = x.device
    per_row, gidx = row_groups(w, _CONFIGS[choose_config(m)][2])
    cc = compute_capability(dev)
    # the exact-integer dot (int4.int_dot_tile): fp16, one group per K tile, the paths switch for M rows
    int_dot = (not per_row and x.dtype == torch.float16
               and paths.int_dot(m, cc))
    # below sm80, few rows: the GEMV's step two rows at a time instead of the 16-row FMA dot (paths.dense_rows)
    rows = 0 if per_row or router is not None or accumulate is not None else paths.dense_rows(m, cc)
    g = small_grid(m, n, k, dev, tuning)
    bm, bn, bk8, warps, stages = g.block_m, g.block_n, g.block_k8, g.num_warps, g.num_stages
    grid_n, splits, tiles_per_split = g.grid_n, g.splits, g.tiles_per_split
    accum = accumulate is not None
    if accum:
        assert m == 1 and accumulate.dtype == torch.float32 and accumulate.shape == (1, n), accumulate.shape
        assert accumulate.stride(-1) == 1
    out = accumulate if accum else torch.empty(m, n, dtype=x.dtype, device=dev)
    bias_arg = bias if bias is not None else out
    if splits == 1 or accum:
        part = out.float()[:0]
    elif m == 1:
        part = torch.empty(splits, 1, n, dtype=torch.float32, device=dev)
    else:
        part = torch.zeros(m, n, dtype=torch.float32, device=dev)
    use_pdl = pdl(dev, m)
    rt: dict = {}
    if router is not None:
        rm, rf, rres, raw = router
        e = rm.shape[0]
        assert accum and bias is None and rm.shape == (e, k) and rf.shape == (e, n), (rm.shape, rf.shape, k, n)
        assert raw.dtype == torch.float32 and raw.numel() == e and rres.numel() == n and rm.is_contiguous()
        assert rf.is_contiguous() and rres.is_contiguous() and raw.is_contiguous()
        rn_chunk = triton.cdiv(n, splits)
        width = max(next_pow2(tiles_per_split * bk8 * 8), next_pow2(rn_chunk))   # both tiles: one shape
        rt = dict(ROUTER=True, BLOCK_RE=next_pow2(triton.cdiv(e, grid_n)), BLOCK_R=width)
        rargs = (rm, rf, rres, raw, e, rn_chunk)
    else:
        rargs = (out, out, out, out, 0, 0)                                # unused without ROUTER
    _w4a16_small_kernel[(grid_n, splits, triton.cdiv(m, rows) if rows else 1)](
        x, w.qweight, w.qzeros, w.scales, gidx, bias_arg, out, part, workspace.counters(dev, "gemm", grid_n),
        m, n, k, w.group_size, w.num_groups, tiles_per_split, x.stride(0), int(bias is not None), *rargs,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K8=bk8, PER_ROW=bool(per_row), BLOCK_S=GEMV_MAX_SPLITS, PDL=use_pdl,
        INT_DOT=int_dot, ACCUM=accum, ROWS=rows, num_warps=warps, num_stages=stages, launch_pdl=use_pdl, **rt)
    if splits > 1 and m > 1:
        _splitk_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            part, bias_arg, out, m * n, n, 1, BLOCK=_REDUCE_BLOCK, HAS_BIAS=bias is not None, PDL=use_pdl,
            launch_pdl=use_pdl)
    return out


def dequantize(w: GPTQWeight, dtype: torch.dtype) -> torch.Tensor:
    """[K, N] dense weights in ``dtype`` (one Triton launch)."""
    k, n = w.in_features, w.out_features
    out = torch.empty(k, n, dtype=dtype, device=w.qweight.device)
    bn, bk8 = _DEQUANT_BLOCK
    _, gidx = row_groups(w, 1 << 30)                                      # always per row here
    grid = (triton.cdiv(k // 8, bk8), triton.cdiv(n, bn))
    _dequant_kernel[grid](w.qweight, w.qzeros, w.scales, gidx, out, n, k, w.group_size,
                          BLOCK_N=bn, BLOCK_K8=bk8, HAS_GIDX=True)
    return out


def w4a16_gemm(x: torch.Tensor, w: GPTQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    m, k = x.shape
    n = w.out_features
    assert k == w.in_features and k % 8 == 0 and n % 8 == 0, (x.shape, k, n)
    assert w.qweight.is_contiguous() and w.qzeros.is_contiguous() and w.scales.is_contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    dev = x.device
    cc = compute_capability(dev)
    # here only where tl.dot has no tensor cores; dispatch sends larger M to cuBLAS on every GPU (same table)
    if not paths.tensor_core_dot(cc) and paths.choose_dense_gemm(m, cc, gpu=dev.type == "cuda") == "cublas":
        y = torch.matmul(x, dequantize(w, x.dtype))
        return y if bias is None else y + bias
    if m <= SMALL_M_MAX:
        return small_m_gemm(x, w, bias)
    bm, bn, bk8, use_dot, warps, stages = _CONFIGS[choose_config(m)]
    per_row, gidx = row_groups(w, bk8)
    k_tiles = triton.cdiv(k // 8, bk8)
    grid_n, grid_m = triton.cdiv(n, bn), triton.cdiv(m, bm)
    splits = _split_k(grid_n * grid_m, k_tiles, dev)
    tiles_per_split = triton.cdiv(k_tiles, splits)
    splits = triton.cdiv(k_tiles, tiles_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=dev)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=dev) if splits > 1 else out.float()[:0]
    bias_arg = bias if bias is not None else out
    _w4a16_kernel[(grid_n, splits, grid_m)](
        x, w.qweight, w.qzeros, w.scales, gidx, bias_arg, out, part, m, n, k, w.group_size, w.num_groups,
        tiles_per_split, x.stride(0), int(per_row), int(bias is not None), int(splits > 1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K8=bk8, USE_DOT=use_dot, num_warps=warps, num_stages=stages)
    if splits > 1:
        _splitk_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            part, bias_arg, out, m * n, n, splits, BLOCK=_REDUCE_BLOCK, HAS_BIAS=bias is not None, PDL=False)
    return out


def aot_configs() -> list[AotConfig]:
    """Every (kernel, block config) the dispatcher above can launch: fp16 everywhere, bf16 on sm80+.

    Group mode, bias and split-K are runtime flags, so each block config is one compiled kernel.
    """
    out: list[AotConfig] = []
    for act, min_cc in (("fp16", 70), ("bf16", 80)):
        for name, (bm, bn, bk8, use_dot, warps, stages) in _CONFIGS.items():
            if bm <= SMALL_M_MAX:
                for per_row in (False, True):
                    cx = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K8=bk8, PER_ROW=per_row, BLOCK_S=GEMV_MAX_SPLITS,
                              PDL=False, INT_DOT=False, ACCUM=False, ROUTER=False, BLOCK_RE=1, BLOCK_R=1, ROWS=0)
                    args = dict(x_ptr=f"*{act}", qw_ptr="*i32", qz_ptr="*i32", sc_ptr="*fp16", gidx_ptr="*i32",
                                bias_ptr=f"*{act}", out_ptr=f"*{act}", part_ptr="*fp32", cnt_ptr="*i32",
                                M="i32", N="i32",
                                K="i32", group_size="i32", num_groups="i32", tiles_per_split="i32",
                                stride_xm="i32", has_bias="i32", rm_ptr=f"*{act}", rf_ptr=f"*{act}",
                                rr_ptr=f"*{act}", raw_ptr="*fp32", E="i32", rn_chunk="i32")
                    tag = "" if not per_row else ",per_row"
                    out.append(AotConfig(_w4a16_small_kernel, signature(args, cx), cx, warps, stages, min_cc,
                                         f"w4a16[{name},{act}]" if not per_row else f"w4a16[{name}{tag},{act}]"))
                    if name == "gemv":                    # accumulating into fp32 (paths.batch1_accumulate)
                        out.append(AotConfig(_w4a16_small_kernel,
                                             signature(dict(args, out_ptr="*fp32"), dict(cx, ACCUM=True)),
                                             dict(cx, ACCUM=True), warps, stages, min_cc,
                                             f"w4a16[{name}{tag},accum,{act}]"))
                    if name == "gemv" and not per_row:    # + the folded router (paths.batch1_router_fold): the
                        # served o_proj (K 4096, 16 splits of 2 tiles; N 2048 in 32 column tiles; E 128)
                        rx = dict(cx, ACCUM=True, ROUTER=True, BLOCK_RE=4, BLOCK_R=256)
                        out.append(AotConfig(_w4a16_small_kernel, signature(dict(args, out_ptr="*fp32"), rx), rx,
                                             warps, stages, min_cc, f"w4a16[{name},accum,router,{act}]"))
                    if name != "gemv" and not per_row and act == "fp16":
                        rx = dict(cx, ROWS=paths.DECODE_ROWS_PRE_AMPERE)          # the row step (paths.dense_rows)
                        out.append(AotConfig(_w4a16_small_kernel, signature(args, rx), rx, warps, stages, min_cc,
                                             f"w4a16[{name},rows,{act}]"))
                        # the exact-integer dot
                        out.append(AotConfig(_w4a16_small_kernel, signature(args, dict(cx, INT_DOT=True)),
                                             dict(cx, INT_DOT=True), warps, stages, max(min_cc, 80),
                                             f"w4a16[{name},int_dot,{act}]"))
                continue
            cx = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K8=bk8, USE_DOT=use_dot)
            args = dict(x_ptr=f"*{act}", qw_ptr="*i32", qz_ptr="*i32", sc_ptr="*fp16", gidx_ptr="*i32",
                        bias_ptr=f"*{act}", out_ptr=f"*{act}", part_ptr="*fp32", M="i32", N="i32", K="i32",
                        group_size="i32", num_groups="i32", tiles_per_split="i32", stride_xm="i32",
                        per_row="i32", has_bias="i32", split="i32")
            out.append(AotConfig(_w4a16_kernel, signature(args, cx), cx, warps, stages, min_cc,
                                 f"w4a16[{name},{act}]"))
        for has_bias in (False, True):
            cx = dict(BLOCK=_REDUCE_BLOCK, HAS_BIAS=has_bias, PDL=False)
            args = dict(part_ptr="*fp32", bias_ptr=f"*{act}", out_ptr=f"*{act}", MN="i32", N="i32",
                        num_splits="i32")
            out.append(AotConfig(_splitk_reduce_kernel, signature(args, cx), cx, 4, 1, min_cc,
                                 f"splitk_reduce[b={has_bias},{act}]"))
    # the cuBLAS path runs on cc < 80 only, in fp16
    cx = dict(BLOCK_N=_DEQUANT_BLOCK[0], BLOCK_K8=_DEQUANT_BLOCK[1], HAS_GIDX=True)
    args = dict(qw_ptr="*i32", qz_ptr="*i32", sc_ptr="*fp16", gidx_ptr="*i32", out_ptr="*fp16", N="i32",
                K="i32", group_size="i32")
    out.append(AotConfig(_dequant_kernel, signature(args, cx), cx, 4, 1, 70, "dequant"))
    return out


__all__ = ["SmallGrid", "aot_configs", "choose_config", "dequantize", "row_groups", "small_grid", "small_m_gemm",
           "w4a16_gemm"]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
