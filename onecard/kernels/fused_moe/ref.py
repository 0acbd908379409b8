"""Reference fused MoE (plain PyTorch, float32 math; the spec).

router: p = softmax(router_logits in fp32) -> top-k (the lowest index first among equal p, as the Triton routing
kernels pick: torch.topk leaves ties' order open) -> divide by their sum when ``renormalize``;
out[t] = sum_k p[t, k] * (silu(x[t] @ Wg[e]) * (x[t] @ Wu[e])) @ Wd[e] with e = topk_ids[t, k].
Weights are float [E, K, N] (w_gate/w_up [E, H, I], w_down [E, I, H]) or stacked GPTQWeight.
norm_moe: the post-attention RMSNorm (norm/ref.py, residual add), the router and fused_moe in one op.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from onecard.kernels.gptq_gemm.format import dequantize_gptq, expert_slice
from onecard.kernels.norm.ref import rms_norm
from onecard.kernels.types import GPTQWeight, MoEWeight


def moe_router(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits [T, E] = x [T, H] @ weight [E, H]^T in x.dtype (what the model computed with F.linear)."""
    return F.linear(x, weight)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_weights fp32 [T, k], topk_ids int64 [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)                  # [T, E]
    # a stable descending sort keeps equal probabilities in index order (fp16 router logits tie now and then)
    probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    topk_weights, topk_ids = probs[:, :top_k], order[:, :top_k]           # [T, k]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def expert_weight(w: MoEWeight, e: int) -> torch.Tensor:
    """float32 [K, N] weights of expert ``e``."""
    if isinstance(w, GPTQWeight):
        return dequantize_gptq(expert_slice(w, e))
    return w[e].float()


def expert_inputs(x: torch.Tensor, router_logits: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight, top_k: int,
                  renormalize: bool) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """fused_moe's inner loop, per expert that got tokens (ascending): (e, rows routed to e [n], their top-k
    weights [n], x rows [n, H], down's input h = silu(x @ Wg) * (x @ Wu) [n, I]), fp32. The quantizer's
    calibration records these inputs."""
    topk_weights, topk_ids = route(router_logits, top_k, renormalize)    # [T, k]
    xf = x.float()                                                        # [T, H]
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)          # rows routed to e
        xe = xf[tok]                                                      # [n, H]
        h = F.silu(xe @ expert_weight(w_gate, e)) * (xe @ expert_weight(w_up, e))   # [n, I]
        yield e, tok, topk_weights[tok, slot], xe, h


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight,
              w_down: MoEWeight, top_k: int, renormalize: bool) -> torch.Tensor:
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e, tok, p, _, h in expert_inputs(x, router_logits, w_gate, w_up, top_k, renormalize):
        y = h @ expert_weight(w_down, e)                                  # [n, H]
        out.index_add_(0, tok, y * p.unsqueeze(1))
    return out.to(x.dtype)


def norm_moe(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
             gate: torch.Tensor, w_gate: MoEWeight, w_up: MoEWeight, w_down: MoEWeight, top_k: int,
             renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (moe out [T, H], residual_out [T, H]): h, residual_out = rms_norm(x, norm_weight, eps, residual);
    out = fused_moe(h, moe_router(h, gate), ...). out is in h's dtype here; a backend may return it in fp32."""
    h, residual_out = rms_norm(x, norm_weight, eps, residual)
    return fused_moe(h, moe_router(h, gate), w_gate, w_up, w_down, top_k, renormalize), residual_out
