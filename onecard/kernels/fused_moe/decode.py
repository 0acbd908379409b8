"""Triton fused MoE for decode-sized batches (T <= DECODE_MAX_TOKENS), same contract as ref.fused_moe.

Built for bandwidth at batch 1..16 (the weights are read once per step; everything else is tiny), in four
launches (every launch is a CUDA-graph node; nothing else runs in between), after the router GEMV
(``router_logits``, one program per expert: cuBLAS took 5 us for this 0.5 MB at batch 1):
  1. routing, one program per token: zero the token's rows of the fp32 accumulators, fp32 softmax, top-k,
     renormalise; then the token claims its experts with atomics on persistent zeroed counters
     (kernels/workspace.py) and the first claimant of an expert appends it (as expert + 1) to a compact
     ``active`` list in the same zeroed workspace (no sort, no host sync; a program whose slot holds 0 idles).
  2, 3. the expert stages (stages.py, shared with batch1.py): gate/up into gu [T*k, 2I], then down, times the
     routed weight, top-k summed by fp32 atomics into out32 [T, H].
  4. finish: cast out32 to x.dtype; zero the counters and the active list for the next call. (A "last
     arriver" of step 3 cannot do this: other CTAs' fp32 atomics are not ordered before its arrival counter.)
With PDL (sm90, triton_common) step 3 reads the routing and its first weight tile before its wait: the
routing was written two launches earlier.
Here: the router GEMV, the routing (softmax + top-k helpers also used by triton.py and batch1.py), the finish
kernel, the host entry ``fused_moe_decode`` and ``decode_aot_configs`` (which includes the stages' configs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecard.kernels import paths, workspace

# DECODE_CONFIGS, choose_decode_config, weight_args: re-exported (public names here before stages.py)
from onecard.kernels.fused_moe.stages import (
    DECODE_CONFIGS,
    choose_decode_config,
    moe_inter_size,
    moe_stages,
    stages_aot_configs,
    weight_args,
)
from onecard.kernels.triton_common import AotConfig, next_pow2, pdl, pdl_enter, settle_cache_keys, signature
from onecard.kernels.types import MoEWeight

DECODE_MAX_TOKENS = paths.DECODE_MAX_TOKENS
ROUTE_WARPS = 1                       # the top-k chain is 8 dependent reductions: shuffles only, no smem
_ZERO_BLOCK = 1024
_FINISH_BLOCK = 1024


@triton.jit(do_not_specialize=["T"])  # runtime-varying: one compile serves all
def _router_kernel(x_ptr, w_ptr, out_ptr, T, H, E, stride_x,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[t, e] = x[t] . w[e] for program e's expert and all T <= BLOCK_T tokens (fp32 sums, cast to out's
    dtype, as F.linear). w [E, H] row-major: an expert's row is contiguous (16-byte loads); its first chunk
    (all of it at T == 1) loads before the PDL wait."""
    e = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    t_mask = offs_t < T
    w = tl.load(w_ptr + e * H + offs_h, mask=offs_h < H, other=0.0)      # [BH]
    pdl_enter(PDL)
    acc = _router_chunk(tl.zeros((BLOCK_T,), dtype=tl.float32), x_ptr, w, 0, offs_t, t_mask, offs_h, H, stride_x)
    for h0 in range(BLOCK_H, H, BLOCK_H):
        w = tl.load(w_ptr + e * H + h0 + offs_h, mask=h0 + offs_h < H, other=0.0)
        acc = _router_chunk(acc, x_ptr, w, h0, offs_t, t_mask, offs_h, H, stride_x)
    tl.store(out_ptr + offs_t * E + e, acc.to(out_ptr.dtype.element_ty), mask=t_mask)


@triton.jit
def _router_chunk(acc, x_ptr, w, h0, offs_t, t_mask, offs_h, H, stride_x):
    """acc [BT] += x[:, h0:h0+BH] @ w [BH] (fp32)."""
    h_ok = h0 + offs_h < H
    x = tl.load(x_ptr + offs_t[:, None] * stride_x + h0 + offs_h[None, :], mask=t_mask[:, None] & h_ok[None, :],
                other=0.0).to(tl.float32)                                 # [BT, BH]
    return acc + tl.sum(x * w.to(tl.float32)[None, :], axis=1)


