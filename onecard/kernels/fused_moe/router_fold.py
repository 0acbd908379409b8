"""The batch-1 MoE router folded into the attention block's o_proj launch (paths.batch1_router_fold).

The fact it rests on: with x the post-attention norm's input (the attention block's output o plus its residual r),
rms_norm gives h = x * rstd * nw (rstd ONE scalar a token) and the router's logits are
    gate @ h = rstd * (F @ x),   F = gate * nw (each router row times the norm weight) [E, H].
And x = r + o with o = a @ W_o (a the attention output, W_o the o projection as y = a @ W, [K_o, H]), so
    F @ x = F @ r + M @ a,   M = F @ W_o^T  [E, K_o].
The o_proj GEMV's programs each add their K split's M @ a and a chunk of F @ r into a zeroed fp32 row ``raw``
(gptq_gemm/small_m ROUTER), complete when that launch is; each MoE slices program then reads x (o and r), computes
rstd, normalises x for its own gate/up and routes from rstd * raw (slices.py NORM). The norm-route launch, one
dependent step of the batch-1 chain, is gone.

Numerics: F and M are stored in the model dtype (as the router's weight is) and the sums are fp32; the reference
rounds x, h and its logits to the model dtype. The slices round rstd * raw to the model dtype before their top-k,
so the logits agree with the norm-route launch's within one rounding (routing can differ only where two experts'
logits do too).

``build`` makes (F, M) once per layer (the model keeps them: models/qwen3.py); ``FoldedRoute`` is what the attention
block hands to the MoE: raw and the MoE's own zeroed fp32 output row, both zeroed by the layer's input norm launch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from onecard.kernels.gptq_gemm.format import dequantize_gptq
from onecard.kernels.types import GPTQWeight


class RouterFold(NamedTuple):
    """One MoE layer's folded router (``build``)."""

    f: torch.Tensor          # [E, H] model dtype: gate * nw
    m: torch.Tensor          # [E, K_o] model dtype: F @ W_o^T


class FoldedRoute(NamedTuple):
    """The attention block's hand-over to the MoE block (views of one zeroed fp32 row)."""

    raw: torch.Tensor        # [1, E] fp32: F @ x (x = o + r), complete after the o_proj launch
    out32: torch.Tensor      # [1, H] fp32 zeros: the MoE's output sums


def build(gate: torch.Tensor, norm_weight: torch.Tensor, w_o: GPTQWeight) -> RouterFold:
    """(F, M) of a layer: its router weight gate [E, H], post-attention norm weight [H], o projection (GPTQ,
    y = a @ W_o, W_o [K_o, H]); computed in fp32 on gate's device, stored in gate's dtype."""
    f = gate.float() * norm_weight.float()[None, :]                       # [E, H]
    w = dequantize_gptq(w_o).to(gate.device)                              # [K_o, H] fp32
    assert w.shape[1] == gate.shape[1], (w.shape, gate.shape)
    return RouterFold(f.to(gate.dtype).contiguous(), (f @ w.t()).to(gate.dtype).contiguous())


def raw_ref(fold: RouterFold, x: torch.Tensor) -> torch.Tensor:
    """The reference ``raw`` for the norm's input x [1, H]: F @ x in fp32, [1, E]."""
    return x.float() @ fold.f.float().t()


__all__ = ["FoldedRoute", "RouterFold", "build", "raw_ref"]
