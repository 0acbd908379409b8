"""GPTQ (Frantar et al. 2022) for one linear layer (the `onecard quantize` command: quant/cli.py).

Contract:
  ``HessianAccumulator(K).add(x)`` accumulates H = 2/n * sum x x^T over calibration inputs x [T, K].
  ``gptq_quantize(weight [N, K], H [K, K], spec, damp, block_size) -> QuantizedLinear`` quantizes the
  nn.Linear weight column by column in Cholesky order of H^-1, with lazy batch updates of ``block_size``
  columns, per-group scale/zero computed on the fly from the error-updated weights, and optional act-order
  (desc_act: columns in decreasing diag(H), groups in that order, recorded in g_idx) - as in AutoGPTQ and
  GPTQModel. Dead inputs (diag(H) == 0) get weight 0 in the objective. An all-zero H (an expert that saw no
  calibration token) reduces to round-to-nearest.
"""
from __future__ import annotations

import logging
import math

import torch

from onecard.quant.quantizer import QuantizedLinear, QuantSpec, find_params, quantize_codes, quantize_rtn

log = logging.getLogger(__name__)


class HessianAccumulator:
    """Running H = 2/n X^T X in float32 (float64 would be safer but costs 2x on GPUs without fp64 speed)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.nsamples = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.H.device, torch.float32)     # [T, K]
        t = x.shape[0]
        if t == 0:
            return
        # running mean keeps H's scale independent of the number of tokens
        self.H.mul_(self.nsamples / (self.nsamples + t))
        self.nsamples += t
        x = x * math.sqrt(2.0 / self.nsamples)
        self.H.addmm_(x.t(), x)


def _inverse_cholesky_upper(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, raising damping if H is not PD."""
    k = H.shape[0]
    diag_mean = torch.mean(torch.diag(H)).item()
    eye = torch.eye(k, dtype=H.dtype, device=H.device)
    lam = damp
    for _ in range(8):
        try:
            L = torch.linalg.cholesky(H + lam * diag_mean * eye)
            Hinv = torch.cholesky_inverse(L)
            return torch.linalg.cholesky(Hinv, upper=True)
        except torch.linalg.LinAlgError:
            lam *= 10.0
            log.warning("Hessian not positive definite; raising damping to %.3g", lam)
    raise RuntimeError("GPTQ: the Hessian stayed singular after raising the damping 10^8-fold.")


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, spec: QuantSpec, damp: float = 0.01,
                  block_size: int = 128) -> QuantizedLinear:
    """weight: nn.Linear layout [N, K]; H: [K, K] from the layer's inputs. Returns codes in input order."""
    W = weight.detach().to(torch.float32).clone()                         # [N, K]
    H = H.detach().to(W.device, torch.float32).clone()                    # [K, K]
    n_out, k_in = W.shape
    if not bool(torch.any(torch.diag(H) > 0)):
        return quantize_rtn(weight, spec.group_size, spec.sym, min_zero=1, bits=spec.bits)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    perm = None
    if spec.desc_act:
        perm = torch.argsort(torch.diag(H), descending=True)              # [K]
        W = W[:, perm]
        H = H[perm][:, perm]
    Hinv = _inverse_cholesky_upper(H, damp)                               # [K, K] upper

    group = spec.effective_group(k_in)
    ngroups = spec.groups(k_in)
    Q = torch.zeros(n_out, k_in, dtype=torch.int32, device=W.device)     # codes, quantization order
    scales = torch.zeros(ngroups, n_out, dtype=torch.float32, device=W.device)
    zeros = torch.zeros(ngroups, n_out, dtype=torch.int32, device=W.device)
    scale = zero = None
    for i1 in range(0, k_in, block_size):
        i2 = min(i1 + block_size, k_in)
        W1 = W[:, i1:i2].clone()                                          # [N, B] updated inside the block
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group == 0:
                # the group's parameters come from the weights as updated so far (AutoGPTQ's on-the-fly
                # groups); columns past this block have already received all earlier blocks' updates
                end = min(col + group, k_in)
                cols = torch.cat([W1[:, i:], W[:, i2:end]], dim=1)[:, : end - col]
                scale, zero = find_params(cols, spec.bits, spec.sym)
                scales[col // group], zeros[col // group] = scale, zero.to(torch.int32)
            w = W1[:, i]                                                  # [N]
            d = Hinv1[i, i]
            q = quantize_codes(w.unsqueeze(1), scale, zero, spec.maxq).squeeze(1)
            Q[:, col] = q.to(torch.int32)
            err = (w - (q - zero) * scale) / d                            # [N]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]                              # lazy batch update

    g_idx = (torch.arange(k_in, device=W.device) // group).to(torch.int32)   # group of quantization step j
    if perm is not None:
        invperm = torch.argsort(perm)
        Q = Q[:, invperm]
        g_idx = g_idx[invperm]
    return QuantizedLinear(Q.t().contiguous(), scales.half(), zeros, g_idx.contiguous(), group)