ROUTER_WARPS = 4
ROUTER_ELEMS = 4096                   # BLOCK_T * BLOCK_H: x chunk elements per program (32 per thread)


def router_block_h(num_tokens: int, hidden: int) -> int:
    return min(next_pow2(hidden), max(64, ROUTER_ELEMS // next_pow2(num_tokens)))


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, E] = x [T, H] @ weight [E, H]^T in x.dtype, T <= DECODE_MAX_TOKENS: one program per expert."""
    t, h = x.shape
    e = weight.shape[0]
    assert 1 <= t <= DECODE_MAX_TOKENS and weight.shape[1] == h and weight.is_contiguous(), (x.shape, weight.shape)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(t, e, dtype=x.dtype, device=x.device)
    use_pdl = pdl(x.device, t)
    _router_kernel[(e,)](x, weight, out, t, h, e, x.stride(0), BLOCK_T=next_pow2(t), BLOCK_H=router_block_h(t, h),
                         PDL=use_pdl, num_warps=ROUTER_WARPS, launch_pdl=use_pdl)
    return out


@triton.jit
def softmax_topk(logits_ptr, t, stride_t, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 RENORM: tl.constexpr):
    """Token t's router: fp32 softmax over E logits -> top-k (lowest index among ties) -> renormalise.
    Returns (weights [BLOCK_K] fp32, expert ids [BLOCK_K] int32, offsets [BLOCK_K]); lanes >= TOP_K unused."""
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_t + offs, mask=offs < E, other=-float("inf"))
    return topk_of(x.to(tl.float32), offs, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)


@triton.jit
def _softmax_keys(x, offs, E, BLOCK_E: tl.constexpr):
    """-> (p, key) shaped as x ([BE], or [R, BE]: one row of logits per R, each its own softmax): the fp32 softmax
    of logits x along the last axis and one int64 key per expert: the probability's bits (p >= 0: ordered as
    integers) above the reversed index, so the larger key is the larger p and, among ties, the lower index (a
    single max per round of topk_of); -1 past E. _key_value and _key_index read a key back."""
    AX: tl.constexpr = len(x.shape) - 1
    p = tl.exp(x - tl.max(x, axis=AX, keep_dims=True))
    p = p / tl.sum(p, axis=AX, keep_dims=True)
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    return p, tl.where(offs < E, (bits << 32) | (BLOCK_E - 1 - offs).to(tl.int64), -1)


@triton.jit
def _key_value(key):
    """The fp32 held in the upper half of a key (_softmax_keys: the probability)."""
    return (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _key_index(key, BLOCK_E: tl.constexpr):
    """The expert index of a _softmax_keys key (stored reversed in its lower half)."""
    return (BLOCK_E - 1 - (key & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def topk_of(x, offs, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """softmax_topk on logits already loaded: x [BLOCK_E] fp32 (-inf past E), offs = arange(BLOCK_E)."""
    _, key = _softmax_keys(x, offs, E, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        idx = _key_index(best, BLOCK_E)
        val = _key_value(best)
        vals = tl.where(offs_k == i, val, vals)
        ids = tl.where(offs_k == i, idx, ids)
        key = tl.where(key == best, -1, key)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)
    return vals, ids, offs_k


@triton.jit
def topk_slot_of(x, offs, E, slot, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """Slot ``slot`` of topk_of alone -> (expert id int32, weight fp32), for a program of several warps that needs
    only its own slot (fused_moe/slices.py's routing). x [R, BLOCK_E] fp32 holds the logits once per row (-inf
    past E; R = the program's warps), offs = arange(BLOCK_E). With the logits loaded 16-byte aligned the compiler
    gives each row one warp ([R, BE] blocked as warpsPerCTA [R, 1]: sm90 PTX, tests/kernels/test_aot.py), so
    the softmax and the TOP_K rounds of max are shuffles inside a warp, with no shared memory and no CTA barrier
    (topk_of on a [BLOCK_E] row spread over 8 warps: 29 barriers, ~2.5 µs of the slices' critical path in the
    full model, bench/slices_trace.py); the rows agree, and one cross-warp max at the end makes the result a
    scalar. The same int64 keys as topk_of, so the same experts, order and ties; the renormalising sum adds the
    TOP_K values in rank order (topk_of: a tree over its [BLOCK_K] lanes), so the weight may differ in its last
    bit."""
    _, key = _softmax_keys(x, offs, E, BLOCK_E)                          # [R, BE]
    for i in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)                                        # [R]
        if i == 0:                                                        # (unrolled: a compile-time branch)
            total = _key_value(best)                                      # [R] the TOP_K values' sum
            mine = best                                                   # [R] this slot's key (slot < TOP_K)
        else:
            total += _key_value(best)
            mine = tl.where(slot == i, best, mine)
        key = tl.where(key == best[:, None], -1, key)
    w = _key_value(mine)
    if RENORM:
        w = w / total
    # weight (>= 0) above the id: one max over the rows, which agree
    packed = tl.max((w.to(tl.int32, bitcast=True).to(tl.int64) << 32) | _key_index(mine, BLOCK_E), axis=0)
    return (packed & 0xFFFFFFFF).to(tl.int32), _key_value(packed)


@triton.jit
def _route_claim_kernel(logits_ptr, w_ptr, ids_ptr, count_ptr, active_ptr, num_active_ptr, gu_ptr, out32_ptr,
                        E, stride_t, GU_ROW, H,
                        TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                        RENORM: tl.constexpr, ZERO_BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    # zero this token's rows of the atomic accumulators: gu [T*k, GU_ROW] and out32 [T, H]
    offs_z = tl.arange(0, ZERO_BLOCK)
    zeros = tl.zeros((ZERO_BLOCK,), dtype=tl.float32)
    for z in range(0, TOP_K * GU_ROW, ZERO_BLOCK):
        tl.store(gu_ptr + t * TOP_K * GU_ROW + z + offs_z, zeros, mask=z + offs_z < TOP_K * GU_ROW)
    for z in range(0, H, ZERO_BLOCK):
        tl.store(out32_ptr + t * H + z + offs_z, zeros, mask=z + offs_z < H)
    vals, ids, offs_k = softmax_topk(logits_ptr, t, stride_t, E, TOP_K, BLOCK_K, BLOCK_E, RENORM)
    k_mask = offs_k < TOP_K
    tl.store(w_ptr + t * TOP_K + offs_k, vals, mask=k_mask)
    tl.store(ids_ptr + t * TOP_K + offs_k, ids, mask=k_mask)
    # a token's k experts are distinct, so one vector atomic has no intra-token conflicts
    old = tl.atomic_add(count_ptr + ids, tl.full((BLOCK_K,), 1, tl.int32), mask=k_mask)
    first = (old == 0) & k_mask
    n_new = tl.sum(first.to(tl.int32), axis=0)
    base = tl.atomic_add(num_active_ptr, n_new)
    slot = base + tl.cumsum(first.to(tl.int32), axis=0) - 1
    tl.store(active_ptr + slot, ids + 1, mask=first)                     # expert + 1: 0 means an empty slot


@triton.jit(do_not_specialize=["TH"])  # runtime-varying: one compile serves all
def _finish_kernel(out32_ptr, out_ptr, state_ptr, TH, NZ, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = out32 cast to out's dtype; program 0 zeroes the NZ words of routing state (expert counters,
    num_active, the active list) for the next call."""
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(out32_ptr + offs, mask=offs < TH, other=0.0)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=offs < TH)
    if tl.program_id(0) == 0:
        for i in range(0, NZ, BLOCK):
            tl.store(state_ptr + i + tl.arange(0, BLOCK), tl.zeros((BLOCK,), dtype=tl.int32),
                     mask=i + tl.arange(0, BLOCK) < NZ)


