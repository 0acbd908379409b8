"""Interpreter helper (imported only under TRITON_INTERPRET=1, by interpret_cases.py): the rounds-of-max top-k
(fused_moe/decode.topk_of) against torch's softmax and order on the same logits; and each slot alone
(topk_slot_of, the logits once per row) against topk_of's."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels.fused_moe.decode import topk_of, topk_slot_of
from onecard.kernels.paths import next_pow2

# (E, TOP_K, RENORM, logits): integer logits in a small range tie often (equal softmax bits: the lowest index
# first); E below its power of two leaves padded lanes; E == TOP_K takes every expert
TOPK = [(128, 8, True, "ties"), (128, 8, False, "randn"), (100, 8, True, "ties"), (6, 6, False, "ties"),
        (64, 4, True, "randn")]


@triton.jit
def _topk_kernel(x_ptr, w_ptr, ids_ptr, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 RENORM: tl.constexpr):
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(x_ptr + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    vals, ids, offs_k = topk_of(x, offs, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)
    tl.store(w_ptr + offs_k, vals, mask=offs_k < TOP_K)
    tl.store(ids_ptr + offs_k, ids, mask=offs_k < TOP_K)


def _logits(i: int, seed: int) -> tuple[torch.Tensor, int, int, bool]:
    """TOPK case i's fp16 logits -> (x [E], E, TOP_K, RENORM)."""
    e, k, renorm, kind = TOPK[i]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(0, 4, (e,), generator=g).float() if kind == "ties" else torch.randn(e, generator=g)).half()
    return x, e, k, renorm


def topk_case(i: int, seed: int) -> float:
    """-> the number of slots whose id is not torch's (the k largest softmax probabilities, the lowest index
    first among equal ones) or whose weight is off torch's (renormalised where RENORM) by more than 1e-6
    relative. 0 passes."""
    x, e, k, renorm = _logits(i, seed)
    bk = next_pow2(k)
    w, ids = torch.zeros(bk), torch.zeros(bk, dtype=torch.int32)
    _topk_kernel[(1,)](x, w, ids, e, TOP_K=k, BLOCK_K=bk, BLOCK_E=next_pow2(e), RENORM=renorm)
    p = torch.softmax(x.float(), 0)
    order = sorted(range(e), key=lambda j: (-float(p[j]), j))[:k]        # lowest index among equal values
    want = p[order] / (p[order].sum() if renorm else 1.0)
    bad = (ids[:k] != torch.tensor(order, dtype=torch.int32)) | ((w[:k] - want).abs() > 1e-6 * want.abs())
    return float(int(bad.sum()))


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
