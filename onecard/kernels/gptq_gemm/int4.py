"""Device helpers (@triton.jit) for GPTQ's packed int4 layout, shared by the GEMMs here and fused_moe's.

Layout (gptq_gemm/format.py is the spec): qweight int32 [K/8, N], nibble j of packed row r is input row 8r + j;
scales fp16 [K/G, N]; qzeros int32 [K/G, N/8] holding TRUE zeros (the loader converts v1), nibble n % 8 of
column n // 8. A K tile is BK8 packed rows, [BK8, BN] int32. Every helper is inlined into its kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dequant_tile_j(q, j: tl.constexpr, s_u, z_u, sc_ptr, qz_ptr, gidx_ptr, k, r_mask, offs_n, n_mask, z_shift,
                    N, per_row):
    """fp32 [BK8, BN] weights of input rows k = 8r + j from the int32 tile q [BK8, BN].

    per_row == 0: the tile lies in one group (s_u, z_u [BN]); else groups come from g_idx per row.
    A runtime (warp-uniform) branch, so one compiled kernel serves both group modes.
    """
    w = ((q >> (4 * j)) & 0xF).to(tl.float32)
    if per_row != 0:
        g_r = tl.load(gidx_ptr + k, mask=r_mask, other=0)
        gm = r_mask[:, None] & n_mask[None, :]
        s_r = tl.load(sc_ptr + g_r[:, None] * N + offs_n[None, :], mask=gm, other=0.0).to(tl.float32)
        zp_r = tl.load(qz_ptr + g_r[:, None] * (N // 8) + (offs_n // 8)[None, :], mask=gm, other=0)
        w = (w - ((zp_r >> z_shift[None, :]) & 0xF).to(tl.float32)) * s_r
    else:
        w = (w - z_u[None, :]) * s_u[None, :]
    return w


@triton.jit
def _group_sz(sc_ptr, qz_ptr, g, offs_n, n_mask, z_shift, N):
    """Scales and true zeros of group g: fp32 [BN] each."""
    s_u = tl.load(sc_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    zp = tl.load(qz_ptr + g * (N // 8) + offs_n // 8, mask=n_mask, other=0)
    return s_u, ((zp >> z_shift) & 0xF).to(tl.float32)


@triton.jit
def nibbles(q, j: tl.constexpr, DT: tl.constexpr):
    """Nibble j of every int32 in q as an exact float of type DT, offset by 1024 (fp16) or 2**23 (else; see magic_zero_scale):
    the nibble is OR-ed into the mantissa of 1024.0 (fp16) or 2**23 (fp32) — bit operations only, no
    int->float conversion instruction (those run at a quarter of the FMA rate and bounded the decode GEMMs)."""
    n = (q >> (4 * j)) & 0xF
    if DT == tl.float16:
        return (n | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)            # 1024 + n, exact
    else:
        return (n | 0x4B000000).to(tl.float32, bitcast=True)                     # 2**23 + n, exact


@triton.jit
def magic_zero_scale(z_u, s_u, DT: tl.constexpr):
    """-> (zb, sc) [BN]: zeros plus the nibbles() offset and the scales, so that (nibbles(q) - zb) * sc is the
    weight: exact q - z, then ONE rounding of (q - z) * s (fp16: the exact product rounded once, the same
    value as the fp32 product cast to fp16; other dtypes: fp32, cast by the caller)."""
    if DT == tl.float16:
        return (z_u + 1024.0).to(tl.float16), s_u.to(tl.float16)
    else:
        return z_u + 8388608.0, s_u


@triton.jit
def row_input(row_ptr, r, j: tl.constexpr, r_mask):
    """fp32 [BK8] inputs 8r + j of the activation row at row_ptr: gemv_tile_mac's plain ``INPUT``."""
    return tl.load(row_ptr + r * 8 + j, mask=r_mask, other=0.0).to(tl.float32)


@triton.jit
def gemv_tile_mac(acc, q, s_u, z_u, src, r, r_mask, INPUT: tl.constexpr, BLOCK_K8: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Batch-1 multiply-accumulate of one K tile in one group: acc [BK8, BN] fp32 += x_(8r+j) * w_(8r+j),
    row sums left to the caller (once, after its K loop). The inputs x [BK8] come from ``INPUT(src, r, j,
    r_mask)``, a @triton.jit function: row_input (src: the row's pointer), or one that computes the row from
    what src holds (fused MoE stage 2: silu(gate) * up); masked rows must be exact zeros.
    The scale and zero are applied once per tile: sum_j (q_j - z) s x_j = s * (sum_j q_j x_j - z * sum_j x_j),
    so the inner loop is shift, or, subtract, FMA per weight (nibbles: no int->float conversions)."""
    nx = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)                 # sum_j ((2**23 + n_j) - 2**23) x_j
    xs = tl.zeros((BLOCK_K8,), dtype=tl.float32)                          # sum_j x_j
    for j in tl.static_range(8):
        xv = INPUT(src, r, j, r_mask)
        nx += (nibbles(q, j, tl.float32) - 8388608.0) * xv[:, None]
        xs += xv
    acc += nx * s_u[None, :] - xs[:, None] * (z_u * s_u)[None, :]
    return acc
