"""Device helpers (@triton.jit) for GPTQ's packed int4 layout, shared by the GEMMs here and fused_moe's.

Layout (gptq_gemm/format.py is the spec): qweight int32 [K/8, N], nibble j of packed row r is input row 8r + j;
scales fp16 [K/G, N]; qzeros int32 [K/G, N/8] holding TRUE zeros (the loader converts v1), nibble n % 8 of
column n // 8. A K tile is BK8 packed rows, [BK8, BN] int32. Every helper is inlined into its kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from onecard.kernels.triton_common import NATIVE, settle_cache_keys


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
def unit_bits(n):
    """The bits of fp32 1.0 (0x3F800000) for runtime ints n >= 0 (a tensor), as values the compiler cannot fold:
    kept in registers, so unit_nibble's and-or is ONE LOP3 (its mask the one immediate operand; with two
    immediates ptxas emits two LOP3s)."""
    return 0x3F800000 + (n >> 31)


@triton.jit
def unit_nibble(q, j: tl.constexpr, one_bits):
    """Nibble j of every int32 in q as the fp32 1 + n/16, exact: the nibble shifted into mantissa bits 19-22 of
    1.0 (``one_bits``: unit_bits), with no int->float conversion and no offset to subtract (a shift and a LOP3)."""
    S: tl.constexpr = 19 - 4 * j
    if S >= 0:
        t = q << S
    else:
        t = q >> (-S)
    return ((t & 0x00780000) | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def gemv_tile_mac(acc, q, s_u, z_u, src, r, r_mask, INPUT: tl.constexpr, BLOCK_K8: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Batch-1 multiply-accumulate of one K tile in one group: acc [BK8, BN] fp32 += x_(8r+j) * w_(8r+j),
    row sums left to the caller (once, after its K loop). The inputs x [BK8] come from ``INPUT(src, r, j,
    r_mask)``, a @triton.jit function: row_input (src: the row's pointer), or one that computes the row from
    what src holds (fused MoE stage 2: silu(gate) * up); masked rows must be exact zeros.
    The scale and zero are applied once per tile (unit_sums, unit_combine)."""
    ux, xs = unit_sums(q, src, r, r_mask, INPUT, BLOCK_K8, BLOCK_N)
    acc += unit_combine(ux, xs[:, None], s_u[None, :], z_u[None, :])
    return acc


@triton.jit
def gemv2_tile_mac(acc0, acc1, q, s_u, z_u, src0, src1, r, mask0, mask1, INPUT: tl.constexpr):
    """gemv_tile_mac on two input rows at once: (acc0, acc1) [BK8, BN] fp32 += x_(8r+j) * w_(8r+j) with x from
    ``INPUT(src0, r, j, mask0)`` and ``INPUT(src1, r, j, mask1)``, each nibble decoded once for both (a shift and
    a LOP3 a weight, then an FMA a row; unit_sums' steps), the scale and zero once per tile (unit_combine). Below
    sm80 it replaces a tl.dot of 16 rows (FMA code there) when few rows are real (paths.decode_rows)."""
    one_bits = unit_bits(r)[:, None]                                      # rows r >= 0: 1.0's bits, per row
    ux0 = tl.zeros_like(acc0)                                             # sum_j u_j x_j, row 0
    ux1 = tl.zeros_like(acc1)
    xs0 = tl.zeros((q.shape[0],), dtype=tl.float32)                      # sum_j x_j [BK8], row 0
    xs1 = tl.zeros((q.shape[0],), dtype=tl.float32)
    for j in tl.static_range(8):
        u = unit_nibble(q, j, one_bits)                                   # [BK8, BN]
        x0 = INPUT(src0, r, j, mask0)
        x1 = INPUT(src1, r, j, mask1)
        ux0 += u * x0[:, None]
        ux1 += u * x1[:, None]
        xs0 += x0
        xs1 += x1
    acc0 += unit_combine(ux0, xs0[:, None], s_u[None, :], z_u[None, :])
    acc1 += unit_combine(ux1, xs1[:, None], s_u[None, :], z_u[None, :])
    return acc0, acc1


@triton.jit
def unit_sums(q, src, r, r_mask, INPUT: tl.constexpr, BLOCK_K8: tl.constexpr, BLOCK_N: tl.constexpr):
    """-> (ux [BK8, BN], xs [BK8]) fp32: sum_j u_j x_j per packed row and column, with u_j = 1 + n_j/16
    (unit_nibble), and sum_j x_j per packed row, over the 8 inputs x_(8r+j) = INPUT(src, r, j, r_mask) of the
    int32 tile q [BK8, BN]. The inner loop is a shift, a LOP3 and an FMA per weight; unit_combine turns the two
    sums into the weights' products once per packed row (the sum of u_j x_j, u_j in [1, 2), loses at most a bit
    or two to the subtraction there)."""
    ux = tl.zeros((BLOCK_K8, BLOCK_N), dtype=tl.float32)                 # sum_j u_j x_j
    xs = tl.zeros((BLOCK_K8,), dtype=tl.float32)                          # sum_j x_j
    one_bits = unit_bits(r)[:, None]                                      # rows r >= 0: 1.0's bits, per row
    for j in tl.static_range(8):
        xv = INPUT(src, r, j, r_mask)
        ux += unit_nibble(q, j, one_bits) * xv[:, None]
        xs += xv
    return ux, xs


