"""Fused MoE for prefill-sized batches: dequantize each projection of all experts once per layer to fp16
(bf16 on sm90+, see _gemm_dtype; one Triton launch each) and run PyTorch's grouped GEMM (cuBLAS/CUTLASS
tensor cores) over tokens sorted by expert. Below sm80 (V100, T4), where PyTorch's grouped GEMM is not built
and Triton's tl.dot has no tensor cores, the grouped GEMM is one cuBLAS GEMM per expert with tokens
(``per_expert``: the run ends are read on the host once per layer, a sync that prefill can afford).

Why: at thousands of tokens the MoE is compute-bound, and the tensor-core grouped GEMM beats a Triton int4
GEMM by far; the dequantization costs one pass over the layer's weights (~0.3 GB read, 1.2 GB written at
Qwen3-30B-A3B size), small against the GEMMs at T >= GROUPED_MIN_TOKENS. Same signature as ref.fused_moe.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from onecard.kernels import paths
from onecard.kernels.fused_moe.ref import route
from onecard.kernels.types import GPTQWeight, MoEWeight

GROUPED_MIN_TOKENS = paths.GROUPED_MIN_TOKENS
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


@functools.cache
def supported_dtypes(device: torch.device) -> frozenset[str]:
    """The dtypes PyTorch's grouped GEMM runs on ``device``, found once by a tiny grouped GEMM per dtype (the
    runner asks at start-up: what the serving path can use is decided there, never by a failing prefill).
    Empty off CUDA and where this torch has no grouped GEMM."""
    fn = _grouped_mm_fn()
    if device.type != "cuda" or fn is None:
        return frozenset()
    ok = set()
    for name, dt in _DTYPES.items():
        try:
            a = torch.ones(32, 16, dtype=dt, device=device)                # [P, K], two groups of 16 rows
            b = torch.ones(2, 16, 16, dtype=dt, device=device)             # [E, K, N]
            offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
            y = fn(a, b, offs=offs)
            if bool((y.float() == 16).all()):                             # start-up: a sync is fine here
                ok.add(name)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            pass
    return frozenset(ok)


def per_expert(device: torch.device) -> bool:
    """One cuBLAS GEMM per expert instead of PyTorch's grouped GEMM: CUDA devices below sm80 (paths)."""
    return device.type == "cuda" and paths.per_expert_moe(paths.capability(device))


def available(device: torch.device) -> bool:
    """Does this path run on ``device`` at all (per expert, or a grouped GEMM dtype that works)?"""
    if device.type != "cuda":
        return False
    return per_expert(device) or bool(supported_dtypes(device))


def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The expert GEMMs' dtype: paths.grouped_gemm_dtype (fp16 runs as bf16 on sm90+, where PyTorch's fast
    grouped GEMM is bf16 only; fp32 accumulation, outputs come back in x.dtype). Off CUDA and below sm80 (the
    per-expert loop): x.dtype."""
    if not x.is_cuda:
        return x.dtype
    cc = paths.capability(x.device)
    if paths.per_expert_moe(cc):
        return x.dtype
    name = paths.grouped_gemm_dtype(_NAMES.get(x.dtype, str(x.dtype)), cc, supported_dtypes(x.device))
    if name is None:
        raise RuntimeError(f"PyTorch's grouped GEMM runs no dtype for {x.dtype} on this device; the dispatcher "
                           "sends such batches to the Triton fused MoE (kernels/paths.choose_moe)")
    return _DTYPES[name]


def dequantize_stacked(w: MoEWeight, dtype: torch.dtype) -> torch.Tensor:
    """[E, K, N] dense weights in ``dtype``."""
    if not isinstance(w, GPTQWeight):
        return w.to(dtype)
    from onecard.kernels.gptq_gemm.triton import dequantize

    e, k, n = w.qweight.shape[0], w.in_features, w.out_features
    if w.g_idx is None and k % w.group_size == 0:
        # experts stacked along K form one big matrix whose groups line up with each expert's groups
        flat = GPTQWeight(w.qweight.reshape(e * k // 8, n), w.qzeros.reshape(-1, w.qzeros.shape[-1]),
                          w.scales.reshape(-1, n), None, w.group_size, e * k, n)
        return dequantize(flat, dtype).view(e, k, n)
    out = torch.empty(e, k, n, dtype=dtype, device=w.qweight.device)
    for i in range(e):
        out[i] = dequantize(GPTQWeight(w.qweight[i], w.qzeros[i], w.scales[i],
                                       None if w.g_idx is None else w.g_idx[i], w.group_size, k, n), dtype)
    return out


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    """[P, N] = a [P, K] rows of expert i (rows offs[i-1]..offs[i], sorted by expert) @ b[i] [K, N]. Without
    ``sizes``: PyTorch's grouped GEMM over the device run ends ``offs``. With ``sizes`` (each expert's rows, read on
    the host): one cuBLAS GEMM per expert that has rows, its operands split in one call each (slicing them
    one by one cost ~1.7 µs of host time more a GEMM, CPU at tiny shapes: 384 GEMMs a layer, host-bound)."""
    if sizes is None:
        return _grouped_mm_fn()(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    for rows, ai, bi, oi in zip(sizes, a.split(sizes), b.unbind(0), out.split(sizes), strict=True):
        if rows:
            torch.mm(ai, bi, out=oi)
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight,
              w_down: MoEWeight, top_k: int, renormalize: bool, per_expert_gemm: bool | None = None) -> torch.Tensor:
    """Same as ref.fused_moe; ``per_expert_gemm`` (default: ``per_expert(x.device)``) picks the GEMM loop."""
    t, h = x.shape
    e = router_logits.shape[-1]
    topk_w, topk_ids = route(router_logits, top_k, renormalize)            # [T, k]: the spec's routing
    flat = topk_ids.reshape(-1)                                             # [P]
    order = torch.argsort(flat, stable=True)                               # pairs sorted by expert
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int32))           # bincount would sync the host
    offs = torch.cumsum(counts, 0, dtype=torch.int32)                       # [E] run ends
    tok = order // top_k                                                    # [P] token of each pair
    loop = per_expert(x.device) if per_expert_gemm is None else per_expert_gemm
    sizes = counts.tolist() if loop else None                               # the layer's one host sync
    dtype = _gemm_dtype(x)
    a = x[tok].to(dtype)                                                    # [P, H]
    g = _gmm(a, dequantize_stacked(w_gate, dtype), offs, sizes)             # [P, I]
    u = _gmm(a, dequantize_stacked(w_up, dtype), offs, sizes)               # [P, I]
    # routed weight folded in before the linear down projection: w * (act @ Wd) == (w * act) @ Wd;
    # each op computes in fp32 and rounds once (no fp32 copies of [P, I])
    act = F.silu(g).mul_(u).mul_(topk_w.reshape(-1)[order].unsqueeze(1))
    y = _gmm(act, dequantize_stacked(w_down, dtype), offs, sizes)           # [P, H], sorted pair order
    # top-k sum as a gather back to (token, slot) order and a reduction over the k rows (fp32 accumulation):
    # no fp32 [P, H] copies and no atomics (index_add_ was ~0.45 ms of a 4,096-token layer on the H200)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return y[inv].view(t, top_k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