def fused_moe_decode(x: torch.Tensor, router_logits: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight,
                     w_down: MoEWeight, top_k: int, renormalize: bool,
                     tuning: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``tuning`` (BLOCK_N, BLOCK_K8, num_warps, num_stages, programs per SM) overrides the table (bench)."""
    t, h = x.shape
    assert 1 <= t <= DECODE_MAX_TOKENS, t
    if x.stride(-1) != 1:
        x = x.contiguous()
    dev = x.device
    num_experts = int(router_logits.shape[1])
    p = t * top_k
    slots = min(num_experts, p)
    # zeros between calls: expert counters [E], num_active [1], active list [slots] (expert + 1 per slot)
    state = workspace.counters(dev, "moe", num_experts + 1 + slots)
    counts, num_active = state[:num_experts], state[num_experts:num_experts + 1]
    active = state[num_experts + 1:]
    n1 = moe_inter_size(w_gate)
    gu = torch.empty(p, 2 * n1, dtype=torch.float32, device=dev)          # [T*k, 2I] gate | up sums
    out32 = torch.empty(t, h, dtype=torch.float32, device=dev)            # [T, H]
    out = torch.empty(t, h, dtype=x.dtype, device=dev)
    topk_w = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    topk_ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    use_pdl = pdl(dev, t)
    _route_claim_kernel[(t,)](router_logits, topk_w, topk_ids, counts, active, num_active, gu, out32,
                              num_experts,
                              router_logits.stride(0), 2 * n1, h, TOP_K=top_k, BLOCK_K=next_pow2(top_k),
                              BLOCK_E=next_pow2(num_experts), RENORM=renormalize, ZERO_BLOCK=_ZERO_BLOCK,
                              PDL=use_pdl, num_warps=ROUTE_WARPS, launch_pdl=use_pdl)
    moe_stages(x, gu, out32, w_gate, w_up, w_down, topk_ids, topk_w, active, top_k, use_pdl, tuning)
    _finish_kernel[(triton.cdiv(t * h, _FINISH_BLOCK),)](out32, out, state, t * h, state.numel(),
                                                         BLOCK=_FINISH_BLOCK, PDL=use_pdl, launch_pdl=use_pdl)
    return out


def decode_aot_configs(act: str, min_cc: int) -> list[AotConfig]:
    """Router GEMV at H=2048 per token block, claiming router at E=128, k=8 and both decode GEMM configs x stages
    x weight kinds."""
    out: list[AotConfig] = []
    for bt in sorted({next_pow2(t) for t in range(1, DECODE_MAX_TOKENS + 1)}):
        cx = dict(BLOCK_T=bt, BLOCK_H=router_block_h(bt, 2048), PDL=False)
        args = dict(x_ptr=f"*{act}", w_ptr=f"*{act}", out_ptr=f"*{act}", T="i32", H="i32", E="i32",
                    stride_x="i32")
        out.append(AotConfig(_router_kernel, signature(args, cx), cx, ROUTER_WARPS, 1, min_cc,
                             f"router[bt={bt},{act}]"))
    for renorm in (True, False):
        cx = dict(TOP_K=8, BLOCK_K=8, BLOCK_E=128, RENORM=renorm, ZERO_BLOCK=_ZERO_BLOCK, PDL=False)
        args = dict(logits_ptr=f"*{act}", w_ptr="*fp32", ids_ptr="*i32", count_ptr="*i32", active_ptr="*i32",
                    num_active_ptr="*i32", gu_ptr="*fp32", out32_ptr="*fp32", E="i32", stride_t="i32",
                    GU_ROW="i32", H="i32")
        out.append(AotConfig(_route_claim_kernel, signature(args, cx), cx, ROUTE_WARPS, 1, min_cc,
                             f"route_claim[{renorm},{act}]"))
    cx = dict(BLOCK=_FINISH_BLOCK, PDL=False)
    args = dict(out32_ptr="*fp32", out_ptr=f"*{act}", state_ptr="*i32", TH="i32", NZ="i32")
    out.append(AotConfig(_finish_kernel, signature(args, cx), cx, 4, 1, min_cc, f"moe_finish[{act}]"))
    out += stages_aot_configs(act, min_cc)
    return out


__all__ = [
    "DECODE_CONFIGS",
    "DECODE_MAX_TOKENS",
    "choose_decode_config",
    "decode_aot_configs",
    "fused_moe_decode",
    "moe_inter_size",
    "moe_stages",
    "router_logits",
    "softmax_topk",
    "topk_of",
    "weight_args",
]

settle_cache_keys(globals())   # Triton cache keys, helpers first (triton_common.settle_cache_keys)