@triton.jit
def unit_combine(ux, xs, s, z):
    """sum_j (n_j - z) s x_j = s * (16 sum_j u_j x_j - (16 + z) sum_j x_j), fp32, from unit_sums' ux and xs and the
    scales and true zeros s, z of each packed row's group, xs, s and z broadcastable to ux's shape (a [BK8, BN]
    tile in one group: xs[:, None], s[None, :], z[None, :]; reshaped to [G, rows, BN], G groups: xs[:, :, None],
    s[:, None, :], z[:, None, :])."""
    return ux * (16.0 * s) - xs * ((16.0 + z) * s)


@triton.jit
def pair_zeros(z_u):
    """-> (ze, zo) int32 [BN]: the fp16 bits of 1024 + z and of 64 + z in both halves (true zeros z_u fp32 [BN]):
    what byte_pair_diffs subtracts from its even and odd nibbles."""
    zi = z_u.to(tl.int32)
    return (0x6400 + zi) * 0x10001, (0x5400 + 16 * zi) * 0x10001


def _pair_diffs_ptx(b: int) -> str:
    """byte_pair_diffs' PTX for byte b: operands $0-$3 the four fp16 results (.b16), $4 qe, $5 qo, $6 ze, $7 zo.
    prmt's selector puts byte b of $4 in byte 0 and byte b of $5 (byte 4 + b of the pair {$5, $4}) in byte 2;
    lop3's 0xEA is (a & b) | c."""
    return (
        "{\n.reg .b32 t, lo, hi;\n"
        f"prmt.b32 t, $4, $5, {b | ((b + 4) << 8):#x};\n"
        "lop3.b32 lo, t, 0x000f000f, 0x64006400, 0xea;\n"
        "lop3.b32 hi, t, 0x00f000f0, 0x54005400, 0xea;\n"
        "sub.f16x2 lo, lo, $6;\n"
        "sub.f16x2 hi, hi, $7;\n"
        "mov.b32 {$0, $1}, lo;\n"
        "mov.b32 {$2, $3}, hi;\n}"
    )


PAIR_DIFFS_PTX = tl.constexpr(tuple(_pair_diffs_ptx(b) for b in range(4)))   # tests/kernels/test_int4_ptx.py


