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

import torch
import torch.nn.functional as F

from onecard.kernels.types import GPTQWeight, MoEWeight

GROUPED_MIN_TOKENS = 256
_STATE: dict[str, object] = {}


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


def per_expert(device: torch.device) -> bool:
    """One cuBLAS GEMM per expert instead of PyTorch's grouped GEMM: CUDA devices below sm80."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8


def available(device: torch.device) -> bool:
    if device.type != "cuda" or _STATE.get("broken"):
        return False
    return per_expert(device) or _grouped_mm_fn() is not None


def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """PyTorch's fast grouped GEMM (CUTLASS, sm90+) takes bf16 only; fp16 goes through a per-expert loop that
    reads the offsets on the host (a sync) and launches cuBLAS per group: measured on the H200 as ~36% of a
    4,096-token prefill forward with the GPU idle. So fp16 activations run the expert GEMMs in bf16 there
    (fp32 accumulation; the dequantized weights and GEMM inputs round to bf16, outputs come back in x.dtype)."""
    if x.dtype == torch.float16 and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9:
        return torch.bfloat16
    return x.dtype


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


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | list[int]) -> torch.Tensor:
    """[P, N] = a [P, K] rows of expert i (rows offs[i-1]..offs[i], sorted by expert) @ b[i] [K, N]. offs on
    the device: PyTorch's grouped GEMM; a host list: one GEMM per expert that has rows."""
    if not isinstance(offs, list):
        return _grouped_mm_fn()(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for i, end in enumerate(offs):
        if end > start:
            torch.matmul(a[start:end], b[i], out=out[start:end])
        start = end
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight,
              w_down: MoEWeight, top_k: int, renormalize: bool, per_expert_gemm: bool | None = None) -> torch.Tensor:
    """Same as ref.fused_moe; ``per_expert_gemm`` (default: ``per_expert(x.device)``) picks the GEMM loop."""
    t, h = x.shape
    e = router_logits.shape[-1]
    probs = torch.softmax(router_logits.float(), dim=-1)                   # [T, E]
    topk_w, topk_ids = torch.topk(probs, top_k, dim=-1)                     # [T, k]
    if renormalize:
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    flat = topk_ids.reshape(-1)                                             # [P]
    order = torch.argsort(flat, stable=True)                               # pairs sorted by expert
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int32))           # bincount would sync the host
    offs = torch.cumsum(counts, 0, dtype=torch.int32)                       # [E] run ends
    tok = order // top_k                                                    # [P] token of each pair
    loop = per_expert(x.device) if per_expert_gemm is None else per_expert_gemm
    if loop:
        offs = offs.tolist()                                                # the layer's one host sync
    dtype = _STATE.get(f"dtype-{x.dtype}", _gemm_dtype(x))    # remembered per input dtype
    while True:
        try:
            a = x[tok].to(dtype)                                            # [P, H]
            g = _gmm(a, dequantize_stacked(w_gate, dtype), offs)            # [P, I]
            u = _gmm(a, dequantize_stacked(w_up, dtype), offs)              # [P, I]
            # routed weight folded in before the linear down projection: w * (act @ Wd) == (w * act) @ Wd;
            # each op computes in fp32 and rounds once (no fp32 copies of [P, I])
            act = F.silu(g).mul_(u).mul_(topk_w.reshape(-1)[order].unsqueeze(1))
            y = _gmm(act, dequantize_stacked(w_down, dtype), offs)          # [P, H], sorted pair order
            break
        except (RuntimeError, NotImplementedError):
            if dtype == torch.bfloat16 or loop:
                _STATE["broken"] = True
                raise
            dtype = _STATE[f"dtype-{x.dtype}"] = torch.bfloat16   # this dtype's grouped GEMM is unsupported
    # top-k sum as a gather back to (token, slot) order and a reduction over the k rows (fp32 accumulation):
    # no fp32 [P, H] copies and no atomics (index_add_ was ~0.45 ms of a 4,096-token layer on the H200)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return y[inv].view(t, top_k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
