"""Triton KV-cache store and varlen paged attention, same contract as ref.py.

paged_attention: one kernel for prefill chunks over a cached prefix and for decode. Program =
(sequence, block of BLOCK_Q query tokens, KV head); its BLOCK_M = BLOCK_Q * GROUP_PAD rows are the query
tokens x the query heads sharing that KV head (GQA), so tl.dot gets M >= 16 even at decode. Keys are gathered
token by token through the block table (any cache block size), causal rule key_pos <= context_len + q_idx,
online softmax in fp32 (exp2, scale folded in). Split-KV (decode-only batches, kernels/paths.split_kv):
num_segments > 1 programs per (sequence, KV head); each sequence's own key tiles are cut into segments of
max(ceil(tiles / num_segments), min_seg_tiles) tiles (_segment_tiles), each writes (acc, max, sum) partials,
segments past the sequence's end exit at once, and a reduce kernel merges the filled ones (it derives their
count from seq_lens with the same helper). Small-q launches (speculative verify steps, while
paths.small_q_split(); on by default since the H100 A/B) split the same way per q-block program, cutting the keys
that q-block sees; their row-wise reduce finds each row's sequence and q-block and derives the same count. The
grid depends only on host-known sizes (B, max_query_len, segments; num_segments from an upper bound on the
lengths, so one CUDA graph serves every context): no syncs.
Below sm80 the prefill chunks of an eager step go to PyTorch's SDPA instead (paths.prefill_sdpa, sdpa.py: tl.dot
is FMA code there), the launch's other sequences to the kernel (metadata.select).
kv_touch: the batch-1 read of a layer's KV into L2 ahead of its attention (paths.batch1_kv_prefetch).
FP8 caches (fp8.py): the kernels take their bytes and a KV_FMT constexpr; K/V tiles are decoded to fp16 after
the load (e5m2: a shift; e4m3: the sm89+ conversion), k_scale is folded into the softmax scale and v_scale
into the output (or the split-KV partials), so the inner loop gains one conversion per element.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from onecard.kernels import paths
from onecard.kernels.attention import sdpa
from onecard.kernels.attention.fp8 import fmt_code, kernel_view, kv_decode, kv_store_value
from onecard.kernels.attention.metadata import AttentionMetadata, select
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

# The online softmax's two sentinels, one home for every kernel here: the running max of a row that has seen no key
# (finite: rescaling by exp2(EMPTY_MAX - EMPTY_MAX) is 1 and by exp2(EMPTY_MAX - m) 0, where -inf would give nan for
# an empty segment) and the floor of the sum that divides the output (an empty row's 0 / SUM_FLOOR is 0, not nan).
EMPTY_MAX = tl.constexpr(-1e30)
SUM_FLOOR = tl.constexpr(1e-30)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt, HD, k_scale, v_scale,
                     BLOCK: tl.constexpr, KV_FMT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < HD
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(kc_ptr + slot * HD + offs, kv_store_value(k, k_scale, KV_FMT, kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * HD + offs, kv_store_value(v, v_scale, KV_FMT, vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_blocks(bt_row, k_pos, kv_end, block_size):
    """[BN] cache blocks of keys ``k_pos`` (0 where k_pos >= kv_end: pass kv_end 0 to load nothing)."""
    return tl.load(bt_row + k_pos // block_size, mask=k_pos < kv_end, other=0)


@triton.jit
def _tile_kv(kc_ptr, vc_ptr, blk, k_pos, kv_end, kvh, block_size, HKV: tl.constexpr, D: tl.constexpr):
    """K and V [BN, D] of keys ``k_pos`` in cache blocks ``blk`` (zeros where k_pos >= kv_end)."""
    ok = k_pos < kv_end
    slot = blk.to(tl.int64) * block_size + k_pos % block_size
    kv_off = (slot[:, None] * HKV + kvh) * D + tl.arange(0, D)[None, :]
    return (tl.load(kc_ptr + kv_off, mask=ok[:, None], other=0),
            tl.load(vc_ptr + kv_off, mask=ok[:, None], other=0))


@triton.jit
def _tile_update(q, k, v, k_pos, k_ok, q_pos, m_i, l_i, acc, scale_log2, KV_FMT: tl.constexpr):
    """One key tile's online-softmax step: -> (m_i, l_i, acc)."""
    if KV_FMT != 0:                                                       # fp8 bytes -> q's dtype (exact)
        k = kv_decode(k, KV_FMT).to(q.dtype)
        v = kv_decode(v, KV_FMT).to(q.dtype)
    s = dot(q, tl.trans(k.to(q.dtype))) * scale_log2                     # [BM, BN] log2 units
    allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
    s = tl.where(allowed, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v.to(q.dtype)).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _rms_rope_lanes(x, xs, w, w_sw, cosf, sinf, eps, D: tl.constexpr):
    """rope.triton.rms_rope's arithmetic on whole head rows x [..., D] fp32: lane d pairs with lane (d + D/2) % D,
    whose values are xs (and w_sw the norm weight's); cosf [D] is cos of lane d % (D/2), sinf that sin negated in
    the first half. -> [..., D] fp32 (QKN's query rows and new key)."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
    return (x * rstd * w) * cosf + (xs * rstd * w_sw) * sinf


@triton.jit
def _segment_tiles(n_tiles, num_segments, min_seg_tiles):
    """Key tiles per split-KV segment of a sequence with ``n_tiles`` tiles (the kernel and the reduce agree)."""
    return tl.maximum(tl.cdiv(n_tiles, num_segments), min_seg_tiles)


@triton.jit
def _filled_segments(n_tiles, num_segments, min_seg_tiles):
    """How many of a sequence's split-KV segments hold keys (the rest exit at once): what the reduce merges."""
    return tl.cdiv(n_tiles, _segment_tiles(n_tiles, num_segments, min_seg_tiles))