@triton.jit
def byte_pair_diffs(qe, qo, ze, zo, B: tl.constexpr):
    """Byte B of packed rows 2i (qe) and 2i+1 (qo), int32 [R, BN] each -> fp16 [R, BN] x 4: n - z of nibble 2B in
    row 2i, in row 2i+1, then of nibble 2B+1 in row 2i, in row 2i+1 — exact small integers.

    On a GPU (triton_common.NATIVE; PAIR_DIFFS_PTX): ONE prmt puts byte B of both rows in the two 16-bit halves of a word; ONE lop3
    each keeps the low nibbles under fp16 1024.0 (0x6400: 1024 + n) and the high nibbles, which sit 4 bits up,
    under 64.0 (0x5400: 64 + n, the mantissa's unit being 1/16 there); ONE sub.f16x2 each takes away 1024 + z,
    64 + z (pair_zeros): exact. 1.25 instructions per weight instead of a shift, an and-or, a pack and an fp16
    subtract. Each 32-bit result holds a row pair of one column: two consecutive inputs, as a tensor-core
    fragment holds them (interleaved_cols).
    Under the interpreter, which runs no inline PTX: the same values from shifts and masks."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            asm=PAIR_DIFFS_PTX[B], constraints="=h,=h,=h,=h,r,r,r,r", args=[qe, qo, ze, zo],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        z = ((ze & 0xFFFF) - 0x6400).to(tl.float32)                       # back to z (same [., BN] shape)
        e0 = (((qe >> (8 * B)) & 0xF).to(tl.float32) - z).to(tl.float16)
        e1 = (((qo >> (8 * B)) & 0xF).to(tl.float32) - z).to(tl.float16)
        o0 = (((qe >> (8 * B + 4)) & 0xF).to(tl.float32) - z).to(tl.float16)
        o1 = (((qo >> (8 * B + 4)) & 0xF).to(tl.float32) - z).to(tl.float16)
        return e0, e1, o0, o1


@triton.jit
def interleaved_cols(we, wo):
    """we, wo [R, BN] (packed rows 2i and 2i+1 of one nibble) -> [BN, 2R]: the weights transposed, their inputs
    in order (column 2i from we, 2i + 1 from wo)."""
    return tl.reshape(tl.join(tl.permute(we, (1, 0)), tl.permute(wo, (1, 0))), (we.shape[1], 2 * we.shape[0]))


def _half2_dot8_ptx() -> str:
    """half2_dot8's PTX: $0 the fp32 result, $1 the packed int32 q, $2-$5 the input pairs (x_k, x_(k+4)) as f16x2,
    $6 1024 + z in both halves (half2_zeros). Step k: (q >> 4k) & 0x000F000F puts nibbles k and k + 4 in the low
    bits of the two halves, OR 0x6400 makes them the fp16 values 1024 + n (lop3 0xEA: (a & b) | c), sub.f16x2 takes
    away 1024 + z (exact: n - z), then one packed multiply-add per two weights. The two halves' sums (nibbles 0-3,
    4-7) are added in fp32."""
    lines = ["{", ".reg .b32 t, u, a;", ".reg .f16 lo, hi;", ".reg .f32 flo, fhi;"]
    for k in range(4):
        src = "$1"
        if k:
            lines.append(f"shr.b32 u, $1, {4 * k};")
            src = "u"
        lines += [f"lop3.b32 t, {src}, 0x000f000f, 0x64006400, 0xea;", "sub.f16x2 t, t, $6;",
                  f"mul.rn.f16x2 a, t, ${2 + k};" if k == 0 else f"fma.rn.f16x2 a, t, ${2 + k}, a;"]
    lines += ["mov.b32 {lo, hi}, a;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 $0, flo, fhi;", "}"]
    return "\n".join(lines)


HALF2_DOT8_PTX = tl.constexpr(_half2_dot8_ptx())                         # tests/kernels/test_int4_ptx.py


@triton.jit
def half2_zeros(z):
    """int32: the fp16 bits of 1024 + z in both halves, for true zeros z (int32 tensor, 0..15): half2_dot8's zz."""
    return (0x6400 + z) * 0x10001


@triton.jit
def half2_pairs(x01, x23, x45, x67):
    """A packed row's 8 fp16 inputs, given as int32 pairs (x_2c, x_2c+1) (c = 0..3, the low half first, as they
    lie in memory) -> half2_dot8's pairs (x_k, x_k+4), k = 0..3, as int32 (x_k in the low half)."""
    lo = 0xFFFF
    hi = -65536                                                           # 0xFFFF0000 as int32
    return ((x01 & lo) | (x45 << 16), ((x01 >> 16) & lo) | (x45 & hi),
            (x23 & lo) | (x67 << 16), ((x23 >> 16) & lo) | (x67 & hi))


@triton.jit
def row_words(x_ptr, r, r_mask):
    """The 16-byte packed rows r ([BK8]) of a 16-bit input row at x_ptr as int32 words [BK8, 4]: word c holds inputs
    8r + 2c (low half) and 8r + 2c + 1; zeros where not r_mask. ONE load a row: in a loop that Triton pipelines it
    streams with the weights (cp.async copies 4, 8 or 16 bytes a thread; a 2-byte element a thread would stay a
    load in the loop)."""
    return tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + r[:, None] * 4 + tl.arange(0, 4)[None, :],
                   mask=r_mask[:, None], other=0)


@triton.jit
def input_pairs(x_ptr, r, r_mask):
    """half2_dot8's inputs for packed rows r ([BK8]) of the fp16 row at x_ptr: the 8 inputs 8r + j of each row
    (row_words: one 16-byte load), as the four int32 pairs (x_k, x_k+4) [BK8] (half2_pairs); zeros where not
    r_mask."""
    BK8: tl.constexpr = r.shape[0]
    pairs = row_words(x_ptr, r, r_mask)                                   # [BK8, 4]: (x[8r + 2c], x[8r + 2c + 1])
    even, odd = tl.split(tl.reshape(pairs, (BK8, 2, 2)))                 # c = 0, 2 | c = 1, 3
    x01, x45 = tl.split(even)
    x23, x67 = tl.split(odd)
    return half2_pairs(x01, x23, x45, x67)


