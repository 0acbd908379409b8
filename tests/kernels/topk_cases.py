"""Interpreter helper (imported only under TRITON_INTERPRET=1, by interpret_cases.py): the rank top-k
(fused_moe/decode.topk_rank_of) against the rounds-of-max top-k (topk_of) on the same logits, bit for bit; and
each slot alone (topk_slot_of, the logits once per row) against topk_of's."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels.fused_moe.decode import topk_of, topk_rank_of, topk_slot_of
from onecard.kernels.paths import next_pow2

# (E, TOP_K, RENORM, logits): integer logits in a small range tie often (equal softmax bits: the lowest index
# first); E below its power of two leaves padded lanes; E == TOP_K takes every expert
TOPK = [(128, 8, True, "ties"), (128, 8, False, "randn"), (100, 8, True, "ties"), (6, 6, False, "ties"),
        (64, 4, True, "randn")]


@triton.jit
def _both_kernel(x_ptr, out_ptr, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 RENORM: tl.constexpr):
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(x_ptr + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    v1, i1, offs_k = topk_of(x, offs, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)
    v2, i2, _ = topk_rank_of(x, offs, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)
    m = offs_k < TOP_K
    tl.store(out_ptr + offs_k, v1.to(tl.int32, bitcast=True), mask=m)
    tl.store(out_ptr + BLOCK_K + offs_k, i1, mask=m)
    tl.store(out_ptr + 2 * BLOCK_K + offs_k, v2.to(tl.int32, bitcast=True), mask=m)
    tl.store(out_ptr + 3 * BLOCK_K + offs_k, i2, mask=m)


def _logits(i: int, seed: int) -> tuple[torch.Tensor, int, int, bool]:
    """TOPK case i's fp16 logits -> (x [E], E, TOP_K, RENORM)."""
    e, k, renorm, kind = TOPK[i]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(0, 4, (e,), generator=g).float() if kind == "ties" else torch.randn(e, generator=g)).half()
    return x, e, k, renorm


def topk_rank_case(i: int, seed: int) -> float:
    """-> the number of slots (weights' bits or ids) where the two differ (0 passes); also checks the ids are
    torch.topk's on the same probabilities where they do not tie."""
    x, e, k, renorm = _logits(i, seed)
    bk = next_pow2(k)
    out = torch.zeros(4 * bk, dtype=torch.int32)
    _both_kernel[(1,)](x, out, e, TOP_K=k, BLOCK_K=bk, BLOCK_E=next_pow2(e), RENORM=renorm)
    v1, i1, v2, i2 = out.view(4, bk)[:, :k]
    p = torch.softmax(x.float(), 0)
    order = sorted(range(e), key=lambda j: (-float(p[j]), j))[:k]        # lowest index among equal values
    assert i1.tolist() == order, (i1.tolist(), order)
    return float(int((v1 != v2).sum()) + int((i1 != i2).sum()))


@triton.jit
def _slot_kernel(x_ptr, out_ptr, E, R: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """Program ``slot``: topk_of's weight and id of that slot, then topk_slot_of's."""
    slot = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(x_ptr + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    vals, ids, offs_k = topk_of(x, offs, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)
    rows = tl.load(x_ptr + tl.arange(0, R)[:, None] * 0 + offs[None, :], mask=(offs < E)[None, :],
                   other=-float("inf")).to(tl.float32)
    e, w = topk_slot_of(rows, offs, E, slot, TOP_K, BLOCK_E, RENORM)
    tl.store(out_ptr + slot * 4, tl.sum(tl.where(offs_k == slot, vals, 0.0), axis=0))
    tl.store(out_ptr + slot * 4 + 1, tl.sum(tl.where(offs_k == slot, ids, 0), axis=0).to(tl.float32))
    tl.store(out_ptr + slot * 4 + 2, w)
    tl.store(out_ptr + slot * 4 + 3, e.to(tl.float32))


def topk_slot_case(i: int, seed: int) -> float:
    """-> the number of slots whose id differs from topk_of's or whose weight is off by more than 1e-6 relative
    (an ulp or two of fp32 is allowed: the renormalising sum adds in another order); R = 4 rows of the logits.
    0 passes."""
    x, e, k, renorm = _logits(i, seed)
    out = torch.zeros(k, 4)
    _slot_kernel[(k,)](x, out, e, R=4, TOP_K=k, BLOCK_K=next_pow2(k), BLOCK_E=next_pow2(e), RENORM=renorm)
    w_off = (out[:, 0] - out[:, 2]).abs() > 1e-6 * out[:, 0].abs()
    return float(int(((out[:, 1] != out[:, 3]) | w_off).sum()))