# runtime-varying ints: one compile serves all
@triton.jit(do_not_specialize=["stride_bt", "num_segments", "min_seg_tiles"])
def _paged_attn_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, part_ptr, ml_ptr, qsl_ptr, seqlen_ptr, bt_ptr,
                       scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, block_size,
                       num_segments, min_seg_tiles, v_scale,
                       k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, slot_ptr, stride_kt, eps,
                       HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                       D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
                       KV_FMT: tl.constexpr, PREFETCH: tl.constexpr = 0, QKN: tl.constexpr = False):
    """QKN (decode-only launches, the model-dtype cache; paths.batch1_attn_qk): q_ptr, k_ptr, v_ptr are the
    projection's raw q | k | v rows (any float type; k and v rows strided by stride_kt, heads contiguous) and the
    kernel does qk_norm_rope_store's work itself: each program normalises and rotates its query rows (per-head
    RMSNorm with qw, neox RoPE at positions[token]); the program whose segment holds the sequence's last key
    normalises and rotates the new token's k (with kw) and stores k and v into the cache at slot_mapping[token]
    (skipped when < 0) before its key tiles, which read them back (a CTA barrier orders the two)."""
    seq = tl.program_id(0)
    qblk = tl.program_id(1)
    kvh = tl.program_id(2) // num_segments
    segment = tl.program_id(2) % num_segments
    # the step's metadata is not the previous kernel's output: its loads are issued before the PDL wait; q and
    # the new tokens' K/V (the previous kernel's) only after it. Every program waits before it may return
    # (triton_common.pdl_enter: a program that exits unwaited would let the next kernel start too early).
    q_start = tl.load(qsl_ptr + seq, cache_modifier=".cg")                # .cg: buffers rewritten every step
    q_len = tl.load(qsl_ptr + seq + 1, cache_modifier=".cg") - q_start
    seq_len = tl.load(seqlen_ptr + seq, cache_modifier=".cg")
    offs_d = tl.arange(0, D)
    if QKN:                                                               # the rotation of the step's position
        HALF: tl.constexpr = D // 2
        pos = tl.load(pos_ptr + q_start, cache_modifier=".cg").to(tl.int64)   # decode: one token a sequence
        slot_new = tl.load(slot_ptr + q_start, cache_modifier=".cg").to(tl.int64)
        swap = (offs_d + HALF) % D                                        # the other half's lane
        cosf = tl.load(cs_ptr + pos * D + offs_d % HALF)                  # [D] cos of lane d % HALF
        sinv = tl.load(cs_ptr + pos * D + HALF + offs_d % HALF)
        sinf = tl.where(offs_d < HALF, -sinv, sinv)                       # x1 c - x2 s | x2 c + x1 s
        qw = tl.load(qw_ptr + offs_d).to(tl.float32)
        qw_sw = tl.load(qw_ptr + swap).to(tl.float32)
        kw = tl.load(kw_ptr + offs_d).to(tl.float32)
        kw_sw = tl.load(kw_ptr + swap).to(tl.float32)
    pdl_enter(PDL)
    if qblk * BLOCK_Q >= q_len:
        return
    ctx_len = seq_len - q_len
    # keys this query block can see: [0, ctx_len + last q_idx + 1)
    kv_end = tl.minimum(seq_len, ctx_len + (qblk + 1) * BLOCK_Q)
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_seg = _segment_tiles(n_tiles, num_segments, min_seg_tiles)
    t0 = segment * tiles_per_seg
    t1 = tl.minimum(t0 + tiles_per_seg, n_tiles)
    if t0 >= t1:                                                          # a segment past this sequence's end
        return                                                            # (num_segments > 1): the reduce skips it
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    q_idx = qblk * BLOCK_Q + rows // GROUP_PAD                            # [BM] token within the sequence
    head = kvh * GROUP + rows % GROUP_PAD                                 # [BM] query head
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    tok = (q_start + q_idx).to(tl.int64)
    if QKN:
        # rope.triton.rms_rope's arithmetic, on whole rows: lane d pairs with lane (d + D/2) % D
        q_row = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
        qx = tl.load(q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)   # [BM, D]
        qs = tl.load(q_row + swap[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q = _rms_rope_lanes(qx, qs, qw, qw_sw, cosf, sinf, eps, D).to(out_ptr.dtype.element_ty)   # as q_out is
        # the new token's k, v (this KV head): the program whose segment holds the new key stores them before
        # its tiles, and the barrier makes the row visible to its threads (no other program reads it)
        new_key = seq_len - 1                                             # its position in the sequence
        if (t0 * BLOCK_N <= new_key) & (new_key < t1 * BLOCK_N) & (slot_new >= 0):
            k_row = k_ptr + q_start.to(tl.int64) * stride_kt + kvh * D
            kx = tl.load(k_row + offs_d).to(tl.float32)                  # [D]
            ks = tl.load(k_row + swap).to(tl.float32)
            k_new = _rms_rope_lanes(kx, ks, kw, kw_sw, cosf, sinf, eps, D).to(kc_ptr.dtype.element_ty)
            v_new = tl.load(v_ptr + q_start.to(tl.int64) * stride_kt + kvh * D + offs_d).to(vc_ptr.dtype.element_ty)
            kv_row = (slot_new * HKV + kvh) * D + offs_d
            tl.store(kc_ptr + kv_row, k_new)
            tl.store(vc_ptr + kv_row, v_new)
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)                      # [BM, D]
    q_pos = ctx_len + q_idx                                               # [BM]
    m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) + EMPTY_MAX
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH > 0:                                                      # tile t0's block-table entries
        bt_row = bt_ptr + seq * stride_bt
        blk_next = _tile_blocks(bt_row, t0 * BLOCK_N + offs_n, kv_end, block_size)
    if PREFETCH > 1:                                                      # tile t0's K/V, tile t0+1's entries
        k_next, v_next = _tile_kv(kc_ptr, vc_ptr, blk_next, t0 * BLOCK_N + offs_n, kv_end, kvh, block_size,
                                  HKV, D)
        blk_next = _tile_blocks(bt_row, (t0 + 1) * BLOCK_N + offs_n, tl.where(t0 + 1 < t1, kv_end, 0), block_size)
    for t in range(t0, t1):
        k_pos = t * BLOCK_N + offs_n                                      # [BN]
        k_ok = k_pos < kv_end
        if PREFETCH == 2:
            # K/V of this tile were loaded during the previous one; tile t+1's loads are issued before this
            # tile's math, so they stream while it computes (registers, not Triton's cp.async pipeline: that
            # keeps one tile in flight and waits for it before each tile's math)
            k, v = k_next, v_next
            k_next, v_next = _tile_kv(kc_ptr, vc_ptr, blk_next, k_pos + BLOCK_N,
                                      tl.where(t + 1 < t1, kv_end, 0), kvh, block_size, HKV, D)
            blk_next = _tile_blocks(bt_row, k_pos + 2 * BLOCK_N, tl.where(t + 2 < t1, kv_end, 0), block_size)
        else:
            if PREFETCH == 1:
                # this tile's K/V addresses come from entries loaded one tile earlier; the next tile's are
                # loaded now, so the block-table read is off the K/V loads' dependency chain
                blk = blk_next.to(tl.int64)
                blk_next = _tile_blocks(bt_row, k_pos + BLOCK_N, tl.where(t + 1 < t1, kv_end, 0), block_size)
            else:
                blk = tl.load(bt_ptr + seq * stride_bt + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
            slot = blk * block_size + k_pos % block_size                  # [BN]
            kv_off = (slot[:, None] * HKV + kvh) * D + offs_d[None, :]    # [BN, D]
            k = tl.load(kc_ptr + kv_off, mask=k_ok[:, None], other=0)
            v = tl.load(vc_ptr + kv_off, mask=k_ok[:, None], other=0)
        m_i, l_i, acc = _tile_update(q, k, v, k_pos, k_ok, q_pos, m_i, l_i, acc, scale_log2, KV_FMT)
    if KV_FMT != 0:
        acc = acc * v_scale                                               # before the split-KV merge: linear
    if num_segments == 1:
        o = acc / tl.maximum(l_i, SUM_FLOOR)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # partials [T, HQ, S, D] and (m, l) [T, HQ, S, 2]
        base = (tok * HQ + head) * num_segments + segment                 # [BM]
        tl.store(part_ptr + base[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + base * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_segments(part_ptr, ml_ptr, base, n_seg, offs_d, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """The output columns offs_d ([D] or a share of it) of the first ``n_seg`` split-KV partials at rows base..
    (partials [.., D], (m, l) [.., 2]), BLOCK_S at a time (online rescale, _merge_pass)."""
    m_run = tl.full([], EMPTY_MAX, tl.float32)
    l_run = tl.full([], 0.0, tl.float32)
    acc = tl.zeros(offs_d.shape, dtype=tl.float32)
    for s0 in range(0, n_seg, BLOCK_S):
        m_run, l_run, acc = _merge_pass(m_run, l_run, acc, part_ptr, ml_ptr, base, s0, n_seg, offs_d, D, BLOCK_S)
    return acc / tl.maximum(l_run, SUM_FLOOR)


@triton.jit
def _merge_pass(m_run, l_run, acc, part_ptr, ml_ptr, base, s0, n_seg, offs_d, D: tl.constexpr,
                BLOCK_S: tl.constexpr):
    """Partials s0 .. s0 + BLOCK_S (those < n_seg) folded into the running (max, sum, acc [D]) by the online
    rescale (_merge_weights, _merge_apply: the merge's arithmetic in one home)."""
    offs_s = s0 + tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_seg
    m, l = _merge_ml(ml_ptr, base, offs_s, s_ok)
    m_new, alpha, w = _merge_weights(m_run, m)
    part = _merge_part(part_ptr, base, offs_s, s_ok, offs_d, D)
    acc, l_run = _merge_apply(acc, l_run, alpha, w, l, part)
    return m_new, l_run, acc


@triton.jit
def _merge_ml(ml_ptr, base, offs_s, s_ok):
    """(m, l) [S] of segments offs_s (EMPTY_MAX and 0 where not s_ok)."""
    m = tl.load(ml_ptr + (base + offs_s) * 2, mask=s_ok, other=EMPTY_MAX)
    l = tl.load(ml_ptr + (base + offs_s) * 2 + 1, mask=s_ok, other=0.0)
    return m, l


@triton.jit
def _merge_part(part_ptr, base, offs_s, s_ok, offs_d, D: tl.constexpr):
    """Partials [S, D] of segments offs_s (0 where not s_ok)."""
    return tl.load(part_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)


@triton.jit
def _merge_weights(m_run, m):
    """-> (new running max, the running sums' rescale, the segments' weights [S])."""
    m_new = tl.maximum(m_run, tl.max(m, axis=0))
    return m_new, tl.exp2(m_run - m_new), tl.exp2(m - m_new)


@triton.jit
def _merge_apply(acc, l_run, alpha, w, l, part):
    """-> (acc [D], l_run) with the weighted segments added to the rescaled running sums."""
    return acc * alpha + tl.sum(part * w[:, None], axis=0), l_run * alpha + tl.sum(l * w, axis=0)


@triton.jit(do_not_specialize=["num_segments", "block_n", "min_seg_tiles"])  # runtime-varying: one compile
def _segment_reduce_kernel(part_ptr, ml_ptr, out_ptr, seqlen_ptr, stride_ot, stride_oh, num_segments, block_n,
                           min_seg_tiles, HQ: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                           PDL: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the filled segments of decode row ``tok`` (= its sequence), BLOCK_S at a time (online rescale), for
    head h's columns [BLOCK_D * program_id(2), + BLOCK_D) (D / paths.REDUCE_D_SPLIT, or D). The sequence length
    (the step's metadata) is loaded before the PDL wait, the partials after it."""
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_tiles = tl.cdiv(tl.load(seqlen_ptr + tok, cache_modifier=".cg"), block_n)
    n_seg = _filled_segments(n_tiles, num_segments, min_seg_tiles)
    pdl_enter(PDL)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    o = _merge_segments(part_ptr, ml_ptr, (tok * HQ + h) * num_segments, n_seg, offs_d, D, BLOCK_S)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_segments", "block_n", "min_seg_tiles"])  # runtime-varying: one compile
def _segment_reduce_rows_kernel(part_ptr, ml_ptr, out_ptr, qsl_ptr, seqlen_ptr, stride_ot, stride_oh, num_segments,
                                block_n, min_seg_tiles, HQ: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                                BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Merge the filled segments of query row ``q_idx`` of sequence ``seq`` (a split small-q launch: any rows per
    sequence). Its q-block's program cut keys [0, kv_end) into the segments, so the filled count is derived from
    that q-block's kv_end as the attention kernel did; a segment that held none of this row's visible keys
    (causal) left m = EMPTY_MAX, l = 0, acc = 0, which the merge weighs to nothing. Metadata before the PDL wait,
    the partials after it (as the attention kernel)."""
    seq = tl.program_id(0)
    q_idx = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq, cache_modifier=".cg")
    q_len = tl.load(qsl_ptr + seq + 1, cache_modifier=".cg") - q_start
    seq_len = tl.load(seqlen_ptr + seq, cache_modifier=".cg")
    pdl_enter(PDL)
    if q_idx >= q_len:
        return
    kv_end = tl.minimum(seq_len, seq_len - q_len + (q_idx // BLOCK_Q + 1) * BLOCK_Q)   # as the kernel's q-block
    n_tiles = tl.cdiv(kv_end, block_n)
    n_seg = _filled_segments(n_tiles, num_segments, min_seg_tiles)
    tok = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, D)
    o = _merge_segments(part_ptr, ml_ptr, (tok * HQ + h) * num_segments, n_seg, offs_d, D, BLOCK_S)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


BLOCK_N = paths.ATTN_BLOCK_N
ATTN_WARPS = paths.ATTN_WARPS
MAX_SEGMENTS = paths.MAX_SEGMENTS
SPLIT_MIN_SEQ_LEN = paths.SPLIT_MIN_SEQ_LEN
attn_tiles = paths.attention_tiles       # (BLOCK_N, num_warps) by capability: the path table owns it


def block_q(group_pad: int, max_query_len: int) -> int:
    """Query tokens per program: enough rows for tl.dot (M >= 16); more for prefill."""
    base = max(1, 16 // group_pad)
    return base if max_query_len <= base else max(base, 64 // group_pad)


def launch_plan(md: AttentionMetadata, hq: int, hkv: int, device: torch.device) -> paths.AttentionLaunch:
    """Tiles, split and reduce of this launch (paths.attention_launch): a split for decode-only batches (every row
    a decode) and, while paths.small_q_split(), for small-q ones (verify steps); md.max_seq_len is the bound
    (max_model_len inside CUDA graphs)."""
    b = md.num_seqs
    decode_only = md.max_query_len == 1 and md.num_decode_tokens >= b
    gp = next_pow2(hq // hkv)
    bq = block_q(gp, md.max_query_len)
    return paths.attention_launch(b, decode_only, md.max_seq_len, hkv, num_sms(device), compute_capability(device),
                                  bq * gp, md.max_query_len, triton.cdiv(md.max_query_len, bq))


def split_plan(md: AttentionMetadata, hkv: int, device: torch.device, hq: int = 32) -> tuple[int, int]:
    """(segments, shortest segment in tiles) of this launch (``launch_plan``)."""
    plan = launch_plan(md, hq, hkv, device)
    return plan.segments, plan.min_seg_tiles


def num_segments(md: AttentionMetadata, num_tokens: int, hkv: int, device: torch.device) -> int:
    """The segment count of ``split_plan``."""
    return split_plan(md, hkv, device)[0]


def reduce_block_s(segments: int) -> int:
    """The reduce's BLOCK_S for ``segments`` at the table's cap (paths.attention_launch decides launches)."""
    return min(next_pow2(segments), paths.REDUCE_BLOCK_S)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(2) != 1 or k.stride(1) != d:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != d:
        v = v.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    _store_kv_kernel[(t,)](k, v, kernel_view(k_cache), kernel_view(v_cache), slot_mapping, k.stride(0),
                           v.stride(0), hkv * d, float(k_scale), float(v_scale), BLOCK=next_pow2(hkv * d),
                           KV_FMT=fmt_code(k_cache))


class RawQK(NamedTuple):
    """A decode launch's unnormalised q | k | v (``paged_attention(..., raw=)``: the kernel's QKN mode does
    rope.triton.qk_norm_rope_store's work itself). k, v [T, Hkv, D]: rows of one stride (views of the projection's
    output), heads contiguous; the rest as qk_norm_rope_store takes them."""
    k: torch.Tensor
    v: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    eps: float


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                    raw: RawQK | None = None) -> torch.Tensor:
    """``raw``: q is the projection's raw q (any float type) and the kernel normalises and rotates it and the new
    k and stores k, v (RawQK; decode-only launches into a model-dtype cache); out is then in the cache's dtype."""
    if raw is None:
        long = sdpa.long_sequences(md, paths.capability(q.device))
        if long and sdpa.available(q.device, q.shape[2]):
            return _with_sdpa(q, k_cache, v_cache, md, scale, k_scale, v_scale, long)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    assert d == next_pow2(d) and q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    b = md.num_seqs
    fmt = fmt_code(k_cache)
    if raw is not None:
        assert md.num_decode_tokens == t == b and fmt == 0, "raw q/k: decode-only launches, model-dtype caches"
        assert raw.k.stride(2) == 1 and raw.k.stride(1) == d and raw.v.stride(1) == d and raw.v.stride(2) == 1
        assert raw.v.stride(0) == raw.k.stride(0) and raw.cos_sin_cache.dtype == torch.float32
        assert raw.cos_sin_cache.is_contiguous() and raw.cos_sin_cache.shape[1] == d
    # padding rows (past query_start_loc[-1]) must come back zero, as in ref; a decode-only batch has none
    out_dt = k_cache.dtype if raw is not None else q.dtype
    out = (torch.empty(q.shape, dtype=out_dt, device=q.device) if md.num_decode_tokens == t == b
           else torch.zeros(q.shape, dtype=out_dt, device=q.device))
    if b == 0 or t == 0:
        return out
    gp = next_pow2(group)
    bq = block_q(gp, md.max_query_len)
    plan = launch_plan(md, hq, hkv, q.device)
    segs, min_tiles = plan.segments, plan.min_seg_tiles
    if segs > 1:
        part = torch.empty(t, hq, segs, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(t, hq, segs, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out.new_empty(0, dtype=torch.float32)
    grid = (b, triton.cdiv(md.max_query_len, bq), hkv * segs)
    block_n = plan.block_n
    use_pdl = pdl(q.device, t)
    if fmt == 0:
        k_scale = v_scale = 1.0                                           # scales belong to fp8 caches only
    # QKN's operands, or stand-ins of the same types (unused)
    qk = ((raw.k, raw.v, raw.q_weight, raw.k_weight, raw.positions, raw.cos_sin_cache, raw.slot_mapping,
           raw.k.stride(0), float(raw.eps)) if raw is not None
          else (q, q, q, q, md.slot_mapping, part, md.slot_mapping, 0, 0.0))
    _paged_attn_kernel[grid](
        q, kernel_view(k_cache), kernel_view(v_cache), out, part, ml, md.query_start_loc, md.seq_lens,
        md.block_table, scale * float(k_scale) * 1.4426950408889634, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), md.block_table.stride(0), k_cache.shape[1], segs, min_tiles, float(v_scale), *qk,
        HQ=hq, HKV=hkv, GROUP=group, GROUP_PAD=gp, D=d, BLOCK_Q=bq, BLOCK_N=block_n, PDL=use_pdl, KV_FMT=fmt,
        PREFETCH=plan.prefetch, QKN=raw is not None, num_warps=plan.num_warps, num_stages=plan.num_stages,
        launch_pdl=use_pdl)
    if plan.row_reduce:                                                   # small-q: rows found per sequence
        _segment_reduce_rows_kernel[(b, md.max_query_len, hq)](
            part, ml, out, md.query_start_loc, md.seq_lens, out.stride(0), out.stride(1), segs, block_n, min_tiles,
            HQ=hq, D=d, BLOCK_Q=bq, BLOCK_S=plan.reduce_block_s, PDL=use_pdl, num_warps=plan.reduce_warps,
            launch_pdl=use_pdl)
    elif segs > 1:
        # decode-only: every sequence's single query row is row i (query_start_loc = arange)
        split_d = plan.reduce_d_split if d % plan.reduce_d_split == 0 else 1
        _segment_reduce_kernel[(md.num_decode_tokens, hq, split_d)](
            part, ml, out, md.seq_lens, out.stride(0), out.stride(1), segs, block_n, min_tiles, HQ=hq, D=d,
            BLOCK_S=plan.reduce_block_s, PDL=use_pdl, BLOCK_D=d // split_d,
            num_warps=plan.reduce_warps, launch_pdl=use_pdl)
    return out


def _with_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float,
               k_scale: float, v_scale: float, long: list[int]) -> torch.Tensor:
    """paged_attention with the sequences ``long`` on SDPA (sdpa.py) and the others, if any, on the kernel."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)             # padding rows stay zero
    sdpa.attend_into(out, q, k_cache, v_cache, md, scale, k_scale, v_scale, long)
    taken = set(long)
    short = [i for i in range(md.num_seqs) if i not in taken]
    if short:
        sub, rows = select(md, short)
        out.index_copy_(0, rows, paged_attention(q.index_select(0, rows), k_cache, v_cache, sub, scale, k_scale,
                                                 v_scale))
    return out


@triton.jit
def _kv_touch_kernel(kc_ptr, vc_ptr, bt_ptr, seqlen_ptr, out_ptr, max_pos, block_size, ROW: tl.constexpr,
                     CHUNK: tl.constexpr, LAST: tl.constexpr):
    """Read the K and V rows (every KV head: ROW = Hkv * D elements, contiguous per slot) of positions
    [pid * CHUNK, + CHUNK) below min(seq_lens[0], max_pos) of sequence 0, through its block table; LAST: with
    eviction priority evict_last (the attention reads them again soon; not LAST: bench/kv_l2_probe.py's other
    arm); out[pid] = their sum (0 past the end), which keeps the loads. Nothing waits on it (a side stream):
    the step's metadata and the cache only."""
    pid = tl.program_id(0)
    n = tl.minimum(tl.load(seqlen_ptr, cache_modifier=".cg"), max_pos)
    pos = pid * CHUNK + tl.arange(0, CHUNK)
    ok = pos < n
    blk = tl.load(bt_ptr + pos // block_size, mask=ok, other=0, cache_modifier=".cg").to(tl.int64)
    row = (blk * block_size + pos % block_size)[:, None] * ROW + tl.arange(0, ROW)[None, :]   # [CHUNK, ROW]
    if LAST:
        k = tl.load(kc_ptr + row, mask=ok[:, None], other=0.0, eviction_policy="evict_last")
        v = tl.load(vc_ptr + row, mask=ok[:, None], other=0.0, eviction_policy="evict_last")
    else:
        k = tl.load(kc_ptr + row, mask=ok[:, None], other=0.0)
        v = tl.load(vc_ptr + row, mask=ok[:, None], other=0.0)
    tl.store(out_ptr + pid, tl.sum(tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=1), axis=0))


def kv_touch(k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, max_positions: int,
             out: torch.Tensor | None = None, evict_last: bool = True) -> torch.Tensor:
    """As ref.kv_touch; ``out``: where the sums go (a buffer reused under CUDA graphs), else a new one."""
    _, bs, hkv, d = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and fmt_code(k_cache) == 0, "model-dtype caches"
    chunks = triton.cdiv(max_positions, paths.KV_PREFETCH_CHUNK)
    if out is None:
        out = torch.empty(chunks, dtype=torch.float32, device=k_cache.device)
    _kv_touch_kernel[(chunks,)](k_cache, v_cache, md.block_table, md.seq_lens, out, max_positions, bs,
                                ROW=hkv * d, CHUNK=paths.KV_PREFETCH_CHUNK, LAST=evict_last, num_warps=4)
    return out


KV_FORMATS = (("", 0, 70), (",kv=e5m2", 1, 70), (",kv=e4m3", 2, 89))   # (name tag, KV_FMT, min cc)


def aot_configs() -> list[AotConfig]:
    """Qwen3-30B-A3B shapes (32 q / 4 kv heads, D 128) at decode and prefill BLOCK_Q, fp16 (bf16 on sm80+);
    paged attention with the tiles of sm80+ (for sm80+ targets: attn_tiles picks them nowhere else) and with
    those used below sm80 (``pre-sm80``; every target: ONECARD_EMULATE_CC runs them on sm80+ too). Each KV
    format: the native cache, fp8_e5m2 (every target) and fp8_e4m3 (sm89+: compiled for sm90)."""
    out: list[AotConfig] = []
    hq, hkv, d = 32, 4, 128
    group = hq // hkv
    gp = next_pow2(group)
    for act, act_cc in (("fp16", 70), ("bf16", 80)):
        for kv_tag, kv_fmt, kv_cc in KV_FORMATS:
            min_cc = max(act_cc, kv_cc)
            cache = f"*{act}" if kv_fmt == 0 else "*u8"
            cx = {"BLOCK": next_pow2(hkv * d), "KV_FMT": kv_fmt}
            args = {"k_ptr": f"*{act}", "v_ptr": f"*{act}", "kc_ptr": cache, "vc_ptr": cache, "slot_ptr": "*i64",
                    "stride_kt": "i32", "stride_vt": "i32", "HD": "i32", "k_scale": "fp32", "v_scale": "fp32"}
            out.append(AotConfig(_store_kv_kernel, signature(args, cx), cx, 4, 1, min_cc,
                                 f"store_kv[{act}{kv_tag}]"))
            decode_bq = block_q(gp, 1)
            variants = [(bq, tcc, 0) for bq in sorted({decode_bq, block_q(gp, 1 << 20)}) for tcc in (80, 70)]
            variants += [(decode_bq, tcc, pf) for pf in (1, 2) for tcc in (80, 70)]   # the prefetch levels (A/B)
            # QKN (raw q | k | v in fp32: the batch-1 attention block's accumulated sums): the decode tiles of
            # sm80+ (paths.batch1_attn_qk), the model-dtype cache
            variants += [(decode_bq, 80, "qkn")] if kv_fmt == 0 else []
            for bq, tiles_cc, prefetch in variants:                      # the tiles of sm80+ and of below
                tag = ",pre-sm80" if tiles_cc < 80 else ""
                qkn = prefetch == "qkn"
                prefetch = 0 if qkn else prefetch
                if (tag or prefetch) and (act != "fp16" or kv_cc > 70) or (prefetch and tag and kv_fmt):
                    continue
                block_n, warps = attn_tiles(tiles_cc, bq * gp)
                cx = {"HQ": hq, "HKV": hkv, "GROUP": group, "GROUP_PAD": gp, "D": d, "BLOCK_Q": bq,
                      "BLOCK_N": block_n, "PDL": False, "KV_FMT": kv_fmt, "PREFETCH": prefetch, "QKN": qkn}
                raw_t = "*fp32" if qkn else f"*{act}"
                args = {"q_ptr": raw_t, "kc_ptr": cache, "vc_ptr": cache, "out_ptr": f"*{act}",
                        "part_ptr": "*fp32", "ml_ptr": "*fp32", "qsl_ptr": "*i32", "seqlen_ptr": "*i32",
                        "bt_ptr": "*i32", "scale_log2": "fp32", "stride_qt": "i32", "stride_qh": "i32",
                        "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32", "block_size": "i32",
                        "num_segments": "i32", "min_seg_tiles": "i32", "v_scale": "fp32",
                        "k_ptr": raw_t, "v_ptr": raw_t, "qw_ptr": f"*{act}", "kw_ptr": f"*{act}", "pos_ptr": "*i64",
                        "cs_ptr": "*fp32", "slot_ptr": "*i64", "stride_kt": "i32", "eps": "fp32"}
                out.append(AotConfig(_paged_attn_kernel, signature(args, cx), cx, warps, paths.ATTN_STAGES,
                                     max(min_cc, tiles_cc),
                                     f"paged_attn[bq={bq}{tag},{act}{kv_tag}{f',prefetch={prefetch}' * bool(prefetch)}"
                                     f"{',qkn' * qkn}]"))
        for segs in sorted({reduce_block_s(s) for s in range(2, MAX_SEGMENTS + 1)}):
            # the decode reduce as launched: D split over paths.REDUCE_D_SPLIT programs of DECODE_REDUCE_WARPS
            cx = {"HQ": hq, "D": d, "BLOCK_S": segs, "PDL": False, "BLOCK_D": d // paths.REDUCE_D_SPLIT}
            args = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": f"*{act}", "seqlen_ptr": "*i32",
                    "stride_ot": "i32", "stride_oh": "i32", "num_segments": "i32", "block_n": "i32",
                    "min_seg_tiles": "i32"}
            out.append(AotConfig(_segment_reduce_kernel, signature(args, cx), cx, paths.DECODE_REDUCE_WARPS, 1,
                                 act_cc, f"segment_reduce[s={segs},{act}]"))
            # the row-wise reduce of split small-q launches, at both BLOCK_Q of up to SPLIT_MAX_QUERY rows
            for bq in sorted({block_q(gp, q) for q in (2, paths.SPLIT_MAX_QUERY)}):
                cx = {"HQ": hq, "D": d, "BLOCK_Q": bq, "BLOCK_S": segs, "PDL": False}
                args = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": f"*{act}", "qsl_ptr": "*i32",
                        "seqlen_ptr": "*i32", "stride_ot": "i32", "stride_oh": "i32", "num_segments": "i32",
                        "block_n": "i32", "min_seg_tiles": "i32"}
                out.append(AotConfig(_segment_reduce_rows_kernel, signature(args, cx), cx, paths.REDUCE_WARPS, 1,
                                     act_cc, f"segment_reduce_rows[bq={bq},s={segs},{act}]"))
        # the batch-1 KV read into L2 ahead of the attention (paths.batch1_kv_prefetch), model-dtype caches
        cx = {"ROW": hkv * d, "CHUNK": paths.KV_PREFETCH_CHUNK, "LAST": True}
        args = {"kc_ptr": f"*{act}", "vc_ptr": f"*{act}", "bt_ptr": "*i32", "seqlen_ptr": "*i32", "out_ptr": "*fp32",
                "max_pos": "i32", "block_size": "i32"}
        out.append(AotConfig(_kv_touch_kernel, signature(args, cx), cx, 4, 1, act_cc, f"kv_touch[{act}]"))
    return out


__all__ = ["RawQK", "aot_configs", "attn_tiles", "block_q", "kv_touch", "num_segments", "paged_attention",
           "split_plan", "store_kv"]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