@triton.jit
def _f16_lo(v):
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def half2_dot8(q, x0, x1, x2, x3, zz):
    """fp32 sum_j (n_j - z) x_j over the 8 nibbles n_j of every int32 in q (input row 8r + j of a packed row r),
    in packed fp16 arithmetic: x0..x3 the inputs as half2_pairs, zz = half2_zeros(z); all broadcast to q's shape.
    Each half of a word sums four products in fp16 (n - z exact; one rounding per multiply-add), the two halves
    are added in fp32: 19 instructions for 8 weights (3 shifts, 4 lop3, 4 sub.f16x2, 4 packed multiply-adds, 2
    conversions and an add) against a shift, an and-or and an fp32 FMA per weight plus the combine (unit_sums).
    On a GPU (NATIVE): HALF2_DOT8_PTX (sm53+: every target). Under the interpreter: the same roundings with
    Triton ops (the product of an fp16 and a small integer is exact in fp32; the sum is rounded to fp32, then
    to fp16: a double rounding the PTX does not have, at most one fp16 unit apart in rare ties)."""
    if NATIVE:
        return tl.inline_asm_elementwise(asm=HALF2_DOT8_PTX, constraints="=f,r,r,r,r,r,r",
                                         args=[q, x0, x1, x2, x3, zz], dtype=tl.float32, is_pure=True, pack=1)
    else:
        z = ((zz & 0xFFFF) - 0x6400).to(tl.float32)
        lo = tl.zeros(q.shape, dtype=tl.float32)                          # q: the full shape
        hi = lo
        xs = (x0, x1, x2, x3)
        for k in tl.static_range(4):
            xk = xs[k]
            d_lo = ((q >> (4 * k)) & 0xF).to(tl.float32) - z
            d_hi = ((q >> (4 * k + 16)) & 0xF).to(tl.float32) - z
            lo = (d_lo * _f16_lo(xk) + lo).to(tl.float16).to(tl.float32)
            hi = (d_hi * _f16_lo(xk >> 16) + hi).to(tl.float16).to(tl.float32)
        return lo + hi


INT_DOT_ROWS: tl.constexpr = tl.constexpr(16)    # int_dot_tile's input rows BT: tl.dot's smallest size


@triton.jit
def rows_input_t(src, k, r_mask):
    """fp16 [len(k), BT] = A[rows, k] transposed: an INPUT of int_dot_tile. src = (a_ptr, rows [BT], row_mask [BT],
    row stride); 0 where not r_mask or not row_mask."""
    a_ptr, rows, row_mask, stride = src
    return tl.load(a_ptr + rows.to(tl.int64)[None, :] * stride + k[:, None], mask=r_mask[:, None] & row_mask[None, :],
                   other=0.0)


@triton.jit
def int_dot_tile(q, s_u, z_u, src, r, r_mask, INPUT: tl.constexpr):
    """fp32 [BN, BT] = s * ((n - z)^T @ A^T) for one K tile in one group: q [BK8, BN] int32 (packed rows r, masked
    rows 0), scales and true zeros s_u, z_u [BN] fp32; A^T's rows 8r + j from ``INPUT(src, k, r_mask)`` (fp16
    [BK8, BT], 0 where not r_mask: rows_input_t, or one that computes them, fused_moe/stages.py's silu * up).

    The decode GEMMs' exact-integer dot (fp16; paths.int_dot). Their loops are
    bound by instructions, not bytes (the batch-16 MoE's time did not move with 4-24 programs per SM; sm90 SASS
    4.5-6 instructions per weight against the ~5 that HBM bandwidth leaves per weight). Here the packed rows
    come as pairs (2i, 2i+1) and byte_pair_diffs turns a byte of each pair into four exact n - z; the dot
    accumulates in fp32 and the group's scale multiplies the tile's sum once instead of every weight. Products
    of fp16 inputs and small integers are exact, so the only roundings are the dot's fp32 sums and that one
    product: closer to the fp32 reference than weights dequantized to fp16. The weights are the dot's FIRST
    operand: second, the inputs' tensor-core fragments needed a register shuffle per mma (sm90 SASS: 841
    instructions per loop against 678 this way round). BT = INT_DOT_ROWS; batch 1 masks 15 of them."""
    qe, qo = tl.split(tl.permute(tl.reshape(q, (q.shape[0] // 2, 2, q.shape[1])), (0, 2, 1)))   # rows 2i, 2i+1
    ze, zo = pair_zeros(z_u)
    tile = tl.zeros((q.shape[1], INT_DOT_ROWS), dtype=tl.float32)         # [BN, BT]
    for b in tl.static_range(4):                                          # byte b: nibbles 2b, 2b + 1
        e0, e1, o0, o1 = byte_pair_diffs(qe, qo, ze[None, :], zo[None, :], b)
        tile += tl.dot(interleaved_cols(e0, e1), INPUT(src, r * 8 + 2 * b, r_mask))       # inputs 8r + 2b
        tile += tl.dot(interleaved_cols(o0, o1), INPUT(src, r * 8 + 2 * b + 1, r_mask))   # inputs 8r + 2b + 1
    return tile * s_u[:, None]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
